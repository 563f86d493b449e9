"""The package's layout rules, checked from the source: layers, no cycles, imports at the top.

Data flows one way: each module imports only from its own layer or the layers
below it, so the reference (ops, model) never depends on the engine, and nothing depends on
the command line. Imports sit at module top, except optional dependencies.
"""

import ast
from pathlib import Path

import npllama

PACKAGE = Path(npllama.__file__).parent

# Bottom to top. A unit is a top-level module or subpackage of npllama.
LAYERS = ["errors", "interrupts", "checks", "storage", "config", "memory", "work", "tokenizers", "ops", "kvcache",
          "model", "lora", "optim", "sampling", "gradcheck", "backend", "engine", "generate", "llama", "io", "train",
          "cli", "__main__"]
OPTIONAL = {"torch", "transformers", "matplotlib", "tokenizers", "mpi4py"}   # third-party, imported where used
# The launcher imports the command line inside main(), after it has installed the stop-signal
# handlers, so that a Ctrl-C during the imports ends in one line: the one late import by design
# (`from .cli import main` in LAUNCHER).
LAUNCHER = "__main__.py"


def modules():
    """{dotted name: parsed source} of every module in the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


def npllama_imports(name, path, tree):
    """(imported npllama module, line, at module top?) for every import in the module."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            yield t, node.lineno, id(node) in top_level


def unit(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_unit_is_in_a_layer():
    units = {unit(m) for m in modules()} - {None}
    assert units <= set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS in this test"


def test_no_module_imports_from_a_layer_above_it():
    found = modules()
    wrong = []
    for name, (path, tree) in found.items():
        if path.name == "__init__.py" and name == "npllama":
            continue                      # the package root gathers the public surface
        mine = LAYERS.index(unit(name))
        for target, line, _ in npllama_imports(name, path, tree):
            if target in found and target != "npllama" and LAYERS.index(unit(target)) > mine:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not wrong, "imports from a layer above:\n" + "\n".join(wrong)


def test_no_import_cycles():
    found = modules()
    graph = {name: {t for t, _, _ in npllama_imports(name, *found[name]) if t in found and t != name and t != "npllama"}
             for name in found}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_imports_sit_at_module_top_except_optional_dependencies():
    late = []
    for name, (path, tree) in modules().items():
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if str(path.relative_to(PACKAGE)) == LAUNCHER and isinstance(node, ast.ImportFrom) \
                    and (node.level, node.module) == (1, "cli"):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if getattr(node, "level", 0) or not all(n.split(".")[0] in OPTIONAL for n in names):
                    late.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not late, "imports inside functions (move them to the top):\n" + "\n".join(late)


READER_UNITS = ("config", "ops", "kvcache", "model", "lora", "optim", "sampling", "backend")


def test_the_reference_path_never_touches_process_wide_state_or_the_engine():
    """config, ops/, model.py, lora.py, optim.py, sampling and the reference backend: no threads,
    no BLAS control, no signal handlers, and no import of npllama.engine, direct or relative."""
    forbidden = ("threading", "concurrent", "ctypes", "signal", "multiprocessing", "npllama.engine", "os")
    checked = set()
    for name, (path, tree) in modules().items():
        if unit(name) not in READER_UNITS:
            continue
        checked.add(unit(name))
        third_party = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        third_party += [node.module or "" for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and not node.level]
        resolved = [t for t, _, _ in npllama_imports(name, path, tree)]
        bad = [n for n in third_party + resolved for f in forbidden if n == f or n.startswith(f + ".")]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
    assert checked == set(READER_UNITS)
