"""Every command in README.md and docs/*.md is run as written: here (the quick ones), by .ci/run, or
by the test that a page's section names.

A command is a line of a ```bash block, a "$ " line of any other block, or inline `code` that
starts with `npllama `, `python ` or `pip ` (but not a line npllama prints, `npllama train: ...`).
The same command on several pages is one command. Each one must have an entry in COVERAGE:

    Run(...)    run here, in a sandbox folder holding what the pages' paths name (weights/,
                tools/, stories260K.bin, tok512.model, llama-folder/, and runs/shakespeare-char
                once the README's first `npllama train` has made it), with `npllama` as
                `python -m npllama` of the npllama under test. Training gets a short budget
                appended (`--max-steps`, fewer evaluation batches), the only change to what is
                written.
    CI          a line of .ci/run starts with the command (installs, the test command itself,
                benchmarks with torch, which append a short budget there).
    CoveredBy(t) the test function t, in the file named, runs the command (or its page's commands:
                docs/finetuning.md's, docs/weights.md's GGUF section).

A page command with no entry, or an entry no page has any more, fails
test_every_documented_command_is_covered; a Run that exits non-zero or prints the wrong thing
fails its own test. The ```python blocks of every page run too, in the same sandbox, except
those of the pages and sections in PYTHON_RUN_BY, whose test runs them after the commands they
read the output of.
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
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
CI_SCRIPT = REPO / ".ci" / "run"
RUN_DIR = "runs/shakespeare-char"
FIRST_TRAINING = "npllama train --time-budget 1m"      # the README's, which makes RUN_DIR
STORIES = ("stories260K.bin", "tok512.model")
SHAKESPEARE = ("tinyshakespeare.txt",)


@dataclass(frozen=True)
class Run:
    extra: tuple = ()                 # appended: a short budget for training
    needs: tuple = ()                 # data files (from NPLLAMA_DATA_DIR) the command reads
    trained: bool = False             # reads runs/shakespeare-char, which FIRST_TRAINING makes
    stdout: str | None = None         # a piece of text stdout must hold
    exact_stdout: str | None = None   # or all of it


CI = "ci"


@dataclass(frozen=True)
class CoveredBy:
    test: str                          # "tests/file.py::test_name"


SHORT = ("--max-steps", "10", "--eval-interval", "5", "--eval-batches", "4")
FINETUNE = CoveredBy("tests/test_finetune.py::test_the_docs_fine_tuning_example_runs_as_written")
GGUF = CoveredBy("tests/test_gguf.py::test_the_docs_gguf_section_runs_as_written")

COVERAGE = {
    # README.md
    "pip install -e '.[test]' && npllama generate -p \"ROMEO:\"": CI,
    "python -m pytest -q": CI,
    FIRST_TRAINING: Run(extra=SHORT, needs=SHAKESPEARE, stdout="loss curve"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"ROMEO:\"": Run(trained=True, stdout="ROMEO:"),
    "npllama train --resume --time-budget 0": Run(extra=("--max-steps", "12"), trained=True, stdout="done: "),
    "npllama generate -m stories260K.bin --tokenizer tok512.model --temp 0 -n 200":
        Run(needs=STORIES, exact_stdout=EXPECTED_TEXT + "\n"),
    "npllama generate -m llama-folder/ -p \"Once upon a time\"": Run(needs=STORIES, stdout="Once upon a time"),
    "npllama train --init stories260K.bin --init-tokenizer tok512.model --lora-rank 8 --lr 1e-2 --max-steps 600 "
    "--out-dir runs/lora --export runs/lora/hf":
        Run(extra=("--max-steps", "4", "--eval-batches", "2", "--train-fraction", "0.99"), needs=STORIES + SHAKESPEARE,
            stdout="runs/lora/hf"),
    "npllama train": Run(extra=SHORT, needs=SHAKESPEARE, stdout="loss curve"),
    "pip install torch==2.13.0 && pip install -e '.[test,torch,plot]'": CI,
    "pip install -e '.[mpi]'": CI,
    "pip install -e '.[docs]'": CI,
    # docs/distributed.md
    "mpiexec -n 2 npllama train --batch-size 32":
        CoveredBy("tests/test_distributed.py::test_the_readme_command_trains_on_two_ranks"),
    "python tools/bench_ddp.py": CI,
    # docs/faults.md
    "npllama generate ... | head -c 10":
        CoveredBy("tests/test_faults.py::test_generate_into_a_pipe_closed_early_ends_quietly"),
    "npllama train | head": CoveredBy("tests/test_faults.py::test_train_into_a_pipe_closed_early_stops_and_saves"),
    "npllama train >&-": CoveredBy("tests/test_faults.py::test_a_closed_stdout_is_no_error"),
    "npllama gradcheck": Run(stdout="rel"),
    # docs/finetuning.md
    "npllama generate -m stories260K.bin --tokenizer tok512.model -p \"ROMEO:\" -n 60 -s 1": FINETUNE,
    "npllama train --init stories260K.bin --init-tokenizer tok512.model --lora-rank 8 --lr 1e-2 "
    "--warmup-steps 30 --max-steps 600 --eval-interval 200 --out-dir runs/stories-lora": FINETUNE,
    "npllama generate -m runs/stories-lora/ckpt.safetensors -p \"ROMEO:\" -n 60 -s 1": FINETUNE,
    "npllama export -m runs/stories-lora/ckpt.safetensors -o runs/stories-lora/hf": FINETUNE,
    # docs/generation.md
    "npllama generate -p \"ROMEO:\"": Run(stdout="ROMEO:"),
    "npllama generate -p \"ROMEO:\" -n 600 --sliding-window": Run(stdout="ROMEO:"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"First Citizen:\" --temp 0.7 --top-k 40 -s 1":
        Run(trained=True, stdout="First Citizen:"),
    f"npllama generate -m {RUN_DIR}/ckpt.safetensors -p \"KING\" --stop \"\\n\\n\" --repeat-penalty 1.1":
        Run(trained=True, stdout="KING"),
    "npllama generate -m stories260K.bin --tokenizer tok512.model -p \"Once upon a time\"":
        Run(needs=STORIES, stdout="Once upon a time"),
    "npllama generate -m stories260K.bin --prompt-ids 1,403,407 -n 50 --temp 0":
        Run(needs=STORIES, stdout="1 403 407 261 378"),
    "npllama generate -m stories260K.bin --tokenizer tok512.model --dtype bfloat16 -p \"Once upon a time\"":
        Run(needs=STORIES, stdout="Once upon a time"),
    "npllama generate --help": Run(stdout="--max-new-tokens"),
    # docs/math.md
    "python tools/draw_block.py": CoveredBy("tests/test_docs_figures.py::test_the_block_picture_is_what_model_py_draws"),
    # docs/speed.md
    "python tools/bench_quality.py --budget 300 --set batch_size=32 --set seq_len=128": CI,
    "python tools/bench_train.py": CI,
    "python tools/bench_quality.py": CI,
    "python tools/bench_decode.py": CI,
    "python tools/bench_finetune.py": CI,
    "python tools/bench_integrity.py": CI,
    "python tools/bench_versions.py --other ../baseline":
        CoveredBy("tests/test_tools.py::test_bench_versions_compares_two_checkouts_interleaved"),
    # docs/training.md
    "npllama train --resume": Run(extra=("--max-steps", "14"), trained=True, stdout="done: "),
    f"npllama plot {RUN_DIR}": Run(trained=True, stdout="o validation"),
    "pip install matplotlib": CI,
    "python tools/draw_loss.py": CoveredBy("tests/test_docs_figures.py::test_the_loss_curve_is_what_its_metrics_draw"),
    "npllama train --help": Run(stdout="--max-steps"),
    "npllama generate": Run(stdout="\n"),
    # docs/weights.md
    "python tools/crosscheck.py weights/tiny-pytorch": Run(stdout="PASS"),
    "npllama export -m stories260K.bin --tokenizer tok512.model -o stories260K.gguf --type q8_0": GGUF,
    "npllama generate -m stories260K.gguf -p \"Once upon a time\" --temp 0 -n 40": GGUF,
}

# The pages and sections whose ```python blocks another test runs (after the commands they need).
PYTHON_RUN_BY = {
    "docs/finetuning.md": FINETUNE,
    "docs/weights.md#GGUF": GGUF,
}


def page_name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def sections(page: Path) -> list[tuple[str, str]]:
    """(heading, text) of each "## " section of a page; the text before the first has heading ""."""
    parts = re.split(r"^## (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


def page_commands(text: str) -> list[str]:
    """A page's commands (see the module docstring) in order of first appearance, trailing `# comments`
    removed."""
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        for line in re.sub(r"\s*\\\n\s*", " ", body).splitlines():     # a continued line is one command
            if lang == "bash":
                found.append(line)
            elif line.startswith("$ "):
                found.append(line[2:])
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]    # a span may wrap lines
    found += [c for c in spans if re.match(r"(npllama|python|pip) ", c) and not re.match(r"npllama \S+:", c)]
    commands = []
    for line in found:
        line = re.sub(r"\s+#.*$", "", line).strip()     # no documented command holds a " #"
        if line and line not in commands:
            commands.append(line)
    return commands


def documented_commands() -> dict[str, str]:
    """Every command of README.md and docs/*.md -> the first page that has it."""
    commands: dict[str, str] = {}
    for page in PAGES:
        for command in page_commands(page.read_text(encoding="utf-8")):
            commands.setdefault(command, page_name(page))
    return commands


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every ```python block that this file runs: not those of PYTHON_RUN_BY."""
    blocks = []
    for page in PAGES:
        for heading, text in sections(page):
            where = page_name(page) + (f"#{heading}" if heading else "")
            if page_name(page) in PYTHON_RUN_BY or where in PYTHON_RUN_BY:
                continue
            blocks += [(where, code) for code in re.findall(r"```python\n(.*?)```", text, re.S)]
    return blocks


def _test_exists(test: str) -> bool:
    path, name = test.split("::")
    return f"def {name}(" in (REPO / path).read_text(encoding="utf-8")


def test_every_documented_command_is_covered():
    commands = documented_commands()
    missing = [f"{page}: {c}" for c, page in commands.items() if c not in COVERAGE]
    assert not missing, f"documented commands with no test or .ci/run step (add them to COVERAGE): {missing}"
    stale = [c for c in COVERAGE if c not in commands]
    assert not stale, f"COVERAGE entries no page has any more: {stale}"
    named = {how.test for how in [*COVERAGE.values(), *PYTHON_RUN_BY.values()] if isinstance(how, CoveredBy)}
    absent_tests = sorted(t for t in named if not _test_exists(t))
    assert not absent_tests, f"COVERAGE names tests that do not exist: {absent_tests}"
    # a line of .ci/run that starts with the command (or runs it through its `bench` helper)
    ci_lines = [line.strip().removeprefix("bench ") for line in CI_SCRIPT.read_text().splitlines()]
    not_in_ci = [c for c, how in COVERAGE.items() if how == CI and not any(line.startswith(c) for line in ci_lines)]
    assert not not_in_ci, f"marked CI but no line of .ci/run runs them: {not_in_ci}"
    sections_there = {page_name(p) + (f"#{h}" if h else "") for p in PAGES for h, _ in sections(p)} | \
        {page_name(p) for p in PAGES}
    assert set(PYTHON_RUN_BY) <= sections_there, f"PYTHON_RUN_BY names no page or section: {set(PYTHON_RUN_BY) - sections_there}"


# ---- the sandbox the pages' paths are relative to -------------------------------------------------

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


def _fill(box: Path) -> Path:
    """Links to what the pages' paths name: weights/, tools/, and stories260K.bin and tok512.model
    when NPLLAMA_DATA_DIR has them."""
    for name in ("weights", "tools"):
        (box / name).symlink_to(REPO / name)
    data = os.environ.get(DATA_DIR_VAR)
    for name in STORIES:
        if data and (Path(data) / name).is_file():
            (box / name).symlink_to(Path(data) / name)
    return box


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    box = _fill(tmp_path_factory.mktemp("docs"))
    if (box / STORIES[0]).exists() and (box / STORIES[1]).exists():
        # a Hugging Face folder with its tokenizer.model: stories260K saved as transformers would
        from npllama.tokenizers import SentencePieceTokenizer
        model = npllama.load(box / STORIES[0])
        model.tokenizer = SentencePieceTokenizer.from_file(box / STORIES[1])
        npllama.save(model, box / "llama-folder", format="hf")
    return box


@pytest.fixture(scope="module")
def trained(sandbox):
    """runs/shakespeare-char, made by the README's first `npllama train` with a short budget."""
    data_file(SHAKESPEARE[0])
    if not (sandbox / RUN_DIR / "ckpt.safetensors").is_file():
        _run(sandbox, FIRST_TRAINING, COVERAGE[FIRST_TRAINING])
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
def test_documented_command_runs_as_written(command, sandbox, request, tmp_path):
    how = COVERAGE[command]
    for name in how.needs:
        data_file(name)
    if command == FIRST_TRAINING:
        request.getfixturevalue("trained")      # which runs exactly this, once, and checks it
        return
    if how.trained:
        request.getfixturevalue("trained")
    # a bare `npllama train` writes where the first one did: it runs in a folder of its own
    _run(_fill(tmp_path) if command == "npllama train" else sandbox, command, how)


@pytest.mark.slow
@pytest.mark.parametrize("where, code", python_blocks(), ids=[w for w, _ in python_blocks()])
def test_documented_python_block_runs(where, code, sandbox, request):
    for name in STORIES + ("runs/",):
        if name in code:
            if name == "runs/":
                request.getfixturevalue("trained")
            else:
                data_file(name)
    proc = subprocess.run([sys.executable, "-c", code], cwd=sandbox, env=_env(sandbox), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"the python block of {where}:\n{code}\n{proc.stderr[-3000:]}"
