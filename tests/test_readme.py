"""Every command in README.md is run as written: here (the quick ones) or by .ci/run.

A command is a line of a ```bash block, a "$ " line of any other block, or inline `code` that
starts with `npllama `, `python ` or `pip `. Each one must have an entry in COVERAGE:

    Run(...)    run here, in a sandbox folder holding what the README's paths name (weights/,
                tools/, stories260K.bin, tok512.model, llama-folder/, and runs/shakespeare-char
                once the README's `npllama train` has made it), with `npllama` as
                `python -m npllama` of the npllama under test. Training gets a short budget
                appended (`--max-steps`, fewer evaluation batches), the only change to what is
                written.
    CI          a line of .ci/run starts with the command (installs, the test command itself,
                benchmarks with torch, which append a short budget there).
    CoveredBy(t) a command (or its pattern) that the test function t runs, in the file named.
    FINETUNE    a command of the "Fine-tuning" section's bash blocks, which
                tests/test_finetune.py::test_the_readme_fine_tuning_example_runs_as_written runs.

A README command with no entry, or an entry the README no longer has, fails
test_every_readme_command_is_covered; a Run that exits non-zero or prints the wrong thing fails
its own test. The ```python blocks are run too, in the same sandbox.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import npllama

from .conftest import DATA_DIR_VAR, data_file
from .test_stories260k import EXPECTED_TEXT

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI_SCRIPT = REPO / ".ci" / "run"
RUN_DIR = "runs/shakespeare-char"
STORIES = ("stories260K.bin", "tok512.model")
SHAKESPEARE = ("tinyshakespeare.txt",)


@dataclass(frozen=True)
class Run:
    extra: tuple = ()                 # appended: a short budget for training
    needs: tuple = ()                 # data files (from NPLLAMA_DATA_DIR) the command reads
    trained: bool = False             # reads runs/shakespeare-char, which the README's `npllama train` makes
    stdout: str | None = None         # a piece of text stdout must hold
    exact_stdout: str | None = None   # or all of it


CI = "ci"
FINETUNE = "finetune"


@dataclass(frozen=True)
class CoveredBy:
    test: str                          # "tests/file.py::test_name"
SHORT = ("--max-steps", "10", "--eval-interval", "5", "--eval-batches", "4")

COVERAGE = {
    # Set up and run
    "pip install -e '.[test]' && npllama generate -p \"ROMEO:\"": CI,
    "python -m pytest -q": CI,
    "npllama generate -m stories260K.bin --tokenizer tok512.model --temp 0 -n 200":
        Run(needs=STORIES, exact_stdout=EXPECTED_TEXT + "\n"),
    "pip install .": CI,
    "npllama gradcheck": Run(stdout="rel"),
    "npllama train": Run(extra=SHORT, needs=SHAKESPEARE, stdout="loss curve"),
    f"npllama train --resume --out-dir {RUN_DIR}": Run(extra=("--max-steps", "12"), trained=True, stdout="done: "),
    f"npllama plot {RUN_DIR}": Run(trained=True, stdout="o validation"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"ROMEO:\"": Run(trained=True, stdout="ROMEO:"),
    "python tools/crosscheck.py weights/tiny-pytorch": Run(stdout="PASS"),
    "python tools/bench_train.py": CI,
    "python tools/bench_decode.py": CI,
    "python tools/bench_quality.py": CI,
    "pip install torch==2.13.0 && pip install -e '.[test,torch,plot]'": CI,
    # Training
    "pip install matplotlib": CI,
    "npllama train --resume": Run(extra=("--max-steps", "14"), trained=True, stdout="done: "),
    "npllama train --help": Run(stdout="--max-steps"),
    "python tools/bench_quality.py --budget 300 --set batch_size=32 --set seq_len=128": CI,
    "pip install -e '.[mpi]'": CI,
    "mpiexec -n 2 npllama train --batch-size 32":
        CoveredBy("tests/test_distributed.py::test_the_readme_command_trains_on_two_ranks"),
    # Generation
    "npllama generate -p \"ROMEO:\"": Run(stdout="ROMEO:"),
    "npllama generate -p \"ROMEO:\" -n 600 --sliding-window": Run(stdout="ROMEO:"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"First Citizen:\" --temp 0.7 --top-k 40 -s 1":
        Run(trained=True, stdout="First Citizen:"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"KING\" --stop \"\\n\\n\" --repeat-penalty 1.1":
        Run(trained=True, stdout="KING"),
    "npllama generate -m llama-folder/ -p \"Once upon a time\"": Run(needs=STORIES, stdout="Once upon a time"),
    "npllama generate -m stories260K.bin --tokenizer tok512.model -p \"Once upon a time\"":
        Run(needs=STORIES, stdout="Once upon a time"),
    "npllama generate -m stories260K.bin --prompt-ids 1,403,407 -n 50 --temp 0":
        Run(needs=STORIES, stdout="1 403 407 261 378"),
    "npllama generate -m stories260K.bin --tokenizer tok512.model --dtype bfloat16 -p \"Once upon a time\"":
        Run(needs=STORIES, stdout="Once upon a time"),
    "npllama generate --help": Run(stdout="--max-new-tokens"),
    # Weights in and out
    "npllama export -m stories260K.bin --tokenizer tok512.model -o stories260K.gguf --type q8_0": Run(needs=STORIES),
    "npllama generate -m stories260K.gguf -p \"Once upon a time\"": Run(needs=STORIES, stdout="Once upon a time"),
    # Fine-tuning
    "npllama generate -m stories260K.bin --tokenizer tok512.model -p \"ROMEO:\" -n 60 -s 1": FINETUNE,
    "npllama train --init stories260K.bin --init-tokenizer tok512.model --lora-rank 8 --lr 1e-2 "
    "--warmup-steps 30 --max-steps 600 --eval-interval 200 --out-dir runs/stories-lora": FINETUNE,
    "npllama generate -m runs/stories-lora/ckpt.safetensors -p \"ROMEO:\" -n 60 -s 1": FINETUNE,
    "npllama export -m runs/stories-lora/ckpt.safetensors -o runs/stories-lora/hf": FINETUNE,
    "python tools/bench_finetune.py": CI,
    # Faults and guarantees
    "npllama generate ... | head -c 10":
        CoveredBy("tests/test_faults.py::test_generate_into_a_pipe_closed_early_ends_quietly"),
    "npllama train | head": CoveredBy("tests/test_faults.py::test_train_into_a_pipe_closed_early_stops_and_saves"),
    "npllama train >&-": CoveredBy("tests/test_faults.py::test_a_closed_stdout_is_no_error"),
    "python tools/bench_integrity.py": CI,
}


def readme_commands() -> list[str]:
    """The README's commands in order of first appearance, trailing `# comments` removed."""
    text = README.read_text(encoding="utf-8")
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        for line in re.sub(r"\s*\\\n\s*", " ", body).splitlines():     # a continued line is one command
            if lang == "bash":
                found.append(line)
            elif line.startswith("$ "):
                found.append(line[2:])
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [c for c in re.findall(r"`([^`\n]+)`", prose) if re.match(r"(npllama|python|pip) ", c)]
    commands = []
    for line in found:
        line = re.sub(r"\s+#.*$", "", line).strip()     # no README command holds a " #"
        if line and line not in commands:
            commands.append(line)
    return commands


def readme_python_blocks() -> list[str]:
    """The ```python blocks, except the Fine-tuning section's: they read what its commands make, and
    tests/test_finetune.py runs them after those commands."""
    text = README.read_text(encoding="utf-8")
    head, rest = text.split("\n## Fine-tuning\n")
    outside = head + rest[rest.index("\n## "):]
    return re.findall(r"```python\n(.*?)```", outside, re.S)


def test_every_readme_command_is_covered():
    commands = readme_commands()
    missing = [c for c in commands if c not in COVERAGE]
    assert not missing, f"README commands with no test or .ci/run step (add them to COVERAGE): {missing}"
    stale = [c for c in COVERAGE if c not in commands]
    assert not stale, f"COVERAGE entries the README no longer has: {stale}"
    finetune = README.read_text(encoding="utf-8").split("\n## Fine-tuning\n")[1].split("\n## ")[0]
    finetune = re.sub(r"\s*\\\n\s*", " ", finetune)
    not_there = [c for c, how in COVERAGE.items() if how == FINETUNE and c not in finetune]
    assert not not_there, f"marked FINETUNE but not in the Fine-tuning section: {not_there}"
    absent_tests = [how.test for how in COVERAGE.values() if isinstance(how, CoveredBy)
                    and f"def {how.test.split('::')[1]}(" not in (REPO / how.test.split("::")[0]).read_text()]
    assert not absent_tests, f"COVERAGE names tests that do not exist: {absent_tests}"
    # a line of .ci/run that starts with the command (or runs it through its `bench` helper)
    ci_lines = [line.strip().removeprefix("bench ") for line in CI_SCRIPT.read_text().splitlines()]
    not_in_ci = [c for c, how in COVERAGE.items() if how == CI and not any(line.startswith(c) for line in ci_lines)]
    assert not not_in_ci, f"marked CI but no line of .ci/run runs them: {not_in_ci}"


# ---- the sandbox the README's paths are relative to ------------------------------------------------

def _env(sandbox: Path) -> dict:
    env = dict(os.environ)
    # the npllama under test first, wherever it is installed from
    env["PYTHONPATH"] = os.pathsep.join([str(Path(npllama.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env["NPLLAMA_CACHE"] = str(sandbox / "cache")      # never the user's cache, never a download
    env.setdefault("COLUMNS", "80")
    return env


def _argv(command: str, extra=()) -> list[str]:
    argv = shlex.split(command) + list(extra)
    if argv[0] == "npllama":
        return [sys.executable, "-m", "npllama", *argv[1:]]
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    box = tmp_path_factory.mktemp("readme")
    for name in ("weights", "tools"):
        (box / name).symlink_to(REPO / name)
    data = os.environ.get(DATA_DIR_VAR)
    for name in STORIES:
        if data and (Path(data) / name).is_file():
            (box / name).symlink_to(Path(data) / name)
    if (box / STORIES[0]).exists() and (box / STORIES[1]).exists():
        # a Hugging Face folder with its tokenizer.model: stories260K saved as transformers would
        from npllama.tokenizers import SentencePieceTokenizer
        model = npllama.load(box / STORIES[0])
        model.tokenizer = SentencePieceTokenizer.from_file(box / STORIES[1])
        npllama.save(model, box / "llama-folder", format="hf")
        npllama.save(model, box / "stories260K.gguf", format="gguf")     # what the README's export writes
    return box


@pytest.fixture(scope="module")
def trained(sandbox):
    """runs/shakespeare-char, made by the README's `npllama train` with a short budget."""
    data_file(SHAKESPEARE[0])
    if not (sandbox / RUN_DIR / "ckpt.safetensors").is_file():
        _run(sandbox, "npllama train", COVERAGE["npllama train"])
    return sandbox / RUN_DIR


def _run(sandbox: Path, command: str, how: Run) -> subprocess.CompletedProcess:
    proc = subprocess.run(_argv(command, how.extra), cwd=sandbox, env=_env(sandbox), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    if how.exact_stdout is not None:
        assert proc.stdout == how.exact_stdout, f"`{command}` printed:\n{proc.stdout}"
    if how.stdout is not None:
        assert how.stdout in proc.stdout, f"`{command}` printed no {how.stdout!r}:\n{proc.stdout[-2000:]}"
    return proc


RUNS = [c for c, how in COVERAGE.items() if isinstance(how, Run)]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNS)
def test_readme_command_runs_as_written(command, sandbox, request):
    how = COVERAGE[command]
    for name in how.needs:
        data_file(name)
    if command == "npllama train":
        request.getfixturevalue("trained")      # which runs exactly this, once, and checks it
        return
    if how.trained:
        request.getfixturevalue("trained")
    _run(sandbox, command, how)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs(index, sandbox, request):
    code = readme_python_blocks()[index]
    for name in STORIES + ("runs/",):
        if name in code:
            if name == "runs/":
                request.getfixturevalue("trained")
            else:
                data_file(name)
    proc = subprocess.run([sys.executable, "-c", code], cwd=sandbox, env=_env(sandbox), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README python block {index}:\n{code}\n{proc.stderr[-3000:]}"
