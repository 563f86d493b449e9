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
