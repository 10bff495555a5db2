"""What must hold after a chaos run, read from the database (plus each agent's own list of its workloads,
for orphans, and, for what the users saw, the traffic's own record of its failures, logouts and kernel
reconnects). Every check returns a ``Check``; none raises on a finding.

The times of the faults (when an agent was killed) come from the injector's records, taken on the
database clock; everything the checks judge (states, meters, transfers, slots) is in the database.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection

from billing.models import CARD_UNIT
from chaos.faults import Fault
from chaos.stack import Agent, Timings
from chaos.traffic import Traffic

SAMPLES = 5  # offending rows quoted per failed check


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def _rows(sql: str, params=None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return cursor.fetchall()


def _one(sql: str, params=None):
    return _rows(sql, params)[0][0]


def _verdict(name: str, bad: list, ok_detail: str, what: str) -> Check:
    if not bad:
        return Check(name, True, ok_detail)
    return Check(name, False, f"{len(bad)} {what}, e.g. {bad[:SAMPLES]}")


# --- the ledger -------------------------------------------------------------------------------------------


def ledger_balances() -> Check:
    bad = _rows(
        """
        SELECT la.id, la.kind, la.balance_micros, COALESCE(sum(e.amount_micros), 0)
        FROM billing_ledgeraccount la LEFT JOIN billing_entry e ON e.account_id = la.id
        GROUP BY la.id HAVING la.balance_micros <> COALESCE(sum(e.amount_micros), 0)
        """
    )
    accounts = _one("SELECT count(*) FROM billing_ledgeraccount")
    return _verdict(
        "ledger: every cached balance equals the sum of its entries",
        bad,
        f"{accounts} ledger accounts",
        "ledger accounts (id, kind, cached, entries)",
    )


def ledger_zero_sum() -> Check:
    bad = [
        ("unit", unit, total)
        for unit, total in _rows(
            "SELECT la.unit, sum(e.amount_micros) FROM billing_entry e "
            "JOIN billing_ledgeraccount la ON la.id = e.account_id GROUP BY la.unit"
        )
        if total != 0
    ]
    bad += [
        ("transfer", t, n)
        for t, n in _rows(
            "SELECT t.id, count(e.id) FROM billing_transfer t "
            "LEFT JOIN billing_entry e ON e.transfer_id = t.id GROUP BY t.id "
            "HAVING count(e.id) <> 2 OR COALESCE(sum(e.amount_micros), 1) <> 0"
        )
    ]
    transfers = _one("SELECT count(*) FROM billing_transfer")
    return _verdict(
        "ledger: entries sum to zero per unit; each transfer is two opposite entries",
        bad,
        f"{transfers} transfers",
        "violations",
    )


def ledger_floors() -> Check:
    bad = _rows(
        "SELECT id, kind, balance_micros FROM billing_ledgeraccount "
        "WHERE (kind IN ('wallet', 'card') AND balance_micros < 0) "
        "OR (kind = 'overdraft' AND balance_micros > 0)"
    )
    return _verdict(
        "ledger: no wallet or card below zero, no overdraft above zero",
        bad,
        "all floors hold",
        "ledger accounts (id, kind, balance)",
    )


def meters_add_up() -> Check:
    bad = _rows(
        """
        WITH t AS (
            SELECT meter_id,
                   COALESCE(sum(amount_micros) FILTER (WHERE unit <> %(card)s), 0) AS money,
                   COALESCE(sum(amount_micros) FILTER (WHERE unit = %(card)s), 0) AS cards
            FROM billing_transfer WHERE meter_id IS NOT NULL GROUP BY meter_id
        )
        SELECT m.id, m.charged_micros, COALESCE(t.money, 0), m.card_charged_micros, COALESCE(t.cards, 0),
               m.billed_seconds, m.posted_seconds, m.state
        FROM billing_meter m LEFT JOIN t ON t.meter_id = m.id
        WHERE COALESCE(t.money, 0) <> m.charged_micros
           OR m.charged_micros <> m.price_micros_per_hour * m.wallet_seconds / 3600
           OR COALESCE(t.cards, 0) <> m.card_charged_micros
           OR m.card_charged_micros <> m.card_burn_micros_per_hour * m.card_seconds / 3600
           OR m.posted_seconds > m.billed_seconds
           OR m.posted_seconds <> m.card_seconds + m.wallet_seconds
           OR m.billed_until <> m.started_at + make_interval(secs => m.billed_seconds)
           OR (m.state = 'closed' AND m.posted_seconds <> m.billed_seconds)
        """,
        {"card": CARD_UNIT},
    )
    meters = _one("SELECT count(*) FROM billing_meter")
    return _verdict(
        "meters: money and card charges equal their transfers and price × posted seconds; closed meters "
        "fully posted",
        bad,
        f"{meters} meters",
        "meters (id, charged, money transfers, card charged, card transfers, billed s, posted s, state)",
    )


# --- sessions and their charges ---------------------------------------------------------------------------


def charges_match_running_time() -> Check:
    """Every session that ran is billed exactly its price × its confirmed running time (running_at to the
    earlier of ended_at and last_alive_at), whole seconds; one that never ran has no meter."""
    bad = _rows(
        """
        SELECT s.id, s.state, m.id, m.billed_seconds,
               floor(extract(epoch FROM (LEAST(s.ended_at, s.last_alive_at) - s.running_at)))::bigint,
               m.started_at = s.running_at, m.price_micros_per_hour = s.price_micros_per_hour, m.state
        FROM provisioner_session s LEFT JOIN billing_meter m ON m.session_ref = s.id::text
        WHERE s.running_at IS NOT NULL AND (
               m.id IS NULL
            OR m.started_at <> s.running_at
            OR m.price_micros_per_hour <> s.price_micros_per_hour
            OR m.card_burn_micros_per_hour <> s.card_burn_micros_per_hour
            OR (s.state IN ('stopped', 'failed', 'lost') AND (
                    m.state <> 'closed'
                 OR m.billed_seconds <> GREATEST(0, floor(extract(epoch FROM
                        (LEAST(s.ended_at, s.last_alive_at) - s.running_at)))::bigint)))
            OR (s.state NOT IN ('stopped', 'failed', 'lost') AND m.billed_seconds >
                    floor(extract(epoch FROM (s.last_alive_at - s.running_at)))::bigint)
        )
        """
    )
    never_ran = _rows(
        "SELECT s.id, s.state FROM provisioner_session s JOIN billing_meter m ON m.session_ref = s.id::text "
        "WHERE s.running_at IS NULL"
    )
    wallet_only = _rows(
        "SELECT m.id, m.charged_micros, m.price_micros_per_hour * m.billed_seconds / 3600 "
        "FROM billing_meter m WHERE m.card_seconds = 0 AND m.state = 'closed' "
        "AND m.charged_micros <> m.price_micros_per_hour * m.billed_seconds / 3600"
    )
    ran = _one("SELECT count(*) FROM provisioner_session WHERE running_at IS NOT NULL")
    seconds = _one("SELECT COALESCE(sum(billed_seconds), 0) FROM billing_meter")
    findings = [("billed", *r) for r in bad] + [("never ran, metered", *r) for r in never_ran]
    findings += [("wallet-only charge", *r) for r in wallet_only]
    return _verdict(
        "charges: every session billed price × confirmed running time to the second; none that never ran",
        findings,
        f"{ran} sessions ran, {seconds} seconds billed",
        "sessions (session, state, meter, billed s, confirmed s, same start, same price, meter state)",
    )


def no_billing_past_alive() -> Check:
    bad = _rows(
        """
        SELECT s.id, s.state, m.billed_until, m.alive_until, s.last_alive_at
        FROM billing_meter m JOIN provisioner_session s ON m.session_ref = s.id::text
        WHERE m.billed_until > m.alive_until OR m.alive_until > s.last_alive_at
        """
    )
    return _verdict(
        "meters: nothing billed past the last time the agent confirmed the workload alive",
        bad,
        "every meter within its session's last alive time",
        "meters (session, state, billed until, alive until, session last alive)",
    )


def no_posting_twice() -> Check:
    """Idempotency keys are unique, and one meter's postings cover disjoint ranges of its seconds."""
    duplicates = _rows(
        "SELECT idempotency_key, count(*) FROM billing_transfer GROUP BY idempotency_key HAVING count(*) > 1"
    )
    ranges = _rows(
        r"""
        SELECT DISTINCT meter_id, (regexp_match(idempotency_key, '^meter:\d+:(\d+)-(\d+)'))[1]::bigint,
               (regexp_match(idempotency_key, '^meter:\d+:(\d+)-(\d+)'))[2]::bigint
        FROM billing_transfer WHERE meter_id IS NOT NULL ORDER BY 1, 2, 3
        """
    )
    posted = dict(_rows("SELECT id, posted_seconds FROM billing_meter"))
    overlaps = []
    last: dict[int, int] = {}
    for meter_id, start, end in ranges:
        if start < last.get(meter_id, 0) or end > posted.get(meter_id, 0):
            overlaps.append((meter_id, start, end, last.get(meter_id, 0), posted.get(meter_id)))
        last[meter_id] = max(last.get(meter_id, 0), end)
    findings = [("duplicate key", *d) for d in duplicates] + [("overlapping posting", *o) for o in overlaps]
    return _verdict(
        "postings: no idempotency key twice; no second of a meter posted twice",
        findings,
        f"{len(ranges)} postings over {len(last)} meters, all disjoint",
        "findings",
    )


# --- nodes, slots, agents -----------------------------------------------------------------------------------


def lost_within_window(faults: list[Fault], timings: Timings) -> Check:
    """Sessions running on a node when its agent was killed end ``lost`` within the liveness window
    (plus a sweep and a little slack), billed no further than the kill; and every lost session in the
    run went lost within the window after its last alive time."""
    window = timedelta(seconds=timings.node_liveness_seconds + timings.liveness_sweep_seconds + 5)
    # a heartbeat sent just before the kill is stamped when the portal gets to it (its clock, not the
    # agent's): allow a few seconds of queueing in a busy web process
    in_flight = timedelta(seconds=timings.heartbeat_seconds + 5)
    findings = []
    judged = 0
    for fault in (f for f in faults if f.kind == "agent-kill"):
        rows = _rows(
            """
            SELECT s.id, s.state, s.last_alive_at, m.billed_until,
                   (SELECT min(e.at) FROM provisioner_sessionevent e WHERE e.session_id = s.id
                     AND e.to_state IN ('stopped', 'failed', 'lost')) AS ended_event
            FROM provisioner_session s JOIN provisioner_node n ON n.id = s.node_id
            LEFT JOIN billing_meter m ON m.session_ref = s.id::text
            WHERE n.name = %s AND s.running_at < %s
            """,
            [fault.target, fault.at],
        )
        for session_id, state, last_alive, billed_until, ended_event in rows:
            if ended_event is not None and ended_event <= fault.at:
                continue  # over before the kill
            judged += 1
            if state != "lost" or ended_event is None:
                findings.append((fault.target, str(session_id), state, "not lost"))
            elif ended_event > fault.at + window:
                findings.append(
                    (fault.target, str(session_id), f"lost {ended_event - fault.at} after the kill")
                )
            if last_alive and last_alive > fault.at + in_flight:
                findings.append(
                    (fault.target, str(session_id), f"alive {last_alive - fault.at} after the kill")
                )
            if billed_until and billed_until > fault.at + in_flight:
                findings.append(
                    (fault.target, str(session_id), f"billed {billed_until - fault.at} past the kill")
                )
    late = _rows(
        """
        SELECT s.id, e.at - s.last_alive_at FROM provisioner_session s
        JOIN provisioner_sessionevent e ON e.session_id = s.id AND e.to_state = 'lost'
        WHERE s.last_alive_at IS NOT NULL AND e.at - s.last_alive_at > %s
        """,
        [window],
    )
    findings += [("lost late", str(s), str(d)) for s, d in late]
    lost = _one("SELECT count(*) FROM provisioner_session WHERE state = 'lost'")
    return _verdict(
        f"dead nodes: their sessions lost within {window.total_seconds():.0f} s, billed no further",
        findings,
        f"{judged} sessions on killed agents judged; {lost} lost in all",
        "findings",
    )


def no_slot_twice() -> Check:
    """Two sessions never held overlapping slots of one device while both were confirmed running, and
    the slot rows held now match their allocations."""
    overlapping = _rows(
        """
        SELECT a.id, b.id, a.device_id FROM provisioner_session a
        JOIN provisioner_session b ON a.device_id = b.device_id AND a.id < b.id
        WHERE a.running_at IS NOT NULL AND b.running_at IS NOT NULL
          AND a.slot_start < b.slot_start + b.slot_count AND b.slot_start < a.slot_start + a.slot_count
          AND a.running_at < COALESCE(LEAST(b.ended_at, b.last_alive_at), b.last_alive_at, 'infinity')
          AND b.running_at < COALESCE(LEAST(a.ended_at, a.last_alive_at), a.last_alive_at, 'infinity')
        """
    )
    mismatched = _rows(
        """
        SELECT al.id, al.slot_start, al.slot_count, array_agg(sl.slot ORDER BY sl.slot)
        FROM provisioner_allocation al LEFT JOIN provisioner_allocationslot sl ON sl.allocation_id = al.id
        GROUP BY al.id
        HAVING array_agg(sl.slot ORDER BY sl.slot) IS DISTINCT FROM
               ARRAY(SELECT generate_series(al.slot_start, al.slot_start + al.slot_count - 1))::smallint[]
            OR bool_or(sl.device_id <> al.device_id)
        """
    )
    placed = _one("SELECT count(*) FROM provisioner_session WHERE device_id IS NOT NULL")
    findings = [("overlap", str(a), str(b), d) for a, b, d in overlapping]
    findings += [("allocation rows", *m) for m in mismatched]
    return _verdict(
        "slots: no slot of a device held by two running sessions at once",
        findings,
        f"{placed} placements compared pairwise",
        "findings",
    )


def nothing_stuck_or_leaked() -> Check:
    """After the run every session has ended, and no ended session still holds slots."""
    stuck = _rows(
        "SELECT id, state, reason FROM provisioner_session WHERE state NOT IN ('stopped', 'failed', 'lost')"
    )
    leaked = _rows(
        "SELECT s.id, s.state FROM provisioner_allocation al "
        "JOIN provisioner_session s ON s.id = al.session_id"
    )
    findings = [("not ended", str(i), s, r) for i, s, r in stuck] + [
        ("slots held", str(i), s) for i, s in leaked
    ]
    total = _one("SELECT count(*) FROM provisioner_session")
    return _verdict(
        "sessions: all ended after the run, none still holding slots",
        findings,
        f"{total} sessions, all ended, no slot held",
        "findings",
    )


def no_orphans(agents: dict[str, Agent]) -> Check:
    """What each agent runs (``GET /v1/workloads`` with its node token) is what the portal wants there."""
    from provisioner.models import Session

    findings = []
    listed = 0
    for name, agent in agents.items():
        try:
            workloads = agent.workloads()
        except Exception as exc:
            findings.append((name, f"agent did not answer: {exc}"))
            continue
        live = {w["session_id"] for w in workloads if w.get("state") in ("starting", "running")}
        listed += len(live)
        wanted = {
            str(s)
            for s in Session.objects.filter(node__name=name, state__in=Session.ON_NODE).values_list(
                "id", flat=True
            )
        }
        findings += [(name, "orphan", sid) for sid in sorted(live - wanted)]
        findings += [(name, "missing", sid) for sid in sorted(wanted - live)]
    return _verdict(
        "agents: no orphan workload on any agent (its list equals the portal's)",
        findings,
        f"{len(agents)} agents asked, {listed} live workloads between them",
        "findings",
    )


# --- what the users saw (the traffic's own record, judged against the fault log) -------------------------

WEB_RESTART_SLACK_SECONDS = 2.0  # requests in flight when web went, and the first ones as it comes back
# An open WebSocket whose node's agent dies is closed by the proxy: the kernel's gateway is gone.
NODE_GONE_DROPS = ("ConnectionClosedError", "ConnectionClosedOK")


def _windows(faults: list[Fault], kinds: tuple[str, ...], slack: float) -> list[tuple[str, float, float]]:
    return [
        (f.target, f.at.timestamp() - slack, (f.until or f.at).timestamp() + slack)
        for f in faults
        if f.kind in kinds
    ]


def users_no_server_errors(traffic: Traffic, faults: list[Fault], timings: Timings) -> Check:
    """No answer >= 500 and no connection error, but for two causes a user cannot be spared: the web
    process itself restarting (no answer at all while it is gone; and a WebSocket handshake it was in
    the middle of when it began to shut down, which uvicorn ends with a 500 before closing the
    connection, in every one of its WebSocket implementations' ``shutdown``: the browser's connect
    fails as if the process were gone, and it reconnects to the new one), and the Jupyter proxy's 502
    (or an open WebSocket dropped) while the session's node is down or slower than the proxy waits:
    its JupyterLab really is unreachable."""
    from provisioner.models import Session

    web = _windows(faults, ("web-restart",), WEB_RESTART_SLACK_SECONDS)
    node_down = _windows(
        faults, ("agent-kill", "agent-delay"), timings.node_liveness_seconds + timings.heartbeat_seconds
    )
    nodes = dict(
        Session.objects.filter(id__in={f.session_id for f in traffic.failures if f.session_id}).values_list(
            "id", "node__name"
        )
    )
    nodes = {str(k): v for k, v in nodes.items()}
    excused_web = excused_node = 0
    bad = []
    for f in traffic.failures:
        answered = f.outcome.isdigit()
        handshake_cut = f.endpoint.startswith("WS ") and f.outcome == "500"
        if (not answered or handshake_cut) and any(start <= f.at <= end for _, start, end in web):
            excused_web += 1
        elif (
            "/jupyter/" in f.endpoint
            and f.outcome in ("502", *NODE_GONE_DROPS)
            and any(
                node == nodes.get(f.session_id or "") and start <= f.at <= end
                for node, start, end in node_down
            )
        ):
            excused_node += 1
        else:
            bad.append((time.strftime("%H:%M:%S", time.localtime(f.at)), f.endpoint, f.outcome))
    answers = sum(1 for f in traffic.failures if f.outcome.isdigit())
    return _verdict(
        "users: no answer >= 500; no connection error but while web restarts",
        bad,
        f"{answers} answers >= 500 and {len(traffic.failures) - answers} connection errors: "
        f"{excused_web} while web restarted, {excused_node} from the Jupyter proxy while the session's node "
        "was down or slow (502, or its open WebSocket dropped); none from a Redis restart",
        "failures (when, endpoint, outcome)",
    )


def users_stayed_logged_in(traffic: Traffic, faults: list[Fault]) -> Check:
    redis = [f for f in faults if f.kind == "redis-restart"]
    return _verdict(
        "users: nobody logged out (no redirect to the login page, no 401/403 for a valid token)",
        [(time.strftime("%H:%M:%S", time.localtime(at)), name, what) for at, name, what in traffic.logouts],
        f"0 logouts across {len(redis)} Redis restarts and "
        f"{sum(1 for f in faults if f.kind == 'web-restart')} web restarts",
        "logouts (when, endpoint, what)",
    )


def users_kernels_outlive_reconnects(traffic: Traffic) -> Check:
    ws = traffic.ws
    findings = [("kernel changed", k) for k in ws.kernels_changed]
    if ws.reconnects == 0:
        findings.append(("no reconnect happened", "the web restarts did not reach a WebSocket"))
    return _verdict(
        "WebSockets: every reconnect finds the same kernel",
        findings,
        f"{ws.connects} connections, {ws.reconnects} reconnects, {ws.kernels_kept} to the same kernel",
        "findings",
    )


def users_checks(traffic: Traffic, faults: list[Fault], timings: Timings) -> list[Check]:
    return [
        users_no_server_errors(traffic, faults, timings),
        users_stayed_logged_in(traffic, faults),
        users_kernels_outlive_reconnects(traffic),
    ]


def run_all(*, faults: list[Fault], timings: Timings, agents: dict[str, Agent]) -> list[Check]:
    return [
        ledger_balances(),
        ledger_zero_sum(),
        ledger_floors(),
        meters_add_up(),
        charges_match_running_time(),
        no_billing_past_alive(),
        no_posting_twice(),
        lost_within_window(faults, timings),
        no_slot_twice(),
        nothing_stuck_or_leaked(),
        no_orphans(agents),
    ]
