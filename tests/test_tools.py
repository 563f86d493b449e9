"""tools/bench_versions.py: runs two checkouts interleaved and reports their ratio; refuses a folder
that is not a checkout. (Its figures are measurements, never asserted.)"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_versions.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_versions_compares_two_checkouts_interleaved(tmp_path):
    done = run_tool("--other", str(ROOT), "--rounds", "2", "--seconds", "0.1", "--train", "p", "--decode", "15M",
                    "--models-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"decode 15M skipped: {tmp_path / '15M.safetensors'} is missing" in done.stdout
    assert "round 2/2 done" in done.stdout
    row = re.search(r"^train p\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$", done.stdout, re.M)
    assert row, done.stdout
    this, other, ratio = (float(g.replace(",", "")) for g in row.groups())
    assert this > 0 and other > 0 and abs(ratio - this / other) < 1e-3 * ratio + 1e-3


def test_bench_versions_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    done = run_tool("--other", str(tmp_path))
    assert done.returncode == 2 and "not an npllama checkout" in done.stderr, done.stderr
