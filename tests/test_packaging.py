"""What a wheel or an sdist of npllama carries: the default model's real bytes, from one file.

weights/shakespeare-char.safetensors is the home of the shipped model (weights/README.md says how
it was made); npllama/weights/ holds a link to it, which setuptools' builds turn into a copy, so
an installed wheel generates offline from any folder. `.ci/run` installs such a wheel into a
fresh venv and runs `npllama generate` from another folder.
"""

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import npllama
from npllama.cli.generate import DEFAULT_MODEL

PACKAGE = Path(npllama.__file__).resolve().parent
REPO = PACKAGE.parent
SHIPPED = REPO / "weights" / DEFAULT_MODEL.name
MEMBER = f"npllama/weights/{DEFAULT_MODEL.name}"


def _checkout():
    if not (REPO / "pyproject.toml").is_file() or not SHIPPED.is_file():
        pytest.skip(f"npllama is installed from {PACKAGE}, not a git checkout with weights/ beside it")


def test_the_default_model_is_package_data_linked_to_weights():
    assert DEFAULT_MODEL == PACKAGE / "weights" / "shakespeare-char.safetensors"
    _checkout()
    # one file to replace: the package's entry is a link to weights/, never a second copy
    assert DEFAULT_MODEL.is_symlink(), f"{DEFAULT_MODEL} should be a link to {SHIPPED}"
    assert DEFAULT_MODEL.resolve() == SHIPPED.resolve()
    assert npllama.load(DEFAULT_MODEL).tokenizer is not None      # generates with no other file


def _build(kind: str, tmp_path: Path) -> Path:
    """Build a wheel or an sdist, offline with the setuptools at hand, from a copy of the checkout
    (links kept as links); returns the file."""
    src = tmp_path / "src"
    if not src.exists():
        shutil.copytree(PACKAGE, src / "npllama", symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (src / "weights").mkdir()
        shutil.copy(SHIPPED, src / "weights")
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, src)
    out = tmp_path / kind
    build = f"from setuptools import build_meta as b; import sys; b.build_{kind}(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (built,) = out.iterdir()
    return built


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_sdist_carries_the_model_bytes(tmp_path):
    _checkout()
    pytest.importorskip("setuptools", reason="building an sdist needs setuptools (pip install setuptools)")
    sdist = _build("sdist", tmp_path)
    with tarfile.open(sdist) as t:
        member = t.getmember(f"{sdist.name[:-len('.tar.gz')]}/{MEMBER}")
        assert member.isfile(), f"{member.name} is stored as a link, not the model"
        assert _sha256(t.extractfile(member).read()) == _sha256(SHIPPED.read_bytes())


def test_wheel_carries_the_model_bytes(tmp_path):
    _checkout()
    setuptools = pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.skip(f"setuptools {setuptools.__version__} builds wheels only with the `wheel` package "
                    "(pip install wheel); .ci/run checks the wheel that `pip install .` builds")
    wheel = _build("wheel", tmp_path)
    with zipfile.ZipFile(wheel) as z:
        assert _sha256(z.read(MEMBER)) == _sha256(SHIPPED.read_bytes())
