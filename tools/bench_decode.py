"""Decode speed: npllama's KV-cached generation against a PyTorch eager KV-cached decode.

    python tools/bench_decode.py                       # stories260K (or its random twin) and the ~8M config
    python tools/bench_decode.py --new-tokens 64 --cases stories260K --batches 1

For each model and batch size (1 and 8 by default) both sides decode the same prompt greedily:
one prefill of an 8-token prompt, then 256 new tokens, one forward per token, timing prefill
plus decode. npllama runs npllama.generate.generate_batch (what `npllama generate` and
Llama.generate use); PyTorch runs the eager model below under torch.inference_mode(), written
as a careful PyTorch user would (Meta's model.py layout, KV cache preallocated, attention
through F.scaled_dot_product_attention with enable_gqa). Both are given the same float32
weights, and the tool checks they pick the same greedy tokens, so the two really run the same
model. Each side runs with 1 and with 2 BLAS/intra-op threads and the faster is reported.

Models:
  stories260K   ../shared/data/stories260K.bin via npllama.load when it is there (dim 64,
                5 layers, 8 heads, 4 kv heads, vocab 512, hidden 172, max_seq_len 512);
                otherwise random weights of that config
  8M            dim 288, 6 layers, 6 heads, vocab 4096, max_seq_len 512, random weights

Example output (2 cores shared with other work; figures move 10-30% from run to run):
  model                  batch  npllama tok/s  torch tok/s  ratio  threads np/torch  same tokens
  stories260K                1          4,167          910  4.58x  2/1               100.0%
  stories260K                8         14,724        5,343  2.76x  2/2               100.0%
  8M(random)                 1            530          352  1.51x  2/2               100.0%
  8M(random)                 8          1,718        1,222  1.41x  2/1               100.0%
Exit code 0 once it has measured (the ratios are reported, not asserted); 2 without torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import npllama  # noqa: E402
import npllama.engine.decode  # noqa: E402
from npllama.engine.blas import blas_threads  # noqa: E402
from npllama.generate import generate_batch  # noqa: E402

STORIES_CONFIG = dict(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172,
                      max_seq_len=512)
EIGHT_M_CONFIG = dict(dim=288, n_layers=6, n_heads=6, vocab_size=4096, max_seq_len=512)


def torch_model(model):
    """A PyTorch eager LLaMA-2 holding `model`'s weights (float32), with a KV-cached step."""
    import torch
    import torch.nn.functional as F

    cfg = model.config
    P = {name: torch.from_numpy(np.asarray(a, dtype=np.float32)) for name, a in model.params.items()}
    if cfg.tie_embeddings:
        P["output.weight"] = P["tok_embeddings.weight"]
    H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)   # (P, Dh/2)

    class RMSNorm(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * self.weight

    def linear(name):
        layer = torch.nn.Linear(*P[name].shape[::-1], bias=False)
        layer.weight = torch.nn.Parameter(P[name], requires_grad=False)
        return layer

    def rope(x, freqs):  # Meta model.py apply_rotary_emb: pairs (2i, 2i+1) as complex numbers
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3)

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            pre = f"layers.{i}."
            self.attention_norm = RMSNorm(P[pre + "attention_norm.weight"])
            self.ffn_norm = RMSNorm(P[pre + "ffn_norm.weight"])
            self.wq, self.wk, self.wv, self.wo = (linear(pre + f"attention.{n}.weight") for n in ("wq", "wk", "wv", "wo"))
            self.w1, self.w2, self.w3 = (linear(pre + f"feed_forward.{n}.weight") for n in ("w1", "w2", "w3"))

        def forward(self, x, freqs, cache, start_pos):
            B, T, _ = x.shape
            xn = self.attention_norm(x)
            q = self.wq(xn).view(B, T, H, Dh)
            k = self.wk(xn).view(B, T, KVH, Dh)
            v = self.wv(xn).view(B, T, KVH, Dh)
            q, k = rope(q, freqs), rope(k, freqs)
            k_cache, v_cache = cache
            k_cache[:, :, start_pos:start_pos + T] = k.transpose(1, 2)
            v_cache[:, :, start_pos:start_pos + T] = v.transpose(1, 2)
            keys, values = k_cache[:, :, :start_pos + T], v_cache[:, :, :start_pos + T]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=T > 1,
                                                 enable_gqa=H != KVH)
            h = x + self.wo(out.transpose(1, 2).reshape(B, T, H * Dh))
            hn = self.ffn_norm(h)
            return h + self.w2(F.silu(self.w1(hn)) * self.w3(hn))

    class Llama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding.from_pretrained(P["tok_embeddings.weight"])
            self.layers = torch.nn.ModuleList(Block(i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(P["norm.weight"])
            self.output = linear("output.weight")

        def forward(self, tokens, caches, start_pos):
            T = tokens.shape[1]
            freqs = freqs_cis[start_pos:start_pos + T]
            h = self.tok_embeddings(tokens)
            for layer, cache in zip(self.layers, caches):
                h = layer(h, freqs, cache, start_pos)
            return self.output(self.norm(h[:, -1]))                  # logits of the last position

        def new_caches(self, B):
            shape = (B, KVH, cfg.max_seq_len, Dh)
            return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.n_layers)]

    return Llama().eval()


def torch_generate(tmodel, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Greedy KV-cached decode: prompt (B, P) -> new ids (B, max_new_tokens)."""
    import torch
    with torch.inference_mode():
        tokens = torch.from_numpy(prompt)
        caches = tmodel.new_caches(tokens.shape[0])
        logits = tmodel(tokens, caches, 0)
        pos, out = tokens.shape[1], []
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = tmodel(nxt, caches, pos)
                pos += 1
        return torch.cat(out, dim=1).numpy()


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def bench_case(name, model, batches, new_tokens, repeats):
    import torch

    tmodel = torch_model(model)
    rows = []
    rng = np.random.default_rng(0)
    for B in batches:
        prompt = rng.integers(0, model.config.vocab_size, size=(B, 8))
        np_times, torch_times = {1: math.inf, 2: math.inf}, {1: math.inf, 2: math.inf}
        # interleaved, best of `repeats`: a machine shared with other work slows both sides alike
        for _ in range(repeats):
            for threads in (1, 2):
                with blas_threads(threads):
                    seconds, ours = timed(lambda: generate_batch(model, list(prompt), new_tokens))
                np_times[threads] = min(np_times[threads], seconds)
                torch.set_num_threads(threads)
                seconds, theirs = timed(lambda: torch_generate(tmodel, prompt, new_tokens))
                torch_times[threads] = min(torch_times[threads], seconds)
        ours = np.stack(ours)
        agree = float((ours == theirs).mean())
        np_threads = min(np_times, key=np_times.get)
        torch_threads = min(torch_times, key=torch_times.get)
        np_tps = B * new_tokens / np_times[np_threads]
        torch_tps = B * new_tokens / torch_times[torch_threads]
        rows.append((name, B, np_tps, torch_tps, np_tps / torch_tps, np_threads, torch_threads, agree,
                     {t: B * new_tokens / s for t, s in np_times.items()},
                     {t: B * new_tokens / s for t, s in torch_times.items()}))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt (>= 1)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes to run")
    parser.add_argument("--cases", nargs="+", default=["stories260K", "8M"], choices=["stories260K", "8M"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument("--data-dir", default=os.environ.get("NPLLAMA_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data")),
                        help="folder holding stories260K.bin")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1 or min(args.batches) < 1:
        parser.error("--new-tokens, --repeats and --batches must be >= 1")
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"bench_decode needs torch ({e}); pip install -e '.[torch]'", file=sys.stderr)
        return 2
    # measure 1 and 2 BLAS threads as set here, not the engine's own choice (DECODE_BLAS_THREADS = 1)
    npllama.engine.decode.DECODE_BLAS_THREADS = None

    rows = []
    for case in args.cases:
        if case == "stories260K":
            path = Path(args.data_dir) / "stories260K.bin"
            if path.is_file():
                model, label = npllama.load(path), "stories260K"
                if model.config.max_seq_len < 8 + args.new_tokens:
                    print(f"{path} has max_seq_len={model.config.max_seq_len} < 8 + {args.new_tokens}", file=sys.stderr)
                    return 2
            else:
                model, label = npllama.Llama(npllama.LlamaConfig(**STORIES_CONFIG), seed=0), "stories260K(random)"
        else:
            model, label = npllama.Llama(npllama.LlamaConfig(**EIGHT_M_CONFIG), seed=0), "8M(random)"
        print(f"{label}: {model.config.n_params():,} parameters, {model.config}", flush=True)
        rows += bench_case(label, model, args.batches, args.new_tokens, args.repeats)

    print(f"\n{args.new_tokens} new tokens after an 8-token prompt, greedy, float32, best of {args.repeats}")
    print(f"{'model':22s} {'batch':>5s} {'npllama tok/s':>14s} {'torch tok/s':>12s} {'ratio':>6s}  threads np/torch  same tokens")
    for name, B, ours, theirs, ratio, nt, tt, agree, _, _ in rows:
        print(f"{name:22s} {B:5d} {ours:14,.0f} {theirs:12,.0f} {ratio:5.2f}x  {nt}/{tt}{'':15s}{agree:.1%}")
    print("\nper thread count (tok/s):")
    for name, B, *_, np_by, torch_by in rows:
        print(f"  {name:22s} batch {B}: npllama {', '.join(f'{t}T {v:,.0f}' for t, v in np_by.items())}; "
              f"torch {', '.join(f'{t}T {v:,.0f}' for t, v in torch_by.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
