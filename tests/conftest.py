"""Shared fixtures: seeded RNGs, tiny configs, hypothesis profiles, and the data-file locator.

Data files (TinyShakespeare, the Llama 2 tokenizer, stories260K.bin and its tok512.model) are found through one
environment variable, NPLLAMA_DATA_DIR; `.ci/run` points it at ../shared/data and checks the
files are there, so in CI these tests run. Elsewhere they skip with a reason that names the file.
"""

import builtins
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

DATA_DIR_VAR = "NPLLAMA_DATA_DIR"


def data_file(name: str) -> Path:
    """Path of a shared data file, or skip (with the reason) when it is not on this machine."""
    directory = os.environ.get(DATA_DIR_VAR)
    if not directory:
        pytest.skip(f"{name}: set {DATA_DIR_VAR} to the folder holding it (CI uses ../shared/data)")
    path = Path(directory) / name
    if not path.is_file():
        pytest.skip(f"{name} not found in {DATA_DIR_VAR}={directory}")
    return path


def block_matplotlib(monkeypatch) -> None:
    """From now on in this test, importing matplotlib fails, as on a machine without it."""
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(params=["mha", "gqa", "tied"])
def tiny_config(request):
    import npllama
    kw = dict(dim=16, n_layers=2, n_heads=4, vocab_size=11, multiple_of=8, max_seq_len=32)
    if request.param == "gqa":
        kw["n_kv_heads"] = 2
    if request.param == "tied":
        kw.update(n_kv_heads=1, tie_embeddings=True)
    return npllama.LlamaConfig(**kw)


WORDS = ("thou art the king of all that lies beneath heaven and earth my lord good night sweet prince "
         "what light through yonder window breaks").split()


def synthetic_text(n_chars=30000, seed=0):
    """Seeded pseudo-verse: lines of words from a small vocabulary, with a speaker tag."""
    rng = np.random.default_rng(seed)
    lines = []
    while sum(map(len, lines)) < n_chars:
        speaker = ["ROMEO:", "JULIET:", "KING:"][rng.integers(3)]
        body = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), rng.integers(4, 10)))
        lines.append(f"{speaker}\n{body.capitalize()}.\n")
    return "\n".join(lines)


@pytest.fixture
def text_file(tmp_path):
    """A 30,000-character file of synthetic verse, for training runs."""
    path = tmp_path / "verse.txt"
    path.write_text(synthetic_text())
    return path


def tiny_cfg(text_file, out_dir, **kw):
    """A two-layer training config on `text_file` that runs in well under a second."""
    from npllama.train import TrainConfig
    base = dict(data=str(text_file), dim=16, n_layers=2, n_heads=2, seq_len=16, batch_size=4, lr=3e-3,
                min_lr=3e-4, warmup_steps=3, max_steps=12, eval_interval=4, eval_batches=2, sample_tokens=0,
                out_dir=str(out_dir), seed=7)
    base.update(kw)
    return TrainConfig(**base)
