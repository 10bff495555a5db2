"""The real OpenID Connect provider of the single sign-on tests (``provider.mjs``, the npm package
``oidc-provider``) as a subprocess, with the accounts and client the tests sign in with. Used by the
Django-client tests (tests/portal/test_oidc.py) and by the browser journey
(tests/browser/test_sso_journey.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.stack import free_port

PROVIDER = Path(__file__).resolve().parent
INSTALLED = bool(shutil.which("node")) and (PROVIDER / "node_modules" / "oidc-provider").is_dir()
NOT_INSTALLED = "no OIDC provider here: install it with `npm ci --prefix tests/oidc` (.ci/run does)"

CLIENT_ID, CLIENT_SECRET = "suanli-portal", "a-client-secret-for-tests"
SCOPES = "openid email profile groups"
ACCOUNTS = {
    "mei": {
        "email": "mei@uni.example.edu",
        "email_verified": True,
        "preferred_username": "mei",
        "groups": ["cs101"],
    },
    "lin": {"email": "lin@elsewhere.example.com", "email_verified": True, "preferred_username": "lin"},
    "chen": {"email": "chen@uni.example.edu", "email_verified": True, "preferred_username": "chen"},
}


@contextlib.contextmanager
def oidc_provider(*, redirect_uris: list[str], port: int | None = None) -> Iterator[str]:
    """Run the provider on 127.0.0.1 (on ``port``, or a free one) for a client that may redirect to
    ``redirect_uris``; yields its issuer URL once it listens, and stops it on exit."""
    env = {
        **os.environ,
        "PORT": str(port or free_port()),
        "CLIENT_ID": CLIENT_ID,
        "CLIENT_SECRET": CLIENT_SECRET,
        "REDIRECT_URI": ",".join(redirect_uris),
        "ACCOUNTS": json.dumps(ACCOUNTS),
    }
    process = subprocess.Popen(
        ["node", str(PROVIDER / "provider.mjs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("ready "), line
        yield line.split()[1]
    finally:
        process.terminate()
        process.wait(timeout=10)
