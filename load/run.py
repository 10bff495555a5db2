"""``make load``: the real stack on ``.data/load`` under 50 then 200 concurrent users (locust, headless),
then every ``bench/`` script; writes the figures to docs/PERFORMANCE.md.

    .venv/bin/python -m load.run [--users 50,200] [--seconds 60] [--bench run|stored|skip]

The stack is the production shape with its default intervals (a web process per core, one Celery worker,
beat, three agents on fake fleets). In production the agents and the JupyterLabs they start are other
machines: here they run at nice 19 in a CPU control group of weight 64 (each of the portal's processes
weighs 1024), so that they use what CPU the portal leaves and what is measured is the portal's. Four
users hold a running session each for the proxy requests. The load is then: the dashboard (browser
cookie), launch + stop of a 1/8 A100 through the API (token), and a small Jupyter API GET through the
proxy. Benchmarks run after the stack is down, one at a time, each with the arguments below; their
output is kept under ``.data/bench-results/`` so that ``--bench stored`` (or a bench that fails this
time) reports the last figures it printed, with their date.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import httpx

from chaos.stack import A100, ENVIRONMENT, FLEETS, ROOT, Stack, Timings, wait_for
from load import cpu

BENCH_ARGS = {"proxy.py": ["--requests", "2000"]}  # the others at their full sizes
BENCH_TIMEOUT_SECONDS = 900
RESULTS = ROOT / ".data" / "bench-results"
ENDPOINTS = [
    "GET /dashboard/",
    "POST /api/v1/sessions",
    "POST /api/v1/sessions/<id>/stop",
    "GET /jupyter/<id>/api/status",
]


def _say(line: str) -> None:
    print(f"load {time.strftime('%H:%M:%S', time.gmtime())}: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--users", default="50,200", help="users of each phase, one after the other on the same stack"
    )
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--bench", choices=["run", "stored", "skip"], default="run")
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for every process"
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("locust") is None:
        sys.stderr.write("load: locust is not installed: .venv/bin/pip install 'locust>=2.47,<3'\n")
        return 2

    load_average = os.getloadavg()[0]
    # The stack points this process at its own database (DATABASE_URL, …); each benchmark gets the
    # environment as it was, and so its own data directory.
    bench_env = dict(os.environ)
    stack = Stack(
        data_dir=ROOT / ".data" / "load",
        timings=Timings(
            metering_tick_seconds=5.0,
            posting_interval_seconds=300,
            node_liveness_seconds=30,
            liveness_sweep_seconds=5.0,
            queue_dispatch_seconds=10.0,
            heartbeat_seconds=5,
            agent_http_timeout_seconds=10.0,
        ),
        # the agents and the JupyterLabs they start run on GPU hosts in production: here they share the
        # portal's cores, at the lowest priority, so that what is measured is the portal's (their CPU
        # is still reported)
        agent_nice=19,
        agent_cpu_shares=64,
        # every simulated user launches and stops all the time: quotas are not what is measured here
        extra_env={
            "QUOTA_DEFAULT_MAX_SESSIONS": "100000",
            "QUOTA_DEFAULT_MAX_EIGHTHS": "1000000",
            "WEB_CONCURRENCY": str(os.cpu_count() or 1),  # as `make run` starts it
            **dict(pair.split("=", 1) for pair in args.env),
        },
    )
    try:
        _say(f"starting the stack under {stack.data_dir}")
        stack.prepare()
        from django.conf import settings

        from chaos.stack import seed_catalog, seed_users

        seed_catalog()
        phases = [int(n) for n in args.users.split(",")]
        _say(f"seeding {max(phases)} users")
        users = seed_users(max(phases), prefix="load", wallet_micros=1_000_000_000)
        stack.start_web()
        stack.start_worker(0)
        stack.start_beat()
        for node in ("node-a", "node-b", "ci-small"):
            stack.enrol_agent(node, FLEETS / f"{node}.yaml")
        targets = _proxy_targets(stack, users[:4], cookie_name=settings.SESSION_COOKIE_NAME)
        _settle()
        plan = {
            "users": [{"token": u.token, "cookie": u.cookie} for u in users],
            "cookie_name": settings.SESSION_COOKIE_NAME,
            "proxy_targets": targets,
            "gpu_model": A100,
            "profile": "1/8",
            "environment": ENVIRONMENT,
        }
        plan_file = stack.data_dir / "plan.json"
        plan_file.write_text(json.dumps(plan))
        stats = {}
        for count in phases:
            _say(f"{count} users for {args.seconds} s against {stack.url}")
            stats[count] = _locust(stack, plan_file, users=count, seconds=args.seconds)
    finally:
        _say("stopping the stack")
        stack.shutdown()
    benches = _benches(args.bench, env=bench_env)
    _write(
        args.report,
        stats=stats,
        seconds=args.seconds,
        load_average=load_average,
        benches=benches,
        extra_env=args.env,
        hosts=(
            f"in a CPU control group of weight {stack.agent_cpu_shares} (each of the portal's processes "
            f"weighs 1024) and at nice {stack.agent_nice}"
            if stack.agents_grouped
            else f"at nice {stack.agent_nice} (this machine let no CPU control group be made)"
        ),
    )
    errors = sum(phase[name]["errors"] for phase in stats.values() for name in ENDPOINTS if name in phase)
    _say(f"report in {args.report}; {errors} errors")
    return 1 if errors else 0


def _settle() -> None:
    """The database as a running portal's is: statistics of the rows just seeded, and their dead rows
    gone, so that the first phase measures the portal, not autovacuum catching up on the seeding."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def _proxy_targets(stack: Stack, owners, *, cookie_name: str) -> list[dict]:
    """One running session per owner (a 1/8 A100 each), for the proxy requests."""
    targets = []
    for owner in owners:
        answer = httpx.post(
            f"{stack.url}/api/v1/sessions",
            headers={"Authorization": f"Bearer {owner.token}"},
            json={"gpu_model": A100, "profile": "1/8", "environment": ENVIRONMENT},
            timeout=30,
        )
        answer.raise_for_status()
        targets.append({"session_id": answer.json()["id"], "cookie": owner.cookie})
    for target in targets:
        wait_for(
            lambda t=target: (
                httpx.get(
                    f"{stack.url}/jupyter/{t['session_id']}/api/status",
                    cookies={cookie_name: t["cookie"]},
                    timeout=5,
                ).status_code
                == 200
            ),
            timeout=240,
            interval=1,
            what=f"session {target['session_id']} to answer through the proxy",
        )
    return targets


def _locust(stack: Stack, plan_file: Path, *, users: int, seconds: int) -> dict[str, dict]:
    prefix = stack.data_dir / "locust"
    command = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "load" / "locustfile.py"), "--headless",
        "--users", str(users), "--spawn-rate", "10", "--run-time", f"{seconds}s", "--host", stack.url,
        "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "10",
    ]  # fmt: skip
    env = {**os.environ, "LOAD_PLAN": str(plan_file)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    processes_before = cpu.snapshot(os.getpid(), stack.data_dir)
    started = time.monotonic()
    with (stack.log_dir / f"locust-{users}.log").open("wb") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    elapsed = time.monotonic() - started
    parts = cpu.by_part(processes_before, cpu.snapshot(os.getpid(), stack.data_dir), elapsed)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    generator = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stats: dict = {"_generator_cpu": generator / elapsed, "_parts": parts}  # cores the generator used
    with open(f"{prefix}_stats.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Name"] in ENDPOINTS:
                key = row["Name"] if row["Type"] != "server" else f"server {row['Name']}"
                stats[key] = {
                    "requests": int(row["Request Count"]),
                    "errors": int(row["Failure Count"]),
                    "rps": float(row["Requests/s"]),
                    "p50": float(row["50%"]),
                    "p95": float(row["95%"]),
                    "p99": float(row["99%"]),
                }
    stats["_connections"] = _connections(stack)
    failures = Path(f"{prefix}_failures.csv")
    stats["_failures"] = failures.read_text() if failures.exists() else ""
    return stats


def _connections(stack: Stack) -> str:
    """PostgreSQL connections by process right after the load (web, worker-0, …), and the ceiling."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "GROUP BY 1 ORDER BY 2 DESC"
        )
        rows = cursor.fetchall()
        cursor.execute("SHOW max_connections")
        ceiling = cursor.fetchone()[0]
    return ", ".join(f"{name or '?'} {n}" for name, n in rows) + f" (max_connections {ceiling})"


def _cpu_busy(seconds: float) -> float:
    """The share of the CPUs' time spent busy over the next ``seconds`` (from /proc/stat)."""

    def read() -> tuple[int, int]:
        fields = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return sum(fields) - idle, sum(fields)

    busy_before, total_before = read()
    time.sleep(seconds)
    busy_after, total_after = read()
    return (busy_after - busy_before) / max(1, total_after - total_before)


def _settle_cpu(*, quiet: float = 0.2, longest: float = 120) -> float:
    """Wait (at most ``longest`` seconds) until the CPUs are ``quiet``: what the run before leaves
    behind (PostgreSQL's autovacuum and checkpoints after the load) would otherwise fall on the next
    benchmark. Returns the share busy at the end."""
    deadline = time.monotonic() + longest
    busy = _cpu_busy(2)
    while busy > quiet and time.monotonic() < deadline:
        busy = _cpu_busy(2)
    return busy


def _benches(mode: str, *, env: dict[str, str]) -> list[dict]:
    """Run (or read the stored output of) every bench/*.py, one at a time."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    found = []
    for script in sorted((ROOT / "bench").glob("*.py")):
        stored = RESULTS / f"{script.stem}.json"
        arguments = BENCH_ARGS.get(script.name, [])
        if mode == "run":
            busy = _settle_cpu()
            _say(f"bench {script.name} {' '.join(arguments)} (the CPUs {busy:.0%} busy)")
            started = time.monotonic()
            try:
                done = subprocess.run(
                    [sys.executable, str(script), *arguments], cwd=ROOT, env=env, capture_output=True,
                    text=True, timeout=BENCH_TIMEOUT_SECONDS, check=False,
                )  # fmt: skip
                output, code = done.stdout + (done.stderr[-2000:] if done.returncode else ""), done.returncode
            except subprocess.TimeoutExpired:
                output, code = f"timed out after {BENCH_TIMEOUT_SECONDS} s", -1
            run = {
                "script": script.name,
                "command": " ".join([".venv/bin/python", f"bench/{script.name}", *arguments]),
                "as_of": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "seconds": round(time.monotonic() - started),
                "busy": round(busy, 2),
                "exit": code,
                "output": output.strip(),
            }
            if code == 0 or not stored.exists():
                stored.write_text(json.dumps(run))
            else:
                run = {**json.loads(stored.read_text()), "note": f"this run failed ({output.strip()[-300:]})"}
            found.append(run)
        elif mode == "stored" and stored.exists():
            found.append(json.loads(stored.read_text()))
        elif mode == "stored":
            found.append({"script": script.name, "as_of": "never run", "output": "", "exit": None})
    return found


def _write(path: Path, *, stats, seconds, load_average, benches, extra_env, hosts: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    phases = " then ".join(str(n) for n in stats)
    lines = [
        "# Performance",
        "",
        f"As of {now}: `make load` ({phases} concurrent users, {seconds} s each, locust {version('locust')}) "
        f"on this machine ({os.cpu_count()} cores, load average {load_average:.1f} when it started: other "
        "work shares the CPUs, so treat the figures as a floor). The benchmarks below each carry their own "
        "date.",
        "",
        "## Load: the dashboard, the launch API and the Jupyter proxy",
        "",
        f"The real stack as production runs it (`DEBUG=0`, {os.cpu_count()} uvicorn web processes, one "
        f"Celery worker, beat, three agents on fake fleets, {hosts} with the JupyterLabs they start, so that "
        "they use what CPU the portal leaves, as GPU hosts are other machines in production; default "
        "intervals) on the "
        "embedded PostgreSQL and Redis. Each "
        "simulated user waits 0.5–1.5 s between requests and picks: the dashboard (weight 3), a Jupyter "
        "`api/status` GET through the proxy to one of four running sessions (weight 3), or a launch of a 1/8 "
        "A100 through the API followed at once by its stop (weight 1). The load generator runs on the same "
        "cores; its own CPU is given for each phase. *Server* is the portal's own time for the answer (its "
        "`Server-Timing` header): the rest of the client's time is queueing for a core and the network."
        + (f" Extra environment: `{' '.join(extra_env)}`." if extra_env else ""),
    ]
    for users, phase in stats.items():
        lines += [
            "",
            f"### {users} users",
            "",
            "| endpoint | requests | throughput (req/s) | p50 (ms) | p95 (ms) | p99 (ms) | server p50 (ms) "
            "| server p95 (ms) | errors |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name in ENDPOINTS:
            row, server = phase.get(name), phase.get(f"server {name}")
            served = f"{server['p50']:.0f} | {server['p95']:.0f}" if server else "– | –"
            if row:
                lines.append(
                    f"| `{name}` | {row['requests']} | {row['rps']:.1f} | {row['p50']:.0f} "
                    f"| {row['p95']:.0f} | {row['p99']:.0f} | {served} | {row['errors']} |"
                )
            else:
                lines.append(f"| `{name}` | 0 | – | – | – | – | – | – | – |")
        lines += [
            "",
            f"The load generator used {phase['_generator_cpu']:.2f} of the {os.cpu_count()} cores. "
            f"PostgreSQL connections right after the load, by process: {phase.get('_connections', '?')}.",
        ]
        if phase.get("_parts"):
            lines += ["", "Cores used by each part of the stack during the phase (from /proc):", ""]
            lines += ["| part | cores |", "| --- | ---: |"]
            lines += [f"| {part} | {cores:.2f} |" for part, cores in phase["_parts"].items()]
        if phase.get("_failures", "").count("\n") > 1:
            lines += ["", "Failures (locust):", "", "```text", phase["_failures"].strip(), "```"]
    heading = "## Benchmarks (`bench/`)"
    kept = path.read_text().partition(heading)[2].strip() if path.exists() else ""
    lines += ["", heading, ""]
    if not benches and kept:
        lines += [
            "Not run this time (`--bench skip`): the figures below are the previous report's.",
            "",
            kept,
        ]
    elif not benches:
        lines.append("Not run this time (`--bench skip`).")
    for bench in benches:
        lines += [
            f"### bench/{bench['script']}",
            "",
            f"As of {bench['as_of']}: `{bench.get('command', '')}`"
            + (f", {bench['seconds']} s" if bench.get("seconds") is not None else "")
            + (f", started with the CPUs {bench['busy']:.0%} busy" if bench.get("busy") is not None else "")
            + (f", exit {bench['exit']}" if bench.get("exit") else "")
            + (f" — {bench['note']}" if bench.get("note") else "")
            + ".",
            "",
            "```text",
            bench["output"] or "(no output)",
            "```",
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
