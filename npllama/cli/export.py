"""`npllama export`: any checkpoint npllama reads, written as a Hugging Face folder, one Meta file or a GGUF.

    npllama export -m runs/lora/ckpt.safetensors -o runs/lora/hf         # LoRA adapters merged: W + s B A
    npllama export -m runs/x/ckpt.safetensors -o model.safetensors      # Meta names, config inside
    npllama export -m stories260K.bin --tokenizer tok512.model -o stories260K-hf --dtype bfloat16
    npllama export -m runs/x/ckpt.safetensors -o model.gguf --type q8_0  # for llama.cpp and ollama

A LoRA training checkpoint is read with its base (which must be unchanged) and exported merged,
so transformers' LlamaForCausalLM.from_pretrained(OUT) gives the fine-tuned model's logits.

--out is never one of the inputs (the checkpoint, its LoRA base, its config.json, --tokenizer),
nor inside or around one (io/outputs.py), and never a training or LoRA checkpoint, whose
optimizer state or adapters the bare model would replace, unless --overwrite-checkpoint says so
(then the old file stays until the new one is complete: io/atomic.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..io import load, save
from ..io.errors import OutputPathError
from ..io.gguf_llama import WRITE_TYPES, write_type_name
from ..io.outputs import (check_output_path, check_save_target, checkpoint_kind, model_inputs, refuse_inputs,
                          same_file)
from ..tokenizers import SentencePieceTokenizer
from ..tokenizers.hf_export import hf_tokenizer_files
from ..train.config import export_format
from ..errors import NpllamaError
from .args import docs_epilog, say


DESCRIPTION = ("Read any checkpoint npllama reads (a training checkpoint, LoRA adapters with their base, an HF "
               "folder, a .safetensors, a llama2.c .bin, a GGUF) and write the model alone: a folder that "
               "transformers' LlamaForCausalLM.from_pretrained loads, one .safetensors file with Meta names and "
               "the config in its metadata, or a .gguf file that llama.cpp and ollama run. LoRA adapters are "
               "merged: W + (alpha / r) B A.")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              epilog=docs_epilog("docs/weights.md"),
                              help="write a checkpoint as a Hugging Face folder, one .safetensors or a .gguf (LoRA merged)")
    p.add_argument("-m", "--model", required=True, default=argparse.SUPPRESS, metavar="PATH", help="the checkpoint to export")
    p.add_argument("-o", "--out", required=True, default=argparse.SUPPRESS, metavar="PATH",
                   help="a folder (Hugging Face layout), a file ending in .safetensors (Meta names) or in .gguf")
    p.add_argument("--format", choices=["hf", "meta", "gguf"], default=argparse.SUPPRESS,
                   help="hf: a transformers folder; meta: one .safetensors file; gguf: one file for llama.cpp "
                        "[default: from --out]")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32",
                   help="dtype of the written tensors (hf, meta)")
    p.add_argument("--type", choices=sorted(WRITE_TYPES), default=argparse.SUPPRESS,
                   help="gguf: ggml type of the weight matrices (norms stay f32; q8_0 is llama.cpp's 8-bit blocks, "
                        "weights whose rows are not a multiple of 32 become f16) [default: from --dtype]")
    p.add_argument("--tokenizer", default=argparse.SUPPRESS, metavar="SPM_FILE",
                   help="a sentencepiece .model to write with the model (for a llama2.c .bin, which has none) "
                        "[default: the checkpoint's]")
    p.add_argument("--overwrite-checkpoint", action="store_true",
                   help="let --out replace a training or LoRA checkpoint (its optimizer state or adapters are "
                        "lost; the model itself is kept, merged); without it that is refused")
    p.set_defaults(func=run)
    return p


def _refuse_inputs(out: Path, args: argparse.Namespace) -> None:
    """Refuse an --out that is, holds or lies inside an input; --overwrite-checkpoint lets a training
    or LoRA checkpoint be exported onto itself (the bare model replaces it, whole, once complete)."""
    inputs = model_inputs(args.model, "the checkpoint being exported (-m)")
    kind = checkpoint_kind(args.model)
    if kind and same_file(out, args.model):
        if not args.overwrite_checkpoint:
            raise OutputPathError(f"--out {out} is the checkpoint being exported (-m), {kind}; the bare model would "
                                  "replace it: write to another path, or add --overwrite-checkpoint to replace it")
        del inputs["the checkpoint being exported (-m)"]
    if getattr(args, "tokenizer", None):
        inputs["--tokenizer"] = args.tokenizer
    refuse_inputs(out, inputs, "--out")


def run(args: argparse.Namespace) -> int:
    out = check_output_path(args.out, "--out", whole=True)
    fmt = getattr(args, "format", None) or export_format(args.out)
    if fmt is None:
        raise NpllamaError(f"--out {args.out}: give a folder (Hugging Face) or a file ending in .safetensors or "
                           ".gguf, or say which with --format")
    gguf_type = getattr(args, "type", None)
    if gguf_type is not None and fmt != "gguf":
        raise NpllamaError(f"--type {gguf_type} is for --format gguf; for {fmt} use --dtype")
    if fmt == "gguf" and gguf_type is not None and args.dtype != "float32":
        raise NpllamaError("give --type (the GGUF tensor type) or --dtype, not both")
    dtype = gguf_type or (write_type_name(args.dtype) if fmt == "gguf" else args.dtype)
    _refuse_inputs(out, args)
    check_save_target(out, fmt, args.overwrite_checkpoint, flag="--overwrite-checkpoint")
    model = load(args.model)
    if getattr(args, "tokenizer", None):
        model.tokenizer = SentencePieceTokenizer.from_file(args.tokenizer)
    out = save(model, out, format=fmt, dtype=dtype, overwrite_checkpoint=args.overwrite_checkpoint)
    cfg = model.config
    say(f"[npllama export] {args.model} -> {out} ({fmt}, {dtype}; {cfg.n_params():,} params, dim {cfg.dim}, "
        f"{cfg.n_layers} layers; tokenizer: {model.tokenizer!r})")
    if fmt == "hf":
        if model.tokenizer is None:
            say(f"note: {hf_tokenizer_files(None).note}")
        say(f"load it with: transformers.LlamaForCausalLM.from_pretrained({str(out)!r})")
    if fmt == "gguf":
        if model.tokenizer is None:
            say("note: the model has no tokenizer, so llama.cpp can only take token ids; pass --tokenizer")
        say(f"run it with: llama-cli -m {out}   (or npllama generate -m {out})")
    return 0
