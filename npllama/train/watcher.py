"""The lost-rank watcher: a small process beside the ranks of an mpiexec run, which says which rank was lost.

When a rank dies (kill -9, the OOM killer), MPICH's mpiexec (hydra) kills every other rank at
once, SIGTERM then SIGKILL back to back, so no rank can say a word; mpiexec prints the dead
process's pid. This process is not a rank, so hydra leaves it alone. The lowest rank on each host
starts it (train/distributed.py MpiWorld) and tells it on its stdin the ranks of the host:

    rank <r> <pid> <host>       one line per rank on this host, the starting rank first
    go                          start watching
    done                        the run is over (its last collective passed): stand down

It waits on the pidfds of the ranks' threads through epoll, whose ready list keeps the order in
which events came, whenever this process gets a core to look: under load, hydra may have killed
every rank of the host before it runs, and only that order tells the lost rank from the ones ended
after it. (A thread's pidfd, not the process's: see _thread_pidfds.)

A rank killed in the middle of a collective is noticed by the rank waiting for it before its own
exit is complete (its memory goes first: MPICH's "process_vm_readv failed"); that rank fails with
a fatal MPI error and ends first. So during collectives every rank points its stderr at this
process's datagram socket (its second argument, a file descriptor; SO_PASSCRED names the sender):
a rank that wrote there failed because of another, and its end is no loss.

The ranks that ended, in that order, before the starting rank ended (or its stdin said "done"),
leaving out those that failed in a collective, were lost: it prints one line naming them, kills
the host's remaining ranks (under `mpiexec -disable-auto-cleanup` hydra would leave them
waiting), and exits. It says nothing when the starting rank ends first, not having failed in a
collective: hydra's own clean-up kills the ranks of a host in rank order, starting with it, so that
is what a loss on another host (or an MPI_Abort) looks like. SIGUSR1 (from a rank that is about to
stop every rank on purpose, having said why) makes it exit quietly.

What it cannot tell apart: with three or more ranks on one host, a rank that hydra kills after
the starting rank failed in a collective is named as lost too; and a fatal MPI error on the
starting rank alone, no rank lost, reads as the loss of the rank hydra kills next.

Standard library only, run as a script: it starts in milliseconds and imports nothing of npllama.
"""

import os
import select
import signal
import socket
import struct
import sys
import time

PIDFD_THREAD = getattr(os, "PIDFD_THREAD", os.O_EXCL)     # Linux's value (O_EXCL), for Pythons without the name
# How long a thread's end waits for its process's, to count as the process's end.
CONFIRM_SECONDS = 5.0
# After the starting rank failed in a collective and ended, how long to wait for the rank it lost.
WAIT_FOR_THE_LOST_SECONDS = 10.0


def main() -> None:
    signal.signal(signal.SIGUSR1, lambda signum, frame: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the ranks' to handle
    command = sys.argv[1] if len(sys.argv) > 1 else "npllama train"
    errors = socket.socket(fileno=int(sys.argv[2])) if len(sys.argv) > 2 else None
    stdin = sys.stdin.fileno()
    ranks = []                                             # (rank, pid, host), the starting rank first
    for line in _lines(stdin):
        words = line.split()
        if words[:1] == ["rank"]:
            ranks.append((int(words[1]), int(words[2]), words[3]))
        elif words[:1] == ["go"]:
            break
        else:
            return
    if not ranks or not hasattr(select, "epoll"):
        return
    launcher = _launcher_stderr(ranks[0][1])
    poller = select.epoll()
    poller.register(stdin, select.EPOLLIN | select.EPOLLHUP)
    if errors is not None:
        errors.setblocking(False)
        poller.register(errors.fileno(), select.EPOLLIN)
    threads, processes = {}, {}          # thread pidfd -> rank; rank -> its process's pidfd
    for rank, pid, host in ranks:
        try:
            processes[(rank, pid, host)] = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone already, or no pidfd here: nothing to say
            return
        threads.update(dict.fromkeys(_thread_pidfds(pid) or [processes[(rank, pid, host)]], (rank, pid, host)))
    for fd in threads:
        poller.register(fd, select.EPOLLIN)
    by_pid = {pid: (rank, pid, host) for rank, pid, host in ranks}
    failed, lost, deadline = set(), [], None
    while not lost:
        events = poller.poll(-1 if deadline is None else max(0.0, deadline - time.monotonic()))
        if not events:
            return                       # the starting rank failed in a collective, and no other rank ended
        for fd, _ in events:             # in the order they came
            if errors is not None and fd == errors.fileno():
                failed |= {by_pid[pid] for pid in _senders(errors) if pid in by_pid}
                continue
            if fd == stdin:              # "done", or the end of the starting rank (its stdin closed)
                poller.unregister(stdin)
                if b"done" in _read_all(stdin) and not lost:
                    return
                ended = ranks[0]
            elif fd in threads:
                ended = threads[fd]
                if not select.select([processes[ended]], [], [], CONFIRM_SECONDS)[0]:
                    poller.unregister(fd)          # a thread that ended in a process that lives on
                    del threads[fd]
                    continue
                for other in [f for f, r in threads.items() if r == ended]:    # one event a rank is enough
                    poller.unregister(other)
                    del threads[other]
            else:
                continue
            if ended != ranks[0]:
                if ended not in failed and ended not in lost:
                    lost.append(ended)
                continue
            if lost or ranks[0] not in failed:
                break                    # the starting rank ended: those that ended before it were lost
            if deadline is None:         # it failed in a collective: wait for the one it lost
                deadline = time.monotonic() + WAIT_FOR_THE_LOST_SECONDS
        if not lost and deadline is None:
            return
    names = " and ".join(f"rank {r} (pid {pid} on {host})" for r, pid, host in lost)
    line = (f"{command}: error: {names} {'was' if len(lost) == 1 else 'were'} lost; every rank stopped, the last "
            "checkpoint written is kept\n")
    try:
        os.write(launcher, line.encode())
    except (OSError, TypeError):                           # not on mpiexec's host: through hydra
        print(line, end="", file=sys.stderr, flush=True)
        time.sleep(0.2)                                    # let hydra forward the line before the ranks go
    for rank, pid, host in ranks:
        if (rank, pid, host) not in lost:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _thread_pidfds(pid: int) -> list:
    """pidfds of the threads of process pid (PIDFD_THREAD, Linux 6.9+); [] where there are none.

    A killed process's threads end one by one, and the last one closes its files (hydra's proxy
    then ends the other ranks) a moment before the process's own pidfd is signalled: a moment in
    which a loaded core may run the proxy instead. Its first thread ends well before. (A thread
    that ends while its process lives on is no end: main() checks the process.)"""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return []
    fds = []
    for tid in tids:
        try:
            fds.append(os.pidfd_open(tid, PIDFD_THREAD))
        except (AttributeError, OSError):
            pass
    return fds


def _launcher_stderr(pid: int) -> int | None:
    """mpiexec's own stderr (opened for appending), found up the parents of pid (the starting rank,
    whose parent is hydra's proxy, whose parent is mpiexec on the host it runs on); None elsewhere.

    hydra forwards what a rank writes only while that rank lives, and ends as soon as its ranks have
    ended; this process may get a core only after that (under load), so its line goes straight to
    where mpiexec's own output goes. On another host the proxy's parent is ssh's: there the line
    goes through hydra, and is kept when this process is quicker than hydra's clean-up."""
    for _ in range(3):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            return None
        if name.startswith("mpiexec"):
            try:
                return os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
            except OSError:
                return None
    return None


def _lines(fd: int):
    """The lines of fd up to "go" (read unbuffered: what follows is epoll's to see)."""
    pending = b""
    while True:
        chunk = os.read(fd, 1)
        if not chunk:
            return
        pending += chunk
        if chunk == b"\n":
            yield pending.decode()
            if pending.startswith(b"go"):
                return
            pending = b""


def _read_all(fd: int) -> bytes:
    """What can be read from fd now (b"" at its end)."""
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _senders(sock: socket.socket) -> set:
    """The pids of the processes whose datagrams are waiting on sock (SO_PASSCRED's credentials)."""
    pids = set()
    size = struct.calcsize("3i")
    while True:
        try:
            _, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(size))
        except (BlockingIOError, InterruptedError):
            return pids
        except OSError:
            return pids
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= size:
                pids.add(struct.unpack("3i", data[:size])[0])


if __name__ == "__main__":
    main()
