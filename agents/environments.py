"""Environments on the process runtime: which interpreter runs JupyterLab and which runs the kernel.

An environment is a *prefix*: a folder with ``bin/python`` (a virtualenv, a conda prefix, a Python
installed under ``/opt``). The portal names it by its interpreter's absolute path
(``environment.python``; none: the agent's own). Two kinds:

- **published**: a prefix an operator installed on the node. Where it has JupyterLab, the server runs
  from it (and the kernel with it, Jupyter's own ``python3``); where it has none, the server runs from
  the agent's own interpreter and the kernel from the prefix, through a kernel spec the agent writes.
  Either way ``sys.prefix`` and ``sys.executable`` in the notebook are the environment's.
- **the user's own**: a virtualenv (or conda prefix) in the user's home, ``environment.home_prefix``
  (a path relative to the home). The server runs from the published environment it was made from
  (``environment.python``), the kernel from the home's prefix. Nothing in a home is ever run outside
  the sandbox: the agent only checks the folder (inside the home, no ``..``, no symlink out of it,
  a ``bin/python`` and a ``pyvenv.cfg`` or ``conda-meta``).

The kernel needs ipykernel; a user's venv need not have it: the kernel spec's launcher appends the
base's site-packages (the server's where the base has no ipykernel) to ``sys.path`` after the venv's
own, so what the user installed wins and ipykernel comes from the base (``python -m venv
--system-site-packages`` from a kernel plus ``pip install`` of what the user wants is all it takes). A
published prefix with neither JupyterLab nor ipykernel borrows the server's, so it must be the agent's
Python version.

The agent reports which published interpreters it has (``present``) in each heartbeat, so the portal
places a session only where its environment is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

UNAVAILABLE = "environment_unavailable"
KERNEL_NAME = "python3"  # the name Jupyter opens by default: ours replaces the server's own
JUPYTER_DIR = "jupyter"  # in the session's private folder: JUPYTER_PATH, holding kernels/python3
HOME_PREFIX_MAX = 200
_PROBE = (
    "import importlib.util, json, sys, sysconfig\n"
    "paths = sysconfig.get_paths()\n"
    "found = lambda name: importlib.util.find_spec(name) is not None\n"
    "print(json.dumps({'prefix': sys.prefix, 'jupyterlab': found('jupyterlab'),"
    " 'ipykernel': found('ipykernel'),"
    " 'site': list(dict.fromkeys([paths['purelib'], paths['platlib']]))}))"
)
# The kernel's launcher: the prefix's own path first, then the server environment's (for ipykernel).
_KERNEL_MAIN = (
    "import sys; sys.path.extend(p for p in {paths!r} if p not in sys.path); "
    "from ipykernel import kernelapp; kernelapp.launch_new_instance()"
)


class EnvironmentUnavailable(Exception):
    """The spec's environment is not on this node, or a home prefix is refused; the message says
    which and why (``code`` is the API's ``environment_unavailable``)."""

    code = UNAVAILABLE


@dataclass(frozen=True)
class Probe:
    """What an operator's interpreter holds, asked of it once (it is trusted: nothing of a home)."""

    python: str
    prefix: str
    jupyterlab: bool
    ipykernel: bool
    site: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """How one workload runs its environment: the server's interpreter, the kernel spec to write (None:
    the server's own kernel), and the host folders the sandbox must show read-only."""

    server_python: str
    kernel_spec: dict | None
    kept: tuple[str, ...]


_probes: dict[tuple[str, int], Probe] = {}
_probes_lock = threading.Lock()


def usable(python: str) -> bool:
    return os.path.isabs(python) and os.path.isfile(python) and os.access(python, os.X_OK)


def present(pythons: Iterable[str]) -> list[str]:
    """The interpreters of ``pythons`` this node has (absolute, executable files), sorted."""
    return sorted({p for p in pythons if isinstance(p, str) and usable(p)})


def probe(python: str) -> Probe:
    """Ask an operator's interpreter for its prefix, its site-packages and whether it has JupyterLab
    and ipykernel; cached while the file is unchanged. Raises EnvironmentUnavailable."""
    if not usable(python):
        raise EnvironmentUnavailable(f"environment.python {python} is not an executable on this node")
    key = (python, os.stat(python).st_mtime_ns)
    with _probes_lock:
        if key in _probes:
            return _probes[key]
    try:
        done = subprocess.run(  # noqa: S603 - an operator's interpreter, named by the portal
            [python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
        found = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        found = None
    if not isinstance(found, dict):
        raise EnvironmentUnavailable(f"environment.python {python} does not run here")
    result = Probe(python, found["prefix"], found["jupyterlab"], found["ipykernel"], tuple(found["site"]))
    with _probes_lock:
        _probes[key] = result
    return result


def home_prefix_error(value: object) -> str | None:
    """Why ``value`` is not a home prefix (a relative path inside the home), None when it is one.
    The spec's own check; the folder itself is checked on the node (``home_prefix_resolve``)."""
    if not isinstance(value, str) or not value or len(value) > HOME_PREFIX_MAX:
        return f"must be a relative path of 1 to {HOME_PREFIX_MAX} characters"
    path = PurePosixPath(value)
    if path.is_absolute() or value.startswith("~"):
        return "must be relative to the home"
    if any(part in ("..", ".") for part in value.split("/")) or "//" in value or "\x00" in value:
        return "must not hold '..', '.' or empty parts"
    if not value.isprintable():
        return "must be printable"
    return None


def home_prefix_resolve(home: Path, home_prefix: str) -> PurePosixPath:
    """The prefix's path relative to the home, resolved (symbolic links followed), after checking that
    it stays inside the home and is an environment. Raises EnvironmentUnavailable."""
    why = home_prefix_error(home_prefix)
    if why:
        raise EnvironmentUnavailable(f"environment.home_prefix {home_prefix!r} {why}")
    real_home = Path(os.path.realpath(home))
    resolved = Path(os.path.realpath(home / home_prefix))
    if resolved == real_home or not resolved.is_relative_to(real_home):
        raise EnvironmentUnavailable(f"~/{home_prefix} leads outside the home folder")
    if not resolved.is_dir():
        raise EnvironmentUnavailable(f"~/{home_prefix} is not in the home folder (create it first)")
    if not os.path.lexists(resolved / "bin" / "python"):
        raise EnvironmentUnavailable(f"~/{home_prefix} has no bin/python")
    if not (resolved / "pyvenv.cfg").is_file() and not (resolved / "conda-meta").is_dir():
        raise EnvironmentUnavailable(f"~/{home_prefix} is neither a virtualenv nor a conda prefix")
    return PurePosixPath(resolved.relative_to(real_home).as_posix())


def kernel_spec(
    *, python: str, display_name: str, server_site: Iterable[str], prefix: str, path: str
) -> dict:
    """A Jupyter kernel spec running ipykernel on ``python`` (as the workload sees it)."""
    main = _KERNEL_MAIN.format(paths=list(server_site))
    return {
        "argv": [python, "-c", main, "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "metadata": {"suanli_environment": display_name},
        "env": {"PATH": f"{prefix}/bin:{path}", "VIRTUAL_ENV": prefix},
    }


def kernel_spec_write(private: Path, spec: dict) -> None:
    """``<private>/jupyter/kernels/python3/kernel.json``: the first kernel Jupyter finds by that name
    (``JUPYTER_PATH`` comes before every other data folder)."""
    folder = private / JUPYTER_DIR / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True)
    file = folder / "kernel.json"
    file.write_text(json.dumps(spec, indent=1))
    for made in (file, folder, folder.parent, folder.parent.parent):  # the tenant's uid reads them
        made.chmod(0o644 if made == file else 0o755)


def _folders(python: str) -> list[str]:
    """A prefix's folders to show in the sandbox: the one ``python`` is in, and the interpreter a
    virtualenv links to (pyenv's lives under /root, which the sandbox hides)."""
    return [str(Path(python).parent.parent), str(Path(os.path.realpath(python)).parent.parent)]


def layout(
    *,
    name: str,
    python: str | None,
    home_prefix: str | None,
    home: Path,
    home_seen: str,
    path: str,
) -> Layout:
    """How to run the environment (see the module docstring); ``home`` is the home's host path,
    ``home_seen`` the same folder as the workload sees it, ``path`` the workload's PATH. Raises
    EnvironmentUnavailable."""
    agent = sys.executable
    base = probe(python) if python else None
    server = base.python if base is not None and base.jupyterlab and base.ipykernel else agent
    kept = {*_folders(agent), *(_folders(base.python) if base else [])}
    if home_prefix is not None:
        inside = f"{home_seen.rstrip('/')}/{home_prefix_resolve(home, home_prefix)}"
        kernel_python, prefix = f"{inside}/bin/python", inside
    elif base is not None and server != base.python:
        kernel_python, prefix = base.python, base.prefix
    else:
        return Layout(server, None, tuple(sorted(kept)))
    # ipykernel from the base where it has it (its own Python version), else from the server's environment
    if base is not None and base.ipykernel:
        ipykernel_site = base.site
    else:
        ipykernel_site = probe(server).site if server != agent else _own_site()
    spec = kernel_spec(
        python=kernel_python,
        display_name=name,
        server_site=ipykernel_site,
        prefix=prefix,
        path=f"{Path(server).parent}:{path}",
    )
    return Layout(server, spec, tuple(sorted(kept)))


def _own_site() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys([paths["purelib"], paths["platlib"]]))
