"""Size before allocation: npllama.memory's estimates hold against real peaks, and what cannot fit
is refused before anything big is allocated.

"Before allocating" is tested by tracemalloc (NumPy reports its allocations to it): a refusal must
come with a peak far below the size it refuses, rather than by wall-clock time on a busy machine.
"""

import io
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllama
from npllama import memory
from npllama.engine import pass_footprint
from npllama.errors import MemoryLimitError
from npllama.io.llama2c import LLAMA2C_MAGIC
from npllama.io.safetensors import read_safetensors, write_safetensors_atomic
from npllama.train import train

from .conftest import tiny_cfg

MiB = 1 << 20


def peak_of(fn):
    """(result or the exception raised, peak bytes traced while fn ran)."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except Exception as e:          # noqa: BLE001 - the caller inspects it
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def scarce_memory(monkeypatch):
    """Pretend 256 MiB are available, so moderate sizes exercise the refusals."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 256 * MiB)


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.integers(1, 300),
       st.booleans(), st.integers(1, 3))
def test_n_params_closed_form_equals_the_shapes(half_dh, kvh, rep, layers, vocab, tied, mult):
    cfg = npllama.LlamaConfig(dim=2 * half_dh * kvh * rep, n_layers=layers, n_heads=kvh * rep, n_kv_heads=kvh,
                              vocab_size=vocab, multiple_of=8 * mult, tie_embeddings=tied)
    assert cfg.n_params() == sum(int(np.prod(s)) for s in cfg.param_shapes().values())


@pytest.mark.parametrize("dim, layers, heads, kv, vocab, batch, seq", [
    (128, 4, 4, 4, 65, 16, 64), (64, 2, 4, 2, 512, 8, 256), (64, 3, 8, 8, 4000, 4, 32), (32, 2, 4, 4, 65, 64, 128)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_estimates_hold_against_traced_peaks(dim, layers, heads, kv, vocab, batch, seq, dtype):
    """Each estimate is within [0.5, 1.3] of the bytes really allocated: near enough to refuse only
    what would not fit, never far below what a pass takes."""
    cfg = npllama.LlamaConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=vocab,
                              max_seq_len=seq)
    itemsize = np.dtype(dtype).itemsize
    model, peak = peak_of(lambda: npllama.Llama(cfg, dtype=dtype))
    assert 0.5 <= peak / memory.model_bytes(cfg, itemsize) <= 1.3
    x = np.random.default_rng(0).integers(0, vocab, (batch, seq))
    # one worker: with two, how far the shards' lifetimes overlap depends on the machine's load
    rows, shards = pass_footprint(batch, seq, dim, workers=1)
    _, peak = peak_of(lambda: model.loss_and_grads(x, x, workers=1))
    assert 0.5 <= peak / memory.pass_bytes(cfg, batch, rows, seq, itemsize, shards) <= 1.3, peak
    _, peak = peak_of(lambda: npllama.ops.cross_entropy_forward(model.forward(x), x))
    # a forward keeps nothing: its estimate (one running layer, from per-token counts) is the looser
    assert 0.2 <= peak / memory.pass_bytes(cfg, batch, rows, seq, itemsize) <= 1.3, peak
    _, peak = peak_of(lambda: model.new_kv_cache(3))
    assert 0.9 <= peak / memory.kv_cache_bytes(cfg, 3, itemsize) <= 1.1


def test_the_init_chunk_is_the_one_model_draws():
    assert memory.INIT_CHUNK_BYTES == 8 * npllama.model.INIT_CHUNK


def test_a_model_too_big_is_refused_before_allocating():
    cfg = npllama.LlamaConfig(dim=65536, n_layers=4, n_heads=64, vocab_size=65)       # --dim 65536: ~830 GB
    error, peak = peak_of(lambda: npllama.Llama(cfg))
    assert isinstance(error, MemoryLimitError) and isinstance(error, MemoryError)
    assert isinstance(error, npllama.NpllamaError)
    assert "needs" in str(error) and "GiB available" in str(error) and "dim" in str(error)
    assert peak < MiB


def test_kv_cache_batch_and_rope_tables_are_refused_before_allocating(scarce_memory):
    cfg = npllama.LlamaConfig(dim=64, n_layers=4, n_heads=4, vocab_size=512, max_seq_len=4096)
    model = npllama.Llama(cfg)
    for attempt in (lambda: model.new_kv_cache(64),                                   # 64 rows x 4096 positions
                    lambda: model.forward(np.zeros((512, 4096), np.int64)),            # logits of 2M tokens
                    lambda: model.loss_and_grads(*[np.zeros((256, 4096), np.int64)] * 2),
                    lambda: npllama.Llama.from_params(cfg.replace(max_seq_len=2 ** 24), model.params)):
        error, peak = peak_of(attempt)
        assert isinstance(error, MemoryLimitError), error
        assert peak <= 2 * 512 * 4096 * 8             # at most the caller's token arrays
        assert "needs" in str(error) and "0.25 GiB available" in str(error)


def test_a_llama2c_header_claiming_a_huge_model_is_refused_before_any_per_layer_work(tmp_path):
    """The issue's one-bit flip: n_layers 5 -> 2,097,157 in stories260K's header took 50 s and 6.8 GB."""
    path = tmp_path / "flipped.bin"
    head = struct.pack("<7i", 64, 172, 2_097_157, 8, 4, -512, 512)
    path.write_bytes(head + np.zeros(1000, "<f4").tobytes())
    error, peak = peak_of(lambda: npllama.load(path))
    assert isinstance(error, npllama.NpllamaError) and "truncated" in str(error)
    assert peak < MiB


def test_a_consistent_header_of_a_model_too_big_is_refused_before_reading(tmp_path):
    """A (sparse) file exactly as large as its header claims: 2 TiB of float32 cannot be read here."""
    big = tmp_path / "big.bin"
    dim, hidden, layers, heads, vocab, seq = 4096, 11008, 8192, 32, 32000, 2048
    head = struct.pack("<Ii7iB", LLAMA2C_MAGIC, 1, dim, hidden, layers, heads, heads, vocab, seq, 1).ljust(256, b"\0")
    cfg = npllama.LlamaConfig(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, vocab_size=vocab,
                              max_seq_len=seq, tie_embeddings=True)
    with open(big, "wb") as f:
        f.write(head)
        f.truncate(256 + 4 * cfg.n_params())
    error, peak = peak_of(lambda: npllama.load(big))
    assert isinstance(error, MemoryLimitError) and "needs" in str(error), error
    assert peak < MiB
    sparse = tmp_path / "big.safetensors"             # the same for safetensors: one tensor of 64 GiB
    write_safetensors_atomic(sparse, {"w": np.zeros((2, 2), np.float32)})
    raw = sparse.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = b'{"w":{"dtype":"F32","shape":[131072,131072],"data_offsets":[0,68719476736]}}'
    header += b" " * (-len(header) % 8)
    with open(sparse, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 68719476736)
    assert n > 0
    error, peak = peak_of(lambda: read_safetensors(sparse))
    assert isinstance(error, MemoryLimitError), error
    assert peak < MiB


def test_training_too_big_is_refused_before_the_model_exists(text_file, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(memory, "available_bytes", lambda: 4 * 2 ** 30)          # the same on every machine
    for changes in (dict(dim=65536, n_heads=64), dict(dim=128, n_heads=4, n_layers=100000),
                    dict(batch_size=10 ** 6), dict(seq_len=8192, batch_size=64, n_layers=64)):
        out = tmp_path / "run"
        error, peak = peak_of(lambda: train(tiny_cfg(text_file, out, **changes), out=io.StringIO()))
        assert isinstance(error, MemoryLimitError), (changes, error)
        assert "needs" in str(error) and "--batch-size" in str(error)
        assert peak < 64 * MiB                        # reading and encoding the text, nothing model-sized
        assert not out.exists()                       # a refused start leaves nothing behind


def test_cli_refuses_in_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be " * 500)
    run = subprocess.run([sys.executable, "-m", "npllama", "train", "--n-layers", "100000", "--dim", "1024", "--out-dir",
                          str(tmp_path / "r"), "--data", str(text)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "npllama train: error: training" in run.stderr
    assert "GiB available" in run.stderr and "Traceback" not in run.stderr


def test_available_memory_reads_meminfo_and_cgroups(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert memory._meminfo_available(meminfo) == 20000000 * 1024
    assert memory._meminfo_available(tmp_path / "absent") is None
    root = tmp_path / "cgroup"
    (root / "user.slice" / "job").mkdir(parents=True)
    (root / "user.slice" / "memory.max").write_text("8589934592\n")            # 8 GiB on the parent
    (root / "user.slice" / "memory.current").write_text("1073741824\n")
    (root / "user.slice" / "job" / "memory.max").write_text("max\n")            # none on the job itself
    (root / "user.slice" / "job" / "memory.current").write_text("536870912\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/user.slice/job\n")
    assert memory._cgroup_headroom(proc, root) == 7 * 2 ** 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("2147483648\n")
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text("1073741824\n")
    proc.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n")
    assert memory._cgroup_headroom(proc, v1) == 2 ** 30
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{2 ** 63 - 4096}\n")   # v1's "no limit"
    assert memory._cgroup_headroom(proc, v1) is None
    assert memory._cgroup_headroom(tmp_path / "absent", root) is None
    real = memory.available_bytes()
    assert real is None or real > 0


def test_require_passes_small_sizes_without_asking(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: pytest.fail("asked for a small size"))
    memory.require(memory.CHECK_FLOOR, "a small thing")
    monkeypatch.setattr(memory, "available_bytes", lambda: None)                 # unknown: nothing refused
    memory.require(1 << 60, "anything")
    monkeypatch.setattr(memory, "available_bytes", lambda: 3 * 2 ** 30)
    with pytest.raises(MemoryLimitError, match=r"a big thing needs 4.00 GiB, 3.00 GiB available; hint"):
        memory.require(4 * 2 ** 30, "a big thing", "hint")


def test_a_lora_run_needs_room_for_its_pass_not_for_a_second_model_and_its_moments(monkeypatch):
    """By the check a LoRA run's base is loaded, and AdamW holds the adapters' moments only."""
    from npllama.train import TrainConfig
    from npllama.train.loop import require_memory
    model_config = npllama.LlamaConfig(dim=768, n_layers=12, n_heads=12, vocab_size=32000, tie_embeddings=True,
                                       max_seq_len=128)
    full = TrainConfig(batch_size=4, seq_len=128)
    lora = TrainConfig(batch_size=4, seq_len=128, lora_rank=8)
    rows, shards = pass_footprint(4, 128, 768)
    lora_needs = memory.pass_bytes(model_config, 4, rows, 128, 4)
    full_needs = memory.training_bytes(model_config, 4, rows, 128, 4, shards)
    assert lora_needs < full_needs
    monkeypatch.setattr(memory, "available_bytes", lambda: (lora_needs + full_needs) // 2)
    require_memory(lora, model_config)                          # fits
    with pytest.raises(MemoryLimitError, match="needs"):
        require_memory(full, model_config)
    monkeypatch.setattr(memory, "available_bytes", lambda: lora_needs - 1)
    with pytest.raises(MemoryLimitError, match="needs"):
        require_memory(lora, model_config)
