"""Check that npllama computes the logits PyTorch computes, from the same weights.

    python tools/crosscheck.py weights/tiny-pytorch
    crosscheck weights/tiny-pytorch: npllama float32 vs reference float32 (weights/tiny-pytorch/reference_logits.safetensors)
      prompt 0  T=1   max|ref| 2.47e+00  max abs err 3.58e-07  rel 1.45e-07
      prompt 1  T=8   max|ref| 2.67e+00  max abs err 9.54e-07  rel 3.57e-07
      prompt 2  T=16  max|ref| 2.63e+00  max abs err 1.04e-06  rel 3.97e-07
      overall         max abs err 1.04e-06  rel 3.97e-07  (tolerance rel 1e-04): PASS

    python tools/crosscheck.py weights/tiny-pytorch --dtype float64     # overall rel 7.5e-16, tolerance 1e-09
    python tools/crosscheck.py stories260K.bin --live                   # overall rel 3.5e-06 (float64: 6.6e-15)

PATH is anything npllama.load reads (a Hugging Face folder, a .safetensors file, a llama2.c
.bin). The reference logits come from, in order:
  --reference FILE               a file tools/export_torch.py wrote
  PATH/reference_logits.safetensors, or one beside PATH
  --live (or no file found and torch installed): transformers.LlamaForCausalLM computes them now,
                                 from PATH itself when it is a Hugging Face folder, otherwise from
                                 the folder npllama.save(model, tmp, format="hf") writes

Errors, per prompt and overall: max abs err = max |ours - ref|, rel = max abs err / max |ref|
(relative to the logits' scale, so that logits near zero do not blow it up).
Tolerance on rel: 1e-4 when either side is float32, 1e-9 when both are float64.

float64. transformers' LlamaForCausalLM in float64 still computes RMSNorm, the RoPE angles and the
eager softmax in float32 (2.7e-7 relative error on the logits of weights/tiny-pytorch; the
issue quotes about 2e-6 for larger models). The float64 references made
here (export_torch.py, and --live --dtype float64) patch those three to follow the input dtype
(export_torch.make_float64_exact), so float64 is compared with a float64 tolerance.

Exit status: 0 when every prompt is within tolerance, 1 when one is not, 2 when something
could not be loaded or computed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # npllama and tools/ from a checkout

import npllama  # noqa: E402
from tools.reference_file import REFERENCE_NAME, fixed_prompts, read_reference  # noqa: E402

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}


def live_reference(path: Path, model, prompts, dtype: str) -> list[np.ndarray]:
    """Logits from transformers' LlamaForCausalLM holding the weights at path (needs torch)."""
    import torch
    from transformers import LlamaForCausalLM

    from tools.export_torch import make_float64_exact, torch_logits     # imports torch: only here

    with tempfile.TemporaryDirectory() as tmp:
        folder = path if path.is_dir() else Path(npllama.save(model, Path(tmp) / "hf", format="hf", dtype=dtype))
        hf = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    hf = hf.to(torch.float64 if dtype == "float64" else torch.float32).eval()
    if dtype == "float64":
        make_float64_exact(hf)
    return [torch_logits(hf, ids) for ids in prompts]


def compare(ours: list[np.ndarray], ref: list[np.ndarray], prompts, tol: float, out=sys.stdout) -> bool:
    worst_abs, worst_rel = 0.0, 0.0
    for i, (a, r, ids) in enumerate(zip(ours, ref, prompts)):
        if a.shape != r.shape:
            print(f"  prompt {i}: shape {a.shape} != reference {r.shape}", file=out)
            return False
        err = float(np.max(np.abs(a.astype(np.float64) - r.astype(np.float64))))
        scale = float(np.max(np.abs(r)))
        rel = err / max(scale, np.finfo(np.float64).tiny)
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
        print(f"  prompt {i}  T={len(ids):<3d} max|ref| {scale:.2e}  max abs err {err:.2e}  rel {rel:.2e}", file=out)
    ok = worst_rel <= tol
    print(f"  overall         max abs err {worst_abs:.2e}  rel {worst_rel:.2e}  (tolerance rel {tol:.0e}): "
          f"{'PASS' if ok else 'FAIL'}", file=out)
    return ok


def find_reference(path: Path) -> Path | None:
    for candidate in (path / REFERENCE_NAME if path.is_dir() else None, path.parent / REFERENCE_NAME):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("path", help="weights npllama.load reads: HF folder, .safetensors, llama2.c .bin")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="npllama's compute dtype (and the live reference's)")
    parser.add_argument("--reference", type=Path, default=None,
                        help=f"reference file (default: {REFERENCE_NAME} in or beside PATH)")
    parser.add_argument("--live", action="store_true",
                        help="compute the reference now with torch + transformers instead of reading a file")
    parser.add_argument("--tol", type=float, default=None,
                        help="tolerance on rel (default: 1e-4 if either side is float32, 1e-9 if both float64)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        model = npllama.load(path, dtype=np.float64 if args.dtype == "float64" else np.float32)
        ref_file = None if args.live else (args.reference or find_reference(path))
        if ref_file is None and not args.live:
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            except ImportError:
                print(f"crosscheck: no {REFERENCE_NAME} in or beside {path} and torch/transformers are not "
                      "installed; pass --reference FILE or install torch and transformers for --live", file=sys.stderr)
                return 2
        if ref_file is None:
            prompts = fixed_prompts(model.config.vocab_size, model.config.max_seq_len)
            ref = live_reference(path, model, prompts, args.dtype)
            ref_dtype, origin = args.dtype, "transformers, live"
        else:
            prompts, refs = read_reference(ref_file)
            ref_dtype = args.dtype if args.dtype in refs else next(iter(refs))
            ref, origin = refs[ref_dtype], str(ref_file)
        ours = [model.forward(np.asarray(ids, dtype=np.int64)[None])[0] for ids in prompts]
    except (ValueError, KeyError, FileNotFoundError, ImportError) as e:
        print(f"crosscheck: error: {e}", file=sys.stderr)
        return 2
    both64 = args.dtype == "float64" and ref_dtype == "float64"
    tol = args.tol if args.tol is not None else TOLERANCE["float64" if both64 else "float32"]
    print(f"crosscheck {path}: npllama {args.dtype} vs reference {ref_dtype} ({origin})")
    return 0 if compare(ours, ref, prompts, tol) else 1


if __name__ == "__main__":
    sys.exit(main())
