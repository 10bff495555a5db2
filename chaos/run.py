"""``make chaos``: the real product under a steady mix of users while faults are injected on a schedule,
then checks from the database that no money and no session was lost and nothing was billed twice.

    .venv/bin/python -m chaos.run            # the full run (~10 minutes), writes docs/RELIABILITY.md
    .venv/bin/python -m chaos.run --short    # the CI variant (~3-4 minutes), report under .data/chaos-ci/

Exits 1 when any check fails (or a fault could not be injected), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from chaos.stack import FLEETS, ROOT, Stack, Timings, wait_for

NODES = [
    ("node-a", "node-a.yaml", False),
    ("node-b", "node-b.yaml", True),
    ("ci-small", "ci-small.yaml", False),
]


def _say(line: str) -> None:
    print(f"chaos {time.strftime('%H:%M:%S', time.gmtime())}: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="the CI variant: fewer faults, ~3-4 minutes")
    parser.add_argument("--users", type=int, default=None, help="simulated users (default 6, short 4)")
    parser.add_argument("--report", type=Path, default=None, help="where the Markdown report goes")
    args = parser.parse_args(argv)

    variant = "short" if args.short else "full"
    data_dir = ROOT / ".data" / ("chaos-ci" if args.short else "chaos")
    report = args.report or (
        data_dir.parent / "chaos-ci-RELIABILITY.md" if args.short else ROOT / "docs" / "RELIABILITY.md"
    )
    users_count = args.users or (4 if args.short else 6)
    timings = Timings()
    stack = Stack(data_dir=data_dir, timings=timings)
    started = time.monotonic()
    try:
        _say(f"{variant} run; starting PostgreSQL and Redis under {data_dir}")
        stack.prepare()
        # Django is set up from here on.
        from django.conf import settings

        from chaos import checks
        from chaos.faults import Injector, Plan
        from chaos.stack import seed_catalog, seed_users
        from chaos.traffic import Traffic

        plan = Plan.short() if args.short else Plan.full()
        seed_catalog()
        seeded = seed_users(users_count, prefix="chaos", wallet_micros=50_000_000, cards=2)
        _say("starting web, two workers, beat and three agents")
        stack.start_web()
        stack.start_worker(0)
        stack.start_worker(1)
        stack.start_beat()
        for node, fleet, delayed in NODES:
            stack.enrol_agent(node, FLEETS / fleet, delayed=delayed)
        _wait_inventory(stack)
        traffic = Traffic(
            base_url=stack.url, users=seeded, ws_users=2, cookie_name=settings.SESSION_COOKIE_NAME
        )
        traffic.start()
        time.sleep(10 if args.short else 20)
        _say(
            f"injecting over {plan.seconds:.0f} s: {plan.worker_kills} worker kills, "
            f"{plan.agent_kills} agent kills, {plan.redis_restarts} Redis restarts, "
            f"{plan.web_restarts} web restarts, {plan.delay_periods} slow-agent periods"
        )
        injector = Injector(stack, traffic, plan)
        injector.run()
        _say("faults over; users leave, every session is stopped")
        traffic.stop()
        _settle(stack, seeded)
        _say("checking")
        results = checks.run_all(faults=injector.faults, timings=timings, agents=stack.agents)
        users = checks.users_checks(traffic, injector.faults, timings)
        results += _fault_checks(injector, plan)
        _write_report(
            report, variant=variant, plan=plan, injector=injector, results=results, users_results=users,
            traffic=traffic, stack=stack, seconds=time.monotonic() - started, users=len(seeded),
        )  # fmt: skip
        results += users
    finally:
        _say("stopping the stack")
        stack.shutdown()
    failed = [r for r in results if not r.passed]
    for result in results:
        print(f"  {'PASS' if result.passed else 'FAIL'}  {result.name}: {result.detail}")
    passed = len(results) - len(failed)
    _say(f"{passed}/{len(results)} checks passed; report in {report}; logs in {stack.log_dir}")
    return 1 if failed else 0


def _wait_inventory(stack: Stack) -> None:
    from provisioner.models import Device

    wait_for(
        lambda: all(
            Device.objects.filter(node_id=a.node_id, gpu_model__isnull=False).exists()
            for a in stack.agents.values()
        ),
        timeout=60,
        what="every agent's first heartbeat",
    )


def _settle(stack: Stack, users) -> None:
    """Stop every live session through the API as its owner, then wait for the sessions to end, the
    agents to drop their workloads and a few metering ticks to pass."""
    from provisioner.models import Session

    live = ",".join(str(s) for s in Session.LIVE)
    for user in users:
        headers = {"Authorization": f"Bearer {user.token}"}
        try:
            page = httpx.get(
                f"{stack.url}/api/v1/sessions?state={live}&limit=200", headers=headers, timeout=15
            )
            for session in page.json()["results"]:
                httpx.post(
                    f"{stack.url}/api/v1/sessions/{session['id']}/stop", headers=headers, json={}, timeout=15
                )
        except httpx.HTTPError as exc:
            _say(f"could not stop the sessions of {user.username}: {exc}")
    try:
        wait_for(
            lambda: not Session.objects.exclude(state__in=Session.ENDED).exists(),
            timeout=120,
            what="every session to end",
        )
        wait_for(
            lambda: all(
                not [w for w in a.workloads() if w.get("state") in ("starting", "running")]
                for a in stack.agents.values()
            ),
            timeout=60,
            what="the agents to drop their workloads",
        )
        wait_for(
            lambda: not Session.objects.filter(allocation__isnull=False).exists(),
            timeout=30,
            what="slots to be freed",
        )
    except TimeoutError as exc:
        _say(f"{exc}: the checks will say what is left")
    time.sleep(stack.timings.metering_tick_seconds * 3 + stack.timings.posting_interval_seconds)


def _fault_checks(injector, plan):
    from chaos.checks import Check

    wanted = {
        "worker-kill": plan.worker_kills,
        "agent-kill": plan.agent_kills,
        "redis-restart": plan.redis_restarts,
        "web-restart": plan.web_restarts,
        "agent-delay": plan.delay_periods,
    }
    short = [
        f"{kind}: {injector.count(kind)} of {n}" for kind, n in wanted.items() if injector.count(kind) < n
    ]
    in_tick = sum(1 for f in injector.faults if f.kind == "worker-kill" and "in a metering tick" in f.detail)
    return [
        Check(
            "faults: every planned fault injected, every process back afterwards",
            not short and not injector.problems,
            "; ".join(short + injector.problems)
            or f"{len(injector.faults)} faults; {in_tick} of {injector.count('worker-kill')} worker kills "
            "inside a metering tick",
        )
    ]


def _endings() -> list[tuple[str, str, int]]:
    """Sessions by final state and reason, node names and times folded away."""
    import re
    from collections import Counter

    from provisioner.models import Session

    folded = Counter(
        (state, re.sub(r"\(no heartbeat since [^)]*\)", "(no heartbeat)", reason)[:120])
        for state, reason in Session.objects.values_list("state", "reason")
    )
    return [(state, why, n) for (state, why), n in folded.most_common()]


def _write_report(
    path: Path, *, variant, plan, injector, results, users_results, traffic, stack, seconds, users
) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    t = stack.timings
    verdict = "all checks passed" if all(r.passed for r in results + users_results) else "CHECKS FAILED"
    planned = {
        "worker-kill": (
            plan.worker_kills,
            "SIGKILL a Celery worker holding the metering tick's lock; restart it",
        ),
        "agent-kill": (
            plan.agent_kills,
            f"SIGKILL a node agent for {t.node_liveness_seconds + 8} s; restart it",
        ),
        "redis-restart": (
            plan.redis_restarts,
            "kill the embedded Redis (SIGKILL, then SIGTERM), start it 3 s later",
        ),
        "web-restart": (
            plan.web_restarts,
            "restart web (SIGTERM, then SIGKILL) while WebSockets run through the proxy",
        ),
        "agent-delay": (
            plan.delay_periods,
            "delay node-b's agent answers (below, then above the HTTP timeout)",
        ),
    }
    lines = [
        "# Reliability: `make chaos`",
        "",
        f"As of {now}: the last {variant} run (`{'make chaos-ci' if variant == 'short' else 'make chaos'}`), "
        f"{seconds / 60:.1f} minutes, {verdict}.",
        "",
        "The real stack on its own data directory: embedded PostgreSQL and Redis, web (uvicorn), two Celery "
        "workers, beat, three agents on fake fleets (node-a, node-b behind a delaying proxy, ci-small), "
        f"{users} users launching through the API, using Jupyter through the proxy (HTTP; two of them a "
        "kernel WebSocket) and stopping. Intervals: metering tick "
        f"{t.metering_tick_seconds:g} s, posting every {t.posting_interval_seconds} s, heartbeat "
        f"{t.heartbeat_seconds} s, node liveness {t.node_liveness_seconds} s (swept every "
        f"{t.liveness_sweep_seconds:g} s), agent HTTP timeout {t.agent_http_timeout_seconds:g} s.",
        "",
        'What users are promised while a fault lasts (the checks under "What the users saw" hold the run '
        "to it): no answer >= 500 from the portal, only no answer at all while the web process itself "
        "restarts, and the Jupyter proxy's 502 while a session's node is down; with Redis down the cache and "
        "the throttles fail open (logged once per outage), logins live in PostgreSQL so nobody is logged "
        "out, and a launch or stop is committed and answered though its task cannot be queued (the agents' "
        "heartbeats carry the desired workloads); a WebSocket dropped by a web restart reconnects to the "
        "same kernel. Probes: `/livez` (liveness, answered before Django), `/readyz` (each dependency with "
        "its latency; 503 only without the database), `/healthz` (its older name).",
        "",
        "## Faults injected",
        "",
        "| fault | planned | injected | how |",
        "| --- | ---: | ---: | --- |",
    ]
    for kind, (count, how) in planned.items():
        lines.append(f"| {kind} | {count} | {injector.count(kind)} | {how} |")
    lines += [
        "",
        "## Checks (from the database, and each agent's own workload list)",
        "",
        "| check | result | detail |",
    ]
    lines += ["| --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.name} | {'pass' if r.passed else '**FAIL**'} | {r.detail.replace('|', '/')} |")
    lines += ["", "## What the users saw", "", "| check | result | detail |", "| --- | --- | --- |"]
    for r in users_results:
        lines.append(f"| {r.name} | {'pass' if r.passed else '**FAIL**'} | {r.detail.replace('|', '/')} |")
    lines += ["", "| endpoint | ok | errors |", "| --- | ---: | --- |"]
    for name, e in sorted(traffic.endpoints.items()):
        errors = ", ".join(f"{k} × {v}" for k, v in e.errors.most_common()) or "0"
        lines.append(f"| `{name}` | {e.ok} | {errors} |")
    ws = traffic.ws
    lines += [
        "",
        f"Sessions launched: {len(traffic.launched)}, reached running: {len(traffic.ran)}. Kernel "
        f"WebSockets: {ws.connects} connections, {ws.drops} drops, {ws.reconnects} reconnects "
        f"({ws.kernels_kept} to the same kernel), {ws.round_trips} `kernel_info` round trips. Logouts: "
        f"{len(traffic.logouts)}. Errors above are what the faults cost users: no answer while web "
        "restarts, 502 from the Jupyter proxy while a session's node is down, and refusals that are real "
        "answers (a 409 for a session that ended with its node); the checks say which are allowed.",
        "",
        "How the sessions ended:",
        "",
        "| state | why | sessions |",
        "| --- | --- | ---: |",
        *[f"| {state} | {why} | {n} |" for state, why, n in _endings()],
        "",
        "## Fault log (database clock)",
        "",
        "| at | kind | target | lasted | detail |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for f in sorted(injector.faults, key=lambda f: f.at):
        lasted = f"{(f.until - f.at).total_seconds():.1f} s" if f.until else ""
        lines.append(f"| {f.at:%H:%M:%S} | {f.kind} | {f.target} | {lasted} | {f.detail} |")
    lines += ["", f"Logs of the run: `{stack.log_dir.relative_to(ROOT)}/` (until the next run).", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
