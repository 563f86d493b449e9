"""What verifying checksums costs: CRC-32 (what npllama records) against sha256, and load times.

    python tools/bench_integrity.py                 # a 110M-parameter model (llama2.c's stories110M shape)
    python tools/bench_integrity.py --dim 288 --n-layers 6 --vocab-size 32000 --repeats 5

Writes, in a temporary folder, the model alone (npllama.save format="meta") and a training
checkpoint of it (parameters and both AdamW moments, three times the size), then times reading
each with the checksums verified and without (npllama.load(..., verify=False) and
read_safetensors(..., verify=False)), interleaved, and reports medians. The files are read
from the page cache after the first repeat, which is the case where hashing costs the most
relative to the read itself. Also times zlib.crc32 and hashlib.sha256 over 256 MiB.

Example output (2-core x86_64 with SHA-NI, load average printed; figures move ~20% run to run):
  load average 1.02 1.20 1.31
  hash over 256 MiB: crc32 3,981 MB/s, sha256 1,115 MB/s
  model (440.4 MB): load 0.41 s verified, 0.31 s unverified: +0.10 s
  checkpoint (1,321.3 MB): read 1.02 s verified, 0.70 s unverified: +0.32 s
Exit code 0 once it has measured.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # npllama and tools/ from a checkout
import npllama  # noqa: E402
from npllama.io.safetensors import read_safetensors  # noqa: E402
from npllama.train.checkpoint import save_train_checkpoint  # noqa: E402
from tools.benchkit import load_averages, median_seconds, take_turns  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-dim", type=int, default=2048)
    p.add_argument("--untied", action="store_true", help="a separate output matrix (stories110M shares it)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print("load average", load_averages())

    buf = memoryview(np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8))
    crc = median_seconds(lambda: zlib.crc32(buf), args.repeats)
    sha = median_seconds(lambda: hashlib.sha256(buf).digest(), args.repeats)
    print(f"hash over 256 MiB: crc32 {256 * 1.048576 / crc:,.0f} MB/s, sha256 {256 * 1.048576 / sha:,.0f} MB/s")

    cfg = npllama.LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                              vocab_size=args.vocab_size, hidden_dim=args.hidden_dim, max_seq_len=1024,
                              tie_embeddings=not args.untied)
    model = npllama.Llama(cfg, seed=0)
    print(f"model: {cfg.n_params():,} parameters, float32")
    with tempfile.TemporaryDirectory() as folder:
        meta = Path(folder) / "model.safetensors"
        npllama.save(model, meta, format="meta")
        ckpt = Path(folder) / "ckpt.safetensors"
        opt = npllama.AdamW(model.params)
        save_train_checkpoint(ckpt, model, None, opt, {"step": 0, "rng": {}, "train_config": {}})
        del model, opt
        for label, path, read in (("model", meta, lambda v: npllama.load(meta, verify=v)),
                                  ("checkpoint", ckpt, lambda v: read_safetensors(ckpt, verify=v))):
            read(False)                                    # into the page cache
            on, off = take_turns({"on": lambda: read(True), "off": lambda: read(False)}, args.repeats).values()
            what = "load" if label == "model" else "read"
            print(f"{label} ({path.stat().st_size / 1e6:,.1f} MB): {what} {on:.2f} s verified, {off:.2f} s "
                  f"unverified: +{on - off:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
