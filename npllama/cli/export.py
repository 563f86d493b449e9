"""`npllama export`: any checkpoint npllama reads, written as a Hugging Face folder or one Meta file.

    npllama export -m runs/lora/ckpt.safetensors -o runs/lora/hf         # LoRA adapters merged: W + s B A
    npllama export -m runs/x/ckpt.safetensors -o model.safetensors      # Meta names, config inside
    npllama export -m stories260K.bin --tokenizer tok512.model -o stories260K-hf --dtype bfloat16

A LoRA training checkpoint is read with its base (which must be unchanged) and exported merged,
so transformers' LlamaForCausalLM.from_pretrained(OUT) gives the fine-tuned model's logits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..io import load, save
from ..tokenizers import SentencePieceTokenizer
from ..tokenizers.hf_export import hf_tokenizer_files
from ..train.config import export_format
from ..errors import NpllamaError


DESCRIPTION = ("Read any checkpoint npllama reads (a training checkpoint, LoRA adapters with their base, an HF "
               "folder, a .safetensors, a llama2.c .bin) and write the model alone: a folder that transformers' "
               "LlamaForCausalLM.from_pretrained loads, or one .safetensors file with Meta names and the config "
               "in its metadata. LoRA adapters are merged: W + (alpha / r) B A.")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              help="write a checkpoint as a Hugging Face folder or one .safetensors (LoRA merged)")
    p.add_argument("-m", "--model", required=True, default=argparse.SUPPRESS, metavar="PATH", help="the checkpoint to export")
    p.add_argument("-o", "--out", required=True, default=argparse.SUPPRESS, metavar="PATH",
                   help="a folder (Hugging Face layout), or a file ending in .safetensors (Meta names)")
    p.add_argument("--format", choices=["hf", "meta"], default=argparse.SUPPRESS,
                   help="hf: a transformers folder; meta: one .safetensors file [default: from --out]")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32",
                   help="dtype of the written tensors")
    p.add_argument("--tokenizer", default=argparse.SUPPRESS, metavar="SPM_FILE",
                   help="a sentencepiece .model to write with the model (for a llama2.c .bin, which has none) "
                        "[default: the checkpoint's]")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    fmt = getattr(args, "format", None) or export_format(args.out)
    if fmt is None:
        raise NpllamaError(f"--out {args.out}: give a folder (Hugging Face) or a file ending in .safetensors, "
                         "or say which with --format")
    model = load(args.model)
    if getattr(args, "tokenizer", None):
        model.tokenizer = SentencePieceTokenizer.from_file(args.tokenizer)
    out = save(model, Path(args.out), format=fmt, dtype=args.dtype)
    cfg = model.config
    print(f"[npllama export] {args.model} -> {out} ({fmt}, {args.dtype}; {cfg.n_params():,} params, dim {cfg.dim}, "
          f"{cfg.n_layers} layers; tokenizer: {model.tokenizer!r})", file=sys.stderr)
    if fmt == "hf":
        if model.tokenizer is None:
            print(f"note: {hf_tokenizer_files(None).note}", file=sys.stderr)
        print(f"load it with: transformers.LlamaForCausalLM.from_pretrained({str(out)!r})", file=sys.stderr)
    return 0
