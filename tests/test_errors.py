"""One error family: every error npllama raises on purpose is an NpllamaError (a ValueError).

The contract asks for the ValueError / KeyError / FileNotFoundError families; npllama's own
subclasses (npllama.errors, io/errors.py, ...) are those and NpllamaError at once, so a caller's
`except npllama.NpllamaError` catches every deliberate error and `except ValueError` too.
This test reads the package's source and fails on a `raise` of a bare built-in exception.
"""

import ast
import inspect
from pathlib import Path

import pytest

import npllama
from npllama.errors import MemoryLimitError, MissingFileError, NpllamaError

PACKAGE = Path(npllama.__file__).parent
# Built-in exceptions npllama must not raise bare: each has an NpllamaError subclass to use instead.
BARE = {"ValueError", "FileNotFoundError", "KeyError", "TypeError", "RuntimeError", "OSError", "IOError",
        "IndexError", "Exception", "MemoryError", "LookupError", "NotImplementedError", "FileExistsError",
        "IsADirectoryError", "NotADirectoryError", "PermissionError"}
# gradcheck.check_gradients reports a failed comparison as a test failure would (its whole purpose).
ALLOWED = {("gradcheck.py", "AssertionError")}


def raised_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                yield target.id, node.lineno


def test_no_module_raises_a_bare_builtin_exception():
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, line in raised_names(ast.parse(path.read_text(), filename=str(path))):
            if name in BARE and (path.name, name) not in ALLOWED:
                bare.append(f"{path.relative_to(PACKAGE)}:{line} raises {name}")
    assert not bare, "raise an NpllamaError subclass instead:\n" + "\n".join(bare)


def test_every_exception_class_npllama_defines_is_an_npllama_error():
    import importlib
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name
                    and not issubclass(obj, NpllamaError)):
                strays.append(f"{name}.{obj.__name__}")
    assert not strays, f"exception classes outside the family: {strays}"


def test_the_family_keeps_the_contract_s_builtin_bases():
    assert issubclass(NpllamaError, ValueError)
    assert issubclass(MissingFileError, FileNotFoundError) and issubclass(MissingFileError, NpllamaError)
    assert issubclass(MemoryLimitError, MemoryError) and issubclass(MemoryLimitError, NpllamaError)


def test_a_missing_file_is_both_a_file_not_found_error_and_an_npllama_error(tmp_path):
    with pytest.raises(MissingFileError) as caught:
        npllama.load(tmp_path / "nothing-here.safetensors")
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)
    assert "nothing-here.safetensors" in str(caught.value)
