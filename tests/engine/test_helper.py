"""The decoder's helper process (npllama/engine/helper.py): its jobs' results, its errors, its end.

The decode step's use of it (its products' halves equal to the reference) is checked in
test_engine_equals_reference.py; these check the process itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest

from npllama.engine import helper
from npllama.engine.helper import HelperProcess
from npllama.errors import NpllamaError

pytestmark = pytest.mark.skipif(not helper.available(), reason="a HelperProcess needs Linux on x86-64")


def ended(pid: int) -> bool:
    """Whether process pid is gone (reaped, or a zombie no one has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_ended(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ended(pid):
            return True
        time.sleep(0.01)
    return ended(pid)


def halves_of_a_product(h: HelperProcess, n_in=40, n=30, seed=0):
    """x (1, n_in) and out (1, n) shared; W's second half of columns the helper's job; the first ours.
    Returns W's halves [w_a | w_b] as one product computed here would see them: each by its own call."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_in, n))
    x, out = h.empty((1, n_in), np.float64), h.empty((1, n), np.float64)
    half = n // 2
    w_a, w_b = np.ascontiguousarray(w[:, :half]), np.ascontiguousarray(w[:, half:])
    job = h.register([partial(np.dot, x[0], w_b, out=out[0, half:])])
    ours = [partial(np.dot, x[0], w_a, out=out[0, :half])]
    return HalvesHere(w_a, w_b), x, out, job, ours


class HalvesHere:
    """x @ [w_a | w_b] as the two calls the helper and its caller make, computed in this process alone."""

    def __init__(self, w_a, w_b):
        self.w_a, self.w_b = w_a, w_b

    def times(self, x):
        return np.concatenate([np.dot(x[0], self.w_a), np.dot(x[0], self.w_b)])[None]


def test_the_helper_computes_its_half_of_each_new_input_and_ends_on_close():
    h = HelperProcess()
    w, x, out, job, ours = halves_of_a_product(h)
    h.start()
    pid = h.pid
    assert pid and pid != os.getpid()
    rng = np.random.default_rng(1)
    for _ in range(50):                           # written after the fork: the helper sees each new x
        x[...] = rng.standard_normal(x.shape)
        out[...] = np.nan
        h.run(job, ours)
        assert np.array_equal(out, w.times(x))         # the same NumPy calls on the same values: the same bits
    h.close()
    assert ended(pid) and h.pid is None
    h.close()                                     # closing twice does nothing


def test_both_sides_calls_read_the_arg_of_the_run_and_see_a_shared_array_written_after_the_fork():
    """run(job, ours, arg): each side's calls read arg through h.arg() (a decode step's positions);
    an array made by helper.shared_zeros before the fork (a decoder's KV cache) is zeroed, and what
    this process writes into it afterwards the helper reads."""
    h = HelperProcess()
    cache = helper.shared_zeros((2, 16), np.float64)
    assert not cache.any()
    sums = h.empty((2,), np.float64)
    job = h.register([lambda: sums.__setitem__(1, cache[1, :h.arg()].sum())])
    ours = [lambda: sums.__setitem__(0, cache[0, :h.arg()].sum())]
    h.start()
    for n in (3, 16, 1, 9):
        cache[:, n - 1] = [n, 10 * n]               # written here, after the fork
        h.run(job, ours, arg=n)
        assert np.array_equal(sums, cache[:, :n].sum(axis=1))
    h.close()


def test_a_failing_job_raises_an_npllama_error_and_the_helper_goes_on(capfd):
    h = HelperProcess()
    w, x, out, job, ours = halves_of_a_product(h)
    bad = h.register([lambda: np.ones(3) @ np.ones(4)])
    h.start()
    with pytest.raises(NpllamaError, match="helper process failed"):
        h.run(bad, [])
    assert "ValueError" in capfd.readouterr().err                     # its error, printed by the helper
    x[...] = 1.0
    h.run(job, ours)
    assert np.array_equal(out, w.times(x))
    h.close()


def test_jobs_are_fixed_before_the_fork():
    h = HelperProcess()
    h.start()
    with pytest.raises(NpllamaError, match="after start"):
        h.register([lambda: None])
    h.close()


def test_a_helper_killed_from_outside_raises_instead_of_hanging():
    h = HelperProcess()
    w, x, out, job, ours = halves_of_a_product(h)
    h.start()
    os.kill(h.pid, signal.SIGKILL)
    time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(NpllamaError, match="ended in the middle of a step"):
        h.run(job, ours)
    assert time.monotonic() - start < 5.0
    with pytest.raises(NpllamaError, match="not running"):          # and after it, at once
        h.run(job, ours)
    h.close()


def test_ctrl_c_is_left_to_the_parent():
    """A terminal's Ctrl-C reaches the helper too (one process group): it ignores it and works on, until
    the parent, which handles it, closes it."""
    h = HelperProcess()
    w, x, out, job, ours = halves_of_a_product(h)
    h.start()
    time.sleep(0.05)                              # past the fork: its handler set
    os.kill(h.pid, signal.SIGINT)
    time.sleep(0.05)
    x[...] = 2.0
    h.run(job, ours)
    assert np.array_equal(out, w.times(x)) and not ended(h.pid)
    h.close()


def test_the_helper_ends_when_its_parent_dies_without_closing_it():
    script = (
        "import os, sys\n"
        "from npllama.engine.helper import HelperProcess\n"
        "h = HelperProcess(); h.register([]); h.start()\n"
        "print(h.pid, flush=True)\n"
        "os._exit(0)\n")              # no close, no finalizers
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert wait_until_ended(int(out.stdout)), "the orphaned helper still runs"


def test_a_helper_never_started_closes_quietly_and_runs_nothing():
    h = HelperProcess()
    job = h.register([])
    with pytest.raises(NpllamaError, match="not running"):
        h.run(job, [])
    h.close()
    assert h.pid is None
