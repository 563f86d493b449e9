"""Decode speed, against PyTorch eager and llama2.c's run.c, with the memory roofline and load memory.

    python tools/bench_decode.py                   # stories260K, 8M, 15M, 110M; batch 1 and 8; prefill; memory
    python tools/bench_decode.py --quick           # CI: small shapes, under 30 s
    python tools/bench_decode.py --runc ~/llama2.c/runomp     # + run.c (built by you, OpenMP), batch 1
    python tools/bench_decode.py --runc ~/llama2.c/runomp --cases 260K --batches 1   # run.c on stories260K's shape
    python tools/bench_decode.py --big7b           # + a Llama-2-7B-shaped model held in float16 (~13.5 GB
                                                   #   of disk for the file, which is deleted afterwards)

Decode. Each side decodes the same 8-token prompts greedily (batch 1 and 8 by default), one
prefill then one token a step, 256 new tokens (fewer where max_seq_len ends sooner), timing
prefill plus decode: npllama through npllama.generate's generate_stream for one row, as `npllama
generate` runs it, and generate_batch for several, with the engine's own thread choices ("auto": every BLAS thread for the
large products of a step and the GEMMs of a long prompt, one elsewhere) and, for batches of
several rows, also everything on one BLAS thread (1T), the better counted; PyTorch eager
(tools/torch_llama.py: Meta's model.py layout, preallocated KV cache,
F.scaled_dot_product_attention, torch.inference_mode) on the same float32 weights, with 1 and
with 2 threads, the better counted, in a subprocess of its own (torch's OpenMP threads spin
after each call and would slow NumPy's BLAS in the same process); run.c, when --runc gives its
path, on a llama2.c .bin of the same weights with OMP_NUM_THREADS 1 and 2 (its own "achieved
tok/s", which counts its forwards after the first; the 2-thread figure is printed on its own line
too). So a one-row generation of npllama's is also timed from its first token, which its prefill
gives, and the "x run.c" column compares those steps/s with run.c's (the ratio with npllama's
prefill timed too is printed below the table, and the ratio without npllama's first decode step,
which makes its copies of the weights, as run.c leaves out its first forward, where its weights'
pages fault in). The tool checks that npllama and PyTorch pick the same tokens. The sides take turns (--repeats rounds, interleaved) and the
medians are reported, with the 1-minute load average each row ran under: on a shared machine
every figure moves with the load.

Roofline. A batch-1 decode step reads every weight once, so its speed is bound by memory
bandwidth: GB/s = (bytes of weights read per step) x (steps/s). The tool measures the bandwidth
of a float32 matrix-vector product on this machine (the best of np.vecdot on one thread and
OpenBLAS's W @ x and x @ W on one and two threads, over copies of a (2048, 768) matrix too large
to stay in cache) and prints each row's fraction of it.

Memory. Peak RSS of loading the 110M model in each format and dtype, each in a fresh process,
against the bytes the weights are held in (float32 files are memory-mapped, not copied).

Models. stories260K is the real file when found (--data-dir, $NPLLAMA_DATA_DIR); the others have
random weights (npllama's init, seed 0, shared classifier, row 1 of the embeddings zero so greedy
decoding never emits BOS, at which run.c stops), written by the tool into --models-dir the first
time (also as llama2.c .bin and a matching tokenizer when --runc is given):

    8M     dim 288, 6 layers, 6 heads, hidden 768, vocab 4096, max_seq_len 512
    15M    dim 288, 6 layers, 6 heads, hidden 768, vocab 32000, max_seq_len 256 (stories15M's shape)
    110M   dim 768, 12 layers, 12 heads, hidden 2048, vocab 32000, max_seq_len 1024 (stories110M's shape)
    7B     dim 4096, 32 layers, 32 heads, hidden 11008, vocab 32000, untied (Llama 2 7B's shape), float16

Exit code 0 once it has measured (speeds are reported, not asserted); 2 on bad arguments.
Example output: README.md, section Speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # npllama and tools/ from a checkout

import npllama  # noqa: E402
from npllama.engine.settings import blas_threads, get_blas_threads  # noqa: E402
from npllama.generate import generate, generate_batch  # noqa: E402
from npllama.io.llama2c import llama2c_layout  # noqa: E402
from npllama.model import init_params  # noqa: E402
from tools.benchkit import (PEER_THREADS, gemm_peaks, load_average, memory_status, roofline, run_worker,  # noqa: E402
                             torch_version)

SHAPES = {
    "stories260K": dict(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172, max_seq_len=512),
    # its shape with random weights, which never end a story: what run.c is timed on (--cases 260K)
    "260K": dict(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172, max_seq_len=512),
    "8M": dict(dim=288, n_layers=6, n_heads=6, hidden_dim=768, vocab_size=4096, max_seq_len=512),
    "15M": dict(dim=288, n_layers=6, n_heads=6, hidden_dim=768, vocab_size=32000, max_seq_len=256),
    "110M": dict(dim=768, n_layers=12, n_heads=12, hidden_dim=2048, vocab_size=32000, max_seq_len=1024),
    "7B": dict(dim=4096, n_layers=32, n_heads=32, hidden_dim=11008, vocab_size=32000, max_seq_len=512,
               tie_embeddings=False),
}
PROMPT_LEN = 8
RUNC_PROMPT = "Once upon a time"
BIG7B_DISK_BYTES = 14 << 30           # the float16 file (13.5 GB) and a margin


def default_models_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "npllama" / "bench"


# ----------------------------------------------------------------------------- model files

def config_of(name: str) -> npllama.LlamaConfig:
    return npllama.LlamaConfig(**{"tie_embeddings": True, **SHAPES[name]})


def random_params(cfg: npllama.LlamaConfig) -> dict:
    params = init_params(cfg, seed=0, dtype=np.float32)
    params["tok_embeddings.weight"][1] = 0.0          # greedy never picks BOS (1), where run.c stops
    return params


def write_llama2c_v0(path: Path, cfg: npllama.LlamaConfig, params: dict) -> None:
    """llama2.c's legacy format, the one run.c reads: 7 int32, then float32 weights in llama2c_layout
    order (the two RoPE tables, which run.c skips, written as zeros)."""
    vocab = cfg.vocab_size if cfg.tie_embeddings else -cfg.vocab_size
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                            vocab, cfg.max_seq_len))
        for name, shape in llama2c_layout(cfg, 0):
            f.write(np.zeros(shape, "<f4").tobytes() if name is None else np.asarray(params[name], "<f4").tobytes())


def write_llama2c_tokenizer(path: Path, vocab_size: int) -> None:
    """A llama2.c tokenizer.bin of vocab_size distinct pieces: <unk> <s> </s>, the 256 byte tokens
    run.c falls back to (id = byte + 3), printable characters, then made-up pieces."""
    chars = [chr(c) for c in range(32, 127)]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + [" " + c for c in chars]
    pieces += [f" t{i}" for i in range(max(0, vocab_size - len(pieces)))]
    data = [p.encode() for p in pieces[:vocab_size]]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(map(len, data))))
        for i, d in enumerate(data):
            f.write(struct.pack("<fi", -float(i), len(d)) + d)


def model_files(name: str, models_dir: Path, data_dir: Path, *, runc: bool = False, formats: bool = False) -> dict:
    """{kind: path} of one case's files, written when missing: "safetensors" (float32, Meta names;
    for stories260K the real llama2.c file when data_dir has it), with runc "bin" and "tokenizer"
    (llama2.c's), with formats also "hf" (a Hugging Face folder) and "f16" (float16 safetensors)."""
    cfg = config_of(name)
    files = {"safetensors": models_dir / f"{name}.safetensors"}
    if runc or formats:
        files["bin"] = models_dir / f"{name}.bin"
    if runc:
        files["tokenizer"] = models_dir / f"tok{cfg.vocab_size}.bin"
    if formats:
        files.update(hf=models_dir / f"{name}-hf", f16=models_dir / f"{name}-f16.safetensors")
    label = name
    if name == "stories260K":
        real = data_dir / "stories260K.bin"
        if real.is_file():
            files["safetensors"] = real
        else:
            label = "stories260K(random)"
    missing = [kind for kind, path in files.items() if not path.exists()]
    if missing:
        models_dir.mkdir(parents=True, exist_ok=True)
        print(f"  writing {name} ({cfg.n_params():,} random parameters): {', '.join(missing)} in {models_dir}",
              flush=True)
        model = npllama.Llama.from_params(cfg, random_params(cfg))
        writers = {"safetensors": lambda path: npllama.save(model, path, format="meta"),
                   "bin": lambda path: write_llama2c_v0(path, cfg, model.params),
                   "tokenizer": lambda path: write_llama2c_tokenizer(path, cfg.vocab_size),
                   "hf": lambda path: npllama.save(model, path, format="hf"),
                   "f16": lambda path: npllama.save(model, path, format="meta", dtype="float16")}
        for kind in missing:
            writers[kind](files[kind])
    return {**files, "label": label}


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once; of the embedding table
    only B rows, unless it is also the classifier (tied), which reads it whole."""
    return sum(a.nbytes for n, a in model.params.items()
               if n != "tok_embeddings.weight" or model.config.tie_embeddings)


# ----------------------------------------------------------------------------- the roofline

def matvec_bandwidth(total_bytes: int, repeats: int = 3) -> dict[str, float]:
    """GB/s of weights streamed by float32 matrix-vector products over copies of a (2048, 768) matrix
    totalling total_bytes (cold: each copy is out of cache when it comes round again)."""
    rng = np.random.default_rng(0)
    shape = (2048, 768)
    mats = [rng.standard_normal(shape, dtype=np.float32) for _ in range(max(2, total_bytes // (4 * 2048 * 768)))]
    x, row = rng.standard_normal(shape[1], dtype=np.float32), rng.standard_normal(shape[0], dtype=np.float32)
    out, row_out = np.empty(shape[0], np.float32), np.empty(shape[1], np.float32)
    # x @ W reads the same bytes as a matrix stored (in, out), as the small models' copies are: OpenBLAS's
    # other gemv, faster than W @ x on some CPUs (its Haswell kernels: docs/speed.md)
    kernels = {"np.vecdot, 1 thread": (lambda w: np.vecdot(w, x, out=out), 1),
               "W @ x, 1 thread": (lambda w: np.matmul(w, x, out=out), 1),
               "W @ x, 2 threads": (lambda w: np.matmul(w, x, out=out), 2),
               "x @ W, 1 thread": (lambda w: np.dot(row, w, out=row_out), 1),
               "x @ W, 2 threads": (lambda w: np.dot(row, w, out=row_out), 2)}
    found = {}
    for label, (kernel, threads) in kernels.items():
        with blas_threads(threads):
            for w in mats:
                kernel(w)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                for w in mats:
                    kernel(w)
                best = min(best, time.perf_counter() - start)
        found[label] = len(mats) * mats[0].nbytes / best / 1e9
    return found


# ----------------------------------------------------------------------------- PyTorch, in its own process

def torch_worker() -> int:
    """Serve timing requests, one JSON line each on stdin: {path, prompt, new_tokens, threads}; reply
    {seconds, tokens}. Models stay loaded between requests."""
    import torch
    from tools.torch_llama import TorchLlama, generate_greedy
    models = {}
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["path"] not in models:
            model = npllama.load(job["path"])
            models[job["path"]] = TorchLlama.from_params(model.config, model.params, torch.float32).eval()
        torch.set_num_threads(job["threads"])
        prompt = np.array(job["prompt"], dtype=np.int64)
        start = time.perf_counter()
        tokens = generate_greedy(models[job["path"]], prompt, job["new_tokens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": tokens.tolist()}), flush=True)
    return 0


class TorchSide:
    """The PyTorch worker process (torch_worker), started here and serving every request (main holds
    None instead with --no-torch or without torch)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--torch-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "ready":          # imported: no longer competing for the CPUs
            raise RuntimeError("the PyTorch worker did not start; see its error above")

    def run(self, path, prompt: np.ndarray, new_tokens: int, threads: int):
        self.proc.stdin.write(json.dumps({"path": str(path), "prompt": prompt.tolist(), "new_tokens": new_tokens,
                                          "threads": threads}) + "\n")
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError("the PyTorch worker stopped; see its error above")
        answer = json.loads(reply)
        return answer["seconds"], np.array(answer["tokens"])

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# ----------------------------------------------------------------------------- llama2.c run.c

def runc_tokens_per_second(runc: Path, files: dict, steps: int, threads: int) -> float:
    """run.c's own "achieved tok/s" (forwards per second after the first) over `steps` positions."""
    out = subprocess.run([str(runc), str(files["bin"]), "-z", str(files["tokenizer"]), "-t", "0", "-n", str(steps),
                          "-i", RUNC_PROMPT], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode != 0 or "achieved tok/s:" not in out.stderr:
        raise RuntimeError(f"{runc} failed ({out.returncode}): {out.stderr[-500:]}")
    return float(out.stderr.split("achieved tok/s:")[1].split()[0])


# ----------------------------------------------------------------------------- decode rounds

class Row:
    """One (model, batch) comparison: every side's timings over the rounds, and the loads they ran under."""

    def __init__(self, label, model, path, files, batch, new_tokens):
        self.label, self.model, self.path, self.files = label, model, path, files
        self.batch, self.new_tokens = batch, new_tokens
        self.prompt = np.random.default_rng(batch).integers(0, model.config.vocab_size, (batch, PROMPT_LEN))
        self.tok_s = {}           # side -> [tokens/s per round]
        self.loads = []
        self.agree = []

    def add(self, side, tokens_per_second):
        self.tok_s.setdefault(side, []).append(tokens_per_second)

    def median(self, side):
        runs = self.tok_s.get(side)
        return statistics.median(runs) if runs else None

    def best(self, side):
        """(median tokens/s, how) of the side's better way of running (threads), or (None, "")."""
        found = [(self.median(f"{side} {how}"), how) for how in ("auto", "1T", "2T") if self.median(f"{side} {how}")]
        return max(found) if found else (None, "")


def npllama_on_one_thread():
    """npllama on one core: one BLAS thread throughout (the engine's steps keep an outer setting)."""
    return blas_threads(1)


def decode_round(row: Row, torch_side, runc):
    B, n = row.batch, row.new_tokens
    row.loads.append(load_average())
    if B == 1:                          # timed at its first token too: run.c counts forwards after its first
        start = time.perf_counter()
        ours, times = [], []
        for token in row.model.generate_stream(row.prompt[0], n):
            times.append(time.perf_counter())
            ours.append(token)
        end = time.perf_counter()
        ours = np.array([ours])
        row.add("npllama auto", n / (end - start))
        row.add("npllama after first", (n - 1) / (end - times[0]))
        if n > 2:                       # the first decode step makes the step's copies (and forks its helper)
            row.add("npllama after first step", (n - 2) / (end - times[1]))
    else:
        start = time.perf_counter()
        ours = np.stack(generate_batch(row.model, list(row.prompt), n))
        row.add("npllama auto", B * n / (time.perf_counter() - start))
        # a few rows' large products use every core (projections.CORES_MIN_WEIGHTS): also one
        with npllama_on_one_thread():
            start = time.perf_counter()
            generate_batch(row.model, list(row.prompt), n)
            row.add("npllama 1T", B * n / (time.perf_counter() - start))
    if torch_side is not None:
        for threads in PEER_THREADS:
            seconds, theirs = torch_side.run(row.path, row.prompt, n, threads)
            row.add(f"torch {threads}T", B * n / seconds)
        row.agree.append(float((ours == theirs).mean()))
    if runc is not None and B == 1 and "bin" in row.files:
        for threads in PEER_THREADS:
            row.add(f"run.c {threads}T", runc_tokens_per_second(runc, row.files, min(PROMPT_LEN + n, row.model.config.max_seq_len),
                                                                threads))


def print_decode_table(rows, bandwidth):
    best_bw = max(bandwidth.values())
    print(f"\ndecode: {PROMPT_LEN}-token prompts, greedy, float32; medians over the rounds; peers at their better "
          f"thread count (thr); roofline = weight bytes per step x steps/s against {best_bw:.1f} GB/s")
    print(f"{'model':20s} {'batch':>5s} {'npllama':>9s} {'thr':>4s} {'torch':>9s} {'thr':>3s} {'x torch':>8s} "
          f"{'run.c':>8s} {'thr':>3s} {'x run.c':>8s} {'GB/s':>6s} {'roofline':>8s} {'same tok':>8s} {'load':>5s}")
    for row in rows:
        ours, our_threads = row.best("npllama")
        theirs, torch_threads = row.best("torch")
        runc, runc_threads = row.best("run.c")
        gbs = weight_bytes_per_step(row.model) * ours / row.batch / 1e9
        print(f"{row.label:20s} {row.batch:5d} {ours:9,.0f} {our_threads:>4s} {_num(theirs, 9)} {torch_threads:>3s} "
              f"{_ratio(ours, theirs)} "
              f"{_num(runc, 8)} {runc_threads:>3s} {_ratio(row.median('npllama after first'), runc)} "
              f"{gbs:6.1f} {gbs / best_bw:8.0%} "
              f"{statistics.mean(row.agree) if row.agree else float('nan'):8.1%} {statistics.median(row.loads):5.1f}")
    if any(row.best("run.c")[0] for row in rows):
        print("x run.c: npllama's steps/s after its first token (its prefill not timed; its first decode step, "
              "which makes the step's copies of the weights and forks its helper process, timed) against run.c's "
              "own \"achieved tok/s\" (its forwards after the first); with npllama's prefill timed too: "
              + ", ".join(f"{row.label} {row.best('npllama')[0] / row.best('run.c')[0]:.2f}x"
                          for row in rows if row.best("run.c")[0]))
        print("without npllama's first decode step either (as run.c's figure leaves out its first forward, where "
              "its weights' pages fault in): " + ", ".join(
                  f"{row.label} {row.median('npllama after first step') / row.best('run.c')[0]:.2f}x"
                  for row in rows if row.best("run.c")[0] and row.median("npllama after first step")))
    if any(row.best("run.c")[0] for row in rows):
        print(f"run.c's own roofline (its tokens/s x the same weight bytes per step, against {best_bw:.1f} GB/s), and "
              "the most npllama's steps could reach against it, at the roofline: " + ", ".join(
                  f"{row.label} {gbs / best_bw:.0%} ({best_bw / gbs:.2f}x)"
                  for row in rows if row.best("run.c")[0]
                  for gbs in [weight_bytes_per_step(row.model) * row.best("run.c")[0] / 1e9]))
    if any(row.median("run.c 2T") for row in rows):
        print("run.c with OpenMP on 2 threads, as llama2.c builds it: " + ", ".join(
            f"{row.label} {row.median('run.c 2T'):,.0f} "
            f"({row.median('npllama after first') / row.median('run.c 2T'):.2f}x)"
            for row in rows if row.median("run.c 2T")))
    print("\nevery round (tokens/s):")
    for row in rows:
        print(f"  {row.label} batch {row.batch}: " + "; ".join(
            f"{side} {', '.join(f'{v:,.0f}' for v in runs)}" for side, runs in row.tok_s.items())
            + f"; loads {', '.join(f'{x:.1f}' for x in row.loads)}")


def _num(value, width):
    return f"{value:{width},.0f}" if value else f"{'-':>{width}s}"


def _ratio(a, b):
    return f"{a / b:7.2f}x" if a and b else f"{'-':>8s}"


# ----------------------------------------------------------------------------- prefill

def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of a prefill of `tokens` positions: every block's projections at each position,
    causal attention (q k^T and P v, 4 Dh (t + 1) per head for the query at position t), and the
    classifier at the last position alone (what generate needs for its first token)."""
    D, Dh, H, KVH, F, L, V = (cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim,
                              cfg.n_layers, cfg.vocab_size)
    blocks = 2 * tokens * L * (D * (H + 2 * KVH) * Dh + H * Dh * D + 3 * D * F)
    attention = L * H * 4 * Dh * tokens * (tokens + 1) / 2
    return blocks + attention + 2 * D * V


def prefill_rounds(path, model, tokens, repeats, torch_side):
    """Tokens/s of one prefill of `tokens` positions (and the first token), npllama vs torch, and
    the FLOP/s each side's best stands at against NumPy's GEMM peak."""
    prompt = np.random.default_rng(7).integers(0, model.config.vocab_size, (1, tokens))
    found, loads = {}, []
    generate(model, prompt[0], 1)                    # warm-up
    for _ in range(repeats):
        loads.append(load_average())
        start = time.perf_counter()
        generate(model, prompt[0], 1)
        found.setdefault("npllama auto", []).append(tokens / (time.perf_counter() - start))
        with npllama_on_one_thread():
            start = time.perf_counter()
            generate(model, prompt[0], 1)
            found.setdefault("npllama 1T", []).append(tokens / (time.perf_counter() - start))
        if torch_side is not None:
            for threads in PEER_THREADS:
                seconds, _ = torch_side.run(path, prompt, 1, threads)
                found.setdefault(f"torch {threads}T", []).append(tokens / seconds)
    medians = {side: statistics.median(v) for side, v in found.items()}
    best_torch = max((v for s, v in medians.items() if s.startswith("torch")), default=None)
    best_ours = max(v for s, v in medians.items() if s.startswith("npllama"))
    print(f"\nprefill of {tokens} tokens, {path.name}, batch 1 (tokens/s, medians of {repeats}; load "
          f"{statistics.median(loads):.1f}): " + ", ".join(f"{s} {v:,.0f}" for s, v in medians.items())
          + (f"; best npllama / best torch {best_ours / best_torch:.2f}x" if best_torch else ""))
    flops, peaks = prefill_flops(model.config, tokens), gemm_peaks()
    print(f"  roofline ({flops / 1e9:,.1f} GFLOP a prefill; NumPy float32 GEMM peak {peaks[1] / 1e9:,.0f} GFLOP/s on "
          f"1 thread, {peaks[2] / 1e9:,.0f} on 2): npllama {roofline(flops * best_ours / tokens, peaks)}"
          + (f"; torch {roofline(flops * best_torch / tokens, peaks)}" if best_torch else ""))


# ----------------------------------------------------------------------------- memory of loading

def load_worker(path: str, dtype: str, mmap: str) -> int:
    """Load one checkpoint in this fresh process and print what it cost, as one JSON line."""
    before = memory_status()
    start = time.perf_counter()
    model = npllama.load(path, dtype=dtype, mmap=mmap == "mmap")
    seconds = time.perf_counter() - start
    after = memory_status()
    held = sum(a.nbytes for a in model.params.values())
    print(json.dumps({"seconds": seconds, "held": held, "rise": after["VmHWM"] - before["VmRSS"],
                      "anon": after["RssAnon"] - before["RssAnon"], "file": after["RssFile"] - before["RssFile"]}))
    return 0


def memory_table(files: dict):
    cases = [("float32 safetensors", files["safetensors"], "float32", "mmap"),
             ("float32 safetensors, mmap=False", files["safetensors"], "float32", "copy"),
             ("Hugging Face folder (float32)", files["hf"], "float32", "mmap"),
             ("llama2.c .bin", files["bin"], "float32", "mmap"),
             ("float16 safetensors -> float32", files["f16"], "float32", "mmap"),
             ("float16 safetensors -> float16", files["f16"], "float16", "mmap"),
             ("float32 safetensors -> float16", files["safetensors"], "float16", "mmap"),
             ("float32 safetensors -> bfloat16", files["safetensors"], "bfloat16", "mmap")]
    print(f"\nmemory of npllama.load({files['label']}), each in a fresh process (peak RSS rise over the RSS before "
          "loading; anonymous memory vs mapped file pages):")
    print(f"  {'file -> held as':34s} {'seconds':>7s} {'held MB':>8s} {'peak rise MB':>12s} {'/ held':>7s} "
          f"{'anon MB':>8s} {'file MB':>8s}")
    for label, path, dtype, mmap in cases:
        r = run_worker(__file__, "--load-worker", str(path), dtype, mmap)
        print(f"  {label:34s} {r['seconds']:7.2f} {r['held'] / 2**20:8.0f} {r['rise'] / 2**20:12.0f} "
              f"{r['rise'] / r['held']:6.2f}x {r['anon'] / 2**20:8.0f} {r['file'] / 2**20:8.0f}")


# ----------------------------------------------------------------------------- the 7B demo

def write_7b_float16(path: Path) -> None:
    """A Llama-2-7B-shaped safetensors file of float16 random weights, streamed tensor by tensor (the
    writer never holds more than one tensor's chunk): N(0, 0.02) values drawn once into a pool of
    2^24 and read from it at random offsets, norms 1."""
    cfg = config_of("7B")
    shapes = cfg.param_shapes()
    header, offset = {"__metadata__": {"format": "pt", "npllama_config": cfg.to_json()}}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 24) * 0.02).astype(np.float16)
    chunk = 1 << 22
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            count = math.prod(shape)
            if name.endswith("norm.weight"):
                f.write(np.ones(count, np.float16).tobytes())
                continue
            for done in range(0, count, chunk):
                start = int(rng.integers(0, pool.size - chunk))
                f.write(pool[start:start + min(chunk, count - done)].tobytes())


def big7b_worker(path: str, new_tokens: str) -> int:
    """Generate greedily from the float16 file held in float16, and print speed and memory as JSON."""
    start = time.perf_counter()
    model = npllama.load(path, dtype="float16")
    loaded = time.perf_counter() - start
    times = []
    last = [start]

    def tick():
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
    last[0] = time.perf_counter()
    ids = []
    for token in model.generate_stream([1, 450, 4996, 17354], int(new_tokens)):   # Llama 2's "The quick brown"
        ids.append(token)
        tick()
    status = {k: v for k, v in memory_status().items() if k in ("VmHWM", "RssAnon", "RssFile")}
    print(json.dumps({"load_s": loaded, "first_s": times[0], "step_s": statistics.median(times[1:]) if len(times) > 1
                      else times[0], "ids": ids, "held": sum(a.nbytes for a in model.params.values()), **status}))
    return 0


def big7b(models_dir: Path, new_tokens: int) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(models_dir).free
    if free < BIG7B_DISK_BYTES:
        print(f"\n7B: skipped, {models_dir} has {free / 2**30:.1f} GiB free and the file needs "
              f"{BIG7B_DISK_BYTES / 2**30:.0f} GiB (--models-dir elsewhere)")
        return
    path = models_dir / "7b-float16.safetensors"
    try:
        start = time.perf_counter()
        write_7b_float16(path)
        print(f"\n7B float16: wrote {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s; "
              f"generating {new_tokens} tokens (load {load_average():.1f}) ...", flush=True)
        try:
            r = run_worker(__file__, "--big7b-worker", str(path), str(new_tokens))
        except RuntimeError as e:
            print(f"7B: the run failed: {e}")
            return
        print(f"7B float16 (Llama 2 7B shape, {r['held'] / 1e9:.2f} GB held, mapped): load {r['load_s']:.1f} s, "
              f"prompt + first token {r['first_s']:.1f} s, then {1 / r['step_s']:.3f} tokens/s "
              f"({r['step_s']:.1f} s/token); peak RSS {r['VmHWM'] / 2**30:.2f} GiB (file pages "
              f"{r['RssFile'] / 2**30:.2f}, anonymous {r['RssAnon'] / 2**30:.2f}); load {load_average():.1f}; "
              f"ids {r['ids']}")
    finally:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="CI: stories260K and 8M, batch 1 and 4, 32 tokens, one round, small prefill and memory "
                             "checks (under 30 s)")
    parser.add_argument("--cases", nargs="+", choices=["stories260K", "260K", "8M", "15M", "110M"],
                        default=["stories260K", "8M", "15M", "110M"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per prompt (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill on 110M (0: skip)")
    parser.add_argument("--no-memory", action="store_true", help="skip the load-memory table")
    parser.add_argument("--no-torch", action="store_true", help="npllama alone")
    parser.add_argument("--runc", type=Path, help="a built llama2.c run.c (e.g. gcc -Ofast -march=native -fopenmp "
                                                  "run.c -lm -o runomp), run with OMP_NUM_THREADS=1 and 2")
    parser.add_argument("--big7b", action="store_true", help="also generate from a Llama-2-7B-shaped float16 model "
                                                             "(writes ~13.5 GB into --models-dir, deleted after)")
    parser.add_argument("--big7b-tokens", type=int, default=8, help="tokens the 7B demo generates")
    parser.add_argument("--models-dir", type=Path, default=default_models_dir(), help="where random models are kept")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("NPLLAMA_DATA_DIR", ROOT.parent / "shared" / "data")),
                        help="folder holding stories260K.bin [default: $NPLLAMA_DATA_DIR, else ../shared/data]")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1 or min(args.batches) < 1 or args.prefill < 0:
        parser.error("--new-tokens, --repeats and --batches must be >= 1, --prefill >= 0")
    if args.runc is not None and not args.runc.is_file():
        parser.error(f"--runc {args.runc}: no such file (build llama2.c's run.c first)")
    if args.quick:
        args.cases, args.batches, args.new_tokens, args.repeats = ["stories260K", "8M"], [1, 4], 32, 1
    biggest = args.cases[-1] if args.quick else "110M"
    torch_side = None
    if not args.no_torch and torch_version() is None:
        print("torch is not installed: npllama alone (pip install -e '.[torch]' for the comparison)")
    elif not args.no_torch:
        torch_side = TorchSide()
        print(f"torch {torch_version()} (its own process)")
    print(f"npllama {npllama.__version__}, NumPy {np.__version__}, BLAS threads {get_blas_threads()}, "
          f"{os.cpu_count()} CPUs; load average {load_average():.2f}", flush=True)
    try:
        rows = []
        for name in args.cases:
            # (run.c stops at BOS, which the trained stories260K emits at the end of each story: timed over
            # a few dozen steps, its figure would mean little, and llama2.c's goals are on 15M and 110M)
            files = model_files(name, args.models_dir, args.data_dir, runc=args.runc is not None and name != "stories260K",
                                formats=name == biggest and not args.no_memory)
            model = npllama.load(files["safetensors"])
            new_tokens = min(args.new_tokens, model.config.max_seq_len - PROMPT_LEN)
            print(f"{files['label']}: {model.config.n_params():,} parameters, {weight_bytes_per_step(model) / 1e6:.1f} MB "
                  f"of weights a step, {new_tokens} new tokens", flush=True)
            rows += [Row(files["label"], model, files["safetensors"], files, B, new_tokens) for B in args.batches]
        bandwidth = matvec_bandwidth((64 << 20) if args.quick else (448 << 20))
        print("matrix-vector bandwidth, float32, cold: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items()),
              flush=True)
        for r in range(args.repeats):
            for row in rows:
                decode_round(row, torch_side, args.runc)
            print(f"  round {r + 1}/{args.repeats} done (load {load_average():.1f})", flush=True)
        print_decode_table(rows, bandwidth)
        if args.prefill:
            files = model_files(biggest, args.models_dir, args.data_dir)
            model = npllama.load(files["safetensors"])
            prefill_rounds(files["safetensors"], model, min(128 if args.quick else args.prefill,
                                                            model.config.max_seq_len - 1), args.repeats, torch_side)
        if not args.no_memory:
            memory_table(model_files(biggest, args.models_dir, args.data_dir, formats=True))
        if args.big7b:
            big7b(args.models_dir, args.big7b_tokens)
    finally:
        if torch_side is not None:
            torch_side.close()
    print(f"\nload average at the end: {load_average():.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        sys.exit(torch_worker())
    if len(sys.argv) > 1 and sys.argv[1] == "--load-worker":
        sys.exit(load_worker(*sys.argv[2:5]))
    if len(sys.argv) > 1 and sys.argv[1] == "--big7b-worker":
        sys.exit(big7b_worker(*sys.argv[2:4]))
    sys.exit(main())
