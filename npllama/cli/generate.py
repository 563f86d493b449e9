"""`npllama generate`: text from a checkpoint, streamed to stdout as it is sampled.

    npllama generate --prompt "ROMEO:" -n 200                        # the model shipped with npllama
    npllama generate -m runs/x/ckpt.safetensors -p "First Citizen:" --temp 0.7 --top-k 40 -s 1
    npllama generate -m stories260K.bin --tokenizer tok512.model -p "Once upon a time"
    npllama generate -m model.safetensors --prompt-ids 1,15043,3186  # no tokenizer: ids in, ids out

The flags follow llama.cpp's where it has one (-m, -p, -n, --temp, --top-k, --top-p, --min-p,
--repeat-penalty, -s); 0 turns --top-k off and 1.0 turns --top-p / --repeat-penalty off, as
there. Generation ends after -n tokens, at the tokenizer's EOS, or at a --stop string (which is
not printed). The prompt is echoed, then the new text; tokens/s goes to stderr at the end.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

from ..generate import generate_stream
from ..io import load
from ..tokenizers import tokenizer_from_file
from .args import docs_epilog, number, say
from ..errors import MissingFileError, NpllamaError

# Package data, so a wheel generates offline from any folder. In the repository this is a link to
# weights/shakespeare-char.safetensors, the one file to replace (tests/test_packaging.py).
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "weights" / "shakespeare-char.safetensors"
DEFAULT_MAX_NEW_TOKENS = 256


def _ids(text):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one id, e.g. 1,2,3")
    return ids


def _unescape(text: str) -> str:
    """\\n, \\t and \\\\ as a shell passes them (--stop "\\n\\n") -> newline, tab, backslash."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="generate text from a checkpoint (streams to stdout)",
        description="Generate text from a checkpoint, streamed to stdout as it is sampled (KV cache: one "
                    "prefill, then one token a step). Flags follow llama.cpp's. Generation ends after -n "
                    "tokens, at the tokenizer's EOS, or before a --stop string. The prompt is echoed, then "
                    "the new text; tokens/s goes to stderr at the end.",
        epilog=docs_epilog("docs/generation.md"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", default=argparse.SUPPRESS,
                   help="checkpoint: .safetensors (npllama, HF or training checkpoint), HF folder, llama2.c .bin, "
                        "or GGUF (llama.cpp; its own tokenizer is used) "
                        f"[default: {DEFAULT_MODEL.name}, shipped with npllama, made by `npllama train`]")
    p.add_argument("-p", "--prompt", default=argparse.SUPPRESS,
                   help="text to continue [default: none: start from BOS (sentencepiece) or a newline (characters)]")
    p.add_argument("--prompt-ids", type=_ids, default=argparse.SUPPRESS, metavar="ID,ID,...",
                   help="the prompt as token ids instead of text (needed when the model has no tokenizer)")
    p.add_argument("-n", "--max-new-tokens", "--n-predict", type=number(int, 0), default=argparse.SUPPRESS, metavar="N",
                   help=f"new tokens at most, up to max_seq_len - (prompt tokens) + 1: the last is sampled at the "
                        f"final position and never fed back, as llama2.c's run.c [default: {DEFAULT_MAX_NEW_TOKENS}, "
                        "or fewer if the context ends sooner]")
    p.add_argument("--temp", "--temperature", dest="temperature", type=number(float, 0.0), default=0.8,
                   metavar="T", help="sampling temperature, >= 0; 0 is greedy (argmax)")
    p.add_argument("--top-k", type=number(int, 0), default=40, metavar="K",
                   help="keep the K most likely tokens (ties at the K-th kept); 0 = off")
    p.add_argument("--top-p", type=number(float, 0.0, 1.0, low_open=True), default=0.95, metavar="P",
                   help="nucleus: keep the smallest set of most likely tokens whose mass reaches P, in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=number(float, 0.0, 1.0), default=0.05, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one, in [0, 1]; 0 = off")
    p.add_argument("--repeat-penalty", type=number(float, 0.0, low_open=True), default=1.0, metavar="R",
                   help="CTRL penalty on tokens already in the prompt or output (> 1 discourages repeats); 1 = off")
    p.add_argument("-s", "--seed", type=number(int, 0), default=argparse.SUPPRESS,
                   help="random seed; the same seed and flags give the same text [default: a fresh one, printed]")
    p.add_argument("--tokenizer", default=argparse.SUPPRESS, metavar="PATH",
                   help="the tokenizer to use instead of the checkpoint's: a sentencepiece .model file, a "
                        "Hugging Face tokenizer.json, or a folder holding one [default: the checkpoint's]")
    p.add_argument("--stop", action="append", type=_unescape, default=argparse.SUPPRESS, metavar="STR",
                   help="stop before this text appears (repeatable; \\n and \\t mean newline and tab); "
                        "EOS always stops")
    p.add_argument("--no-bos", action="store_true", help="do not put the tokenizer's BOS id before the prompt")
    p.add_argument("--sliding-window", action="store_true",
                   help="when prompt + N passes the model's max_seq_len, keep going: the newest half of the "
                        "context is re-read from position 0 each time the context fills (without it, an error)")
    p.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"], default="float32",
                   help="precision the weights are held in: float32 or float64 (computed in it too), or float16 / "
                        "bfloat16, half the memory of float32, computed in float32 a layer at a time (for models "
                        "whose float32 copy does not fit; slower than float32)")
    p.add_argument("--reference", action="store_true",
                   help="decode on the readable reference (model.forward with a KV cache, single-threaded) "
                        "instead of the engine: the same text, slower")
    p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                   help="map the weights file instead of reading it (--no-mmap: always read it); by default "
                        "it is read into memory unless it holds more than half the memory available. A mapped "
                        "file must not be rewritten in place or truncated while generating: a change stops "
                        "generation with a message, a truncation mid-step ends it with exit code 135")
    p.set_defaults(func=run)
    return p


# Flags whose help states its default in words; argparse leaves them out of args when not given.
_UNSTATED_DEFAULTS = dict(model=None, prompt="", prompt_ids=None, max_new_tokens=None, seed=None,
                          tokenizer=None, stop=[], mmap=None)


def _load(args):
    path = Path(args.model) if args.model else DEFAULT_MODEL
    if not path.exists():
        if args.model:
            raise MissingFileError(f"--model {path} does not exist; pass a .safetensors file, a Hugging Face "
                                    "folder, a llama2.c .bin or a .gguf")
        raise MissingFileError(f"no --model given and the default model {path} is missing from the installed "
                                "package; reinstall npllama (its wheel carries the model; in a git checkout the "
                                "file is a link to weights/shakespeare-char.safetensors) or pass --model PATH")
    model = load(path, dtype=args.dtype, mmap=args.mmap, backend="reference" if args.reference else "engine")
    tokenizer = getattr(model, "tokenizer", None)
    if args.tokenizer:
        tokenizer = tokenizer_from_file(args.tokenizer)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise NpllamaError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}: they do not belong together; pass the model's own "
                         "tokenizer with --tokenizer")
    return path, model, tokenizer


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        if args.prompt:
            raise NpllamaError("give --prompt or --prompt-ids, not both")
        return list(args.prompt_ids)
    if tokenizer is None:
        raise NpllamaError("this model carries no tokenizer, so a text --prompt cannot be encoded; pass "
                         "--tokenizer PATH, or the prompt as ids with --prompt-ids 1,2,3")
    bos = tokenizer.bos_id is not None and not args.no_bos
    text = args.prompt
    if not text and not bos:
        text = "\n"  # nanoGPT's sample.py starts from a newline too
    ids = tokenizer.encode(text, bos=bos)
    if not ids:
        raise NpllamaError("the prompt encodes to no tokens; give a non-empty --prompt")
    return ids


class StopStrings:
    """Cuts streamed text before the first stop string, holding back any tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of pending + text that is certainly output; sets .stopped at a stop string."""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = 0  # longest tail of pending that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def run(args: argparse.Namespace) -> int:
    for name, value in _UNSTATED_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    path, model, tokenizer = _load(args)
    cfg = model.config
    if args.stop and tokenizer is None:
        raise NpllamaError("--stop compares text, which needs a tokenizer (--tokenizer PATH)")
    prompt = _prompt_ids(args, tokenizer)
    n = args.max_new_tokens
    if n is None:
        # to the very end of the context, as llama2.c's run.c: the last token is sampled from the
        # final position's logits and never fed back, so max_seq_len - p + 1 fit
        n = DEFAULT_MAX_NEW_TOKENS if args.sliding_window else \
            max(0, min(DEFAULT_MAX_NEW_TOKENS, cfg.max_seq_len - len(prompt) + 1))
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    stop_ids = [tokenizer.eos_id] if tokenizer is not None and tokenizer.eos_id is not None else []
    sampling = dict(temperature=args.temperature, top_k=args.top_k or None,
                    top_p=args.top_p if args.top_p < 1.0 else None, min_p=args.min_p or None,
                    repetition_penalty=args.repeat_penalty if args.repeat_penalty != 1.0 else None)
    stream = generate_stream(model, prompt, n, seed=seed, stop_ids=stop_ids,
                             sliding_window=args.sliding_window, **sampling)
    shown = ", ".join(f"{k}={v}" for k, v in sampling.items() if v is not None and
                      (args.temperature > 0 or k == "repetition_penalty"))
    shown = shown if args.temperature > 0 else ", ".join(["greedy", shown]).rstrip(", ")
    say(f"[npllama generate] {path} ({cfg.n_params():,} params, dim={cfg.dim}, layers={cfg.n_layers}, "
        f"max_seq_len={cfg.max_seq_len}, {args.dtype}); tokenizer: {tokenizer!r}; prompt: {len(prompt)} tokens; "
        f"{shown}; seed={seed}; max_new_tokens={n}")

    out = sys.stdout
    start = time.perf_counter()
    first_token_at = None
    count = 0
    if tokenizer is None:
        out.write(" ".join(map(str, prompt)))
        for token_id in stream:
            first_token_at = first_token_at or time.perf_counter()
            count += 1
            out.write(f" {token_id}")
            out.flush()
        out.write("\n")
    else:
        out.write(tokenizer.decode(prompt))
        out.flush()
        decoder = tokenizer.stream_decoder()
        for t in prompt:   # so the first new piece is decoded in context (leading-space rule)
            decoder.push(t)
        decoder.flush()
        stops = StopStrings(args.stop)
        for token_id in stream:
            first_token_at = first_token_at or time.perf_counter()
            count += 1
            text = stops.feed(decoder.push(token_id))
            if text:
                out.write(text)
                out.flush()
            if stops.stopped:
                stream.close()
                break
        if not stops.stopped:
            out.write(stops.feed(decoder.flush()) + stops.flush())
        out.write("\n")
    out.flush()
    elapsed = time.perf_counter() - start
    if count:
        decode = elapsed - (first_token_at - start)
        per_s = (count - 1) / decode if count > 1 and decode > 0 else float("nan")
        say(f"[npllama generate] {count} tokens in {elapsed:.2f} s; prompt + first token "
            f"{1000 * (first_token_at - start):.0f} ms, then {per_s:,.1f} tokens/s")
    else:
        say(f"[npllama generate] no tokens generated ({elapsed:.2f} s)")
    return 0
