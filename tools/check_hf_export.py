"""Do the Hugging Face folders `npllama export` writes work in transformers alone? (issue 20)

    python tools/check_hf_export.py export OUT    # npllama's side: one exported folder per kind of
                                                  # tokenizer, and OUT/expected.json
    python tools/check_hf_export.py check OUT     # transformers' side, in a venv holding torch and
                                                  # transformers only: exit 0 when all checks pass

The two halves run in different environments: `export` where npllama is installed (it needs
NPLLAMA_DATA_DIR, the folder holding tinyshakespeare.txt, llama2-tokenizer.model, stories260K.bin
and tok512.model), `check` in a fresh venv with `pip install torch transformers` and nothing else
(.ci/run makes one). `check` refuses to run when sentencepiece, protobuf, tiktoken or npllama can be
imported, unless --hide is given: then it hides them from itself first (what the in-suite test
does, in an environment that has them).

The folders, one per kind of tokenizer npllama has:
    char     the shipped weights/shakespeare-char.safetensors (CharTokenizer)
    tok512   llama2.c's stories260K.bin exported with --tokenizer tok512.model (sentencepiece BPE)
    llama2   a small random model with Llama 2's tokenizer (llama2-tokenizer.model)
    bpe      a small random model whose tokenizer train_sentencepiece trained on TinyShakespeare
             (what `npllama train --tokenizer bpe` makes)
    unigram  the same with a sentencepiece unigram model trained on TinyShakespeare

For each, `check` asserts:
  1. AutoTokenizer.from_pretrained(folder) encodes 200 TinyShakespeare lines (and, for the
     sentencepiece kinds, a few texts with odd spacing and characters outside the vocabulary) to
     npllama's ids, puts BOS first by default exactly when npllama's tokenizer has one, and
     decodes the ids back to npllama's text;
  2. pipeline("text-generation", model=folder) with greedy decoding (do_sample=False) generates
     the ids `npllama generate --temp 0` generates, and prints its text. One exception, which is
     transformers': since transformers 5.x (PR #45860) the pipeline decodes the new ids on their
     own and puts the prompt before them, so when the first new piece starts a word ('▁time') the
     decoder drops its space, as it does for every Llama tokenizer: the printed text then lacks
     exactly that one space, and the ids decoded whole by AutoTokenizer give npllama's text.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("sentencepiece", "google.protobuf", "tiktoken", "npllama")
N_LINES = 200
MAX_NEW_TOKENS = 40
# Texts beyond TinyShakespeare's lines for the sentencepiece kinds: spaces at either end and in
# runs, tabs, accents, and characters outside every vocabulary here (byte fallback).
ODD_TEXTS = [" leading space", "trailing space ", "two  spaces,   three", "  ", "", "tab\there\n\nnewlines",
             "café naïve Straße", "日本語 😀 ✓", "a" + " " * 17 + "b"]


# ---------------------------------------------------------------- npllama's side

def tinyshakespeare_lines(text: str, n: int = N_LINES) -> list[str]:
    """n lines spread evenly over the whole text (speaker names, verse, blank lines)."""
    lines = text.split("\n")
    return [lines[i * len(lines) // n] for i in range(n)]


def _npllama(argv: list[str]) -> str:
    """Run the npllama command line in this process; its stdout."""
    from npllama.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"npllama {' '.join(argv)} failed (exit code {code}): {err.getvalue().strip()}")
    return out.getvalue()


def _random_model_file(path: Path, tokenizer) -> Path:
    """A small random model (2 layers, dim 32, GQA) for a sentencepiece tokenizer, with its tokenizer,
    saved as one .safetensors file. The output rows of <unk> and of the byte pieces are zero, so
    greedy decoding never picks them (the others' logits are random, the largest above 0): a random
    pick of byte pieces is rarely valid UTF-8, which sentencepiece and transformers print differently
    (one U+FFFD per bad byte, or per byte of the run), a difference of decoders this check is not about."""
    import numpy as np
    import npllama
    cfg = npllama.LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size,
                              multiple_of=16, max_seq_len=128)
    model = npllama.Llama(cfg, seed=0)
    never = [i for i in range(cfg.vocab_size) if i == tokenizer.unk_id or tokenizer.id_to_piece(i).startswith("<0x")]
    model.params["output.weight"][np.array(never)] = 0.0
    model.tokenizer = tokenizer
    return npllama.save(model, path, format="meta")


def train_unigram(text: str, vocab_size: int):
    """A sentencepiece unigram model trained on text, with train_sentencepiece's other settings."""
    import sentencepiece as spm
    from npllama.tokenizers import SentencePieceTokenizer
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.split("\n") if line]), model_writer=model,
        model_type="unigram", vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=1, minloglevel=2)
    return SentencePieceTokenizer(model.getvalue())


def export(out: Path, data_dir: Path) -> Path:
    """Export the five folders into out and write out/expected.json; returns its path."""
    import npllama
    from npllama.tokenizers import SentencePieceTokenizer, train_sentencepiece
    from npllama.tokenizers.tokenizer_json import HFTokenizer

    text = (data_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")
    lines = tinyshakespeare_lines(text)
    out.mkdir(parents=True, exist_ok=True)
    sources = {
        "char": ([str(ROOT / "weights" / "shakespeare-char.safetensors")], "ROMEO:"),
        "tok512": ([str(data_dir / "stories260K.bin"), "--tokenizer", str(data_dir / "tok512.model")], "Once upon a"),
        "llama2": ([str(_random_model_file(out / "llama2-random.safetensors", SentencePieceTokenizer.from_file(
            data_dir / "llama2-tokenizer.model")))], lines[1]),
        # trained on TinyShakespeare's first 100k characters, as `npllama train --tokenizer bpe`
        # trains it on the training split
        "bpe": ([str(_random_model_file(out / "bpe-random.safetensors", train_sentencepiece(text[:100_000], 400)))],
                lines[3]),
        "unigram": ([str(_random_model_file(out / "unigram-random.safetensors", train_unigram(text[:100_000], 600)))],
                    lines[5]),
    }
    cases = []
    for name, (model_args, prompt) in sources.items():
        folder = out / name
        _npllama(["export", "-m", *model_args, "-o", str(folder)])
        model = npllama.load(folder)
        tokenizer = model.tokenizer
        texts = lines + (ODD_TEXTS if tokenizer.bos_id is not None else [])
        ids = [tokenizer.encode(t) for t in texts]
        # npllama's own reader of tokenizer.json must give the same ids and text
        ours = HFTokenizer.from_folder(folder)
        wrong = [t for t, i in zip(texts, ids) if ours.encode(t) != i or ours.decode(i) != tokenizer.decode(i)]
        if wrong:
            raise SystemExit(f"{folder}/tokenizer.json: npllama's reader disagrees with {tokenizer!r} on {wrong[:3]}")
        bos = tokenizer.bos_id is not None
        prompt_ids = tokenizer.encode(prompt, bos=bos)
        stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else None
        new_ids = model.generate(prompt_ids, MAX_NEW_TOKENS, temperature=0.0, stop_ids=stop).tolist()
        printed = _npllama(["generate", "-m", str(folder), "-p", prompt, "-n", str(MAX_NEW_TOKENS), "--temp", "0"])
        cases.append({"name": name, "folder": name, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
                      "texts": texts, "ids": ids, "decoded": [tokenizer.decode(i) for i in ids],
                      "prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS, "generated_ids": prompt_ids + new_ids,
                      "generated_text": printed[:-1] if printed.endswith("\n") else printed})
    path = out / "expected.json"
    path.write_text(json.dumps({"cases": cases}, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


# ---------------------------------------------------------------- transformers' side

def _forbidden(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FORBIDDEN)


class _Hiding:
    """A finder of sys.meta_path that finds nothing FORBIDDEN, as in a venv that lacks those
    modules: importlib.util.find_spec (which transformers asks) returns None, import fails."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, path=None, target=None):
        find = getattr(self._finder, "find_spec", None)
        return None if _forbidden(fullname) or find is None else find(fullname, path, target)

    def __getattr__(self, name):    # find_distributions, invalidate_caches, ...
        return getattr(self._finder, name)


def hide_forbidden() -> None:
    """Hide the FORBIDDEN modules from this process (before anything imports them)."""
    loaded = [m for m in sys.modules if _forbidden(m)]
    if loaded:
        raise SystemExit(f"--hide comes too late: {loaded} already imported")
    sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _first_difference(a, b) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {i}: npllama {a[i:i + 8]!r}, transformers {b[i:i + 8]!r}"


def check_case(case: dict, folder: Path) -> list[str]:
    """The checks of one folder (see the module docstring); a list of failures, each one line.
    Runs torch on one thread (these models are tiny: more threads only wait on each other)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check_case(case, folder)
    finally:
        torch.set_num_threads(threads)


def _check_case(case: dict, folder: Path) -> list[str]:
    from transformers import AutoTokenizer, pipeline

    failures = []
    tok = AutoTokenizer.from_pretrained(folder)
    bos = [case["bos_id"]] if case["bos_id"] is not None else []
    for text, ids, decoded in zip(case["texts"], case["ids"], case["decoded"]):
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != ids:
            failures.append(f"encode {text[:50]!r}: {_first_difference(ids, got)}")
        elif tok(text)["input_ids"] != bos + ids:
            failures.append(f"encode {text[:50]!r} with special tokens: {tok(text)['input_ids'][:4]}..., "
                            f"expected BOS {bos} first")
        back = tok.decode(bos + ids, skip_special_tokens=True)
        if back != decoded:
            failures.append(f"decode of {text[:50]!r}: {_first_difference(decoded, back)}")

    generator = pipeline("text-generation", model=str(folder), tokenizer=tok)
    settings = dict(do_sample=False, max_new_tokens=case["max_new_tokens"])
    ids = generator(case["prompt"], return_tensors=True, **settings)[0]["generated_token_ids"]
    ids = [int(i) for i in ids]
    if case["eos_id"] is not None and ids and ids[-1] == case["eos_id"]:
        ids = ids[:-1]     # generate() returns the EOS it stopped at; npllama does not
    if ids != case["generated_ids"]:
        failures.append(f"pipeline greedy ids: {_first_difference(case['generated_ids'], ids)}")
        return failures
    expected = case["generated_text"]
    whole = tok.decode(ids, skip_special_tokens=True)
    if whole != expected:
        failures.append(f"the pipeline's ids decoded whole: {_first_difference(expected, whole)}")
    printed = generator(case["prompt"], **settings)[0]["generated_text"]
    prompt = case["prompt"]
    # transformers' pipeline: prompt + decode(new ids alone), whose dummy-prefix strip drops the
    # space of a first piece that starts a word (see the module docstring)
    junction = expected.startswith(prompt + " ") and printed == prompt + expected[len(prompt) + 1:]
    if printed != expected and not junction:
        failures.append(f"pipeline text: {_first_difference(expected, printed)}")
    elif junction:
        print(f"  {case['name']}: the pipeline printed npllama's text without the space after the prompt "
              f"({printed[:len(prompt) + 12]!r}...): transformers' pipeline decodes the new ids alone")
    return failures


def check(out: Path, only: list[str] | None = None) -> int:
    """Run check_case on every folder of out/expected.json (or those named in only); 0 when all pass, else 1."""
    present = [m for m in FORBIDDEN if _findable(m)]
    if present:
        print(f"check_hf_export: {present} can be imported here; run `check` in a venv with torch and "
              "transformers only, or pass --hide", file=sys.stderr)
        return 1
    start = time.perf_counter()
    import torch
    import transformers
    print(f"check_hf_export: torch {torch.__version__}, transformers {transformers.__version__}; "
          f"not importable: {', '.join(FORBIDDEN)}")
    cases = json.loads((out / "expected.json").read_text(encoding="utf-8"))["cases"]
    cases = [c for c in cases if only is None or c["name"] in only]
    failed = 0
    for case in cases:
        t0 = time.perf_counter()
        failures = check_case(case, out / case["folder"])
        status = "PASS" if not failures else f"FAIL ({len(failures)})"
        print(f"  {case['name']}: {len(case['texts'])} texts encoded and decoded, {MAX_NEW_TOKENS} greedy tokens "
              f"from {case['prompt'][:20]!r}: {status} ({time.perf_counter() - t0:.1f} s)")
        for f in failures[:10]:
            print(f"    {f}")
        failed += bool(failures)
    print(f"check_hf_export: {len(cases) - failed} of {len(cases)} folders pass "
          f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["export", "check"])
    p.add_argument("out", type=Path, help="folder for the exports and expected.json")
    p.add_argument("--hide", action="store_true",
                   help="check: hide sentencepiece, protobuf, tiktoken and npllama from this process first")
    p.add_argument("--only", type=lambda s: s.split(","), metavar="NAME,...",
                   help="check: only these folders (char, tok512, llama2, bpe, unigram)")
    args = p.parse_args(argv)
    if args.mode == "export":
        data_dir = os.environ.get("NPLLAMA_DATA_DIR")
        if not data_dir:
            print("check_hf_export export: set NPLLAMA_DATA_DIR to the folder holding tinyshakespeare.txt, "
                  "llama2-tokenizer.model, stories260K.bin and tok512.model", file=sys.stderr)
            return 1
        print(f"check_hf_export: wrote {export(args.out, Path(data_dir))}")
        return 0
    if args.hide:
        hide_forbidden()
    return check(args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())
