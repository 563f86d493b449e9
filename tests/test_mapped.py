"""Weights read or mapped, and never silently wrong: small files are read into memory, large ones (or
when asked) mapped; a mapped model notices a file changed under it and says to reload; a truncation
in the middle of a step ends the process with one line naming the file and exit code 135, never a
silent SIGBUS death; the SIGBUS handler exists only while a file is mapped.
"""

import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import npllama
from npllama import memory
from npllama.generate import SOURCE_CHECK_STEPS
from npllama.io import mapped, sigbus
from npllama.io.errors import CheckpointError, WeightsFileChangedError
from npllama.io.mapped import is_file_mapped
from npllama.lora import LoraSpec

from .conftest import data_file
from .test_checkpoint import _write_llama2c, gqa_config, random_model
from .test_faults import NPLLAMA, no_traceback

TOKENS = np.array([[1, 5, 3, 9, 0, 2, 7]])


def any_mapped(model) -> bool:
    return any(is_file_mapped(p) for p in model.params.values())


def rewrite_in_place(path, source):
    """`cp source path`: the same file (inode), new bytes: what a mapped model must not miss."""
    with open(source, "rb") as src, open(path, "r+b") as dst:
        dst.write(src.read())
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))   # a coarse clock


@pytest.fixture
def files(tmp_path):
    """Two same-shaped models (so a copy keeps the size), as Meta safetensors, and one as llama2.c."""
    a, b = random_model(gqa_config()), random_model(gqa_config(), seed=9)
    paths = {"a": npllama.save(a, tmp_path / "a.safetensors", format="meta"),
             "b": npllama.save(b, tmp_path / "b.safetensors", format="meta"),
             "bin": tmp_path / "a.bin"}
    _write_llama2c(paths["bin"], a, 1)
    return paths


# ----------------------------------------------------------------------------- read or mapped

def test_small_files_are_read_large_ones_mapped_and_either_when_asked(files, monkeypatch):
    for path in (files["a"], files["bin"]):
        assert not any_mapped(npllama.load(path))                       # small against what is free
        assert any_mapped(npllama.load(path, mmap=True))
        assert not any_mapped(npllama.load(path, mmap=False))
        size = path.stat().st_size
        monkeypatch.setattr(memory, "available_bytes", lambda: int(1.9 * size))       # now large against it
        assert any_mapped(npllama.load(path))
        monkeypatch.setattr(memory, "available_bytes", lambda: int(2.1 * size))
        assert not any_mapped(npllama.load(path))
        monkeypatch.undo()


def _mapping_of(address: int) -> tuple[str, set]:
    """(permissions, VmFlags) of the mapping of this process holding address (/proc/self/smaps)."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                start, end = (int(a, 16) for a in head[0].split("-"))
                found = head[1] if start <= address < end else None
            elif found is not None and head[0] == "VmFlags:":
                return found, set(head[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps, which only Linux has")
@pytest.mark.parametrize("name", ["a", "bin"])
def test_a_read_file_lies_in_private_memory_advised_for_huge_pages(files, name):
    """A file read into memory lies in private anonymous pages advised MADV_HUGEPAGE ("hg"), which the
    kernel may back with 2 MB pages (a decode step reads them faster: io/mapped.py ReadBuffer); not in
    shared anonymous memory, Python's default, which it would not. (A kernel built without
    transparent huge pages refuses the advice; the pages are private all the same.)"""
    model = npllama.load(files[name], mmap=False)
    buffers = {id(b): b for b in (mapped._buffer_of(p) for p in model.params.values())
               if isinstance(b, mapped.ReadBuffer)}
    assert buffers
    huge_pages = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    for buffer in buffers.values():
        permissions, flags = _mapping_of(ctypes.addressof(ctypes.c_char.from_buffer(buffer)))
        assert permissions.endswith("p") and ("hg" in flags) == huge_pages, (permissions, flags)


def test_a_kernel_without_huge_pages_still_reads_a_file(files, monkeypatch):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without transparent huge pages: the
    file is read all the same."""
    def refuse(self, *args):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(mapped.ReadBuffer, "madvise", refuse)
    model = npllama.load(files["bin"], mmap=False)
    np.testing.assert_array_equal(model.forward(TOKENS), npllama.load(files["bin"], mmap=True).forward(TOKENS))


def test_a_read_model_is_unaffected_by_its_file_changing(files):
    model = npllama.load(files["a"], mmap=False)
    expected = model.forward(TOKENS)
    rewrite_in_place(files["a"], files["b"])
    np.testing.assert_array_equal(model.forward(TOKENS), expected)
    os.truncate(files["a"], 10)
    np.testing.assert_array_equal(model.forward(TOKENS), expected)
    assert model._source_check is None


def test_a_file_cut_short_while_it_is_read_is_an_error(files):
    class ShrinkingFile:                                     # another process truncates it mid-read
        def __init__(self, f):
            self.f = f

        def fileno(self):
            return self.f.fileno()

        def seek(self, pos):
            self.f.seek(pos)

        def readinto(self, b):
            return 0 if self.f.tell() >= 4096 else self.f.readinto(b[:4096])

    with open(files["a"], "rb") as f, pytest.raises(CheckpointError, match="ended after 4,096 of its .* bytes while "
                                                                            "it was read; it was cut short"):
        mapped.file_buffer(ShrinkingFile(f), files["a"], mapped=False)


def test_reading_checks_the_memory_before_it_allocates(files, monkeypatch):
    monkeypatch.setattr(memory, "CHECK_FLOOR", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(npllama.errors.MemoryLimitError, match=r"reading .*a.safetensors needs.*mmap=True"):
        npllama.load(files["a"], mmap=False)


# ----------------------------------------------------------------------------- a mapped file that changes

@pytest.mark.parametrize("name", ["a", "bin"])
def test_a_mapped_model_refuses_to_go_on_once_its_file_was_rewritten(files, name):
    model = npllama.load(files[name], mmap=True)
    model.forward(TOKENS)
    rewrite_in_place(files[name], files["b"] if name == "a" else files["bin"])
    for use in (lambda: model.forward(TOKENS), lambda: model.loss_and_grads(TOKENS, TOKENS),
                lambda: model.generate([1, 2, 3], 5), lambda: list(model.generate_stream([1, 2], 3)),
                lambda: model.generate_batch([[1], [2, 3]], 3)):
        with pytest.raises(WeightsFileChangedError, match=f"{files[name]} changed on disk .*rewritten in place.*"
                                                          "load the model again.*atomically"):
            use()


def test_a_mapped_model_notices_a_truncation_before_it_reads(files):
    model = npllama.load(files["a"], mmap=True)
    os.truncate(files["a"], 1000)
    with pytest.raises(WeightsFileChangedError, match=r"truncated from [\d,]+ to 1,000 bytes"):
        model.forward(TOKENS)


def test_a_change_in_the_middle_of_generation_stops_it_within_a_few_steps(files):
    model = npllama.load(files["a"], mmap=True)
    stream = model.generate_stream([1, 2, 3], 12)
    next(stream)
    rewrite_in_place(files["a"], files["b"])
    with pytest.raises(WeightsFileChangedError):
        for _ in range(SOURCE_CHECK_STEPS):               # checked every SOURCE_CHECK_STEPS steps
            next(stream)


def test_replacing_a_mapped_file_atomically_is_safe(files):
    model = npllama.load(files["a"], mmap=True)
    expected = model.generate([1, 2, 3], 8)
    npllama.save(random_model(gqa_config(), seed=5), files["a"], format="meta")       # write + rename
    shutil.copy(files["b"], files["a"].with_suffix(".tmp"))
    os.replace(files["a"].with_suffix(".tmp"), files["a"])
    assert np.array_equal(model.generate([1, 2, 3], 8), expected)


def test_lora_on_a_mapped_base_and_its_merge_watch_the_base(files):
    base = npllama.load(files["a"], mmap=True)
    lora = npllama.llama.LoraLlama(base, LoraSpec(rank=2, alpha=4, targets="wq,wv"))
    merged = lora.merged()
    assert any_mapped(base) and merged._source_check is not None
    rewrite_in_place(files["a"], files["b"])
    for use in (lambda: lora.forward(TOKENS), lambda: merged.forward(TOKENS)):
        with pytest.raises(WeightsFileChangedError):
            use()


def test_training_a_mapped_model_keeps_its_arrays_and_keeps_watching(files):
    """model.params keep their identity: a mapped model trains on its copy-on-write pages (the file
    never changes), and a rewrite of the file in place is still reported at the next step."""
    model = npllama.load(files["a"], mmap=True)
    held = dict(model.params)
    opt = model.optimizer(lr=0.1)
    _, grads = model.loss_and_grads(TOKENS, TOKENS)
    opt.step(grads)
    assert any_mapped(model) and all(model.params[n] is held[n] for n in held)
    rewrite_in_place(files["a"], files["b"])
    with pytest.raises(WeightsFileChangedError):
        model.loss_and_grads(TOKENS, TOKENS)


# ----------------------------------------------------------------------------- SIGBUS

def sigbus_handler() -> int:
    """The address of the process's current SIGBUS handler (sigaction's first field)."""
    libc = ctypes.CDLL(None)
    buf = ctypes.create_string_buffer(1024)
    assert libc.sigaction(signal.SIGBUS, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value or 0


needs_sigbus = pytest.mark.skipif(sigbus._LIBC is None, reason="needs SIGBUS and libc's signal() (Linux, macOS)")


@needs_sigbus
def test_the_sigbus_handler_lives_exactly_as_long_as_a_mapping(files):
    gc.collect()                # a mapped model an earlier test left to the collector
    before = sigbus_handler()
    assert not sigbus.installed(), dict(sigbus._mapped)
    model = npllama.load(files["a"], mmap=True)
    assert sigbus.installed() and sigbus_handler() != before
    other = npllama.load(files["bin"], mmap=True)
    del model
    gc.collect()
    assert sigbus.installed()                                # the .bin is still mapped
    del other
    gc.collect()
    assert not sigbus.installed() and sigbus_handler() == before      # put back exactly (pytest's faulthandler)
    npllama.load(files["a"], mmap=False)
    assert not sigbus.installed()


TRUNCATED_MID_STEP = textwrap.dedent("""
    import os, sys, numpy as np, npllama
    path = sys.argv[1]
    model = npllama.load(path, mmap=True)
    def truncate_after_the_check():          # as if cut short just after the check, during the step
        os.truncate(path, 4096)
    model._source_check = truncate_after_the_check
    {use}
    print("not reached")
""")


@needs_sigbus
@pytest.mark.parametrize("use", ["model.forward(np.array([[1, 2, 3]]))", "model.generate([1, 2, 3], 10)",
                                 "truncate_after_the_check(); float(np.sum(model.params['output.weight']))"])
@pytest.mark.parametrize("name", ["a", "bin"])
def test_a_truncation_in_the_middle_of_a_step_ends_in_one_line_and_exit_135(files, use, name):
    run = subprocess.run([sys.executable, "-c", TRUNCATED_MID_STEP.format(use=use), str(files[name])],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == sigbus.EXIT_BUS_ERROR == 128 + signal.SIGBUS, (run.returncode, run.stderr)
    assert run.stderr.count("\n") == 1 and str(files[name]) in run.stderr and no_traceback(run.stderr)
    assert "bus error (SIGBUS) reading memory-mapped weights" in run.stderr and "not reached" not in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncate", "rewrite", "replace"])
@pytest.mark.parametrize("mmap", ["--mmap", "--no-mmap"])
def test_generate_while_its_file_is_truncated_rewritten_or_replaced(fault, mmap, tmp_path):
    """The command line: a read model never notices; a mapped one goes on after an atomic replace and
    otherwise stops with one line (the check before a step, or the SIGBUS handler within one)."""
    cfg = npllama.LlamaConfig(dim=128, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=4096)
    path = npllama.save(npllama.Llama(cfg, seed=0), tmp_path / "m.safetensors", format="meta")
    other = npllama.save(npllama.Llama(cfg, seed=1), tmp_path / "other.safetensors", format="meta")
    proc = subprocess.Popen([*NPLLAMA, "generate", "-m", str(path), "--prompt-ids", "1,2,3", "-n", "400",
                             "--temp", "0", mmap], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.read(100)                                    # generating by now
    if fault == "truncate":
        os.truncate(path, 5000)
    elif fault == "rewrite":
        rewrite_in_place(path, other)
    else:
        shutil.copy(other, tmp_path / "new")
        os.replace(tmp_path / "new", path)
    out, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if not line.startswith("[npllama generate]")]
    assert no_traceback(err), err
    if mmap == "--no-mmap" or fault == "replace":
        assert proc.returncode == 0 and not lines, err
        return
    assert proc.returncode in (1, sigbus.EXIT_BUS_ERROR) and len(lines) == 1 and str(path) in lines[0], err
    if proc.returncode == 1:
        assert "changed on disk" in lines[0] and ("truncated" if fault == "truncate" else "rewritten") in lines[0]


def test_a_generate_of_stories260k_reads_it(capsys):
    """The default: a 1 MB file is read, and generation does not depend on the file afterwards."""
    model = npllama.load(data_file("stories260K.bin"))
    assert not any_mapped(model) and model._source_check is None


@pytest.mark.parametrize("name", ["a", "bin"])
def test_a_file_that_shrinks_while_it_is_opened_is_an_error(files, name, monkeypatch):
    """Its header was read at one size, its data held at a smaller one (a writer truncating it)."""
    from npllama.io import llama2c, safetensors

    real = mapped.file_buffer

    def shrunk(f, path, as_mapped):
        buffer = real(f, path, as_mapped)
        smaller = mapped.ReadBuffer(-1, len(buffer) // 2)
        smaller[:] = buffer[:len(smaller)]
        return smaller

    monkeypatch.setattr(safetensors, "file_buffer", shrunk)
    monkeypatch.setattr(llama2c, "file_buffer", shrunk)
    with pytest.raises(CheckpointError, match="while it was opened.*being written or truncated"):
        npllama.load(files[name])
