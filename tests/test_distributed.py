"""Data-parallel training over MPI (npllama/train/distributed.py, docs/distributed.md).

The first tests need no MPI: the gradient-averaging math on one process, the packing of the
gradients into one flat array, how a launch is detected, and that a normal run never imports
mpi4py. The others run `mpiexec -n N npllama train` for real; they skip, naming what is missing,
without mpiexec and mpi4py (`pip install -e '.[mpi]'` brings both; CI installs them).

Every mpiexec run is small (a two-layer model, tens of steps); the 1-process references run in
this process. The rank processes get one BLAS thread each (train/distributed.py share_cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.engine.layout import FlatLayout
from npllama.train import distributed
from npllama.train.checkpoint import load_train_checkpoint, load_train_state
from npllama.train.distributed import World, allreduce_gradients, config_differences, row_bounds

from .conftest import data_file, synthetic_text

REPO = Path(__file__).resolve().parents[1]

SIBLING = Path(sys.executable).parent / "mpiexec"     # the mpiexec of this Python's environment first
MPIEXEC = str(SIBLING) if SIBLING.exists() else shutil.which("mpiexec")
MISSING = [what for what, there in (("mpiexec", MPIEXEC), ("mpi4py", importlib.util.find_spec("mpi4py"))) if not there]
needs_mpi = pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not installed: pip install -e '.[mpi]'")

LAUNCH_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


# ----------------------------------------------------------------------------- one process

class RankOf(World):
    """Rank r of n, without MPI: what World.shard gives that rank."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_the_averaged_gradient_of_the_shards_is_the_gradient_of_their_union():
    config = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8,
                                 max_seq_len=8)
    model = npllama.Llama(config, seed=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (5, 8))
    y = rng.integers(0, 11, (5, 8))
    y[1, :6] = y[4, 2:] = -100            # ignored targets: the shares are not the rows' shares
    loss, grads = model.loss_and_grads(x, y)
    for size in (2, 3, 5):
        shares = [RankOf(r, size).shard(x, y) for r in range(size)]
        assert [len(xs) for xs, _, _ in shares] == [hi - lo for lo, hi in (row_bounds(5, r, size) for r in range(size))]
        assert sum(share for _, _, share in shares) == pytest.approx(1.0, abs=1e-15)
        parts = [(share, *model.loss_and_grads(xs, ys)) for xs, ys, share in shares]
        assert sum(s * part_loss for s, part_loss, _ in parts) == pytest.approx(loss, rel=1e-12)
        for name, g in grads.items():
            np.testing.assert_allclose(sum(s * part[name] for s, _, part in parts), g, rtol=1e-10, atol=1e-13)


def test_one_process_is_rank_0_of_1_and_every_collective_returns_its_input():
    world = World()
    x, y = np.zeros((3, 4), dtype=np.int64), np.ones((3, 4), dtype=np.int64)
    assert world.shard(x, y) == (x, y, 1.0)
    flat = np.arange(5.0)
    assert world.allreduce_sum_(flat) is flat and world.sums(1.5, 2.5) == (1.5, 2.5)
    assert world.any_of(0, True, False) == (False, True, False) and world.broadcast_int(7) == 7


class Doubling(World):
    """Two ranks holding the same gradients: the Allreduce doubles them."""
    size = 2

    def __init__(self):
        self.calls = []

    def allreduce_sum_(self, flat):
        self.calls.append(flat)
        flat *= 2.0
        return flat


def test_the_gradients_travel_as_one_flat_array():
    config = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=8)
    model = npllama.Llama(config, seed=0, dtype=np.float64)
    x = np.arange(16).reshape(2, 8) % 11
    _, grads = model.loss_and_grads(x, x)
    before = {n: g.copy() for n, g in grads.items()}
    world = Doubling()
    out = allreduce_gradients(world, grads, config)       # the engine's: reduced in place, no copy
    assert out is grads and len(world.calls) == 1 and world.calls[0] is FlatLayout(config).base_of(grads)
    assert all(np.array_equal(out[n], 2 * before[n]) for n in grads)
    separate = {n: g.copy() for n, g in before.items()}   # any other dict (LoRA, the reference): packed once
    world = Doubling()
    out = allreduce_gradients(world, separate, config)
    assert len(world.calls) == 1 and world.calls[0].size == sum(g.size for g in separate.values())
    assert all(np.array_equal(out[n], 2 * before[n]) and np.shares_memory(out[n], world.calls[0]) for n in out)
    assert all(np.array_equal(separate[n], before[n]) for n in separate)


def test_a_launch_is_read_from_mpich_or_open_mpi_variables(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert (distributed.launched_size(), distributed.launched_rank()) == (1, 0)
    assert type(distributed.connect()) is World
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert (distributed.launched_size(), distributed.launched_rank()) == (4, 3)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    assert (distributed.launched_size(), distributed.launched_rank()) == (2, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_without_mpi4py_rank_0_says_how_to_install_it_and_the_others_stay_quiet(rank, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", str(rank))
    monkeypatch.setitem(sys.modules, "mpi4py", None)      # import mpi4py fails, as where it is not installed
    assert cli.main(["train", "--preset", "tiny", "--out-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    if rank == 0:
        assert err.count("\n") == 1 and "pip install -e '.[mpi]'" in err and "mpiexec started 2 ranks" in err
    else:
        assert err == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_run_without_mpiexec_never_imports_mpi4py(tmp_path):
    text = tmp_path / "verse.txt"
    text.write_text(synthetic_text(5000))
    script = ("import sys; from npllama.cli import main; rc = main(sys.argv[1:]); "
              "sys.exit(rc or ('mpi4py' in sys.modules and 'mpi4py was imported'))")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    run = subprocess.run([sys.executable, "-c", script, "train", "--preset", "tiny", "--data", str(text), "--out-dir",
                          str(tmp_path / "run"), "--max-steps", "2", "--sample-tokens", "0", "--eval-batches", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "ranks" not in run.stdout                       # the header's ranks line is for mpiexec runs only


def test_differing_settings_are_named_with_both_values():
    mine = {"config": {"lr": 0.002, "seed": 1, "data": "a.txt"}, "explicit": ["lr"], "preset": "tiny"}
    theirs = {"config": {"lr": 0.001, "seed": 1, "data": "b.txt"}, "explicit": ["lr"], "preset": "tiny"}
    assert config_differences(mine, theirs, 3) == ("rank 3 was started with other settings than rank 0: "
                                                   "--data 'b.txt' (rank 0: 'a.txt'); --lr 0.001 (rank 0: 0.002)")
    assert "explicit" in config_differences(mine, {**mine, "explicit": []}, 1)


# ----------------------------------------------------------------------------- mpiexec runs

def launch_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(npllama.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    return env


def mpiexec(n, argv, flags=(), **kw):
    """`mpiexec [flags] -n n npllama train argv...` (completed)."""
    return subprocess.run([MPIEXEC, *flags, "-n", str(n), sys.executable, "-m", "npllama", "train", *map(str, argv)],
                          capture_output=True, text=True, env=launch_env(), timeout=kw.pop("timeout", 180), **kw)


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def final_params(out: Path) -> dict:
    return load_train_checkpoint(out / "ckpt.safetensors").model.params


def assert_same_training(a: Path, b: Path, tol: float) -> None:
    """The same loss at every step, and the same final parameters, within tol (0: bit for bit)."""
    la, lb = train_losses(a), train_losses(b)
    assert len(la) == len(lb) and len(la) > 0
    np.testing.assert_allclose(la, lb, rtol=0, atol=tol)
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=0, atol=tol, err_msg=name)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text(synthetic_text())
    return path


def small(text, out, *extra):
    return ["--preset", "tiny", "--data", text, "--out-dir", out, "--dim", 16, "--n-heads", 2, "--seq-len", 16,
            "--batch-size", 4, "--max-steps", 20, "--eval-interval", 10, "--eval-batches", 2, "--sample-tokens", 0,
            "--dtype", "float64", "--lr", 1e-2, "--warmup-steps", 2, "--seed", 7, *extra]


def lora(text, base, out, *extra):
    return ["--init", base, "--lora-rank", 4, "--data", text, "--out-dir", out, "--seq-len", 16, "--batch-size", 4,
            "--max-steps", 20, "--eval-interval", 10, "--eval-batches", 2, "--sample-tokens", 0, "--dtype", "float64",
            "--lr", 1e-2, "--warmup-steps", 2, "--seed", 7, *extra]


def in_process(argv) -> None:
    assert cli.main(["train", *map(str, argv)]) in (0, 130)


CASES = {   # name: (the arguments given an output folder, tolerance against one process)
    "full": (lambda t, b, o: small(t, o), 1e-10),
    "full, accumulating 3": (lambda t, b, o: small(t, o, "--grad-accum", 3, "--batch-size", 5), 1e-10),
    "LoRA": (lambda t, b, o: lora(t, b, o), 1e-10),
    "LoRA, accumulating 2": (lambda t, b, o: lora(t, b, o, "--grad-accum", 2), 1e-10),
    "float32, accumulating 2": (lambda t, b, o: small(t, o, "--dtype", "float32", "--grad-accum", 2), 1e-5),
}


@pytest.fixture(scope="module")
def two_ranks_and_one(text, tmp_path_factory):
    """Every CASE trained by 1 process (here) and by 2 ranks (one mpiexec job running them in turn),
    plus the first 10 of the 20 steps of "full" on 2 ranks: {name: (one, two)} folders."""
    if MISSING:
        pytest.skip(f"{' and '.join(MISSING)} not installed: pip install -e '.[mpi]'")
    root = tmp_path_factory.mktemp("ddp")
    base = root / "base"                                       # the model LoRA adapts
    in_process(small(text, base, "--max-steps", 2))
    base = base / "ckpt.safetensors"
    runs, jobs = {}, []
    for i, (name, (args, _)) in enumerate(CASES.items()):
        runs[name] = (root / f"one{i}", root / f"two{i}")
        in_process(args(text, base, runs[name][0]))
        jobs.append(["train", *map(str, args(text, base, runs[name][1]))])
    runs["half"] = (None, root / "half")
    jobs.append(["train", *map(str, small(text, root / "half", "--max-steps", 10, "--decay-steps", 20))])
    script = "import json, sys; from npllama.cli import main; sys.exit(max(main(a) for a in json.loads(sys.argv[1])))"
    job = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", script, json.dumps(jobs)], capture_output=True,
                         text=True, env=launch_env(), timeout=300)
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("  ranks      2 ranks (MPI)") == len(jobs) and "rows 2 + 2 of every batch" in job.stdout
    return runs


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_as_one_process_with_the_same_global_batch(name, two_ranks_and_one):
    one, two = two_ranks_and_one[name]
    assert_same_training(one, two, CASES[name][1])
    assert load_train_state(one / "ckpt.safetensors")["rng"] == load_train_state(two / "ckpt.safetensors")["rng"]


@needs_mpi
@pytest.mark.slow
def test_a_two_rank_run_resumed_on_one_process_continues_the_same_curve(two_ranks_and_one, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(two_ranks_and_one["half"][1], half)
    assert load_train_state(half / "ckpt.safetensors")["step"] == 10
    in_process(["--resume", "--out-dir", half, "--max-steps", 20])
    assert_same_training(half, two_ranks_and_one["full"][0], 1e-10)


@needs_mpi
@pytest.mark.slow
def test_three_ranks_share_an_uneven_batch_exactly_and_refuse_a_batch_smaller_than_them(text, tmp_path):
    in_process(small(text, tmp_path / "one", "--max-steps", 8))
    run = mpiexec(3, small(text, tmp_path / "three", "--max-steps", 8))
    assert run.returncode == 0, run.stderr
    assert "rows 1 + 1 + 2 of every batch" in run.stdout
    assert_same_training(tmp_path / "one", tmp_path / "three", 1e-10)
    refused = mpiexec(3, small(text, tmp_path / "refused", "--batch-size", 2))
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == ("npllama train: error: --batch-size 2 cannot be shared by 3 ranks, which need a window "
                              "of every batch each; use --batch-size 3 or more, or fewer ranks\n")
    assert not (tmp_path / "refused").exists()                 # before any work


@needs_mpi
@pytest.mark.slow
def test_the_readme_command_trains_on_two_ranks(tmp_path):
    data_file("tinyshakespeare.txt")
    page = (REPO / "docs" / "distributed.md").read_text()
    command = next(line for line in page.splitlines() if line.startswith("mpiexec -n 2 "))
    argv = shlex.split(command, comments=True)
    at = argv.index("npllama")
    # a short budget appended; 1% of the text for validation, as the closing pass over all of it is the slow part
    run = subprocess.run([MPIEXEC, *argv[1:at], sys.executable, "-m", "npllama", *argv[at + 1:], "--max-steps", "6",
                          "--eval-interval", "3", "--eval-batches", "2", "--sample-tokens", "20",
                          "--train-fraction", "0.99"],
                         capture_output=True, text=True, env=launch_env(), timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "rows 16 + 16 of every batch" in run.stdout and "done: 6 steps" in run.stdout
    assert load_train_state(tmp_path / "runs" / "shakespeare-char" / "ckpt.safetensors")["step"] == 6


@needs_mpi
def test_ranks_started_with_different_settings_are_refused_before_any_work(text, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "npllama", "train", *map(str, small(text, out))]
    run = subprocess.run([MPIEXEC, "-n", "1", *command, "--lr", "0.001", ":", "-n", "1", *command, "--lr", "0.002"],
                         capture_output=True, text=True, env=launch_env(), timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == ("npllama train: error: rank 1 was started with other settings than rank 0: --lr 0.002 "
                          "(rank 0: 0.001); give every rank the same command line (and the same files)\n")
    assert not out.exists()


@needs_mpi
def test_an_error_on_one_rank_alone_stops_every_rank_with_one_line_naming_it(text, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()                                  # rank 1 runs here, where verse.txt is not
    shutil.copy(text, tmp_path / "a" / "verse.txt")
    command = [sys.executable, "-m", "npllama", "train", *map(str, small("verse.txt", tmp_path / "run"))]
    t0 = time.monotonic()
    run = subprocess.run([MPIEXEC, "-n", "1", "-wdir", tmp_path / "a", *command, ":",
                          "-n", "1", "-wdir", tmp_path / "b", *command],
                         capture_output=True, text=True, env=launch_env(), timeout=120)
    assert run.returncode == 1 and time.monotonic() - t0 < 30
    assert run.stderr == ("npllama train: error: rank 1: training text verse.txt does not exist; pass a UTF-8 text "
                          "file with --data PATH\n")


def start(argv, flags=()):
    return subprocess.Popen([MPIEXEC, *flags, "-n", "2", sys.executable, "-m", "npllama", "train", *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())


def rank_pids(proc) -> dict[int, int]:
    """{rank: pid}, from the header's ranks line (read from proc's stdout)."""
    for line in proc.stdout:
        if line.startswith("  ranks "):
            return {int(rank): int(pid) for rank, pid in re.findall(r"rank (\d+) pid (\d+)", line)}
    pytest.fail("no ranks line in the header")


def rank_pid(proc, rank: int) -> int:
    """The pid of a rank, from the header's ranks line (read from proc's stdout)."""
    return rank_pids(proc)[rank]


def watcher_pid(parent: int) -> int:
    """The pid of the lost-rank watcher that the rank `parent` started (train/watcher.py)."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == parent \
                    and b"watcher.py" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    pytest.fail(f"rank pid {parent} has no watcher process")


def steps_logged(out: Path) -> int:
    """Training steps in out's metrics.jsonl so far (while a run may be writing it)."""
    try:
        return (out / "metrics.jsonl").read_text().count('"kind": "train"')
    except FileNotFoundError:
        return 0


def wait_for_step(out: Path, step: int, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while steps_logged(out) < step:
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.05)


def kill_rank_1(out: Path, at_step: int, flags=(), watcher_late=False) -> tuple[subprocess.Popen, str, str, float, int]:
    """Start a long 2-rank run, kill -9 its rank 1 once at_step steps are logged: (proc, stdout, stderr,
    seconds from the kill to mpiexec's end, the victim's pid). watcher_late: the lost-rank watcher is
    stopped (SIGSTOP) from before the kill until hydra has ended rank 0 too, as a loaded machine
    may leave it without a core: it then finds both ranks ended at once."""
    proc = start(small(out.parent / "verse.txt", out, "--max-steps", 100000, "--eval-interval", 5), flags)
    try:
        pids = rank_pids(proc)
        victim = pids[1]
        watcher = watcher_pid(pids[0]) if watcher_late else None
        rank_0 = os.pidfd_open(pids[0]) if watcher_late else None       # readable once every thread ended
        wait_for_step(out, at_step)
        t0 = time.monotonic()
        if watcher:
            os.kill(watcher, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        if watcher:
            assert select.select([rank_0], [], [], 30)[0], "hydra never ended rank 0 after rank 1 was lost"
            os.close(rank_0)
            os.kill(watcher, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=30)
        return proc, stdout, stderr, time.monotonic() - t0, victim
    finally:
        if proc.poll() is None:
            proc.kill()


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("-disable-auto-cleanup",)], ids=["mpiexec", "mpiexec -disable-auto-cleanup"])
def test_kill_9_of_a_rank_stops_every_rank_with_one_line_naming_it(flags, text, tmp_path):
    shutil.copy(text, tmp_path / "verse.txt")
    proc, stdout, stderr, seconds, victim = kill_rank_1(tmp_path / "run", 7, flags)
    assert_lost_rank_reported(proc, stderr, seconds, victim, tmp_path / "run")


@needs_mpi
@pytest.mark.slow
def test_a_watcher_that_wakes_after_hydra_ended_every_rank_still_names_the_one_lost_first(text, tmp_path):
    """On a loaded machine hydra may kill rank 0 before the watcher runs: both ranks have ended when
    it looks, and the order they ended in (epoll's) is what tells the lost one."""
    shutil.copy(text, tmp_path / "verse.txt")
    proc, stdout, stderr, seconds, victim = kill_rank_1(tmp_path / "run", 7, watcher_late=True)
    assert_lost_rank_reported(proc, stderr, seconds, victim, tmp_path / "run")


def assert_lost_rank_reported(proc, stderr, seconds, victim, out):
    assert proc.returncode != 0 and seconds < 30
    assert re.fullmatch(rf"npllama train: error: rank 1 \(pid {victim} on \S+\) was lost; every rank stopped, the "
                        r"last checkpoint written is kept\n", stderr), stderr
    # the last checkpoint written (every 5 steps; how many passed before the kill landed depends on
    # the machine's load) is whole: it loads, at a step the run saved
    step = load_train_state(out / "ckpt.safetensors")["step"]
    assert step >= 5 and step % 5 == 0, step


@needs_mpi
@pytest.mark.slow
def test_the_checkpoint_of_a_killed_run_resumes_on_two_ranks_bit_for_bit_and_on_one_the_same_curve(text, tmp_path):
    shutil.copy(text, tmp_path / "verse.txt")
    out = tmp_path / "run"
    kill_rank_1(out, 12)
    step = load_train_state(out / "ckpt.safetensors")["step"]
    assert step >= 10
    shutil.copytree(out, tmp_path / "on-one")
    resumed = mpiexec(2, ["--resume", "--out-dir", out, "--max-steps", step + 4])
    assert resumed.returncode == 0, resumed.stderr
    assert "was left by a run that ended without releasing it" in resumed.stdout
    in_process(["--resume", "--out-dir", tmp_path / "on-one", "--max-steps", step + 4])
    straight = mpiexec(2, small(tmp_path / "verse.txt", tmp_path / "straight", "--max-steps", step + 4, "--eval-interval", 5,
                                "--decay-steps", 100000))
    assert straight.returncode == 0, straight.stderr
    assert_same_training(out, tmp_path / "straight", 0.0)                 # 2 ranks: bit for bit
    assert_same_training(tmp_path / "on-one", tmp_path / "straight", 1e-10)


@needs_mpi
@pytest.mark.slow
def test_ctrl_c_to_mpiexec_stops_every_rank_at_the_same_step_and_saves(text, tmp_path):
    out = tmp_path / "run"
    proc = start(small(text, out, "--max-steps", 100000, "--eval-interval", 1000))
    try:
        wait_for_step(out, 5)
        proc.send_signal(signal.SIGINT)                       # mpiexec passes it on to every rank
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    step = load_train_state(out / "ckpt.safetensors")["step"]
    assert step == len(train_losses(out)) >= 5


@needs_mpi
def test_sigterm_to_mpiexec_ends_every_rank_and_reports_no_rank_lost(text, tmp_path):
    out = tmp_path / "run"
    proc = start(small(text, out, "--max-steps", 100000, "--eval-interval", 5))
    try:
        wait_for_step(out, 7)
        proc.terminate()                                      # mpiexec passes SIGTERM on to every rank
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "lost" not in stderr, stderr
    assert load_train_state(out / "ckpt.safetensors")["step"] >= 5


@needs_mpi
@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_run_after_the_timeout(text, tmp_path):
    out = tmp_path / "run"
    env = {**launch_env(), distributed.TIMEOUT_VAR: "2"}
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "npllama", "train",
                             *map(str, small(text, out, "--max-steps", 100000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    victim = rank_pid(proc, 1)
    try:
        wait_for_step(out, 3)
        os.kill(victim, signal.SIGSTOP)                       # alive, but silent: as a host cut off
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        for pid in (victim, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert proc.returncode == 1 and time.monotonic() - t0 < 15
    assert stderr.count("\n") == 1 and "no answer from the other ranks for 2 s in " in stderr
