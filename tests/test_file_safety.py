"""Files are never lost: no write over an input or a checkpoint, folders swapped in whole, no link followed.

docs/faults.md "Files are never lost" states the guarantees; each test below breaks one on
purpose. The ones about processes (a concurrent writer and readers, kill -9 mid-save, the
run lock) run real processes, since that is where they mean something.
"""

import importlib.util
import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.io import CheckpointError
from npllama.io import atomic
from npllama.io.atomic import FOLDER_SUFFIX, stale_temp_folders, write_folder_atomic
from npllama.io.errors import OutputPathError
from npllama.io.metadata import SAVE_ID_KEY
from npllama.tokenizers import CharTokenizer
from npllama.train import train
from npllama.train.checkpoint import load_train_checkpoint, load_train_state

from .conftest import synthetic_text, tiny_cfg
from .test_faults import NPLLAMA, no_traceback

CFG = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=16)


def model(seed: int, cfg=CFG):
    m = npllama.Llama(cfg, seed=seed)
    m.tokenizer = CharTokenizer("abcdefghijk"[:cfg.vocab_size])
    return m


def same_params(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def one_error_line(err: str, *needles) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and lines[0].split(": error: ", 1)[-1].strip() != "" and no_traceback(err) \
        and all(n in err for n in needles)


@pytest.fixture
def run_ckpt(text_file, tmp_path):
    """A two-step training run: (its checkpoint, the checkpoint's bytes)."""
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=2, eval_interval=2), out=io.StringIO())
    ckpt = out / "ckpt.safetensors"
    return ckpt, ckpt.read_bytes()


@pytest.fixture
def lora_ckpt(text_file, tmp_path):
    """A LoRA run on a tiny base saved with its character tokenizer: (checkpoint, base)."""
    base = tmp_path / "base.safetensors"
    tok = CharTokenizer.from_text(synthetic_text())
    base_model = npllama.Llama(CFG.replace(vocab_size=tok.vocab_size), seed=0)
    base_model.tokenizer = tok
    npllama.save(base_model, base, format="meta")
    out = tmp_path / "lora"
    train(tiny_cfg(text_file, out, init=str(base), lora_rank=2, max_steps=2, eval_interval=2), out=io.StringIO())
    return out / "ckpt.safetensors", base


# ----------------------------------------------------------------------------- outputs over inputs

def test_export_onto_its_own_training_checkpoint_is_refused_unless_asked(run_ckpt, capsys):
    ckpt, before = run_ckpt
    assert cli.main(["export", "-m", str(ckpt), "-o", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert one_error_line(err, "training checkpoint", "--overwrite-checkpoint") and ckpt.read_bytes() == before
    linked = ckpt.parent / "hard-link.safetensors"
    os.link(ckpt, linked)                                          # the same inode under another name
    assert cli.main(["export", "-m", str(ckpt), "-o", str(linked)]) == 1
    assert one_error_line(capsys.readouterr().err) and ckpt.read_bytes() == before
    # asked for: the bare model replaces it, whole
    assert cli.main(["export", "-m", str(ckpt), "-o", str(ckpt), "--overwrite-checkpoint"]) == 0
    with pytest.raises(ValueError, match="no training state"):
        load_train_state(ckpt)
    assert same_params(npllama.load(ckpt).params, npllama.load(linked).params)   # the old inode, untouched


def test_export_never_replaces_another_checkpoint_or_a_lora_one_unasked(run_ckpt, lora_ckpt, tmp_path, capsys):
    ckpt, before = run_ckpt
    lora, base = lora_ckpt
    lora_bytes, base_bytes = lora.read_bytes(), base.read_bytes()
    other = tmp_path / "other.safetensors"
    npllama.save(model(1), other, format="meta")
    assert cli.main(["export", "-m", str(other), "-o", str(ckpt)]) == 1
    assert one_error_line(capsys.readouterr().err, "training checkpoint") and ckpt.read_bytes() == before
    assert cli.main(["export", "-m", str(lora), "-o", str(lora)]) == 1
    assert one_error_line(capsys.readouterr().err, "LoRA checkpoint") and lora.read_bytes() == lora_bytes
    assert cli.main(["export", "-m", str(lora), "-o", str(base)]) == 1       # the base the adapters need
    assert one_error_line(capsys.readouterr().err, "base model") and base.read_bytes() == base_bytes
    with pytest.raises(OutputPathError, match="base model of these LoRA adapters"):
        npllama.save(load_train_checkpoint(lora).model, base, format="meta")
    with pytest.raises(OutputPathError, match="overwrite_checkpoint=True"):
        npllama.save(model(1), ckpt, format="meta")
    assert ckpt.read_bytes() == before
    npllama.save(npllama.load(other), ckpt, format="meta", overwrite_checkpoint=True)
    assert same_params(npllama.load(ckpt).params, npllama.load(other).params)


@pytest.mark.parametrize("out", ["", "   ", ".", "..", "the current folder by its full path"])
def test_export_to_no_path_is_refused(out, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path) if out.startswith("the current") else out
    src = npllama.save(model(0), tmp_path / "m.safetensors", format="meta")
    assert cli.main(["export", "-m", str(src), "-o", out]) == 1
    assert one_error_line(capsys.readouterr().err, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]      # nothing written anywhere


def test_export_into_around_or_onto_an_input_folder_is_refused(tmp_path, capsys):
    folder = npllama.save(model(0), tmp_path / "hf", format="hf")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for out, needle in [(folder, "is the checkpoint"), (folder / "inner", "inside"),
                        (folder / "copy.safetensors", "inside"), (tmp_path, "holds")]:
        assert cli.main(["export", "-m", str(folder), "-o", str(out), "--format", "hf"]) == 1
        assert one_error_line(capsys.readouterr().err, needle)
    spm = tmp_path / "tok.model"
    spm.write_bytes(b"a tokenizer")
    assert cli.main(["export", "-m", str(folder), "-o", str(spm), "--format", "hf", "--tokenizer", str(spm)]) == 1
    assert one_error_line(capsys.readouterr().err, "--tokenizer")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and spm.read_bytes() == b"a tokenizer"


def test_train_refuses_outputs_that_are_its_inputs(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(out), "--max-steps", "1"]
    text = text_file.read_bytes()
    for extra, needle in [(["--export", str(text_file)], "--export"), (["--export", str(out)], "replace the run's folder"),
                          (["--export", str(out / "ckpt.safetensors")], "the run's checkpoint"),
                          (["--export", ""], "--export"), (["--export", "."], "--export")]:
        assert cli.main(argv + extra) == 1
        assert one_error_line(capsys.readouterr().err, needle)
    metrics_as_data = tmp_path / "m" / "metrics.jsonl"
    metrics_as_data.parent.mkdir()
    metrics_as_data.write_text(synthetic_text())
    assert cli.main(["train", "--preset", "tiny", "--data", str(metrics_as_data), "--out-dir", str(metrics_as_data.parent),
                     "--max-steps", "1"]) == 1
    assert one_error_line(capsys.readouterr().err, "the run's metrics", "--data")
    assert cli.main(["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", "  ", "--max-steps", "1"]) == 1
    assert one_error_line(capsys.readouterr().err, "--out-dir")
    assert text_file.read_bytes() == text and not out.exists() and metrics_as_data.read_text() == synthetic_text()


# ----------------------------------------------------------------------------- symbolic links

@pytest.fixture
def victim(tmp_path):
    """A file a planted link points at; its contents must survive."""
    path = tmp_path / "precious.txt"
    path.write_text("the user's data\n")
    return path


def test_a_planted_lock_link_is_refused_in_a_fresh_process(text_file, tmp_path, victim):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.lock").symlink_to(victim)
    run = subprocess.run([*NPLLAMA, "train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(out),
                          "--max-steps", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and one_error_line(run.stderr, "train.lock", "symbolic link")
    assert victim.read_text() == "the user's data\n" and (out / "train.lock").is_symlink()
    (out / "train.lock").unlink()
    os.link(victim, out / "train.lock")                            # a hard link: truncating it would empty the victim
    assert cli.main(["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(out),
                     "--max-steps", "2"]) == 1
    assert victim.read_text() == "the user's data\n"


@pytest.mark.parametrize("name", ["ckpt.safetensors", "metrics.jsonl", "loss.png"])
def test_a_planted_link_in_the_run_folder_is_refused_before_training(name, text_file, tmp_path, victim, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    assert cli.main(["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(out),
                     "--max-steps", "2"]) == 1
    assert one_error_line(capsys.readouterr().err, name, "symbolic link")
    assert victim.read_text() == "the user's data\n"
    assert sorted(p.name for p in out.iterdir()) == [name]          # nothing else written


def test_plot_and_exports_never_write_through_a_link(text_file, tmp_path, victim, capsys):
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=2, eval_interval=2), out=io.StringIO())
    (out / "loss.png").unlink(missing_ok=True)
    (out / "loss.png").symlink_to(victim)
    if importlib.util.find_spec("matplotlib") is None:          # plot draws text only: it writes no file
        assert cli.main(["plot", str(out)]) == 0
        assert "matplotlib is not installed" in capsys.readouterr().err
    else:
        assert cli.main(["plot", str(out)]) == 1
        assert one_error_line(capsys.readouterr().err.splitlines()[-1] + "\n", "loss.png", "symbolic link")
    assert victim.read_text() == "the user's data\n"
    src = str(out / "ckpt.safetensors")
    folder = tmp_path / "victim-folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    for link, target in [(tmp_path / "link.safetensors", victim), (tmp_path / "link-hf", folder)]:
        link.symlink_to(target)
        assert cli.main(["export", "-m", src, "-o", str(link)]) == 1
        assert one_error_line(capsys.readouterr().err, str(link), "symbolic link")
        with pytest.raises(OutputPathError, match="symbolic link"):
            npllama.save(npllama.load(src), link, format="meta" if link.suffix else "hf")
    assert victim.read_text() == "the user's data\n" and [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert cli.main(["train", "--preset", "tiny", "--data", str(text_file), "--out-dir", str(tmp_path / "r2"),
                     "--max-steps", "2", "--export", str(tmp_path / "link.safetensors")]) == 1
    assert one_error_line(capsys.readouterr().err, "symbolic link") and victim.read_text() == "the user's data\n"


# ----------------------------------------------------------------------------- folders written whole

def test_a_folder_save_replaces_the_model_and_keeps_the_rest(tmp_path):
    folder = npllama.save(model(0), tmp_path / "hf", format="hf")
    (folder / "README.md").write_text("mine")
    (folder / "extra").mkdir()
    (folder / "extra" / "data.bin").write_bytes(b"\1\2")
    (folder / ".model.safetensors.abcd1234.tmp").write_bytes(b"a killed write's")
    (folder / "tokenizer.model").write_bytes(b"an old model's tokenizer")      # superseded: would mislead
    npllama.save(model(1), folder, format="hf")
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["README.md", "config.json", "extra", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    assert (folder / "README.md").read_text() == "mine" and (folder / "extra" / "data.bin").read_bytes() == b"\1\2"
    assert same_params(npllama.load(folder).params, model(1).params)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]     # no temporary folder left


def test_a_reader_never_gets_one_saves_config_with_anothers_weights(tmp_path):
    folder = npllama.save(model(0), tmp_path / "hf", format="hf")
    other = npllama.save(model(1, CFG.replace(norm_eps=1e-3)), tmp_path / "other", format="hf")
    (folder / "config.json").write_bytes((other / "config.json").read_bytes())    # a mix, as a torn write leaves
    with pytest.raises(CheckpointError, match="not written by one save"):
        npllama.load(folder)
    config = json.loads((folder / "config.json").read_text())
    del config[SAVE_ID_KEY]                                       # the user's way out, named in the message
    (folder / "config.json").write_text(json.dumps(config))
    assert npllama.load(folder).config.norm_eps == 1e-3


def test_without_an_exchange_the_old_folder_is_renamed_aside(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_renameat2", None)               # as on a system without RENAME_EXCHANGE
    folder = npllama.save(model(0), tmp_path / "hf", format="hf")
    npllama.save(model(1), folder, format="hf")
    assert same_params(npllama.load(folder).params, model(1).params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # killed between its two renames: the old folder is aside, the new one in its temporary folder
    aside = tmp_path / ".hf.killed12.old"
    folder.rename(aside)
    (tmp_path / f".hf.killed34{FOLDER_SUFFIX}").mkdir()
    (tmp_path / f".hf.killed34{FOLDER_SUFFIX}" / "config.json").write_text("{}")
    atomic.remove_stale_temp_folders(folder)                      # the next writer puts the old folder back
    assert same_params(npllama.load(folder).params, model(1).params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_live_writers_temporary_folder_is_left_alone(tmp_path):
    seen = []

    def contents(tmp):
        (tmp / "a.txt").write_text("x")
        seen.append(stale_temp_folders(tmp_path / "out"))      # while this writer holds its flock
    write_folder_atomic(tmp_path / "out", contents)
    assert seen == [[]] and (tmp_path / "out" / "a.txt").read_text() == "x"
    dead = tmp_path / f".out.deadbeef{FOLDER_SUFFIX}"
    dead.mkdir()
    (dead / "half.bin").write_bytes(b"\0")
    assert stale_temp_folders(tmp_path / "out") == [dead]


WRITER = textwrap.dedent("""
    import sys, time
    import npllama
    from npllama.tokenizers import CharTokenizer
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=16)
    models = []
    for seed in (0, 1):                   # two models whose config.json differ too: a mix shows
        m = npllama.Llama(cfg.replace(norm_eps=10.0 ** (-5 + 2 * seed)), seed=seed)
        m.tokenizer = CharTokenizer("abcdefghijk")
        models.append(m)
    fmt, path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        npllama.save(models[n % 2], path, format=fmt)
        n += 1
        print(n, flush=True)
""")

READER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import npllama
    from npllama.io import CheckpointError
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=16)
    models = [npllama.Llama(cfg.replace(norm_eps=10.0 ** (-5 + 2 * s)), seed=s) for s in (0, 1)]
    path, seconds = sys.argv[1], float(sys.argv[2])
    counts = {"0": 0, "1": 0, "retry": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            loaded = npllama.load(path)
        except CheckpointError as e:
            assert "retry" in str(e), str(e)
            counts["retry"] += 1
            continue
        which = [i for i, m in enumerate(models) if loaded.config.norm_eps == m.config.norm_eps
                 and all(np.array_equal(loaded.params[n], p) for n, p in m.params.items())]
        assert len(which) == 1, "a load that is neither model"
        counts[str(which[0])] += 1
    print(json.dumps(counts))
""")


@pytest.mark.slow
def test_concurrent_saves_and_loads_give_one_model_or_a_clear_error(tmp_path):
    folder = tmp_path / "hf"
    npllama.save(model(0), folder, format="hf")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, "hf", str(folder), "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(folder), "2"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [r.communicate(timeout=120) for r in readers]
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    saves = int(out.split()[-1])
    counts = {"0": 0, "1": 0, "retry": 0}
    for r, (stdout, stderr) in zip(readers, results):
        assert r.returncode == 0, stderr
        for k, v in json.loads(stdout).items():
            counts[k] += v
    assert saves >= 10 and counts["0"] + counts["1"] >= 10, (saves, counts)
    assert counts["retry"] <= (counts["0"] + counts["1"]) // 2, counts
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,name", [("hf", "hf"), ("meta", "m.safetensors")])
def test_kill_9_during_a_save_leaves_the_old_model_whole(fmt, name, tmp_path):
    sizes = dict(dim=128, n_layers=4, n_heads=4, vocab_size=2048, multiple_of=32)   # 1.3M params: a write takes a while
    shape = ", ".join(f"{k}={v}" for k, v in sizes.items())
    cfg = npllama.LlamaConfig(**sizes, max_seq_len=16)
    big = [npllama.Llama(cfg.replace(norm_eps=10.0 ** (-5 + 2 * s)), seed=s).params for s in (0, 1)]
    path = tmp_path / name
    rng = random.Random(0)
    for _ in range(3):
        script = WRITER.replace("dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8", shape)
        writer = subprocess.Popen([sys.executable, "-c", script, fmt, str(path), "60"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        writer.stdout.readline()                                  # one save done: there is an old model to keep
        time.sleep(rng.uniform(0.0, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
        params = npllama.load(path).params                        # the old model or the new one, whole
        assert any(all(np.array_equal(params[n], m[n]) for n in m) for m in big)
    npllama.save(npllama.Llama(cfg, seed=0), path, format=fmt)   # the next save clears what the kills left
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".") and (p.is_file() or any(p.iterdir()))]
    assert left == [] or fmt == "meta", left                      # temp files: the run's cleanup (test_faults)
