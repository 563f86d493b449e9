"""`npllama gradcheck`: run a forward pass, then check every op's and the model's hand-written
gradients against central differences in float64, printing one line per check. The model's
gradients are those of the engine (the default) or, with --reference, of the reference.

Exit code 0 when every relative error is below --tol, 1 otherwise.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..gradcheck import gradcheck, numerical_grad, rel_error
from ..llama import Llama
from .args import number


def op_checks(rng, B, T, H, KVH, Dh, F, V):
    """(name, forward, backward, inputs) for each op, at the given sizes."""
    D = H * Dh
    x = rng.standard_normal((B, T, D))
    cos, sin = ops.rope_tables(Dh, T, 10000.0, np.float64)
    ids = rng.integers(0, V, (B, T))
    targets = rng.integers(0, V, (B, T))
    targets[0, 0] = ops.IGNORE_INDEX
    return [
        ("embedding", lambda w: ops.embedding_forward(ids, w), ops.embedding_backward,
         [rng.standard_normal((V, D))]),
        ("rmsnorm", lambda x, w: ops.rmsnorm_forward(x, w, 1e-5), ops.rmsnorm_backward,
         [x, rng.standard_normal(D)]),
        ("linear", ops.linear_forward, ops.linear_backward, [x, rng.standard_normal((F, D))]),
        ("rope", lambda q: ops.rope_forward(q, cos, sin), ops.rope_backward,
         [rng.standard_normal((B, H, T, Dh))]),
        ("attention (GQA, causal)", ops.attention_forward, ops.attention_backward,
         [rng.standard_normal((B, H, T, Dh)), rng.standard_normal((B, KVH, T, Dh)),
          rng.standard_normal((B, KVH, T, Dh))]),
        ("swiglu", ops.swiglu_forward, ops.swiglu_backward,
         [rng.standard_normal((B, T, F)), rng.standard_normal((B, T, F))]),
        ("cross-entropy", lambda z: (ops.cross_entropy_forward(z, targets)[0], ops.cross_entropy_forward(z, targets)[1]),
         ops.cross_entropy_backward, [rng.standard_normal((B, T, V))]),
    ]


def run(args) -> int:
    rng = np.random.default_rng(args.seed)
    H, KVH = args.n_heads, args.n_kv_heads
    cfg = LlamaConfig(dim=H * args.head_dim, n_layers=args.n_layers, n_heads=H, n_kv_heads=KVH,
                      vocab_size=args.vocab_size, multiple_of=8, max_seq_len=args.seq_len)
    print(f"config: {cfg}")
    B, T = args.batch_size, args.seq_len
    backend = "reference" if args.reference else "engine"
    print(f"\n1. forward pass (float64, {backend}): tokens ({B}, {T}) -> logits ({B}, {T}, {cfg.vocab_size})")
    model = Llama(cfg, seed=args.seed, dtype=np.float64, backend=backend)
    params = model.params
    # Weights far larger than the 0.02 init: there, q and k gradients are ~1e-8, below what central
    # differences (noise ~1e-10) can certify to 1e-6.
    for p in params.values():
        p += rng.standard_normal(p.shape) * 0.3
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = np.roll(tokens, -1, axis=1)
    targets[:, -1] = ops.IGNORE_INDEX
    t0 = time.perf_counter()
    loss, grads = model.loss_and_grads(tokens, targets)
    print(f"   loss {loss:.6f} (ln V = {np.log(cfg.vocab_size):.6f} for a uniform guess), "
          f"forward + backward {1e3 * (time.perf_counter() - t0):.1f} ms")

    worst = 0.0
    print("\n2. each op: analytic gradient vs central differences of sum(op(x) * dy), h = 1e-6")
    for name, forward, backward, inputs in op_checks(rng, B, T, H, KVH, args.head_dim, cfg.hidden_dim, cfg.vocab_size):
        if name == "cross-entropy":
            z = inputs[0]
            _, cache = forward(z)
            analytic = backward(1.0, cache)
            errors = [rel_error(analytic, numerical_grad(lambda: forward(z)[0], z))]
        else:
            errors = gradcheck(forward, backward, *inputs, seed=args.seed)
        worst = max(worst, *errors)
        print(f"   {name:<24} relative error " + "  ".join(f"{e:.1e}" for e in errors))

    print(f"\n3. whole model: {args.entries} entries of every parameter, loss differences, h = 1e-6")
    for name, p in params.items():
        picks = rng.choice(p.size, size=min(args.entries, p.size), replace=False)
        numeric = numerical_grad(lambda: model.loss_and_grads(tokens, targets)[0], p, indices=picks)
        err = rel_error(grads[name].reshape(-1)[picks], numeric.reshape(-1)[picks])
        worst = max(worst, err)
        print(f"   {name:<36} {str(p.shape):<10} relative error {err:.1e}")
    ok = worst < args.tol
    print(f"\nworst relative error {worst:.1e}: {'PASS' if ok else 'FAIL'} (tolerance {args.tol:.0e})")
    return 0 if ok else 1


def register(subparsers):
    p = subparsers.add_parser(
        "gradcheck", help="watch a forward pass and every gradient checked numerically",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n-layers", type=number(int, 1), default=2, help="transformer blocks (>= 1)")
    p.add_argument("--n-heads", type=number(int, 1), default=4, help="query heads (>= 1)")
    p.add_argument("--n-kv-heads", type=number(int, 1), default=2, help="key/value heads, dividing --n-heads")
    p.add_argument("--head-dim", type=number(int, 1), default=4, help="features per head (even)")
    p.add_argument("--vocab-size", type=number(int, 1), default=13, help="vocabulary size (>= 1)")
    p.add_argument("--batch-size", type=number(int, 1), default=2, help="sequences (>= 1)")
    p.add_argument("--seq-len", type=number(int, 1), default=6, help="positions per sequence (>= 1)")
    p.add_argument("--entries", type=number(int, 1), default=4, help="entries checked per parameter")
    p.add_argument("--tol", type=number(float, 0.0, low_open=True), default=1e-6, help="largest relative error that passes")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, tokens and probes")
    p.add_argument("--reference", action="store_true",
                   help="check the readable reference's gradients (npllama/model.py) instead of the engine's")
    p.set_defaults(func=run)
