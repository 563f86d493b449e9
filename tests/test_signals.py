"""Stop signals: SIGINT, SIGTERM and SIGHUP at any moment of any command end in one line on stderr and
the exit code 128 + the signal (130, 143, 129), never a traceback; training finishes its step and
saves a checkpoint that resumes bit for bit; a second signal stops it at once, leaving no partial file.

The commands run in real processes (`python -m npllama`). "Any moment" starts when npllama's launcher
is running: the test waits until the process catches SIGTERM (/proc/PID/status SigCgt), which only
npllama/__main__.py makes it do, and signals it 0 to 0.8 s later: during the imports, the load,
the run. (Before that, the interpreter's own start-up is outside npllama's reach: docs/faults.md.)
"""

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from npllama.interrupts import STOP_SIGNALS, StopRequest, exit_code, interrupt_signal, raise_on_stop_signals
from npllama.train import preset, train
from npllama.train.checkpoint import load_train_checkpoint, load_train_state

from .conftest import block_matplotlib, data_file
from .test_faults import NPLLAMA, no_traceback, tiny_train_argv


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (npllama's launcher installs one first thing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def has_open(pid: int, path: Path) -> bool:
    """Whether the process has path open (it is reading it)."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def signalled(argv, sig, delay, when=catches_sigterm):
    """Run argv; once when(pid) (default: its launcher is up), wait `delay` seconds and send sig;
    return (exit code, stdout, stderr)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/PID/status to see when the launcher is running")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not when(proc.pid) and proc.poll() is None:
            assert time.monotonic() < deadline, "the moment to signal never came"
            time.sleep(0.0005)
        time.sleep(delay)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def assert_one_line(code, err, sig):
    """Exit code 128 + sig and one line saying so (besides generate's own "[npllama generate] ..." report)."""
    lines = [line for line in err.splitlines() if not line.startswith("[npllama generate]")]
    assert code == 128 + sig, (code, err)
    assert len(lines) == 1 and f"interrupted by {signal.Signals(sig).name}" in lines[0], err
    assert no_traceback(err) and "Error" not in err, err


# ----------------------------------------------------------------------------- any moment, any command

@pytest.mark.slow
@pytest.mark.parametrize("sig, delay", [(signal.SIGINT, 0.0), (signal.SIGINT, 0.1), (signal.SIGTERM, 0.05),
                                        (signal.SIGINT, 0.25), (signal.SIGTERM, 0.4), (signal.SIGHUP, 0.8)])
def test_a_signal_while_generate_starts_loads_or_runs_is_one_line(sig, delay):
    code, _, err = signalled([*NPLLAMA, "generate", "-p", "ROMEO:", "-n", "5000", "--sliding-window"], sig, delay)
    assert_one_line(code, err, sig)


@pytest.mark.slow
@pytest.mark.parametrize("mmap", ["--mmap", "--no-mmap"])
def test_a_signal_during_a_load_is_one_line(tmp_path, mmap):
    """Signalled as soon as the process opens the model file: in the middle of the load."""
    import npllama
    cfg = npllama.LlamaConfig(dim=256, n_layers=8, n_heads=8, vocab_size=512)
    path = npllama.save(npllama.Llama(cfg), tmp_path / "model.safetensors", format="meta")
    code, _, err = signalled([*NPLLAMA, "generate", "-m", str(path), "--prompt-ids", "1,2", "-n", "2000", mmap],
                             signal.SIGINT, 0.0, when=lambda pid: has_open(pid, path))
    assert_one_line(code, err, signal.SIGINT)
    assert "[npllama generate]" not in err                      # it never got past the load


# what each command prints last: its outcome is decided and reported
FINISHED = {"train": "done: ", "gradcheck": "worst relative error", "export": "from_pretrained(", "plot": "loss.png"}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "gradcheck", "export", "plot"])
def test_every_command_ends_in_one_line_on_sigterm(command, tmp_path, text_file):
    if command == "train":
        argv = tiny_train_argv(text_file, tmp_path / "run")
    elif command == "gradcheck":
        argv = [*NPLLAMA, "gradcheck", "--n-layers", "12"]
    elif command == "export":
        argv = [*NPLLAMA, "export", "-m", str(data_file("stories260K.bin")), "-o", str(tmp_path / "hf")]
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
        argv = [*NPLLAMA, "plot", str(tmp_path / "run")]
    code, out, err = signalled(argv, signal.SIGTERM, 0.2)
    if code == 0:                                  # done before the signal came: nothing to report
        assert no_traceback(err)
        return
    if code in (128 + signal.SIGTERM, -signal.SIGTERM) and FINISHED[command] in out + err:
        # in its last moments, its outcome reported: it ends quietly, through the launcher's
        # exit_on_stop_signals (143) or, once the interpreter shuts down and Python has put the
        # default handlers back, by the signal itself (a shell sees 143 too)
        assert no_traceback(err) and "interrupted" not in err, err
        return
    if command == "train" and "stopped at step" in err:            # it reached the loop: saved first
        assert code == 143 and err.count("\n") == 1 and no_traceback(err), err
    else:
        assert_one_line(code, err, signal.SIGTERM)
    assert not list(tmp_path.rglob(".*.tmp"))


@pytest.mark.parametrize("handlers", ["raise_on_stop_signals()", "StopRequest()"])
def test_a_signal_in_the_middle_of_an_import_is_held_until_the_import_is_done(handlers, tmp_path):
    """A KeyboardInterrupt raised while a module runs its top-level code can be lost by the code
    importing it (NumPy's numpy.random, imported on first use, lost one: `generate` ran to its
    end). So a signal during an import raises only once the import is done. StopRequest: its
    second signal (the first is sent before the import) is the one that raises."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "deadline = time.monotonic() + 0.3\n"
        "while time.monotonic() < deadline:\n"          # bytecodes: Python calls the handler in here
        "    pass\n"
        "FINISHED = True\n")
    script = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from npllama.interrupts import StopRequest, raise_on_stop_signals
with HANDLERS as handlers:
    if isinstance(handlers, StopRequest):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    try:
        import slow_module
        sys.stdout.write(f"imported {slow_module.FINISHED}\\n")    # one write: the signal may come between two
        sys.stdout.flush()
        time.sleep(5)
        print("not interrupted")
    except KeyboardInterrupt as e:
        print("interrupted by", e.args[0].name, "after the import" if "slow_module" in sys.modules else "inside it")
"""
    run = subprocess.run([sys.executable, "-c", script.replace("HANDLERS", handlers), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert (run.stdout, run.stderr) == ("imported True\ninterrupted by SIGTERM after the import\n", "")


def test_a_line_to_stderr_is_one_write_with_its_newline(monkeypatch):
    """print() writes a line and its newline separately: a signal handled between the two glued the
    "interrupted by" line to the unfinished one. say() writes both at once."""
    from npllama.cli.args import say
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Recorder())
    say("[npllama generate] 5000 tokens")
    assert writes == ["[npllama generate] 5000 tokens\n"]


# ----------------------------------------------------------------------------- training

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_training_with_a_checkpoint_that_resumes_bit_exactly(sig, text_file, tmp_path,
                                                                                    monkeypatch):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    schedule = dict(decay_steps=300, eval_interval=1000, log_interval=1)
    proc = subprocess.Popen(tiny_train_argv(text_file, stopped, "--max-steps", 300,
                                            *[f"--{k.replace('_', '-')}={v}" for k, v in schedule.items()]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not proc.stdout.readline().startswith("step 4/"):      # a few steps in
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    step = load_train_state(stopped / "ckpt.safetensors")["step"]
    assert proc.returncode == 128 + sig, err
    assert err == (f"npllama train: {signal.Signals(sig).name}: stopped at step {step}, saved "
                   f"{stopped / 'ckpt.safetensors'} (continue with --resume)\n")
    assert f"stopping at step {step} ({signal.Signals(sig).name})" in out and 4 <= step < 300
    block_matplotlib(monkeypatch)                      # the rest in this process: no loss.png to draw
    tiny = preset("tiny").replace(data=str(text_file), sample_tokens=0, **schedule)
    train(tiny.replace(out_dir=str(stopped), resume=True, max_steps=step + 3), out=io.StringIO())
    train(tiny.replace(out_dir=str(straight), max_steps=step + 3), out=io.StringIO())
    a = load_train_checkpoint(stopped / "ckpt.safetensors")
    b = load_train_checkpoint(straight / "ckpt.safetensors")
    assert a.state["step"] == b.state["step"] == step + 3
    for name, p in b.model.params.items():
        assert np.array_equal(a.model.params[name], p), name
    for name, m in b.optimizer_state.items():
        assert np.array_equal(np.asarray(a.optimizer_state[name]), np.asarray(m)), name


@pytest.mark.slow
def test_a_second_signal_stops_training_at_once_without_a_partial_file(text_file, tmp_path):
    out_dir = tmp_path / "run"
    proc = subprocess.Popen(tiny_train_argv(text_file, out_dir, "--max-steps", 100000, "--eval-interval", 5,
                                            "--log-interval", 1),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not proc.stdout.readline().startswith("step 7/"):      # past the first checkpoint, at step 5
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    files = sorted(p.name for p in out_dir.iterdir())
    assert not [f for f in files if f.endswith(".tmp")], files
    assert load_train_checkpoint(out_dir / "ckpt.safetensors").state["step"] >= 5
    assert no_traceback(err) and err.count("\n") == 1, err
    # Python runs pending handlers in signal-number order, so which one counts as the second
    # depends on whether the first was handled before the second arrived
    assert proc.returncode in (130, 143), err
    if "a second signal" in err:
        assert "a second signal stopped training at once; the last good checkpoint" in err
    else:                               # the second came after the save had finished: saved and stopped
        assert ": stopped at step" in err and "saved" in err


# ----------------------------------------------------------------------------- the pieces, in one process

def test_the_stop_request_records_the_first_signal_and_raises_on_the_second():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with StopRequest() as stop:
        assert not stop.poll()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)                                   # a handler runs between bytecodes
        assert stop.poll() and stop.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt) as e:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.5)
        assert interrupt_signal(e.value) == signal.SIGHUP and exit_code(signal.SIGHUP) == 129
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_stop_signals_raise_a_keyboard_interrupt_naming_the_signal():
    with raise_on_stop_signals(), pytest.raises(KeyboardInterrupt) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    assert interrupt_signal(e.value) == signal.SIGTERM and exit_code(signal.SIGTERM) == 143
    assert interrupt_signal(KeyboardInterrupt()) == signal.SIGINT          # Python's own Ctrl-C


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def worker():
        with StopRequest() as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            seen.append(stop.poll())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [before, False]


def test_importing_npllama_imports_nothing_heavy_until_a_name_is_used():
    """So the launcher's handlers are in place before NumPy and the rest load."""
    probe = ("import sys, npllama; light = 'numpy' not in sys.modules; "
             "cfg = npllama.LlamaConfig(); print(light, 'numpy' in sys.modules, npllama.io.load is npllama.load)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["True", "True", "True"], run.stderr
