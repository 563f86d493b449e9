"""Loading without copies, and weights held at half precision.

Memory-mapped loads (mmap=True) give the very parameters a reading load gives, bit for bit,
in every format; writing to a mapped parameter (an optimizer step) never reaches the file;
weights held in float16 / bfloat16 are the file's own bits or the correctly rounded values,
compute in float32, save and load back, and refuse training with a clear message.
"""

import hashlib
import tracemalloc

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.io import checkpoint as ck
from npllama.io.errors import CheckpointError
from npllama.io.mapped import is_file_mapped
from npllama.io.metadata import CHECKSUM_KEY
from npllama.io.safetensors import read_safetensors_header
from npllama.storage import float32_to_bfloat16, to_float

from .test_checkpoint import _write_llama2c, _write_sharded, gqa_config, random_model

TOKENS = np.array([[1, 5, 3, 9, 0, 2, 7]])


is_mapped = is_file_mapped          # True when an array is a view of a memory-mapped file


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoints(tmp_path, model):
    """The same float32 model in every format load reads: {name: path}."""
    tied = random_model(gqa_config(tie_embeddings=True))
    paths = {"meta": npllama.save(model, tmp_path / "m.safetensors", format="meta"),
             "hf": npllama.save(model, tmp_path / "hf", format="hf"),
             "llama2c v0": tmp_path / "v0.bin", "llama2c v1 tied": tmp_path / "v1.bin"}
    _write_llama2c(paths["llama2c v0"], model, 0)
    _write_llama2c(paths["llama2c v1 tied"], tied, 1)
    _write_sharded(tmp_path / "sharded", model)
    paths["hf shards"] = tmp_path / "sharded"
    return paths


def test_a_mapped_load_is_bit_identical_to_a_copying_load_in_every_format(tmp_path):
    model = random_model(gqa_config())
    for name, path in checkpoints(tmp_path, model).items():
        mapped, copied = npllama.load(path, mmap=True), npllama.load(path, mmap=False)
        assert list(mapped.params) == list(copied.params), name
        for n, p in copied.params.items():
            assert mapped.params[n].dtype == p.dtype == np.float32, (name, n)
            assert np.array_equal(mapped.params[n].view(np.uint32), p.view(np.uint32)), (name, n)
            assert not is_mapped(p), (name, n)
        # Meta and llama2.c layouts are the file's own: every tensor stays mapped. Hugging Face q/k
        # rows are permuted into Meta's RoPE order, which takes a copy of those two.
        permuted = {n for n in copied.params if n.endswith(("wq.weight", "wk.weight"))} if "hf" in name else set()
        assert {n for n, p in mapped.params.items() if not is_mapped(p)} == permuted, name


def test_writing_to_a_mapped_parameter_never_changes_the_file(tmp_path):
    model = random_model(gqa_config())
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    before = digest(path)
    loaded = npllama.load(path, mmap=True)
    w = loaded.params["layers.0.attention.wq.weight"]
    assert is_mapped(w) and w.flags.writeable
    w[...] = 7.0                                                  # in place, as AdamW writes
    opt = npllama.AdamW(loaded.params, lr=0.1)
    _, grads = loaded.loss_and_grads(TOKENS, TOKENS)
    opt.step(grads)
    assert (loaded.params["layers.0.attention.wq.weight"] != model.params["layers.0.attention.wq.weight"]).all()
    assert digest(path) == before
    again = npllama.load(path)
    for n, p in model.params.items():
        assert np.array_equal(again.params[n], p), n


def test_the_mapped_file_can_be_replaced_by_save_while_in_use(tmp_path):
    """save writes a new file and renames it over the old one: the mapped model keeps its pages."""
    model = random_model(gqa_config())
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    loaded = npllama.load(path, mmap=True)
    expected = loaded.forward(TOKENS)
    npllama.save(random_model(gqa_config(), seed=9), path, format="meta")
    np.testing.assert_array_equal(loaded.forward(TOKENS), expected)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_float32_file_held_at_half_precision_is_rounded_per_tensor(tmp_path, storage):
    model = random_model(gqa_config())
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    half = npllama.load(path, dtype=np.float16 if storage == "float16" else "bfloat16")
    assert half.storage_dtype == storage and half.dtype == np.float32
    for n, p in model.params.items():
        want = p.astype(np.float16) if storage == "float16" else float32_to_bfloat16(p)
        assert half.params[n].dtype == want.dtype and np.array_equal(half.params[n], want), n


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_a_half_precision_file_held_as_is_is_mapped(tmp_path, storage):
    model = random_model(gqa_config())
    folder = npllama.save(model, tmp_path / "hf", format="hf", dtype=storage)
    assert {code for code, _ in read_safetensors_header(folder / "model.safetensors")[0].values()} == \
        {"F16" if storage == "float16" else "BF16"}
    half = npllama.load(folder, dtype=storage, mmap=True)
    as_float = npllama.load(folder)                               # float32: the file's values upcast, exactly
    for n, p in half.params.items():
        assert is_mapped(p) or n.endswith(("wq.weight", "wk.weight")), n
        assert np.array_equal(to_float(p), as_float.params[n]), n


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_a_half_held_model_computes_in_float32_saves_and_refuses_training(tmp_path, storage):
    model = random_model(gqa_config())
    half = npllama.Llama.from_params(model.config, model.params, dtype=storage)
    values = npllama.Llama.from_params(model.config, {n: to_float(p) for n, p in half.params.items()})
    assert half.dtype == np.float32 and half.storage_dtype == storage and f"storage_dtype={storage}" in repr(half)
    logits = half.forward(TOKENS)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, values.forward(TOKENS), rtol=1e-5, atol=1e-5)
    assert np.array_equal(half.generate([1, 2, 3], 8), values.generate([1, 2, 3], 8))
    with pytest.raises(ValueError, match=f"holds its weights in {storage}.*dtype=np.float32"):
        half.loss_and_grads(TOKENS, TOKENS)
    for dtype in ("float32", storage):
        back = npllama.load(npllama.save(half, tmp_path / f"{dtype}.safetensors", format="meta", dtype=dtype),
                            dtype=dtype)
        for n, p in values.params.items():
            assert np.array_equal(to_float(back.params[n]), p), (dtype, n)


def test_weights_beyond_float16_are_refused_naming_the_tensor(tmp_path):
    model = random_model(gqa_config())
    model.params["layers.1.feed_forward.w2.weight"][0, 0] = 1e6
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    with pytest.raises(CheckpointError, match="w2.weight holds NaN or infinite values.*overflowed"):
        npllama.load(path, dtype=np.float16)
    assert npllama.load(path, dtype="bfloat16").storage_dtype == "bfloat16"     # bfloat16 has float32's range


def test_a_weight_dtype_npllama_does_not_hold_is_refused(tmp_path):
    path = npllama.save(random_model(gqa_config()), tmp_path / "m.safetensors", format="meta")
    with pytest.raises(ValueError, match="float16 or 'bfloat16'"):
        npllama.load(path, dtype=np.int8)
    with pytest.raises(ValueError, match="float16 or 'bfloat16'"):
        ck.read_checkpoint(path, dtype="float8")


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_generate_command_holds_the_weights_at_half_precision(tmp_path, capsys, storage):
    model = random_model(gqa_config())
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    assert cli.main(["generate", "-m", str(path), "--prompt-ids", "1,2,3", "-n", "6", "--temp", "0",
                     "--dtype", storage]) == 0
    out, err = capsys.readouterr()
    half = npllama.load(path, dtype=storage)
    assert out.split() == [str(i) for i in [1, 2, 3, *half.generate([1, 2, 3], 6)]]
    assert storage in err


def test_the_footprint_worked_out_before_loading_is_what_the_load_holds(tmp_path):
    """The footprint (the figure a fit check compares with free memory), from shapes and dtypes alone,
    equals the bytes the loaded model then holds in new arrays and in mapped file pages."""
    model = random_model(gqa_config())
    files = checkpoints(tmp_path, model)
    files["f16"] = npllama.save(model, tmp_path / "f16.safetensors", format="meta", dtype="float16")
    for name, path in files.items():
        for dtype in ("float32", "float16", "bfloat16"):
            for mapped in (True, False):
                loaded = ck.read_checkpoint(path, dtype, mmap=mapped)
                held = loaded.params.values()
                want = (sum(p.nbytes for p in held if not is_mapped(p)), sum(p.nbytes for p in held if is_mapped(p)))
                assert tuple(loaded.footprint) == want, (name, dtype, mapped)
                assert loaded.footprint.total == sum(p.nbytes for p in held) > 0
                assert f"holds {loaded.footprint.describe()}" in loaded.notes


BLOCK_BYTES = 4 << 20          # storage.copy_into's block of 2^20 elements, as float32

PEAK_OF_A_LOAD = """
import json, sys, npllama
import npllama.engine, npllama.io, npllama.llama        # their imports are not the load's memory
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
before = status()
model = npllama.load(sys.argv[1], dtype=sys.argv[2], mmap=sys.argv[3] == "mapped" if len(sys.argv) > 3 else True)
held = sum(a.nbytes for a in model.params.values())
print(json.dumps({"rise": status()["VmHWM"] - before["VmRSS"], "held": held}))
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads peak RSS from /proc (Linux)")
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_a_verified_converting_load_holds_the_converted_weights_not_the_file_s_pages_too(tmp_path, storage):
    """The checksum check reads every page of a mapped file; a load converting float32 to half
    precision hands them back as it goes, so its peak is what it holds plus one tensor's
    temporaries (1.1-1.3x here), not the file's pages too (2.0-2.2x before)."""
    import json
    import subprocess
    import sys
    cfg = npllama.LlamaConfig(dim=512, n_layers=6, n_heads=8, vocab_size=256, max_seq_len=64)
    path = npllama.save(npllama.Llama(cfg, seed=0), tmp_path / "m.safetensors", format="meta")
    header = path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")]
    assert CHECKSUM_KEY.encode() in header                     # the load verifies (reads every page)
    done = subprocess.run([sys.executable, "-c", PEAK_OF_A_LOAD, str(path), storage], capture_output=True, text=True,
                          check=True)
    found = json.loads(done.stdout)
    assert found["rise"] < 1.5 * found["held"], found


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads peak RSS from /proc (Linux)")
@pytest.mark.parametrize("how", ["mapped", "read"])
@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
@pytest.mark.parametrize("suffix", ["safetensors", "gguf"])
def test_a_half_precision_file_held_as_float32_peaks_at_its_weights_and_one_block_of_the_file(tmp_path, suffix,
                                                                                               stored, how):
    """load widens each tensor straight from the file into the model's one flat array, handing the
    file's pages back a block at a time: the peak is the float32 weights plus about one block, not
    plus the largest tensor widened whole beside them (1.23x on 110M before; here, where the two
    vocabulary tables are 91% of the weights, it was about 1.46x)."""
    import json
    import subprocess
    import sys
    cfg = npllama.LlamaConfig(dim=256, n_layers=2, n_heads=4, vocab_size=32000, max_seq_len=64)
    path = npllama.save(npllama.Llama(cfg, seed=0), tmp_path / f"m.{suffix}", format="meta" if suffix == "safetensors"
                        else "gguf", dtype=stored)
    done = subprocess.run([sys.executable, "-c", PEAK_OF_A_LOAD, str(path), "float32", how], capture_output=True,
                          text=True, check=True)
    found = json.loads(done.stdout)
    assert found["held"] == 4 * cfg.n_params()
    # a block's temporaries and what glibc keeps of them (its thresholds rise with freed blocks): a few MB
    assert found["rise"] < found["held"] + 4 * BLOCK_BYTES, found


@pytest.mark.parametrize("backend", ["engine", "reference"])
@pytest.mark.parametrize("source", ["float16", "bfloat16", "float64"])
def test_arrays_of_another_dtype_are_converted_straight_into_the_model_s_layout(backend, source):
    """from_params(..., dtype=float32) of arrays held otherwise: each converted on its own (the engine:
    straight into its one flat array, no whole converted copy beside it), the same values as a
    conversion of each, and a handed-over dict emptied."""
    model = npllama.Llama(npllama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                              max_seq_len=16), seed=0)          # 0.6 MB in float32
    as_held = {"float16": lambda a: a.astype(np.float16), "float64": lambda a: a.astype(np.float64),
               "bfloat16": float32_to_bfloat16}[source]
    params = {n: as_held(a) for n, a in model.params.items()}
    expected = {n: to_float(a, np.float32) for n, a in params.items()}
    tracemalloc.start()                  # NumPy reports its arrays' memory to tracemalloc
    try:
        held = npllama.Llama.from_params(model.config, params, dtype=np.float32, backend=backend, adopt=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not params                                            # handed over, every array taken
    float32_bytes = sum(a.nbytes for a in expected.values())
    largest = max(a.nbytes for a in expected.values())
    # never two float32 copies at once: the model's arrays, and at most the one tensor in hand (bfloat16
    # bits are converted one tensor at a time), and a few KB of tables (RoPE's)
    assert peak <= float32_bytes + largest + (64 << 10)
    assert all(held.params[n].dtype == np.float32 and np.array_equal(held.params[n], expected[n]) for n in expected)
    arrays = list(held.params.values())
    one_flat = all(a.base is not None for a in arrays) and len({id(a.base) for a in arrays}) == 1
    assert one_flat == (backend == "engine")
    again = npllama.Llama.from_params(model.config, expected, backend=backend)
    assert np.array_equal(held.forward(TOKENS), again.forward(TOKENS))


def test_a_load_lays_the_weights_out_in_one_flat_array_unless_most_are_read_in_place(tmp_path):
    """The engine's training pass reads one flat array. A load lays the weights out in it when it
    widens them from the file (also a float16 GGUF file's, whose float32 norms would be read in
    place) or holds them all in memory; a file read in place stays in place; a quantized GGUF
    file's tensors, decoded into memory beside its float32 norms read in place, stay where they
    are (laying them out would hold the largest twice for a moment). Every way gives the same values."""
    from npllama.engine.layout import FlatLayout
    # rows of 64: Q8_0's blocks of 32 (narrower tensors are written unquantized)
    model = npllama.Llama(npllama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                              max_seq_len=16), seed=0)
    files = {"float16 gguf": npllama.save(model, tmp_path / "h.gguf", format="gguf", dtype="float16"),
             "q8_0 gguf": npllama.save(model, tmp_path / "q.gguf", format="gguf", dtype="q8_0"),
             "float16 safetensors": npllama.save(model, tmp_path / "h.safetensors", format="meta", dtype="float16"),
             "float32 safetensors": npllama.save(model, tmp_path / "m.safetensors", format="meta")}
    flat = {("float16 gguf", True): True, ("q8_0 gguf", True): False, ("float16 safetensors", True): True,
            ("float32 safetensors", True): False,
            # read into memory: the float32 file's arrays are held in its buffer, the others laid out
            ("float16 gguf", False): True, ("q8_0 gguf", False): True, ("float16 safetensors", False): True,
            ("float32 safetensors", False): False}
    for name, path in files.items():
        for mapped in (True, False):
            loaded = npllama.load(path, mmap=mapped)
            assert (FlatLayout(loaded.config).base_of(loaded.params) is not None) == flat[name, mapped], (name, mapped)
            if flat[name, mapped]:
                assert not any(is_mapped(a) for a in loaded.params.values()), (name, mapped)
            reference = ck.read_checkpoint(path, np.float32, mmap=mapped).params
            assert all(np.array_equal(loaded.params[n], reference[n]) for n in reference), (name, mapped)
