"""``python -m agents``: the node agent's command line. Every option also reads ``AGENT_<NAME>``.

A bad option, token file or fleet file ends the agent at once with one line on stderr and exit
code 2 (no traceback). SIGTERM / SIGINT stop the agent and leave every workload running; the next
agent on the same ``--state-dir`` adopts them.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from agents import __version__, homes
from agents.api import AgentApi
from agents.egress import EgressPolicy, EgressServer
from agents.gpuplan import VGPU_LIB_TARGET, HostGpuTools
from agents.heartbeat import Heartbeats
from agents.home_usage import HomeMeter
from agents.nvml import GpuReader, nvml_source
from agents.nvml.fleet import FleetError
from agents.runtimes import Runtime, RuntimeOptions, runtime_class, runtime_names
from agents.runtimes.base import CODE_SERVER_DIR
from agents.sandbox import parse_uid_range
from agents.server import AgentServer, make_server
from agents.workloads import Workloads

log = logging.getLogger("agents")
EXIT_USAGE = 2
MONITOR_SECONDS = 1.0
STARTING_MONITOR_SECONDS = 0.1  # while a JupyterLab is starting: report it running as soon as it answers


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"agents: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"AGENT_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m agents", description="Suanli node agent")
    p.add_argument("--listen", default=_env("LISTEN", "127.0.0.1:8701"), help="HOST:PORT for the agent API")
    p.add_argument("--token-file", default=_env("TOKEN_FILE"), help="file holding the node token")
    p.add_argument("--portal", default=_env("PORTAL"), help="portal base URL; without it, no heartbeats")
    p.add_argument("--runtime", default=_env("RUNTIME", "process"), choices=runtime_names())
    p.add_argument("--state-dir", default=_env("STATE_DIR"), help="where workload records and homes live")
    p.add_argument(
        "--homes-root",
        default=_env("HOMES_ROOT"),
        help="where users' homes live (default <state-dir>/homes, this node only); a shared mount every "
        "node of the pool has makes a home follow its user (docs/STORAGE.md)",
    )
    p.add_argument("--fleet", default=_env("FLEET"), help="fake NVML from this fleet YAML (else real pynvml)")
    p.add_argument("--heartbeat-seconds", type=float, default=float(_env("HEARTBEAT_SECONDS", "5")))
    p.add_argument(
        "--home-round-seconds",
        type=float,
        default=float(_env("HOME_ROUND_SECONDS", "60")),
        help="measure the homes (for storage quotas) at most this often (docs/STORAGE.md)",
    )
    p.add_argument("--advertise-url", default=_env("ADVERTISE_URL"), help="listen_url sent to the portal")
    p.add_argument(
        "--sandbox",
        default=_env("SANDBOX", "auto"),
        choices=["auto", "bwrap", "none"],
        help="process runtime: auto/bwrap sandbox every workload (or refuse to start); none runs tenants "
        "UNSANDBOXED, for a single-user development machine only",
    )
    p.add_argument(
        "--sandbox-uids",
        default=_env("SANDBOX_UIDS", "60000-64999"),
        help="FIRST-LAST: the uids workloads run as, one per user (the agent runs as root)",
    )
    p.add_argument(
        "--team-gids",
        default=_env("TEAM_GIDS", "70000-79999"),
        help="FIRST-LAST: the groups of the team folders, one per team, apart from --sandbox-uids "
        "(docs/STORAGE.md, 'Team folders')",
    )
    p.add_argument(
        "--sandbox-hide",
        action="append",
        default=[p for p in _env("SANDBOX_HIDE", "").split(":") if p],
        help="a host folder the sandbox never shows (repeatable; AGENT_SANDBOX_HIDE is colon-separated)",
    )
    p.add_argument(
        "--outbound",
        default=_env("OUTBOUND", "on"),
        choices=["on", "off"],
        help="sandboxed workloads reach the internet over HTTP(S) through the node's egress proxy, or not",
    )
    p.add_argument(
        "--egress-deny",
        action="append",
        default=[c for c in _env("EGRESS_DENY", "").split(",") if c],
        help="a network (CIDR) the egress proxy refuses, e.g. the site's own (repeatable)",
    )
    p.add_argument(
        "--device-dir",
        default=_env("DEVICE_DIR", "/dev"),
        help="where the GPUs' device nodes are (a folder of stand-ins with a fake fleet)",
    )
    p.add_argument("--vgpu-lib", default=_env("VGPU_LIB", "/usr/local/vgpu/libvgpu.so"), help="HAMi-core lib")
    p.add_argument("--mps-control", default=_env("MPS_CONTROL", "nvidia-cuda-mps-control"))
    p.add_argument("--docker-image", default=_env("DOCKER_IMAGE", "quay.io/jupyter/base-notebook"))
    p.add_argument(
        "--code-server",
        default=_env("CODE_SERVER", str(CODE_SERVER_DIR)),
        help="process runtime: code-server's folder, for VS Code environments (agents/editors/install.sh "
        "installs it at the default); without one this node offers JupyterLab only",
    )
    p.add_argument("--start-timeout-seconds", type=float, default=float(_env("START_TIMEOUT_SECONDS", "120")))
    p.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "info"), choices=["debug", "info", "warning", "error"]
    )
    p.add_argument("--version", action="version", version=__version__)
    return p


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"--listen must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ValueError as exc:  # a bad number in an AGENT_* variable
        fail(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    host, port = parse_listen(args.listen)
    args_check(args)
    token = node_token(args.token_file)
    reader = gpu_reader(args.fleet)

    state_dir = Path(args.state_dir).absolute()
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        fail(f"cannot create --state-dir {state_dir}: {exc.strerror}")
    try:
        policy = EgressPolicy(args.egress_deny, portal_url=args.portal)
    except ValueError as exc:
        fail(str(exc))
    runtime = workload_runtime(args, state_dir)
    workloads = Workloads(
        runtime=runtime,
        reader=reader,
        tools=host_gpu_tools(state_dir, vgpu_lib=args.vgpu_lib, mps_control=args.mps_control),
        state_dir=state_dir,
        start_timeout_seconds=args.start_timeout_seconds,
    )
    api = AgentApi(
        token=token,
        workloads=workloads,
        runtime_name=args.runtime,
        nvml_name="fake" if args.fleet else "real",
    )
    try:
        server = make_server(host, port, api)
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        fail(f"cannot listen on {host}:{port}: {reason}")
    egress_dir = runtime.options.egress_dir
    if egress_dir:
        try:
            EgressServer(egress_dir, policy).start()
        except OSError as exc:
            fail(f"cannot start the egress proxy in {egress_dir}: {exc.strerror or exc}")
    adopted = workloads.adopt()
    listen_url = args.advertise_url or f"http://{host}:{server.server_address[1]}"
    log.info(
        "agent %s listening on %s (runtime %s, nvml %s, %d GPUs, %d workloads adopted)",
        __version__,
        listen_url,
        args.runtime,
        api.nvml_name,
        len(reader.inventory()["gpus"]),
        len(adopted),
    )
    heartbeats = None
    if args.portal:
        heartbeats = Heartbeats(
            portal=args.portal,
            token=token,
            listen_url=listen_url,
            runtime_name=args.runtime,
            workloads=workloads,
            interval_seconds=args.heartbeat_seconds,
            homes=home_meter(args, runtime),
        )
    # removals of homes a kill cut short (docs/STORAGE.md, "Retention"), away from the start's path
    threading.Thread(
        target=homes.removing_sweep, args=(runtime.options.homes,), name="removing-sweep", daemon=True
    ).start()
    serve(server, workloads, heartbeats)
    return 0


def args_check(args: argparse.Namespace) -> None:
    """Refuse, saying why, the options an agent cannot start with."""
    if not args.token_file:
        fail("--token-file (or AGENT_TOKEN_FILE) is required")
    if not args.state_dir:
        fail("--state-dir (or AGENT_STATE_DIR) is required")
    if args.heartbeat_seconds <= 0:
        fail("--heartbeat-seconds must be positive")
    if args.portal and not args.portal.startswith(("http://", "https://")):
        fail(f"--portal must be an http(s) URL, got {args.portal!r}")


def node_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        fail(f"cannot read --token-file {path}: {exc.strerror}")
    if len(token) < 16:
        fail(f"the node token in {path} is shorter than 16 characters")
    return token


def gpu_reader(fleet: str | None) -> GpuReader:
    """The real NVML, or a fake one built from a fleet file; its inventory read once."""
    try:
        source = nvml_source("fake", fleet_path=fleet) if fleet else nvml_source("real")
        nvml = source.open()
    except FleetError as exc:
        fail(f"bad fleet file: {exc}")
    except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, DriverNotLoaded, …
        fail(f"NVML is not available ({exc}); on a host without GPUs pass --fleet FILE")
    reader = GpuReader(nvml)
    reader.inventory()
    return reader


def home_meter(args: argparse.Namespace, runtime: Runtime) -> HomeMeter:
    """What measures the homes for the portal's storage quotas (agents/home_usage.py)."""
    options = runtime.options
    return HomeMeter(
        options.homes, shared=options.homes_root is not None, round_seconds=args.home_round_seconds
    )


def workload_runtime(args: argparse.Namespace, state_dir: Path) -> Runtime:
    """The runtime the options name, its sandbox checked (the process runtime refuses to run
    without one unless told --sandbox none)."""
    try:
        uids = parse_uid_range(args.sandbox_uids)
        gids = parse_uid_range(args.team_gids, option="--team-gids")
    except ValueError as exc:
        fail(str(exc))
    if gids[0] <= uids[1] and uids[0] <= gids[1]:  # a tenant's own gid is its uid: never a team's
        fail(f"--team-gids {args.team_gids} overlaps --sandbox-uids {args.sandbox_uids}")
    sandboxed = args.runtime == "docker" or (args.runtime == "process" and args.sandbox != "none")
    homes_root = Path(args.homes_root).absolute() if args.homes_root else None
    if homes_root == state_dir / "homes":
        homes_root = None
    if homes_root is not None and not homes_root.is_dir():
        fail(f"--homes-root {homes_root} is not a folder (is the shared filesystem mounted?)")
    options = RuntimeOptions(
        state_dir=state_dir,
        homes_root=homes_root,
        sandbox=args.sandbox,
        sandbox_uids=uids,
        team_gids=gids,
        sandbox_hide=tuple(os.path.abspath(p) for p in args.sandbox_hide),
        device_dir=args.device_dir,
        egress_dir=str(state_dir / "egress") if sandboxed and args.outbound == "on" else None,
        default_image=args.docker_image,
        code_server=Path(args.code_server).absolute()
        if args.runtime == "process" and args.code_server
        else None,
    )
    runtime = runtime_class(args.runtime)(options)
    if args.runtime == "process":
        try:
            runtime.sandbox_in_use()
        except Exception as exc:
            fail(str(exc))
        if args.sandbox == "none":
            log.warning(
                "--sandbox none: TENANT CODE RUNS UNSANDBOXED as %s, with this host's network and files. "
                "Single-user development only; never on a host that serves other people.",
                "root" if os.geteuid() == 0 else f"uid {os.geteuid()}",
            )
    return runtime


def serve(server: AgentServer, workloads: Workloads, heartbeats: Heartbeats | None) -> None:
    """Serve the API and beat until SIGTERM or SIGINT, watching the workloads; leave them running."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="api", daemon=True).start()
    if heartbeats:
        heartbeats.start()
    while not stop.wait(STARTING_MONITOR_SECONDS if workloads.starting() else MONITOR_SECONDS):
        try:
            workloads.refresh()
        except Exception:
            log.exception("workload refresh failed")
    log.info("agent stopping; %d workloads left running", sum(w.live for w in workloads.all()))
    if heartbeats:
        heartbeats.stop()
    server.shutdown()
    server.server_close()


def host_gpu_tools(state_dir: Path, *, vgpu_lib: str, mps_control: str) -> HostGpuTools:
    """What this host offers for GPU sharing; writes the preload list naming libvgpu.so's target."""
    lib = vgpu_lib if os.path.isfile(vgpu_lib) else None
    preload = None
    if lib:
        preload_path = state_dir / "vgpu" / "ld.so.preload"
        preload_path.parent.mkdir(parents=True, exist_ok=True)
        preload_path.write_text(f"{VGPU_LIB_TARGET}\n")
        preload = str(preload_path)
    return HostGpuTools(
        vgpu_lib=lib and os.path.abspath(lib),
        vgpu_preload_file=preload,
        mps_control=shutil.which(mps_control),
        mps_root=str(state_dir / "mps"),
        vgpu_lib_configured=vgpu_lib,
        mps_control_configured=mps_control,
    )
