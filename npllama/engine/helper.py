"""HelperProcess: a second process that takes half of a one-row decode step's products, on the other core.

    helper = HelperProcess()                   # before anything is made for it
    x, out = helper.empty((1, n_in), dtype), helper.empty((1, n), dtype)   # memory both processes see
    job = helper.register([partial(np.dot, x[0], w_b, out=out[0, h:])])    # its half, fixed in advance
    helper.start()                             # forks: the helper holds everything made so far
    helper.run(job, [partial(np.dot, x[0], w_a, out=out[0, :h])])           # both halves, then returns
    helper.close()

Why a process. A one-row step of a 15M-shaped model (dim 288) multiplies by matrices of 83,000 to
249,000 weights, 27-63 us each on one core, which OpenBLAS keeps on one thread (it splits a gemv
only from 460,800 weights, projections.GEMV_THREADS_MIN_WEIGHTS). A Python thread cannot take half
of one: a hand-off between two threads of this interpreter takes 72-77 us on the 2-core EPYC this
was measured on (through locks; a pipe 76-94, a polling thread 98-161 as it contends for the GIL).
A process has its own interpreter: it polls shared memory without holding anything the step needs,
and a round trip takes 1.6-2.0 us (median 1.8, measured 6 December 2026). The two halves are the
same NumPy calls the step would make on one core, on the same arrays, so the results are the same
bits whichever process computes them.

How. start() forks this process: the helper inherits every array made before it (the weights, the
step's stacked copies), which neither side writes again, so they stay one copy in memory. What
changes after the fork, the activations a job reads and the outputs it writes (and a decoder's KV
cache), lives in memory mapped shared (empty(), shared_zeros). A job is a list of calls without
arguments registered before start(). run() writes the job's index and its arg (an int both sides'
calls may read through arg(): a decode step's positions), then a new sequence number into the
shared control words, runs the caller's half, and polls until the helper has written that number
back. The helper polls the sequence number while a generation runs, and naps (IDLE_NAP, later IDLE_LONG_NAP) once no job
has come for IDLE_SPIN seconds, checking then that its parent is alive (it exits when not). It
ignores Ctrl-C (the parent handles it and closes the helper) and ends with os._exit, flushing
nothing of its parent's.

Neither process sets a BLAS thread count while the helper lives: OpenBLAS shuts its threads down at
a fork and starts its pool anew at the next call that sets one, and a new thread spins some 0.1 s
(measured: the first 20 steps after the fork 2.8x slower with the step's usual one-thread setting).
The jobs are cut instead so that no call is large enough for OpenBLAS to thread
(projections.helper_cuts), and the step sets nothing (decode.DecodeStep).

Only on Linux on x86-64 (available()): fork is the POSIX call, and the order of the control words
relies on x86's stores becoming visible in program order (its loads, likewise), so that a sequence
number seen implies the job index and the outputs written before it.
Like OpenBLAS's own threads it spins while it waits, so the decoder uses it only where the process
allows two BLAS threads (npllama.engine.blas_threads(1) turns it off, the advice for a busy machine).
"""

from __future__ import annotations

import mmap
import os
import platform
import signal
import sys
import time
import warnings
import weakref

import numpy as np

from ..errors import NpllamaError

# Control words, int64s at the start of the shared control page.
SEQ, JOB, DONE, FAILED, ARG = 0, 1, 2, 3, 4
EXIT = -1                           # a sequence number that ends the helper
# The helper polls without pause for this long after its last job (a generation's steps come
# microseconds apart, between them the caller's sampling), then naps between polls: a paused
# generator costs no core, and its next step's first product waits at most a nap; after a second
# without a job, a longer one (a step never closed, its helper waiting to be collected).
IDLE_SPIN = 0.005
IDLE_NAP = 0.0002
IDLE_LONG, IDLE_LONG_NAP = 1.0, 0.01
# The caller checks the helper is alive every this many polls of a wait (~1 ms)
ALIVE_CHECK_POLLS = 1 << 13


def available() -> bool:
    """Whether this platform can run a HelperProcess (module docstring)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "fork")


class HelperProcess:
    """The helper process of one decoder: arrays it shares, jobs it runs (module docstring)."""

    def __init__(self):
        self._control = mmap.mmap(-1, mmap.PAGESIZE)           # anonymous, shared with a fork
        self._words = memoryview(self._control).cast("q")
        self.jobs: list[list] = []
        self._seq = 0
        self.pid = None
        self._finalizer = None

    def empty(self, shape, dtype) -> np.ndarray:
        """An array in memory this process and its helper both see (make before start): shared_zeros."""
        return shared_zeros(shape, dtype)

    def register(self, pieces: list) -> int:
        """Fix a job (calls without arguments, run in order by the helper) before start(); its index."""
        if self.pid is not None:
            raise NpllamaError("HelperProcess.register after start(): the helper only knows the jobs it was forked with")
        self.jobs.append(list(pieces))
        return len(self.jobs) - 1

    def start(self) -> None:
        """Fork the helper, which holds every job and array made so far."""
        if self.pid is not None:
            return
        words, jobs, parent = self._words, self.jobs, os.getpid()
        with warnings.catch_warnings():             # Python 3.12+ warns of fork in a threaded process:
            warnings.simplefilter("ignore", DeprecationWarning)     # the helper calls only NumPy on its arrays
            pid = os.fork()
        if pid == 0:                                                # the helper: never returns
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                _serve(words, jobs, parent)
                code = 0
            finally:
                os._exit(code)
        self.pid = pid
        self._finalizer = weakref.finalize(self, _end, words, pid)

    def run(self, job: int, ours: list, arg: int = 0) -> None:
        """Run the registered job on the helper and every call of `ours` here; return when both are done.
        arg: an int both sides' calls may read through arg() while they run (a decode step's positions)."""
        if self.pid is None:
            raise NpllamaError("the decoder's helper process is not running (never started, closed, or ended)")
        words = self._words
        self._seq = seq = self._seq + 1
        words[ARG] = arg
        words[JOB] = job
        words[SEQ] = seq                                # after the job index: the helper reads them in this order
        try:
            for piece in ours:
                piece()
        finally:
            polls = 0
            while words[DONE] != seq:
                polls += 1
                if polls == ALIVE_CHECK_POLLS:
                    polls = 0
                    self._check_alive()
        if words[FAILED]:
            words[FAILED] = 0
            raise NpllamaError("the decoder's helper process failed in one of its products; its error went to stderr")

    def arg(self) -> int:
        """The arg of the job being run (run's), in either process."""
        return self._words[ARG]

    def _check_alive(self) -> None:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:       # reaped by someone else's wait
            pid = self.pid
        if pid:
            self.pid = None
            self._finalizer.detach()
            raise NpllamaError("the decoder's helper process ended in the middle of a step "
                               "(killed from outside?); the generation cannot go on")

    def close(self) -> None:
        """End the helper and wait for it (nothing when it never started or has ended)."""
        if self._finalizer is not None:
            self._finalizer()
        self.pid = None


def shared_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array in anonymous memory mapped shared: a process forked after it is made and this one
    see each other's writes to it (a HelperProcess's activations, a decoder's KV cache). Its pages
    are made on first touch, zeroed, as np.zeros' are."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    block = mmap.mmap(-1, max(count * dtype.itemsize, 1))         # the array holds it (its base)
    return np.frombuffer(block, dtype=dtype, count=count).reshape(shape)


def _end(words, pid) -> None:
    words[SEQ] = EXIT
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:           # already reaped
        pass


def _serve(words, jobs, parent) -> None:
    """The helper's loop: run each job the caller posts, until EXIT or the parent is gone."""
    seen = 0                        # not words[SEQ]: the caller may have posted a job already
    last = time.perf_counter()
    while True:
        seq = words[SEQ]
        if seq == seen:
            idle = time.perf_counter() - last
            if idle > IDLE_SPIN:
                time.sleep(IDLE_NAP if idle < IDLE_LONG else IDLE_LONG_NAP)
                if os.getppid() != parent:
                    return
            continue
        if seq == EXIT:
            return
        seen = seq
        try:
            for piece in jobs[words[JOB]]:
                piece()
        except BaseException as e:          # reported to the caller through FAILED; details here
            print(f"npllama helper process: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            words[FAILED] = 1
        words[DONE] = seq
        last = time.perf_counter()
