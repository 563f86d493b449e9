"""Faults around a run: the folder lock, temporary files, OS errors, closed pipes, the CLI's error policy.

Several tests run real processes (`python -m npllama`), since locks, pipes and a closed stdout
only mean something between processes. Disk-full, read-only and permission-denied file systems
are made with `unshare` (a private tmpfs, or an unprivileged user); where unshare is not
allowed those tests skip with the reason, and in-process versions of the same faults still run.
"""

import errno
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.errors import NpllamaError, describe_os_error
from npllama.io.atomic import stale_temp_files, write_bytes_atomic
from npllama.train import train
from npllama.train.checkpoint import load_train_checkpoint, load_train_state
from npllama.train.lock import LOCK_NAME, RunLock, RunLockedError
from npllama.train.loop import RunWriteError
from npllama.train.metrics import MetricsLog

from .conftest import tiny_cfg

NPLLAMA = [sys.executable, "-m", "npllama"]


def tiny_train_argv(text, out_dir, *extra):
    return [*NPLLAMA, "train", "--preset", "tiny", "--data", str(text), "--out-dir", str(out_dir),
            "--sample-tokens", "0", *map(str, extra)]


def wait_for(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def lock_holder(out_dir: Path):
    try:
        return json.loads((out_dir / LOCK_NAME).read_text() or "null")
    except (OSError, ValueError):
        return None


def no_traceback(stderr: str) -> bool:
    return not any(s in stderr for s in ("Traceback", "BrokenPipeError", "Exception ignored", "AttributeError"))


# ----------------------------------------------------------------------------- one run per folder

def test_a_second_trainer_on_the_same_folder_is_refused_naming_the_first(text_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    first = subprocess.Popen(tiny_train_argv(text_file, out, "--max-steps", 100000, "--eval-interval", 100000),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (lock_holder(out) or {}).get("pid") == first.pid, "the first run's lock")
        second = subprocess.run(tiny_train_argv(text_file, out, "--max-steps", 5), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 1
        assert second.stderr.count("\n") == 1 and f"pid {first.pid}" in second.stderr
        assert "in use by another training run" in second.stderr and no_traceback(second.stderr)
        assert first.poll() is None                              # the first run goes on, untouched
    finally:
        first.send_signal(signal.SIGINT)                         # Ctrl-C: it saves and exits 130
        assert first.wait(timeout=120) == 130, first.stderr.read()
    assert load_train_state(out / "ckpt.safetensors")["step"] > 0
    assert not (out / LOCK_NAME).exists()                        # released on the way out


def test_a_killed_runs_lock_and_temp_files_are_taken_over_on_resume(text_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    killed = subprocess.Popen(tiny_train_argv(text_file, out, "--max-steps", 100000, "--eval-interval", 3),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (out / "ckpt.safetensors").exists(), "a first checkpoint")
    finally:
        killed.kill()                                            # kill -9: no handler runs
        killed.wait(timeout=60)
    assert lock_holder(out)["pid"] == killed.pid                 # the lock file stays, its lock does not
    (out / ".ckpt.safetensors.k1ll3d__.tmp").write_bytes(b"\0" * 300_000)    # as a kill mid-write leaves it
    (out / ".metrics.jsonl.x0x0x0x0.tmp").write_bytes(b"{}")
    (out / ".ckpt.safetensors.note.txt").write_bytes(b"not ours")             # not a temp name: kept
    step = load_train_state(out / "ckpt.safetensors")["step"]
    # the kill may itself have left a temp file, mid-write of the next checkpoint: count what is there
    stale = [p for p in out.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert len(stale) >= 2
    megabytes = sum(p.stat().st_size for p in stale) / 1e6
    resumed = subprocess.run(tiny_train_argv(text_file, out, "--resume", "--max-steps", step + 3),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"pid {killed.pid}" in resumed.stdout and "ended without releasing it" in resumed.stdout
    assert f"removed {len(stale)} temporary file(s) ({megabytes:.1f} MB)" in resumed.stdout
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".ckpt.safetensors.note.txt"]
    assert load_train_state(out / "ckpt.safetensors")["step"] == step + 3


def test_the_lock_in_one_process(tmp_path):
    out = tmp_path / "a" / "b"
    with RunLock(out) as lock:
        assert lock.stale_note() is None and out.is_dir()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(out).acquire()                              # flock is per open file: this conflicts too
    assert not out.exists() and (tmp_path / "a").is_dir()      # created, never written: removed again
    out.mkdir(parents=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": 99999999, "host": "h", "started": "then"}))
    with RunLock(out) as lock:                                  # a holder recorded, no lock held: stale
        assert "pid 99999999" in lock.stale_note() and "killed?" in lock.stale_note()
        (out / "kept.txt").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["kept.txt"]


def test_stale_temp_files_are_only_those_of_the_path(tmp_path):
    target = tmp_path / "ckpt.safetensors"
    for name in (".ckpt.safetensors.abc.tmp", ".ckpt.safetensors.def.part", ".other.abc.tmp", "ckpt.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in stale_temp_files(target)] == [".ckpt.safetensors.abc.tmp"]
    assert [p.name for p in stale_temp_files(target, ".part")] == [".ckpt.safetensors.def.part"]
    assert stale_temp_files(tmp_path / "absent" / "x") == []


# ----------------------------------------------------------------------------- OS errors

@pytest.mark.parametrize("layout, needle", [("file", "is a file, not a folder"), ("under", "which is a file")])
def test_out_dir_that_is_a_file_or_under_one_is_one_line(layout, needle, text_file, tmp_path, capsys):  # noqa: F811
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if layout == "file" else blocker / "run"
    assert cli.main(["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and str(blocker) in err


def test_disk_full_during_a_checkpoint_keeps_the_last_one(text_file, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    real_fsync, calls = os.fsync, {"n": 0}

    def full_disk(fd):                                         # the 2nd checkpoint's data hits a full disk
        calls["n"] += stat.S_ISREG(os.fstat(fd).st_mode)      # (folders are fsynced too, after a rename)
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(RunWriteError) as e:
        train(tiny_cfg(text_file, out, max_steps=12, eval_interval=4), out=io.StringIO())
    msg = str(e.value)
    assert msg.startswith("step 8: ") and f"{out / 'ckpt.safetensors'}: No space left on device" in msg
    assert "(step 4), is kept" in msg and "--resume" in msg and isinstance(e.value.__cause__, OSError)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert load_train_state(out / "ckpt.safetensors")["step"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.safetensors", "metrics.jsonl"]     # no temp file
    [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train(tiny_cfg(text_file, out, max_steps=12, eval_interval=4, resume=True), out=io.StringIO())
    assert load_train_state(out / "ckpt.safetensors")["step"] == 12


def test_a_failed_metrics_write_leaves_valid_json_lines(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", None)
    log.write(kind="train", step=1, loss=2.5)
    real = log._f

    class HalfThenFull:                                          # writes part of the line, then the disk is full
        def __init__(self):
            self.calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls == 1:
                return real.write(bytes(data[:7]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(real, name)

    log._f = HalfThenFull()
    with pytest.raises(OSError) as e:
        log.write(kind="train", step=2, loss=2.4)
    assert e.value.filename == str(tmp_path / "metrics.jsonl")
    log._f = real
    log.write(kind="train", step=3, loss=2.3)
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]


def test_describe_os_error_names_path_and_cause():
    assert describe_os_error(OSError(errno.ENOSPC, "No space left on device", "/r/ckpt.safetensors")) == \
        "/r/ckpt.safetensors: No space left on device (the disk is full; free some space)"
    assert describe_os_error(PermissionError(errno.EACCES, "Permission denied", "/a", None, "/b")).startswith(
        "/a -> /b: Permission denied")
    assert describe_os_error(FileNotFoundError("no training checkpoint at x")) == "no training checkpoint at x"


def test_atomic_writes_name_the_target_not_the_temp_file(tmp_path, monkeypatch):
    import tempfile

    def denied(dir, prefix, suffix):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "x1y2z3" + suffix))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(PermissionError) as e:
        write_bytes_atomic(tmp_path / "config.json", b"{}")
    assert e.value.filename == str(tmp_path / "config.json")


def _unshare(args, script):
    """Run a shell script under `unshare args`, or skip saying why not."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare to make a small or read-only file system")
    probe = subprocess.run(["unshare", *args, "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"unshare {' '.join(args)} is not allowed here: {probe.stderr.strip()}")
    return subprocess.run(["unshare", *args, "sh", "-c", script], capture_output=True, text=True, timeout=300)


def test_a_full_and_a_read_only_file_system_are_one_line_each(text_file, tmp_path):  # noqa: F811
    """A real 600 kB tmpfs: the first checkpoint (~380 kB) fits, the second cannot; then read-only."""
    train_cmd = " ".join(tiny_train_argv(text_file, "/mnt/run", "--eval-interval", 30))
    check = (f"{sys.executable} -c \"import json; from npllama.train.checkpoint import load_train_state; "
             "print('STEP', load_train_state('/mnt/run/ckpt.safetensors')['step']); "
             "[json.loads(l) for l in open('/mnt/run/metrics.jsonl')]; import os; print('FILES', sorted(os.listdir('/mnt/run')))\"")
    script = (f"mount -t tmpfs -o size=600k tmpfs /mnt && cd {tmp_path} && "
              f"{train_cmd} > /dev/null; echo RC $?; {check}; mount -o remount,ro /mnt && "
              f"{train_cmd} --resume > /dev/null; echo RC $?")
    run = _unshare(["-Urm"], script)
    lines = run.stderr.strip().splitlines()
    assert run.stdout.split("RC ")[1].split()[0] == "1" and run.stdout.split("RC ")[2].split()[0] == "1", run
    assert "STEP 30" in run.stdout and "FILES ['ckpt.safetensors', 'metrics.jsonl']" in run.stdout
    assert len(lines) == 2 and no_traceback(run.stderr)
    assert "step 60: /mnt/run/ckpt.safetensors: No space left on device" in lines[0] and "(step 30)" in lines[0]
    assert "/mnt/run/" in lines[1] and "Read-only file system" in lines[1]


def test_permission_denied_is_one_line(text_file, tmp_path):  # noqa: F811
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)                                      # unshare -U: we become an unprivileged user
    script = " ".join(tiny_train_argv(text_file, locked / "run")) + " > /dev/null"
    run = _unshare(["-U"], script)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run
    assert f"{locked / 'run'}: Permission denied" in run.stderr and no_traceback(run.stderr)


# ----------------------------------------------------------------------------- pipes

def test_generate_into_a_pipe_closed_early_ends_quietly():
    proc = subprocess.Popen([*NPLLAMA, "generate", "-p", "ROMEO:", "-n", "3000", "--sliding-window", "-s", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = proc.stdout.read(10)                               # `| head -c 10`
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141                      # 128 + SIGPIPE, as a shell reports `yes | head`
    assert head.startswith(b"ROMEO:") and no_traceback(proc.stderr.read().decode())


def test_train_into_a_pipe_closed_early_stops_and_saves(text_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = subprocess.Popen(tiny_train_argv(text_file, out, "--max-steps", 100000, "--log-interval", 1),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = [proc.stdout.readline() for _ in range(10)]      # `| head`
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141
    err = proc.stderr.read()
    assert first[0].startswith("npllama train --preset tiny") and no_traceback(err)
    assert "output closed; stopped at step" in err and err.count("\n") == 1
    ck = load_train_checkpoint(out / "ckpt.safetensors")
    assert f"stopped at step {ck.state['step']}," in err
    assert all(np.isfinite(p).all() for p in ck.model.params.values())


@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_closed_stdout_is_no_error(command, text_file, tmp_path):  # noqa: F811
    argv = ([*NPLLAMA, "generate", "-p", "ROMEO:", "-n", "20"] if command == "generate"
            else tiny_train_argv(text_file, tmp_path / "run", "--max-steps", 4))
    run = subprocess.run(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(1))     # `npllama ... >&-`
    assert run.returncode == 0 and no_traceback(run.stderr), run.stderr
    if command == "train":
        assert load_train_state(tmp_path / "run" / "ckpt.safetensors")["step"] == 4


# ----------------------------------------------------------------------------- the CLI's error policy

BUILD_PARSER = cli.build_parser


def _patched_parser(error):
    """The real parser, with `npllama generate` raising error."""
    parser = BUILD_PARSER()
    sub = parser._subparsers._group_actions[0].choices["generate"]

    def raises(args):
        raise error
    sub.set_defaults(func=raises)
    return parser


@pytest.mark.parametrize("error, needle", [
    (NpllamaError("the tensors do not fit"), "npllama generate: error: the tensors do not fit"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/x"), "npllama generate: error: /ro/x: Read-only file system"),
    (npllama.io.TensorMismatchError("missing 1: ['norm.weight']"), "missing 1: ['norm.weight']"),
])
def test_npllama_and_os_errors_are_one_line(error, needle, monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", lambda: _patched_parser(error))
    assert cli.main(["generate"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), AttributeError("no attribute 'x'"),
                                 AssertionError("q.shape=(1, 2)"), KeyError("layers.0"), IndexError("out of range")])
def test_a_bug_keeps_its_traceback(bug, monkeypatch):
    monkeypatch.setattr(cli, "build_parser", lambda: _patched_parser(bug))
    with pytest.raises(type(bug)):
        cli.main(["generate"])
