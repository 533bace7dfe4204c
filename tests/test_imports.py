"""fusedlm.ops, fusedlm.nn and fusedlm.patch need no transformers; fusedlm.models says
that it does."""
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
