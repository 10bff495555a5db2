"""How a workload starts JupyterLab (agents/runtimes/base.py): the same application as ``jupyter lab``,
with the one import that cost 70 % of its start refused."""

from __future__ import annotations

import subprocess
import sys

from agents.runtimes.base import JUPYTER_LAB_MAIN, JUPYTER_LAB_PRELUDE


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_prelude_keeps_rfc3987_syntax_out_and_jupyters_schemas_still_validate():
    # Installed here (jupyter_events asks for jsonschema[format-nongpl]): what the prelude is for.
    installed = _run("import importlib.util; print(importlib.util.find_spec('rfc3987_syntax') is not None)")
    assert installed == "True"
    code = (
        f"{JUPYTER_LAB_PRELUDE}\n"
        "import jsonschema, jupyter_events.validators\n"
        "print(sys.modules['rfc3987_syntax'])\n"
        "checker = jsonschema.Draft7Validator.FORMAT_CHECKER\n"
        "print(checker.conforms('10.0.0.1', 'ipv4'), checker.conforms('10.0.0', 'ipv4'))\n"
        "jupyter_events.validators.validate_schema("
        "{'$id': 'http://x/e', 'version': '1', 'title': 't', 'type': 'object', 'properties': {}})\n"
        "print('valid')"
    )
    assert _run(code).splitlines() == ["None", "True False", "valid"]


def test_the_lab_main_is_jupyter_labs_own_entry_point():
    version = _run(f"import sys; sys.argv[1:] = ['--version']; {JUPYTER_LAB_MAIN}")
    import jupyterlab

    assert version == jupyterlab.__version__
