"""Size before allocation: npllama.memory's estimates hold against real peaks, and what cannot fit
is refused before anything big is allocated.

"Before allocating" is tested by tracemalloc (NumPy reports its allocations to it): a refusal must
come with a peak far below the size it refuses, rather than by wall-clock time on a busy machine.
"""

import contextlib
import gc
import io
import os
import resource
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npllama
from npllama import cli, memory
from npllama.cli import gradcheck as gradcheck_command
from npllama.engine import pass_footprint
from npllama.engine import settings as engine_settings
from npllama.errors import MemoryLimitError
from npllama.io.llama2c import LLAMA2C_MAGIC
from npllama.io.metadata import model_metadata
from npllama.io.safetensors import read_safetensors, write_safetensors_atomic
from npllama.train import train

from .conftest import data_file, tiny_cfg

MiB = 1 << 20
GiB = 1 << 30


def peak_of(fn):
    """(result or the exception raised, peak bytes traced while fn ran). The engine's once-per-process
    malloc adaptation (an untouched 32 MB block) is made first, and the garbage earlier tests left
    is collected first (its finalizers run outside the window), so a peak does not depend on which
    tests ran before."""
    engine_settings.adapt_malloc_once()
    gc.collect()
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


# ----------------------------------------------------------------------------- the address-space limit

def test_the_address_space_limit_less_the_virtual_size_bounds_what_is_available(tmp_path, monkeypatch):
    statm = tmp_path / "statm"
    statm.write_text("1000 200 100 1 0 300 0\n")                 # 1000 pages of virtual size
    page = os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (memory.resource.RLIM_INFINITY,) * 2)
    assert memory._address_space_headroom(statm) is None          # no limit: no bound
    limit = 10 * GiB
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (limit, memory.resource.RLIM_INFINITY))
    reserve = memory.THREAD_RESERVE * (os.cpu_count() or 1)
    assert memory._address_space_headroom(statm) == limit - 1000 * page - reserve
    statm.write_text(f"{limit // page} 1 1 1 0 1 0\n")           # already at the limit
    assert memory._address_space_headroom(statm) == 0
    monkeypatch.setattr(memory, "_address_space_headroom", lambda: 3 * GiB)
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 20 * GiB)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: None)
    assert memory.available_bytes() == 3 * GiB
    with pytest.raises(MemoryLimitError, match=r"needs 4.00 GiB, 3.00 GiB available \(the address-space limit, "
                                               r"ulimit -v\); hint"):
        memory.require(4 * GiB, "x", "hint")


ULIMIT_V = 6_000_000 * 1024          # `ulimit -v 6000000` (KiB)

# `python -m npllama ARGS`, which also writes its peak resident memory (VmHWM, in kB) to the file
# named by its first argument as it exits. (The kernel's ru_maxrss of a child cannot serve: it
# counts the pytest process it was forked from, hundreds of MB.)
WITH_PEAK = textwrap.dedent("""
    import atexit, runpy, sys
    out = sys.argv.pop(1)
    def report():
        with open("/proc/self/status") as status, open(out, "w") as f:
            f.write(next(line for line in status if line.startswith("VmHWM:")).split()[1])
    atexit.register(report)
    sys.argv[0] = "npllama"
    runpy.run_module("npllama", run_name="__main__", alter_sys=True)
""")


def limited(args, peak_file, timeout=120):
    """`python -m npllama *args` under `ulimit -v 6000000`: (exit code, stderr, CPU seconds, peak RSS in MiB)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ULIMIT_V, ULIMIT_V))

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc/self/status (VmHWM) to measure a command's peak memory")
    proc = subprocess.Popen([sys.executable, "-c", WITH_PEAK, str(peak_file), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    try:
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)            # this child's own CPU time
    finally:
        if proc.poll() is None:
            proc.kill()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, usage.ru_utime + usage.ru_stime, int(peak_file.read_text()) / 1024


def test_the_python_api_raises_memory_limit_error_for_what_cannot_fit():
    """The issue's four: each was numpy's _ArrayMemoryError after seconds and GBs (under ulimit -v 6000000)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ULIMIT_V, ULIMIT_V))

    probe = textwrap.dedent("""
        import npllama, sys
        from npllama import Llama, LlamaConfig
        cases = [lambda: Llama(LlamaConfig(n_layers=100000)), lambda: Llama(LlamaConfig(max_seq_len=10**8)),
                 lambda: Llama(LlamaConfig(dim=4096, n_heads=32, n_layers=12, vocab_size=32000)),
                 lambda: npllama.load(sys.argv[1], max_seq_len=10**8)]
        for case in cases:
            try:
                case()
                print("fitted")
            except MemoryError as e:
                print(type(e).__name__, "|", e)
        print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
    """)
    run = subprocess.run([sys.executable, "-c", probe, str(data_file("stories260K.bin"))], capture_output=True,
                         text=True, timeout=120, preexec_fn=limit)
    assert run.returncode == 0, run.stderr
    *lines, peak_kb = run.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("MemoryLimitError | ") for line in lines), run.stdout
    assert all("needs" in line and "GiB available (the address-space limit" in line for line in lines), run.stdout
    assert int(peak_kb) < 300 * 1024, peak_kb


def _long_context_file(tmp_path):
    """A tiny model whose config claims max_seq_len 10**8 (its RoPE tables alone: 9 GiB)."""
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=16)
    path = tmp_path / "long.safetensors"
    write_safetensors_atomic(path, npllama.Llama(cfg).params, model_metadata(cfg.replace(max_seq_len=10 ** 8), None))
    return path


ABSURD = {
    "train --vocab-size 10000000": ["train", "--tokenizer", "bpe", "--vocab-size", "10000000"],
    "train --n-layers 1000": ["train", "--n-layers", "1000"],
    "train --max-seq-len 100000000": ["train", "--max-seq-len", "100000000"],
    "train --dim 2048 --n-heads 16 --n-layers 8": ["train", "--dim", "2048", "--n-heads", "16", "--n-layers", "8"],
    "train --grad-accum 1000000000": ["train", "--grad-accum", "1000000000"],
    "train --eval-batches 1000000000": ["train", "--eval-batches", "1000000000"],
    "train --lora-rank 1000000": ["train", "--init", "{stories}", "--init-tokenizer", "{tok512}", "--lora-rank", "1000000"],
    "gradcheck --vocab-size 10000000": ["gradcheck", "--vocab-size", "10000000"],
    "gradcheck --n-layers 1000": ["gradcheck", "--n-layers", "1000"],
    "gradcheck --seq-len 100000000": ["gradcheck", "--seq-len", "100000000"],
    "gradcheck --head-dim 128 --n-heads 16 --n-layers 8": ["gradcheck", "--head-dim", "128", "--n-heads", "16",
                                                           "--n-kv-heads", "16", "--n-layers", "8"],
    "generate, max_seq_len 10**8": ["generate", "-m", "{long}", "--prompt-ids", "1,2"],
    "export, max_seq_len 10**8": ["export", "-m", "{long}", "-o", "{out}"],
}


@pytest.mark.slow
def test_every_command_refuses_absurd_sizes_in_one_line_quickly_and_small(tmp_path, text_file):  # noqa: F811
    """Under ulimit -v 6000000: exit 1 with one line, under 5 s of CPU, peak RSS under 300 MB (each ran
    for tens of seconds to GBs before). Four at a time: the machine's two cores stay busy."""
    paths = dict(stories=data_file("stories260K.bin"), tok512=data_file("tok512.model"), long=_long_context_file(tmp_path))
    runs = {}
    for i, (name, argv) in enumerate(ABSURD.items()):
        argv = [a.format(**paths, out=tmp_path / f"out{i}.safetensors") for a in argv]
        if argv[0] == "train":
            argv += ["--data", str(text_file), "--out-dir", str(tmp_path / f"run{i}")]
        runs[name] = (argv, tmp_path / f"peak{i}")
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(runs, pool.map(lambda run: limited(*run), runs.values())))
    for name, (code, err, cpu, peak) in results.items():
        command = name.split()[0].rstrip(",")
        assert code == 1, (name, err)
        assert err.count("\n") == 1 and err.startswith(f"npllama {command}: error: "), (name, err)
        assert len(err) > len(f"npllama {command}: error: ") + 20 and "Traceback" not in err, (name, err)
        assert cpu < 5 and peak < 300, (name, cpu, peak)
    for i in range(len(ABSURD)):
        assert not (tmp_path / f"run{i}").exists() and not (tmp_path / f"out{i}.safetensors").exists()


# ----------------------------------------------------------------------------- estimates against drawn configs
#
# For each command, the estimate it checks against what is free is compared with the peak
# tracemalloc sees (NumPy reports its allocations to it) on configs hypothesis draws:
#     measured <= estimate + SLACK  and  estimate <= 3 * measured + SLACK
# SLACK, 2 MiB, is the command's own small objects (Python's, the timing runs' arrays), which no
# estimate of arrays counts and which dominate the smallest configs.

SLACK = 2 * MiB


def within(measured, estimate):
    return measured <= estimate + SLACK and estimate <= 3 * measured + SLACK


@st.composite
def shapes(draw, max_layers=3, max_head_dim=8, max_vocab=300):
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 2))
    return dict(n_layers=draw(st.integers(1, max_layers)), n_heads=heads, n_kv_heads=kv,
                head_dim=2 * draw(st.integers(1, max_head_dim // 2)), vocab_size=draw(st.integers(5, max_vocab)))


@pytest.mark.slow
@settings(max_examples=3)
@given(shapes(max_layers=6), st.integers(1, 3), st.integers(2, 8))
def test_gradcheck_s_estimate_holds_against_its_peak(shape, batch, seq):
    args = cli.build_parser().parse_args(
        ["gradcheck", "--entries", "1", "--batch-size", str(batch), "--seq-len", str(seq),
         *[a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]])
    cfg = npllama.LlamaConfig(dim=shape["n_heads"] * shape["head_dim"], n_layers=shape["n_layers"],
                              n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"],
                              vocab_size=shape["vocab_size"], multiple_of=8, max_seq_len=seq)
    with contextlib.redirect_stdout(io.StringIO()):
        code, peak = peak_of(lambda: gradcheck_command.run(args))
    assert code in (0, 1), code                   # ran to the end (1: a drawn config above the tolerance)
    assert within(peak, memory.gradcheck_bytes(cfg, batch, seq)), (peak, memory.gradcheck_bytes(cfg, batch, seq))


@settings(max_examples=8)
@given(shapes(max_layers=4, max_head_dim=32, max_vocab=3000), st.integers(1, 3), st.integers(1, 200),
       st.sampled_from([np.float32, np.float64]), st.sampled_from(["engine", "reference"]))
def test_generation_s_estimate_holds_against_its_peak(shape, batch, prompt_len, dtype, backend):
    cfg = npllama.LlamaConfig(dim=shape["n_heads"] * shape["head_dim"], n_layers=shape["n_layers"],
                              n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"],
                              vocab_size=shape["vocab_size"], max_seq_len=prompt_len + 16)
    model = npllama.Llama(cfg, dtype=dtype, backend=backend)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, max(1, prompt_len - b)) for b in range(batch)]
    _, peak = peak_of(lambda: model.generate_batch(prompts, 16, temperature=0.9, top_p=0.9, repetition_penalty=1.1,
                                                   seed=0))
    stacked = model.backend.decoder_copy_bytes(model.params, model.dtype)
    estimate = memory.generate_bytes(cfg, batch, prompt_len, np.dtype(dtype).itemsize, stacked,
                                     model.backend.scores_in_blocks)
    assert within(peak, estimate), (peak, estimate)


@pytest.mark.slow
@settings(max_examples=4)
@given(st.sampled_from([(32, 2), (64, 4), (96, 4)]), st.integers(1, 3), st.sampled_from([(8, 16), (16, 32), (4, 64)]),
       st.integers(1, 2), st.sampled_from(["float32", "float64"]))
def test_training_s_estimate_holds_against_its_peak(dim_heads, layers, batch_seq, accum, dtype):
    """A whole (short) run: steps, evaluations, the samples printed, checkpoints; no loss.png drawn."""
    import builtins
    import tempfile
    from pathlib import Path
    from .conftest import synthetic_text
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **kw)

    (dim, heads), (batch, seq) = dim_heads, batch_seq
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "verse.txt"
        text.write_text(synthetic_text())
        cfg = tiny_cfg(text, Path(tmp) / "run", dim=dim, n_heads=heads, n_layers=layers, batch_size=batch, seq_len=seq,
                       grad_accum=accum, dtype=dtype, max_steps=4, eval_interval=2, sample_tokens=8)
        builtins.__import__ = no_matplotlib
        try:
            result, peak = peak_of(lambda: train(cfg, out=io.StringIO()))
        finally:
            builtins.__import__ = real_import
    assert result.steps == 4
    mcfg = cfg.model_config(len(set(synthetic_text())))
    rows, shards = pass_footprint(batch, seq, dim)
    estimate = memory.training_bytes(mcfg, batch, rows, seq, np.dtype(dtype).itemsize, shards)
    assert within(peak, estimate), (peak, estimate)


@settings(max_examples=6)
@given(shapes(max_layers=3, max_head_dim=32, max_vocab=2000), st.sampled_from(["float32", "float16", "bfloat16",
                                                                               "float64"]),
       st.sampled_from(["meta", "hf"]))
def test_saving_s_estimate_holds_against_its_peak(shape, dtype, fmt):
    """What `npllama export` and npllama.save convert before writing."""
    import tempfile
    from pathlib import Path
    from npllama.io.checkpoint import _require_save
    cfg = npllama.LlamaConfig(dim=shape["n_heads"] * shape["head_dim"], n_layers=shape["n_layers"],
                              n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"], vocab_size=shape["vocab_size"])
    model = npllama.Llama(cfg)
    seen = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / ("m.safetensors" if fmt == "meta" else "hf")
        real = memory.require
        try:
            memory.require = lambda nbytes, what, hint="": seen.append(nbytes) if what.startswith("writing") else None
            _require_save(model.params, out, fmt, dtype)
        finally:
            memory.require = real
        _, peak = peak_of(lambda: npllama.save(model, out, format=fmt, dtype=dtype))
    assert within(peak, seen[0]), (peak, seen[0])


@pytest.mark.parametrize("error, needle", [(MemoryError(), "out of memory"), (npllama.NpllamaError(), "NpllamaError"),
                                           (OSError(), "OSError")])
def test_every_error_line_has_a_message(error, needle, monkeypatch, capsys):
    """`--grad-accum 100000000` once ended in "npllama train: error: " and nothing after it."""
    from .test_faults import _patched_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _patched_parser(error))
    assert cli.main(["generate"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"npllama generate: error: {needle}")
