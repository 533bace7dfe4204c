"""fusedlm.ops, fusedlm.nn and fusedlm.patch need no transformers; fusedlm.models says
that it does; every torch function the source names exists; and fusedlm's modules import
one another in one direction: no module imports, at module level or inside a function, a
module that imports it back, directly or through others.

The last is read from the import statements of every module of the installed package (an
import inside a function counts: it runs the same code, only later). Importing a submodule
runs its parent packages first, which is not counted: a package may import its own
submodules."""
import ast
import importlib.machinery
import subprocess
import sys
from pathlib import Path

import fusedlm

BLOCKED = "import sys; sys.modules['transformers'] = None; "


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED + code], capture_output=True, text=True)


def test_ops_nn_and_patch_import_without_transformers():
    done = _run("import fusedlm, fusedlm.ops, fusedlm.nn; from fusedlm import patch; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_models_without_transformers_say_what_to_install():
    done = _run("import fusedlm.models")
    assert done.returncode != 0
    assert "fusedlm.models needs transformers" in done.stderr and "fusedlm[hf]" in done.stderr


# Much of the package runs only on a GPU (the checks at first use, the benchmarks' timers),
# where a misspelt or removed torch function would first fail on a user's machine. Every
# dotted torch name the package's source spells must resolve in the torch installed here.
def test_every_torch_name_in_the_source_exists():
    import importlib
    import re
    from pathlib import Path

    import torch

    import fusedlm

    def resolves(name: str) -> bool:
        parts = name.split(".")
        obj = torch
        for i, part in enumerate(parts[1:], 1):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                return False
        return True

    root = Path(fusedlm.__file__).parent
    names = {m for path in root.rglob("*.py")
             for m in re.findall(r"\btorch(?:\.[A-Za-z_]\w*)+", path.read_text())}
    assert len(names) > 50
    assert not sorted(n for n in names if not resolves(n))


# --- import circles ---------------------------------------------------------------------------

ROOT = Path(fusedlm.__path__[0])


def _modules() -> dict:
    """{dotted name: (path of its source or None, whether it is a package)}."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    found = {}
    for path in ROOT.rglob("*"):
        if not path.name.endswith(suffixes) or "__pycache__" in path.parts:
            continue
        parts = ("fusedlm",) + path.relative_to(ROOT).parts
        stem = parts[-1].split(".")[0]
        package = stem == "__init__"
        name = ".".join(parts[:-1] if package else parts[:-1] + (stem,))
        source = path if path.suffix == ".py" else None
        if source is not None or name not in found:
            found[name] = (source, package)
    return found


def _imports(name: str, source: Path, package: bool, modules: dict) -> set:
    """The fusedlm modules ``name``'s import statements name."""
    base = name.split(".") if package else name.split(".")[:-1]
    named = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parent = ".".join(base[:len(base) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (parent, node.module or "") if p)
            subs = [f"{module}.{alias.name}" for alias in node.names]
            named.update(s for s in subs if s in modules)
            if not all(s in modules for s in subs):
                named.add(module)  # a name defined in `module` itself
    # `import a.b.c` names a.b.c; the packages it passes through run, but are not its import
    return {m for m in named if m in modules and m != name}


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    assert {"fusedlm.ops", "fusedlm.backends.dispatch", "fusedlm.verify", "fusedlm._C"} <= set(modules)
    graph = {name: _imports(name, source, package, modules) if source else set()
             for name, (source, package) in modules.items()}
    circles = [[f"{m} -> {sorted(set(graph[m]) & set(circle))}" for m in circle]
               for circle in _circles(graph)]
    assert not circles, "import circles:\n" + "\n\n".join("\n".join(c) for c in circles)


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
