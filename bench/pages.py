"""Benchmark: the server time of every page, one request at a time, on the real web process.

One uvicorn process (as ``make run`` starts each of its web processes) on the embedded PostgreSQL and
Redis under ``.data/bench-pages``, with the seeded demo (``manage.py seed_demo``: a student with cards
and a wallet, a team lead with a team, an admin, a fleet), grown by what a few weeks add (``_grow``).
Each page is fetched ``--requests`` times as its user, in rounds that fetch every page once (so that
what else the machine does falls on all pages alike), after ten rounds of warm-up, and its server time
read from the ``Server-Timing`` header (the time spent in Django for the answer: middleware, views,
queries, templates). The client's own time is given too: it adds the HTTP parsing and the loopback.

The baseline, in the same run, is the login page for a visitor: a template page with a form and no
data, what any page pays for the framework. Each page's median is given as a ratio to it.

Prints a table; never fails on a time. Issue #15 asks for 15 ms of server time per page at most.

    .venv/bin/python bench/pages.py [--requests 200] [--only /dashboard/,/wallet/]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaos.stack import Stack, login_cookie  # noqa: E402

BASELINE = ("visitor", "/login/")
PAGES = {
    "student": [
        "/", "/dashboard/", "/launch/", "/launch/?profile=cpu", "/wallet/", "/cards/", "/sessions/",
        "/profile/", "/teams/", "/notices/", "/notices/settings/", "/files/",
        "/live/funds", "/live/sessions", "/live/dashboard",
    ],
    "teamlead": ["/dashboard/", "/wallet/", "/teams/vision-lab/", "/teams/vision-lab/usage/"],
    "admin": ["/operations/", "/operations/usage/", "/operations/audit/"],
}  # fmt: skip
TARGET_MS = 15.0


def _grow() -> None:
    """More than a fresh demo has, as a user has after a few weeks: six unread notices each (the bell
    lists five, the dashboard the unread), a dozen wallet movements each, six more members in the team."""
    from billing.services.topups import wallet_credit_promotion
    from notices.services import notify
    from portal.models import Membership, Team, User
    from portal.services import user_create

    for user in User.objects.filter(username__in=PAGES):
        for index in range(12):
            wallet_credit_promotion(
                account=user.account, amount_micros=1_000_000, idempotency_key=f"bench-{user.pk}-{index}"
            )
        for index in range(6):
            params = {"session": f"T4 #{index}"}
            notify(users=[user], kind="session_started", key="session_started", params=params,
                   dedupe_key=f"bench-{index}", url="/sessions/")  # fmt: skip
    team = Team.objects.get(slug="vision-lab")
    for index in range(6):
        member = user_create(
            username=f"member-{index}", email=f"member-{index}@example.edu", password="bench-pass-phrase-1"
        )
        Membership.objects.create(team=team, user=member, role=Membership.Role.MEMBER)


def _server_ms(answer: httpx.Response) -> float:
    timing = answer.headers.get("Server-Timing", "")
    if not timing.startswith("app;dur="):
        raise RuntimeError(f"{answer.request.url}: no Server-Timing header ({answer.status_code})")
    return float(timing.removeprefix("app;dur="))


def _get(client: httpx.Client, path: str) -> tuple[float, float]:
    """One request: the server's time and the client's, in ms."""
    started = time.perf_counter()
    answer = client.get(path)
    wall = (time.perf_counter() - started) * 1000
    if answer.status_code != 200:
        raise RuntimeError(f"GET {path}: {answer.status_code} {answer.text[:300]}")
    return _server_ms(answer), wall


def _figures(samples: list[tuple[float, float]]) -> dict:
    server = sorted(figure for figure, _wall in samples)
    return {
        "p50": statistics.median(server),
        "p95": server[max(0, int(len(server) * 0.95) - 1)],
        "client": statistics.median(wall for _server, wall in samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="of each page")
    parser.add_argument("--only", default="", help="comma-separated paths: only these pages (and the floor)")
    args = parser.parse_args()
    only = {path for path in args.only.split(",") if path}
    pages = [(user, path) for user, paths in PAGES.items() for path in paths if not only or path in only]

    stack = Stack(data_dir=ROOT / ".data" / "bench-pages")
    stack.prepare()
    from django.core.management import call_command

    call_command("seed_demo", url=stack.url, stdout=io.StringIO())
    _grow()
    samples: dict[tuple[str, str], list] = {BASELINE: [], **{page: [] for page in pages}}
    try:
        stack.start_web()
        base = {"base_url": stack.url, "timeout": 30, "follow_redirects": False}
        clients = {"visitor": httpx.Client(**base)}
        from django.conf import settings

        from portal.models import User

        for name in PAGES:
            cookie = {settings.SESSION_COOKIE_NAME: login_cookie(User.objects.get(username=name))}
            clients[name] = httpx.Client(**base, cookies=cookie)
        # Round after round, every page once: whatever else the machine does falls on all pages alike.
        for round_ in range(10 + args.requests):
            for user, path in samples:
                measured = _get(clients[user], path)
                if round_ >= 10:  # the first rounds warm the process: its caches, its connections
                    samples[(user, path)].append(measured)
        for client in clients.values():
            client.close()
    finally:
        stack.shutdown()
        from portal import embedded

        embedded.stop()

    floor = _figures(samples.pop(BASELINE))
    rows = [(*BASELINE, floor), *((user, path, _figures(found)) for (user, path), found in samples.items())]
    print(
        f"server time per page, {args.requests} requests each, in rounds of every page, one at a time, "
        f"one web process ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)"
    )
    print(f"{'user':<9} {'page':<26} {'p50 ms':>7} {'p95 ms':>7} {'× floor':>8} {'client p50':>11}")
    for username, path, figures in rows:
        print(
            f"{username:<9} {path:<26} {figures['p50']:>7.1f} {figures['p95']:>7.1f} "
            f"{figures['p50'] / floor['p50']:>7.1f}× {figures['client']:>10.1f}"
        )
    pages = rows[1:]
    worst = max(pages, key=lambda row: row[2]["p50"])
    over = [f"{user} {path}" for user, path, figures in pages if figures["p50"] > TARGET_MS]
    print(
        f"floor (a visitor's login page): {floor['p50']:.1f} ms. Slowest page: {worst[0]} {worst[1]} at "
        f"{worst[2]['p50']:.1f} ms ({worst[2]['p50'] / floor['p50']:.1f}× the floor). "
        + (
            f"Over {TARGET_MS:.0f} ms (median): {', '.join(over)}."
            if over
            else f"Every median ≤ {TARGET_MS:.0f} ms."
        )
    )


if __name__ == "__main__":
    main()
