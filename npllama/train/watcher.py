"""The lost-rank watcher: a small process beside the ranks of an mpiexec run, which says which rank was lost.

When a rank dies (kill -9, the OOM killer), MPICH's mpiexec (hydra) kills every other rank at
once, SIGTERM then SIGKILL back to back, so no rank can say a word; mpiexec prints the dead
process's pid. This process is not a rank, so hydra leaves it alone. The lowest rank on each host
starts it (train/distributed.py MpiWorld) and tells it on its stdin the ranks of the host:

    rank <r> <pid> <host>       one line per rank on this host, the starting rank first
    go                          start watching
    done                        the run is over (its last collective passed): stand down

It waits on the ranks' pidfds. When a rank ends before `done`, and it is not the starting rank,
it prints one line naming it, kills the host's remaining ranks (under `mpiexec
-disable-auto-cleanup` hydra would leave them waiting), and exits. It says nothing when the
starting rank ends first: hydra's own clean-up kills the ranks of a host in rank order, starting
with it, so that is what a loss on another host (or an MPI_Abort) looks like. SIGUSR1 (from a rank
that is about to stop every rank on purpose, having said why) and the end of its stdin (the
starting rank is gone) make it exit quietly.

Standard library only, run as a script: it starts in milliseconds and imports nothing of npllama.
"""

import os
import select
import signal
import sys
import time


def main() -> None:
    signal.signal(signal.SIGUSR1, lambda signum, frame: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the ranks' to handle
    command = sys.argv[1] if len(sys.argv) > 1 else "npllama train"
    ranks = []                                             # (rank, pid, host), the starting rank first
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["rank"]:
            ranks.append((int(words[1]), int(words[2]), words[3]))
        elif words[:1] == ["go"]:
            break
        else:
            return
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
    fds = {}
    for rank, pid, host in ranks:
        try:
            fds[os.pidfd_open(pid)] = (rank, pid, host)
        except (AttributeError, OSError):                  # gone already, or no pidfd here: nothing to say
            return
    for fd in fds:
        poller.register(fd, select.POLLIN)
    while True:
        events = poller.poll()
        ended = sorted(fds[fd] for fd, _ in events if fd in fds)
        if not ended or ranks[0] in ended:   # "done" or the end of stdin; or the starting rank ended first
            return
        names = " and ".join(f"rank {r} (pid {pid} on {host})" for r, pid, host in ended)
        print(f"{command}: error: {names} {'was' if len(ended) == 1 else 'were'} lost; every rank stopped, the last "
              "checkpoint written is kept", file=sys.stderr, flush=True)
        time.sleep(0.2)                                    # let mpiexec forward the line first
        for rank, pid, host in ranks:
            if (rank, pid, host) not in ended:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return


if __name__ == "__main__":
    main()
