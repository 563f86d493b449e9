"""What a wheel or an sdist of npllama carries: the default model's real bytes, from one file.

weights/shakespeare-char.safetensors is the home of the shipped model (weights/README.md says how
it was made); npllama/weights/ holds a link to it, which setuptools' builds turn into a copy, so
an installed wheel generates offline from any folder. `.ci/run` installs such a wheel into a
fresh venv and runs `npllama generate` from another folder.
"""

import hashlib
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


def test_wheel_and_sdist_carry_the_model_bytes(tmp_path):
    """Build both from a copy of the checkout (links kept as links), offline, with the setuptools
    at hand, and find the model's bytes, not a link, in each."""
    _checkout()
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools (pip install setuptools)")
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "npllama", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (src / "weights").mkdir()
    shutil.copy(SHIPPED, src / "weights")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src)
    out = tmp_path / "dist"
    for kind in ("wheel", "sdist"):      # one process each: setuptools keeps state between the two
        build = f"from setuptools import build_meta as b; import sys; b.build_{kind}(sys.argv[1])"
        subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, check=True, capture_output=True)
    want = hashlib.sha256(SHIPPED.read_bytes()).hexdigest()

    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert hashlib.sha256(z.read(MEMBER)).hexdigest() == want
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        member = t.getmember(f"{sdist.name[:-len('.tar.gz')]}/{MEMBER}")
        assert member.isfile(), f"{member.name} is stored as a link, not the model"
        assert hashlib.sha256(t.extractfile(member).read()).hexdigest() == want
