"""Two checkouts of npllama against each other: training steps and batch-1 decode, interleaved.

    python tools/bench_versions.py --other ../baseline [--rounds 5] [--train p b c] [--decode 15M 110M]

(a checkout of an older commit: git worktree add ../baseline <commit>)

For the closing note of a change that must not slow anything down (a restructure): each round
runs every case once on this checkout and once on the other, alternating which goes first, each
in a fresh process (PYTHONPATH at that checkout), and the medians are reported with their ratio
and the load average each round ran under. Only the public API of CONTRACT.md is used
(Llama, loss_and_grads, clip_grad_norm, AdamW, load, generate), so any version since it was
written runs. The cases:
    train p, b, c     bench_train.py's configurations: the library user's step, tokens/s
    decode 15M, 110M  bench_decode.py's random models (made by it, in its --models-dir), greedy,
                      batch 1, tokens/s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_train import CONFIGS  # noqa: E402
from tools.benchkit import load_average  # noqa: E402

TRAIN = {name: CONFIGS[name] for name in ("p", "b", "c")}      # bench_train.py's own shapes

TRAIN_SNIPPET = textwrap.dedent("""
    import json, sys, time, numpy as np, npllama
    kw, B, T, seconds = json.loads(sys.argv[1])
    model = npllama.Llama(npllama.LlamaConfig(**kw), seed=0)
    opt = npllama.AdamW(model.params, lr=1e-3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, kw["vocab_size"], (B, T))
    targets = np.roll(tokens, -1, axis=1)
    def step():
        loss, grads = model.loss_and_grads(tokens, targets)
        npllama.clip_grad_norm(grads, 1.0)
        opt.step(grads)
    for _ in range(2):
        step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    print(steps * B * T / (time.perf_counter() - start))
""")

DECODE_SNIPPET = textwrap.dedent("""
    import json, sys, time, numpy as np, npllama
    path, new_tokens = json.loads(sys.argv[1])
    model = npllama.load(path)
    prompt = list(np.random.default_rng(0).integers(1, model.config.vocab_size, 16))
    model.generate(prompt, max_new_tokens=8, temperature=0.0)
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, temperature=0.0)
    print(new_tokens / (time.perf_counter() - start))
""")


def run_side(checkout: Path, snippet: str, argument) -> float:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", snippet, json.dumps(argument)], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"bench_versions: {checkout}: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="the other checkout (its folder)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of training steps per side per round")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each decode generates")
    parser.add_argument("--train", nargs="*", choices=list(TRAIN), default=list(TRAIN), help="training configurations")
    parser.add_argument("--decode", nargs="*", choices=["15M", "110M"], default=["15M", "110M"], help="decode models")
    parser.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "npllama" / "bench",
                        help="where bench_decode.py keeps its random models")
    args = parser.parse_args(argv)
    other = args.other.resolve()
    if not (other / "npllama" / "__init__.py").is_file():
        parser.error(f"--other {other}: not an npllama checkout (no npllama/__init__.py)")
    cases = {f"train {name}": (TRAIN_SNIPPET, [*TRAIN[name], args.seconds]) for name in args.train}
    for name in args.decode:
        path = args.models_dir / f"{name}.safetensors"
        if path.is_file():
            cases[f"decode {name}"] = (DECODE_SNIPPET, [str(path), args.new_tokens])
        else:
            print(f"(decode {name} skipped: {path} is missing; `python tools/bench_decode.py --cases {name}` makes it)")
    found = {case: {"this": [], "other": []} for case in cases}
    loads = []
    for r in range(args.rounds):
        loads.append(load_average())
        for case, (snippet, argument) in cases.items():
            order = [("this", ROOT), ("other", other)]
            for side, checkout in order if r % 2 == 0 else order[::-1]:
                found[case][side].append(run_side(checkout, snippet, argument))
        print(f"round {r + 1}/{args.rounds} done (load {loads[-1]:.2f})", flush=True)
    print(f"\nthis checkout: {ROOT}\nthe other:     {other}\nmedians of {args.rounds} interleaved rounds, "
          f"tokens/s; load average {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'case':12s} {'this':>10s} {'other':>10s} {'this/other':>11s}")
    for case, sides in found.items():
        this, theirs = statistics.median(sides["this"]), statistics.median(sides["other"])
        print(f"{case:12s} {this:10,.0f} {theirs:10,.0f} {this / theirs:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
