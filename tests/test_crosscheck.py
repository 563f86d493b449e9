"""tools/crosscheck.py on the shipped PyTorch fixture: passes as shipped, fails when one weight moves."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npllama.io.safetensors import read_safetensors, write_safetensors_atomic

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "crosscheck.py"
FIXTURE = ROOT / "weights" / "tiny-pytorch"


def _crosscheck():
    spec = importlib.util.spec_from_file_location("crosscheck", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args, capsys):
    code = _crosscheck().main([str(a) for a in args])
    return code, capsys.readouterr().out


def perturbed_copy(tmp_path, name, delta):
    folder = tmp_path / "tiny"
    shutil.copytree(FIXTURE, folder)
    tensors, meta = read_safetensors(folder / "model.safetensors")
    tensors[name] = tensors[name].copy()
    tensors[name].flat[5] += delta
    write_safetensors_atomic(folder / "model.safetensors", tensors, meta)
    return folder


def test_command_line_passes_on_the_shipped_fixture():
    out = subprocess.run([sys.executable, str(TOOL), str(FIXTURE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "float32 vs reference float32" in out.stdout and out.stdout.rstrip().endswith("PASS")
    assert out.stdout.count("prompt ") == 3


def test_float64_passes_at_float64_tolerance(capsys):
    code, out = run([FIXTURE, "--dtype", "float64"], capsys)
    assert code == 0, out
    assert "tolerance rel 1e-09" in out


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.norm.weight"])
def test_one_perturbed_weight_fails(tmp_path, capsys, name):
    code, out = run([perturbed_copy(tmp_path, name, 0.05), "--reference", FIXTURE / "reference_logits.safetensors"],
                    capsys)
    assert code == 1, out
    assert out.rstrip().endswith("FAIL")


def test_float64_sees_what_float32_tolerance_cannot(tmp_path, capsys):
    folder = perturbed_copy(tmp_path, "model.layers.1.mlp.down_proj.weight", 1e-6)
    ref = FIXTURE / "reference_logits.safetensors"
    assert run([folder, "--reference", ref], capsys)[0] == 0
    assert run([folder, "--reference", ref, "--dtype", "float64"], capsys)[0] == 1


def test_unusable_inputs_exit_2(tmp_path, capsys):
    assert run([tmp_path / "missing"], capsys)[0] == 2
    write_safetensors_atomic(tmp_path / "ref.safetensors", {"x": np.zeros(2, np.float32)})
    assert run([FIXTURE, "--reference", tmp_path / "ref.safetensors"], capsys)[0] == 2


@pytest.mark.slow  # importing transformers takes most of its ~9 s when run alone
def test_live_reference_agrees_in_float64(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out = run([FIXTURE, "--live", "--dtype", "float64"], capsys)
    assert code == 0, out
    assert "transformers, live" in out and "tolerance rel 1e-09" in out
