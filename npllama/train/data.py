"""Training text: find or fetch TinyShakespeare, split it 90/10, cut random windows into batches.

Where the text comes from, first match wins (`find_text`):
  1. an explicit path (`npllama train --data PATH`): any UTF-8 text file, used as is;
  2. $NPLLAMA_DATA_DIR/tinyshakespeare.txt (CI points NPLLAMA_DATA_DIR at ../shared/data);
  3. the cache, $NPLLAMA_CACHE/tinyshakespeare.txt or ~/.cache/npllama/tinyshakespeare.txt;
  4. a download from char-rnn's URL into the cache.
The TinyShakespeare file (2-4) is checked against its sha256; a mismatching download is
deleted, never kept, and a mismatching file raises ValueError naming both hashes.

    ids = np.array(tokenizer.encode(text), dtype=np.int32)
    train_ids, val_ids = split(ids)                       # first 90% / last 10%, as nanoGPT
    x, y = get_batch(train_ids, 32, 128, rng)             # (B, T) inputs and next-token targets

Expected (TinyShakespeare, 1,115,394 characters, 65 distinct): a character tokenizer gives
1,003,854 training and 111,540 validation tokens.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..checks import check_int, check_real
from ..errors import MissingFileError, NpllamaError
from ..io.atomic import write_atomic
from ..io.integrity import sha256_file
from ..tokenizers import CharTokenizer, train_sentencepiece
from .config import TrainConfig

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
DATA_DIR_VAR = "NPLLAMA_DATA_DIR"     # folder holding tinyshakespeare.txt (CI: ../shared/data)
CACHE_VAR = "NPLLAMA_CACHE"           # cache folder; default ~/.cache/npllama

_CHUNK = 1 << 16


class ChecksumError(NpllamaError):
    """A file's sha256 is not the one expected: a corrupt or different file."""


def cache_dir() -> Path:
    """$NPLLAMA_CACHE, else ~/.cache/npllama (not created here)."""
    env = os.environ.get(CACHE_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "npllama"


def urlopen(url: str, timeout: float):
    """The one network call (tests replace this function; they never touch the network)."""
    return urllib.request.urlopen(url, timeout=timeout)


def download(url: str, dest: str | os.PathLike, sha256: str, timeout: float = 60.0) -> Path:
    """Fetch url into dest, atomically, keeping it only if its sha256 is the expected one.

    The bytes stream into a temporary file in dest's folder while being hashed; on a
    match the file is renamed to dest (os.replace, so dest is never half-written), on a
    mismatch or any error the temporary file is deleted and ChecksumError / OSError raised.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)

    def fetch(out):
        h = hashlib.sha256()
        with urlopen(url, timeout=timeout) as response:
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                h.update(chunk)
                out.write(chunk)
        got = h.hexdigest()
        if got != sha256:   # raised inside the write: the temporary file is deleted, dest untouched
            raise ChecksumError(f"download of {url} has sha256 {got}, expected {sha256}; the file was "
                                "discarded. Fetch it by hand and pass --data PATH, or retry later")

    write_atomic(dest, fetch, suffix=".part")
    return dest


def _verified(path: Path) -> Path:
    got = sha256_file(path)
    if got != TINYSHAKESPEARE_SHA256:
        raise ChecksumError(f"{path} has sha256 {got}, expected {TINYSHAKESPEARE_SHA256} (TinyShakespeare); "
                            "the file is corrupt or a different text. Delete it, or pass another file with --data PATH")
    return path


def find_text(path: str | os.PathLike | None = None, download_ok: bool = True) -> Path:
    """Path of the training text, by the order in the module docstring.

    path: an explicit text file (not checksummed: any corpus works), or None for TinyShakespeare.
    download_ok: False never touches the network (step 4 is skipped).
    Raises FileNotFoundError naming every place looked at, and how to fix it.
    """
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / TINYSHAKESPEARE_FILE
        if not p.is_file():
            raise MissingFileError(f"training text {p} does not exist; pass a UTF-8 text file with --data PATH")
        return p
    looked = []
    data_dir = os.environ.get(DATA_DIR_VAR)
    if data_dir:
        p = Path(data_dir).expanduser() / TINYSHAKESPEARE_FILE
        if p.is_file():
            return _verified(p)
        looked.append(f"{p} (from ${DATA_DIR_VAR})")
    cached = cache_dir() / TINYSHAKESPEARE_FILE
    if cached.is_file():
        if sha256_file(cached) == TINYSHAKESPEARE_SHA256:
            return cached
        cached.unlink()            # a bad file in our own cache is never kept: fetch it again
    looked.append(f"{cached} (the cache; set ${CACHE_VAR} to move it)")
    if download_ok:
        try:
            print(f"downloading TinyShakespeare from {TINYSHAKESPEARE_URL} to {cached}", flush=True)
            return download(TINYSHAKESPEARE_URL, cached, TINYSHAKESPEARE_SHA256)
        except (urllib.error.URLError, OSError) as e:
            looked.append(f"{TINYSHAKESPEARE_URL} ({e})")
    raise MissingFileError(
        "TinyShakespeare not found; looked at: " + "; ".join(looked) +
        f". Download {TINYSHAKESPEARE_URL} and pass --data PATH, or put it in ${DATA_DIR_VAR}/{TINYSHAKESPEARE_FILE}")


def load_text(path: str | os.PathLike | None = None, download_ok: bool = True) -> str:
    """The training text as a str (see find_text for where it comes from)."""
    p = find_text(path, download_ok=download_ok)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NpllamaError(f"{p} is not UTF-8 text ({e}); pass a UTF-8 text file with --data PATH") from None
    if not text:
        raise NpllamaError(f"{p} is empty; pass a text file with something to learn")
    return text


def split_text(text: str, train_fraction: float = 0.9) -> tuple[str, str]:
    """First train_fraction of the characters for training, the rest for validation (nanoGPT's cut).

    Splitting the text (not the token ids) lets a BPE tokenizer be trained on the training
    part alone; with characters it gives the same cut as split(ids).
    """
    _check_fraction(train_fraction)
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]


def split(ids: np.ndarray, train_fraction: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """ids[:n], ids[n:] with n = int(len(ids) * train_fraction), as nanoGPT's prepare.py."""
    _check_fraction(train_fraction)
    n = int(len(ids) * train_fraction)
    return ids[:n], ids[n:]


def _check_fraction(f: float) -> None:
    check_real("train_fraction", f, 0.0, 1.0, low_open=True, high_open=True)


def get_batch(ids: np.ndarray, batch_size: int, seq_len: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """batch_size random contiguous windows of ids: inputs x and next-token targets y.

    Start offsets s_b are drawn uniformly from [0, len(ids) - seq_len) (nanoGPT's randint),
    x[b] = ids[s_b : s_b + T], y[b] = ids[s_b + 1 : s_b + T + 1]. One draw from rng per batch,
    so a seeded rng gives the same batches (and a saved rng state resumes them).
    Shapes: ids (N,) -> x, y (B, T), with ids' dtype.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise NpllamaError(f"ids must be a 1-D array of token ids, got shape {ids.shape}")
    check_int("batch_size", batch_size, 1)
    check_int("seq_len", seq_len, 1)
    if len(ids) <= seq_len:
        raise NpllamaError(f"{len(ids)} tokens cannot give a window of seq_len={seq_len} plus its target; "
                         "use a shorter --seq-len or more text")
    starts = rng.integers(0, len(ids) - seq_len, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)            # (B,) -> (B, T + 1)
    window = ids[idx]
    return window[:, :-1], window[:, 1:]


# ---- the corpus of a training run -------------------------------------------------------------------


@dataclass
class Corpus:
    """The text, its tokenizer and the two token streams."""
    text_path: Path
    text_sha256: str
    tokenizer: object
    train_ids: np.ndarray        # (N_train,) int32
    val_ids: np.ndarray          # (N_val,) int32


def prepare_data(cfg: TrainConfig, tokenizer=None, log: Callable[[str], None] = print) -> Corpus:
    """Load the text, split it, build (or reuse) the tokenizer on the training part, encode both parts.

    The BPE model is trained on the training split only, so validation text is never seen.
    A char tokenizer takes the characters of the whole text (the validation part may hold
    a character the training part lacks; nanoGPT does the same).
    """
    path = find_text(cfg.data)
    text = load_text(path)
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    train_text, val_text = split_text(text, cfg.train_fraction)
    if tokenizer is None:
        if cfg.tokenizer == "char":
            tokenizer = CharTokenizer.from_text(text)
            if cfg.vocab_size and cfg.vocab_size != tokenizer.vocab_size:
                raise NpllamaError(f"--vocab-size={cfg.vocab_size} but the text has {tokenizer.vocab_size} distinct "
                                 "characters; --vocab-size applies to --tokenizer bpe only (leave it at 0)")
        else:
            vocab_size = cfg.vocab_size or 1024
            log(f"training a {vocab_size}-token sentencepiece BPE model on the training split ...")
            t0 = time.perf_counter()
            tokenizer = train_sentencepiece(train_text, vocab_size, seed=cfg.seed)
            log(f"  done in {time.perf_counter() - t0:.1f}s")
    train_ids = np.asarray(tokenizer.encode(train_text), dtype=np.int32)
    val_ids = np.asarray(tokenizer.encode(val_text), dtype=np.int32)
    for name, ids in (("training", train_ids), ("validation", val_ids)):
        if len(ids) <= cfg.seq_len:
            raise NpllamaError(f"the {name} split has {len(ids)} tokens, not enough for one window of --seq-len="
                             f"{cfg.seq_len}; use more text, a shorter --seq-len or another --train-fraction")
    return Corpus(path, sha, tokenizer, train_ids, val_ids)
