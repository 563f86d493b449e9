"""Data parallelism over MPI: `mpiexec -n N npllama train ...` trains one model on N processes.

Every rank (process) holds the whole model and its AdamW state. Each step every rank draws the
same global batch (the same data generator in the same state: train/data.py get_batch), takes
its contiguous share of the rows (`World.shard`), and computes the gradient of its share's mean
loss. With n_r valid targets in rank r's rows and n = sum_r n_r in the batch:

    L = sum_r (n_r / n) L_r,   so   grad L = sum_r (n_r / n) grad L_r

the averaged gradient of N shards, each weighted by its share of the targets, is the gradient of
their union. Each rank scales its gradient by n_r / n and one Allreduce (SUM) of the flat gradient
array (`allreduce_gradients`) leaves every rank the gradient of the whole batch. Clipping, AdamW
and the schedule then run identically everywhere, so the parameters stay identical; a checksum
compared across ranks every CHECK_INTERVAL steps and before each checkpoint turns any drift (a
rank with another NumPy or BLAS, say) into an error. Shares may differ by one row (a global batch
of 4 on 3 ranks: 1 + 1 + 2 rows) and stay exact, since each is weighted by its targets; a batch
smaller than the number of ranks is refused.

Because every rank draws the full global batch from one generator, N ranks follow the batches
of one process exactly, and a checkpoint (written by rank 0 alone, with that generator's state)
resumes on any number of ranks.

`World` is one process: rank 0 of 1, every collective the identity; mpi4py is never imported.
`connect()` returns an `MpiWorld` only when a launcher started several ranks (PMI_SIZE: MPICH's
hydra, Slurm; OMPI_COMM_WORLD_SIZE: Open MPI).

Failures (docs/distributed.md has the whole story, and what mpiexec itself does):
  - an exception on a rank: `stop_all` reports it (rank 0 at once; another rank after a grace
    period in which rank 0 reports the same error if it has it too) and calls MPI_Abort, which
    ends every rank. MPICH's own abort message goes to /dev/null: one line.
  - a rank killed (kill -9, the OOM killer): mpiexec kills the others at once (SIGKILL: they
    cannot say a word) and prints the dead process's pid; the lost-rank watcher of that host
    (train/watcher.py, a process beside the ranks) prints one line naming the rank. (A rank that
    was in a collective with it may meet a fatal MPI error and end first: MPICH's messages during
    a collective go to the watcher, which learns from them that this rank's end is no loss.)
  - a rank that stops answering (another host cut off, a stopped process): the watchdog thread
    ends the run when a collective has waited longer than $NPLLAMA_RANK_TIMEOUT seconds.
  - SIGTERM to mpiexec, which passes it on to every rank: each ends as one process does (where
    nothing else handles SIGTERM or SIGHUP, a rank first stands the watcher down, so that ranks
    ending together are not reported lost).
Checkpoints are written atomically (io/atomic.py), so no failure leaves half of one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.settings import blas_threads
from ..engine.layout import FlatLayout
from ..errors import NpllamaError
from ..ops import IGNORE_INDEX

SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")      # set by MPICH's hydra (and Slurm), by Open MPI
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
TIMEOUT_VAR = "NPLLAMA_RANK_TIMEOUT"    # seconds a collective may wait for the other ranks; 0: for ever
DEFAULT_TIMEOUT = 600.0                 # above any checkpoint write or sample rank 0 makes alone
CHECK_INTERVAL = 200                    # steps between two comparisons of the parameters across ranks
WATCH_INTERVAL = 0.5                    # seconds between two looks of the watchdog
GRACE = 1.0                             # seconds another rank leaves rank 0 to report a failure first
SPIN = 1e-3                             # a small collective spins this long, then sleeps between tests
POLL = 1e-3


class RanksDisagree(NpllamaError):
    """The ranks of one run were started with different settings, or their parameters drifted apart."""


class CollectiveFailed(NpllamaError):
    """An MPI collective failed: another rank ended in the middle of it (or MPI itself failed)."""


class MpiUnavailable(NpllamaError):
    """mpiexec started several ranks, but mpi4py cannot be imported (or speaks to another MPI)."""


def launched_size() -> int:
    """How many ranks the launcher started (1 when no launcher did)."""
    return next((int(os.environ[v]) for v in SIZE_VARS if os.environ.get(v, "").isdigit()), 1)


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 when no launcher did)."""
    return next((int(os.environ[v]) for v in RANK_VARS if os.environ.get(v, "").isdigit()), 0)


def connect(command: str = "npllama train") -> "World":
    """The World this process belongs to: World() alone, an MpiWorld when mpiexec started several ranks.

    mpi4py is imported only in the second case; when it is missing every rank raises
    MpiUnavailable (rank 0 reports it: the others use launched_rank() to stay quiet).
    """
    size = launched_size()
    if size <= 1:
        return World()
    try:
        from mpi4py import MPI
    except ImportError:
        raise MpiUnavailable(f"mpiexec started {size} ranks but mpi4py is not installed; install the MPI extra "
                             "with pip install -e '.[mpi]' (mpi4py and MPICH), or run without mpiexec") from None
    if MPI.COMM_WORLD.Get_size() != size:
        raise MpiUnavailable(f"mpiexec started {size} ranks but MPI sees {MPI.COMM_WORLD.Get_size()}: mpi4py is built "
                             "for another MPI than this mpiexec; use the mpiexec that pip install -e '.[mpi]' installs")
    return MpiWorld(MPI, command)


def row_bounds(batch_size: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's contiguous rows [lo, hi) of a batch; the shares of the ranks differ by one row at most."""
    return batch_size * rank // size, batch_size * (rank + 1) // size


def allreduce_gradients(world: "World", grads: dict, config) -> dict:
    """The gradients summed over the ranks with ONE Allreduce of one flat array; returns them keyed as grads.

    The engine's gradients of a whole model are views of one flat array (engine/layout.py), which
    is reduced in place. Any other dict (LoRA's adapters, the reference backend's arrays) is
    packed into one new flat array first (one copy) and returned as views of it.
    """
    if world.size == 1:
        return grads
    flat = FlatLayout(config).base_of(grads)
    if flat is not None:
        world.allreduce_sum_(flat)
        return grads
    flat = np.concatenate([np.ravel(g) for g in grads.values()])
    world.allreduce_sum_(flat)
    out, offset = {}, 0
    for name, g in grads.items():
        out[name] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size
    return out


def checksum(arrays: dict) -> int:
    """CRC-32 of a strided sample (about 4096 values) of every array, in name order: equal on every
    rank while the arrays are identical, and almost surely not once the parameters drift (every
    AdamW step moves every one of them)."""
    crc = 0
    for name in sorted(arrays):
        flat = np.asarray(arrays[name]).reshape(-1)
        crc = zlib.crc32(np.ascontiguousarray(flat[::max(1, flat.size // 4096)]).tobytes(), crc)
    return crc


def config_differences(mine: dict, theirs: dict, rank: int) -> str:
    """The settings that differ between two ranks' resolved configs: "--lr 0.001 (rank 0: 0.002); ..."."""
    cfg, other = mine.get("config", {}), theirs.get("config", {})
    parts = [f"--{k.replace('_', '-')} {other.get(k)!r} (rank 0: {cfg.get(k)!r})"
             for k in sorted(set(cfg) | set(other)) if cfg.get(k) != other.get(k)]
    parts += [f"{key} {theirs.get(key)!r} (rank 0: {mine.get(key)!r})" for key in ("explicit", "preset")
              if mine.get(key) != theirs.get(key) and not parts]
    return f"rank {rank} was started with other settings than rank 0: {'; '.join(parts)}"


class World:
    """One process training alone: rank 0 of 1. Every collective returns its input."""

    rank = 0
    size = 1
    ranks_here = 1          # ranks on this machine

    def shard(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """This rank's contiguous rows of a global batch (x, y), and its share n_r / n of the batch's valid
        targets (its loss and gradient weight). Shapes: (B, T) -> (B_r, T), B_r = B // size or one more."""
        if self.size == 1:
            return x, y, 1.0
        lo, hi = row_bounds(len(x), self.rank, self.size)
        n = np.count_nonzero(y != IGNORE_INDEX)
        n_r = np.count_nonzero(y[lo:hi] != IGNORE_INDEX)
        assert n_r > 0, f"rows {lo}:{hi} of the batch hold no target"      # get_batch's windows are all targets
        return x[lo:hi], y[lo:hi], n_r / n

    def allreduce_sum_(self, flat: np.ndarray) -> np.ndarray:
        """flat (one contiguous array) summed over the ranks, in place; returns flat."""
        return flat

    def sums(self, *values: float) -> tuple[float, ...]:
        """The sums over the ranks of a few numbers, in the order given."""
        return values

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over the ranks: a decision every rank takes together (stop now?)."""
        return tuple(bool(f) for f in flags)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        return int(value)

    def raise_together(self, error: BaseException | None) -> None:
        """Raise error (this rank's outcome of a check every rank makes at the same point, or None).

        With several ranks: when every rank raises, the error is marked on_every_rank, so that the
        command line reports it once (rank 0) and every rank ends normally, with no MPI_Abort (which
        mpiexec may follow with its "BAD TERMINATION" banner). When only some do, they raise as
        usual (stop_all) and the others wait here for the MPI_Abort that ends them."""
        if error is not None:
            raise error

    def check_same_config(self, settings: dict) -> None:
        """RanksDisagree on every rank when some rank's settings (JSON-ready) differ from rank 0's."""

    def check_same(self, arrays: dict, what: str) -> None:
        """RanksDisagree on every rank when the arrays (the parameters, say) are not the same on every
        rank; what: their description in the message ("step 200: the parameters")."""

    def describe(self) -> str:
        """One line for the run's header: the ranks, their pids and hosts, and their cores."""
        return "1 process"

    @contextmanager
    def share_cores(self):
        """Run a block with this rank's share of the machine's cores (one process: all of them, as they are)."""
        yield

    def close(self) -> None:
        """The end of the collectives: every rank passes here before any leaves the run."""


class MpiWorld(World):
    """N ranks over MPI.COMM_WORLD (module docstring): the collectives a run needs, core sharing, the
    lost-rank watcher process of each host (train/watcher.py), and a watchdog thread that stops
    every rank when a collective waits longer than the timeout."""

    def __init__(self, mpi, command: str = "npllama train"):
        self.MPI, self.comm, self.command = mpi, mpi.COMM_WORLD, command
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(os.environ.get(TIMEOUT_VAR) or DEFAULT_TIMEOUT)
        self._busy = None                     # (what, since) while this rank waits in a collective
        self._channel, self.local = None, []  # a datagram socket to the watcher (watcher.py); this host's ranks
        try:                                  # stderr, and what holds fd 2 during collectives (/dev/null at first)
            self._stderr, self._quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        except OSError:                       # no stderr to keep clean
            self._stderr = self._quiet = None
        self.hosts = self._allgather_text(mpi.Get_processor_name())
        self.pids = [int(p) for p in self._allgather_ints([os.getpid()])[:, 0]]
        self.local = [r for r in range(self.size) if self.hosts[r] == self.hosts[self.rank]]   # ranks on this host
        self.ranks_here = len(self.local)
        self._watcher, address = self._start_watcher() if self.rank == self.local[0] else (None, "")
        self._watcher_pid = int(self._allgather_ints([self._watcher.pid if self._watcher else 0])[self.local[0], 0])
        self._tell_watcher_of_failures(self._allgather_text(address)[self.local[0]])
        self._armed = True
        threading.Thread(target=self._watch, name="npllama-rank-watchdog", daemon=True).start()
        self._signals = {}                    # signal -> the handler it had (restored by close)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                try:
                    signal.signal(signum, self._end_as_signalled)
                    self._signals[signum] = signal.SIG_DFL
                except ValueError:            # not the main thread
                    pass

    def _end_as_signalled(self, signum, frame) -> None:
        """A signal that ends this rank anyway (mpiexec passes SIGTERM on to every rank): tell the watcher
        first, so that the ranks ending together are not reported as lost; then end by it. Unless a
        rank of this host has ended already: then this is hydra ending the others after that loss,
        which the watcher reports (told that this rank's end is not one)."""
        if self._others_ending():
            self._failed_after_a_loss()
        else:
            self._stand_down_watcher()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _start_watcher(self) -> tuple[subprocess.Popen | None, str]:
        """The lost-rank watcher of this host, told its ranks (this one first), and the address of its
        datagram socket (abstract namespace; "" where there is none); None where it cannot run."""
        errors, address = None, ""
        if sys.platform.startswith("linux"):
            try:
                errors = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                errors.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                address = f"\0npllama-watcher-{os.getpid()}-{secrets.token_hex(8)}"
                errors.bind(address)
            except OSError:
                errors, address = None, ""
        try:
            watcher = subprocess.Popen([sys.executable, "-I", str(Path(__file__).with_name("watcher.py")), self.command,
                                        *([str(errors.fileno())] if errors else [])],
                                       pass_fds=[errors.fileno()] if errors else [], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, text=True,
                                       start_new_session=True)     # out of the group mpiexec kills
            watcher.stdin.write("".join(f"rank {r} {self.pids[r]} {self.hosts[r]}\n" for r in self.local) + "go\n")
            watcher.stdin.flush()
        except OSError:
            return None, ""
        finally:
            if errors is not None:
                errors.close()                # the watcher holds it
        return watcher, address

    def _tell_watcher_of_failures(self, address: str) -> None:
        """Point fd 2 during collectives at the watcher's socket (watcher.py): a fatal MPI error that a
        lost rank causes in this one then tells the watcher that this rank's end is no loss."""
        if not address or self._quiet is None:
            return
        try:
            channel = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            channel.connect(address)
        except OSError:
            return
        os.close(self._quiet)
        self._quiet, self._channel = channel.fileno(), channel

    # ---- the collectives -------------------------------------------------------------------

    @contextmanager
    def _collective(self, what: str):
        """A collective in progress: `what` is what the watchdog names if it waits too long. Meanwhile
        MPICH's own messages (fd 2) go to the watcher's socket, or to /dev/null: when a rank dies in
        the middle of a transfer, the one waiting for it meets a fatal error (e.g. "process_vm_readv
        failed") and prints its stack a moment before it ends, and the watcher or the watchdog has
        the one line that says what happened. npllama's own lines are written outside collectives,
        or to self._stderr."""
        self._busy = (what, time.monotonic())
        if self._stderr is not None:
            os.dup2(self._quiet, 2)
        try:
            yield
        except self.MPI.Exception as e:
            if self._others_ending() and self._channel is not None:
                self._failed_after_a_loss()          # the watcher names the lost rank
                os._exit(1)
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CollectiveFailed(f"MPI failed in {what} ({detail}): another rank ended or was lost in the middle "
                                   "of it; every rank stops, the last checkpoint written is kept") from None
        finally:
            if self._stderr is not None:
                os.dup2(self._stderr, 2)
            self._busy = None

    def _others_ending(self) -> bool:
        """Whether another rank of this host has ended or is ending."""
        return any(_ending(self.pids[r]) for r in self.local if r != self.rank)

    def _failed_after_a_loss(self) -> None:
        """Tell the watcher that this rank ends because another rank of the host was lost (watcher.py),
        where there is a channel to it."""
        if self._channel is None:
            return
        try:
            self._channel.send(b"npllama: this rank ends after the loss of another\n")
        except OSError:
            pass

    def _wait(self, what: str, post) -> None:
        """Post a non-blocking collective (post() returns its request) and wait for it: spin briefly
        (ranks in step meet within microseconds), then sleep between tests, so that a rank waiting
        for rank 0's checkpoint takes no core."""
        with self._collective(what):
            request = post()
            spin_until = time.perf_counter() + SPIN
            while not request.Test():
                if time.perf_counter() > spin_until:
                    time.sleep(POLL)

    def allreduce_sum_(self, flat):
        # blocking: the hot path, where the ranks arrive together (MPICH spins for it anyway)
        with self._collective("the gradient Allreduce"):
            self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
        return flat

    def sums(self, *values):
        buf = np.array(values, dtype=np.float64)
        self._wait("a sum of losses", lambda: self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))
        return tuple(float(v) for v in buf)

    def raise_together(self, error):
        failed = int(self.sums(1.0 if error is not None else 0.0)[0])
        if failed == self.size:
            error.on_every_rank = True
        if error is not None:
            raise error
        if failed:
            time.sleep(GRACE + 0.1 * min(self.size, 40) + 30)    # a failing rank reports, then aborts every rank
            os._exit(1)

    def any_of(self, *flags):
        buf = np.array(flags, dtype=np.int32)
        self._wait("the stop decision", lambda: self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX))
        return tuple(bool(v) for v in buf)

    def broadcast_int(self, value):
        buf = np.array([value], dtype=np.int64)
        self._wait("a broadcast", lambda: self.comm.Ibcast(buf, root=0))
        return int(buf[0])

    def _allgather_ints(self, values) -> np.ndarray:
        """(size, k) int64: every rank's k values."""
        mine = np.array(values, dtype=np.int64)
        out = np.empty((self.size, mine.size), dtype=np.int64)
        self._wait("an allgather", lambda: self.comm.Iallgather(mine, out))
        return out

    def _allgather_text(self, text: str) -> list[str]:
        data = text.encode("utf-8")
        longest = int(self._allgather_ints([len(data)]).max())
        mine = np.zeros(longest, dtype=np.uint8)
        mine[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        out = np.empty((self.size, longest), dtype=np.uint8)
        self._wait("an allgather", lambda: self.comm.Iallgather(mine, out))
        return [bytes(row).rstrip(b"\0").decode("utf-8") for row in out]

    def _broadcast_text(self, text: str, root: int) -> str:
        data = text.encode("utf-8")
        n = np.array([len(data)], dtype=np.int64)
        self._wait("a broadcast", lambda: self.comm.Ibcast(n, root=root))
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), np.uint8)
        self._wait("a broadcast", lambda: self.comm.Ibcast(buf, root=root))
        return bytes(buf).decode("utf-8")

    # ---- agreement --------------------------------------------------------------------------

    def check_same_config(self, settings):
        text = json.dumps(settings, sort_keys=True)
        crcs = self._allgather_ints([zlib.crc32(text.encode("utf-8"))])[:, 0]
        differ = [r for r in range(self.size) if crcs[r] != crcs[0]]
        if differ:      # every rank learns the first one that differs, and names its settings
            theirs = json.loads(self._broadcast_text(text, root=differ[0]))
            mine = json.loads(self._broadcast_text(text, root=0))
            raise RanksDisagree(config_differences(mine, theirs, differ[0]) + "; give every rank the same command "
                                "line (and the same files)")

    def check_same(self, arrays, what):
        sums = self._allgather_ints([checksum(arrays)])[:, 0]
        differ = [r for r in range(self.size) if sums[r] != sums[0]]
        if differ:
            raise RanksDisagree(f"{what} of rank {differ[0]} are not those of rank 0 (their checksums differ): "
                                "the ranks read different files or compute differently (another npllama, NumPy or "
                                "BLAS on some host?); give every rank the same files and versions, then --resume")

    def describe(self):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
        ranks = ", ".join(f"rank {r} pid {self.pids[r]} on {self.hosts[r]}" for r in range(self.size))
        return f"{self.size} ranks (MPI), {cores} core(s) each: {ranks}"

    # ---- cores ------------------------------------------------------------------------------

    @contextmanager
    def share_cores(self):
        """Pin this rank to its share of the cores, C / (ranks on this host), and give BLAS as many threads.

        The engine's threads (engine/shards.py resolve_workers, FusedAdamW) count the cores the
        process may use, so they follow. A launcher that bound the ranks already (mpiexec -bind-to
        core) has given a share: it is kept. Affinity and BLAS threads are restored on return.
        """
        if not hasattr(os, "sched_setaffinity"):
            yield
            return
        cores = sorted(os.sched_getaffinity(0))
        per_rank = max(1, len(cores) // len(self.local))
        first = self.local.index(self.rank) * per_rank
        mine = {cores[(first + j) % len(cores)] for j in range(per_rank)}
        if len(cores) > per_rank:
            os.sched_setaffinity(0, mine)
        try:
            with blas_threads(per_rank):
                yield
        finally:
            os.sched_setaffinity(0, cores)

    # ---- the end, and failures ---------------------------------------------------------------

    def close(self):
        """The last collective: once here, a rank that leaves is no loss (the watchers stand down)."""
        if self._armed:
            self._armed = False
            self._stand_down_watcher(done=True)
            self._wait("the final barrier", lambda: self.comm.Ibarrier())
            for signum, handler in self._signals.items():
                signal.signal(signum, handler)

    def _stand_down_watcher(self, done: bool = False) -> None:
        """Tell this host's watcher that the ranks end on purpose. done: the run is over ("done", from the
        rank that started it, before the final barrier lets any rank leave); else a rank is about to
        stop them all, having said why (SIGUSR1, from any rank)."""
        if done:
            if self._watcher is not None:
                try:
                    self._watcher.stdin.write("done\n")
                    self._watcher.stdin.close()
                    self._watcher.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        elif self._watcher_pid:
            try:
                os.kill(self._watcher_pid, signal.SIGUSR1)
            except OSError:
                pass

    def stop_all(self, report: Callable[[str], int | None], error: BaseException) -> None:
        """End every rank after `error` ended this one: report it, then MPI_Abort (which ends them all).

        Rank 0 reports at once. Another rank first waits (_before_stopping_all), in which time
        rank 0, if it met the same error (they mostly do: the ranks run the same steps on the same
        numbers), reports it and ends everything: one line in all. Then it reports its own,
        naming itself. report(prefix) prints the line and returns the exit code,
        None for a bug, whose traceback is printed instead.
        """
        self._before_stopping_all()
        code = report(f"rank {self.rank}: " if self.rank else "")
        if code is None:
            traceback.print_exception(type(error), error, error.__traceback__)
        self._abort(1 if code is None else code)

    def _before_stopping_all(self) -> None:
        """This rank is about to say why every rank stops: the watcher must not add a line, and a rank
        other than 0 first leaves rank 0 GRACE seconds (the higher its rank, the longer) to say it."""
        self._armed = False
        self._stand_down_watcher()
        if self.rank:
            time.sleep(GRACE + 0.1 * min(self.rank, 40))

    def _abort(self, code: int) -> None:
        """MPI_Abort: mpiexec ends every rank (with or without -disable-auto-cleanup) and exits with code."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        time.sleep(0.2)                  # let mpiexec forward our line before the processes go
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)              # MPICH's own "Abort(1) on node 0 ..." line: ours said it
        self.comm.Abort(code)
        os._exit(code)                   # MPI_Abort may return before mpiexec's kill arrives

    def _watch(self) -> None:
        """The watchdog thread: stop every rank when a collective has waited longer than the timeout (a
        rank on another host lost, or stopped). A rank lost on this host is the watcher's to report."""
        while self._armed:
            time.sleep(WATCH_INTERVAL)
            busy = self._busy
            if not (busy and self.timeout and time.monotonic() - busy[1] > self.timeout and self._armed):
                continue
            self._before_stopping_all()
            line = (f"{self.command}: error: no answer from the other ranks for {self.timeout:g} s in {busy[0]}: one "
                    f"was lost or is stuck (${TIMEOUT_VAR} sets the limit); every rank stopped, the last checkpoint "
                    "written is kept\n")
            try:                          # to stderr itself: fd 2 is held by _collective while the main thread waits
                os.write(2 if self._stderr is None else self._stderr, line.encode())
            except OSError:
                pass
            self._abort(1)


def _ending(pid: int) -> bool:
    """True when the process pid has ended or is ending: gone, a zombie, or without its memory (a
    process killed in the middle of its exit); False where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return fields[0] in "ZXx" or fields[20] == "0"          # state; vsize (field 23 of stat)


ALONE = World()      # the one process of a run without mpiexec
