"""The agent is a plain package: it never imports Django or the portal's apps."""

from __future__ import annotations

import subprocess
import sys

from tests.agents.conftest import REPO


def test_agent_imports_no_django_nor_portal_apps():
    code = (
        "import sys, agents.cli, agents.api, agents.heartbeat, agents.workloads, agents.runtimes, agents.nvml; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'portal', 'billing', 'provisioner', "
        "'rest_framework', 'celery')); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
