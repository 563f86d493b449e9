"""`npllama gradcheck`: run a forward pass, then check every op's and the model's hand-written
gradients against central differences in float64, printing one line per check. The model's
gradients are those of the engine (the default) or, with --reference, of the reference.

Central differences cost two evaluations per number checked: every element of each op's inputs
(step 2) and --entries of every parameter of the model (step 3, two forward passes each). Before
anything is allocated the command works out the memory this takes (npllama.memory.gradcheck_bytes)
and the time (estimate_seconds: the evaluations it needs, each timed on tiny sizes plus its
arithmetic at this machine's measured speed), prints the estimate, and refuses a check that
cannot fit or would take longer than --max-minutes.

Exit code 0 when every relative error is below --tol, 1 otherwise.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import memory, model as reference, ops
from ..config import LlamaConfig
from ..gradcheck import gradcheck, numerical_grad, rel_error
from ..llama import Llama
from ..work import MachineSpeed, describe_seconds, require_time
from .args import docs_epilog, number


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


def model_loss(params, cfg, tokens, targets) -> float:
    """The reference model's loss, a forward pass alone (what central differences evaluate)."""
    return ops.cross_entropy_forward(reference.forward(params, cfg, tokens)[0], targets)[0]


def _timed(fn, inputs) -> float:
    """Seconds of fn(*inputs), the shortest of three."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(*inputs)
        best = min(best, time.perf_counter() - t0)
    return best


def estimate_seconds(cfg: LlamaConfig, B: int, T: int, entries: int, speed: MachineSpeed) -> tuple[float, int, int]:
    """(seconds, model forward passes, op evaluations) of the whole check, before running it.

    An evaluation's time is what it takes at tiny sizes (its Python and NumPy call overhead,
    timed here) plus its arithmetic at the real sizes at `speed`: ~10 elementwise operations per
    element an op reads or writes, and the multiply-adds of its matmuls. The model's pass is timed
    at one and two tiny layers, for the overhead of the pass and of a layer.
    """
    H, KVH, Dh, F, V, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size, cfg.dim
    # per op check: (float inputs' elements, elements read and written by one forward, multiply-adds)
    work = {"embedding": (V * D, 2 * B * T * D, 0), "rmsnorm": (B * T * D + D, 2 * B * T * D, 0),
            "linear": (B * T * D + F * D, B * T * (D + F), B * T * D * F),
            "rope": (B * H * T * Dh, 2 * B * H * T * Dh, 0),
            "attention (GQA, causal)": ((H + 2 * KVH) * B * T * Dh, B * H * T * (4 * Dh + 3 * T), 2 * B * H * T * T * Dh),
            "swiglu": (2 * B * T * F, 3 * B * T * F, 0), "cross-entropy": (B * T * V, 3 * B * T * V, 0)}
    tiny_ops = op_checks(np.random.default_rng(0), 1, 2, 1, 1, 2, 2, 2)
    op_seconds, op_evaluations = 0.0, 0
    for name, forward, _, inputs in tiny_ops:
        n_inputs, touched, macs = work[name]
        op_evaluations += 2 * n_inputs
        op_seconds += 2 * n_inputs * (_timed(forward, inputs) + speed.seconds(10 * touched, macs))

    def tiny_pass(layers):
        tiny = LlamaConfig(dim=2, n_layers=layers, n_heads=1, vocab_size=2, multiple_of=2, max_seq_len=2)
        params, tokens = reference.init_params(tiny, 0, np.float64), np.zeros((1, 2), np.int64)
        return _timed(model_loss, (params, tiny, tokens, tokens))

    one, two = tiny_pass(1), tiny_pass(2)
    per_layer = max(two - one, 0.0)
    forward = (max(one - per_layer, 0.0) + cfg.n_layers * per_layer
               + speed.seconds(10 * memory.activation_bytes(cfg, B, T, 1), pass_macs(cfg, B, T)))
    tensors = 9 * cfg.n_layers + 2 + (0 if cfg.tie_embeddings else 1)      # len(cfg.param_shapes()), at once
    passes = 2 * entries * tensors
    return 3 * forward + op_seconds + passes * forward, passes + 3, op_evaluations


def pass_macs(cfg: LlamaConfig, B: int, T: int) -> float:
    """Multiply-adds of a forward over B windows of T tokens (no causal saving: the reference's)."""
    return B * T * (cfg.n_params() - cfg.vocab_size * cfg.dim) + 2 * cfg.n_layers * B * T * T * cfg.dim


def run(args) -> int:
    rng = np.random.default_rng(args.seed)
    H, KVH = args.n_heads, args.n_kv_heads
    cfg = LlamaConfig(dim=H * args.head_dim, n_layers=args.n_layers, n_heads=H, n_kv_heads=KVH,
                      vocab_size=args.vocab_size, multiple_of=8, max_seq_len=args.seq_len)
    print(f"config: {cfg}")
    B, T = args.batch_size, args.seq_len
    memory.require(memory.gradcheck_bytes(cfg, B, T), f"gradcheck of {cfg.n_params():,} parameters in float64 "
                   f"on {B} x {T} tokens", "choose smaller sizes (--vocab-size, --n-layers, --head-dim, --n-heads, "
                   "--batch-size, --seq-len)")
    seconds, passes, evaluations = estimate_seconds(cfg, B, T, args.entries, MachineSpeed.measure())
    print(f"estimated time: {describe_seconds(seconds)} ({passes:,} forward passes of the model, "
          f"{evaluations:,} op evaluations)", flush=True)
    require_time(seconds, 60 * args.max_minutes, "this gradcheck",
                 "choose smaller sizes, fewer --entries, or allow more with --max-minutes")
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
        numeric = numerical_grad(lambda: ops.cross_entropy_forward(model.forward(tokens), targets)[0], p,
                                 indices=picks)
        err = rel_error(grads[name].reshape(-1)[picks], numeric.reshape(-1)[picks])
        worst = max(worst, err)
        print(f"   {name:<36} {str(p.shape):<10} relative error {err:.1e}")
    ok = worst < args.tol
    print(f"\nworst relative error {worst:.1e}: {'PASS' if ok else 'FAIL'} (tolerance {args.tol:.0e})")
    return 0 if ok else 1


def register(subparsers):
    p = subparsers.add_parser(
        "gradcheck", help="watch a forward pass and every gradient checked numerically",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=docs_epilog("docs/math.md (the formulas and derivatives it checks)"))
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
    p.add_argument("--max-minutes", type=number(float, 0.0, low_open=True), default=10.0,
                   help="refuse, before starting, a check estimated to take longer than this")
    p.set_defaults(func=run)
