"""fusedlm.ops, fusedlm.nn and fusedlm.patch need no transformers; fusedlm.models says
that it does; every torch function the source names exists."""
import subprocess
import sys

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
