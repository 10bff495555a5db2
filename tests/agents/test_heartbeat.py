"""Heartbeats to a stand-in portal (a real stdlib HTTP server written here): convergence, back-off."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.agents.conftest import NODE_TOKEN, free_port, wait_for, workload_spec

pytestmark = pytest.mark.slow


class StandInPortal:
    """Answers POST /api/agent/heartbeat with whatever desired set the test holds."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.desired: list[dict] = []
        self.beats: list[dict] = []
        self.auth: list[str | None] = []
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                portal.auth.append(self.headers.get("Authorization"))
                if (
                    self.path != "/api/agent/heartbeat"
                    or self.headers.get("Authorization") != f"Bearer {NODE_TOKEN}"
                ):
                    self.send_response(401)
                    self.end_headers()
                    return
                portal.beats.append(body)
                data = json.dumps(
                    {"desired_workloads": portal.desired, "heartbeat_interval_seconds": 0.5}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def beats_after(self, count: int, more: int = 2, timeout: float = 20) -> dict:
        wait_for(lambda: len(self.beats) >= count + more, timeout, what=f"{more} more heartbeats")
        return self.beats[-1]


def test_agent_converges_to_the_portal_and_keeps_workloads_while_it_is_down(start_agent, tmp_path):
    port = free_port()
    portal = StandInPortal(port)
    try:
        agent = start_agent(
            tmp_path / "state",
            "--sandbox",
            "none",
            "--portal",
            f"http://127.0.0.1:{port}",
            "--heartbeat-seconds",
            "0.5",
        )
        beat = portal.beats_after(0, 1)
        assert beat["runtime"] == "process" and beat["listen_url"] == agent.url
        gpus = beat["inventory"]["gpus"]
        devices = {g["uuid"] for g in gpus} | {m["uuid"] for g in gpus for m in g["mig_devices"]}
        assert len(gpus) == 2 and {m["uuid"] for m in beat["metrics"]["gpus"]} == devices  # MIG ones too
        uuid = beat["inventory"]["gpus"][0]["uuid"]

        wanted = workload_spec(
            "wanted-1",
            {
                "device_uuid": uuid,
                "profile": "1/2",
                "slot_start": 0,
                "slot_count": 4,
                "sharing_policy": "best-effort",
            },
        )
        unservable = workload_spec("unservable-1", {**wanted["allocation"], "device_uuid": "GPU-nope"})
        orphan = workload_spec("orphan-1", None)
        assert agent.put_workload(orphan).status_code == 201  # the portal does not list it
        portal.desired = [wanted, unservable]
        agent.wait_state("wanted-1", ("running",))
        wait_for(
            lambda: agent.get("/v1/workloads/orphan-1").status_code == 404, 10, what="the orphan to stop"
        )
        refused = agent.workload("unservable-1")
        assert refused["state"] == "failed" and "device_uuid" in refused["exit_reason"]
        beat = portal.beats_after(len(portal.beats))
        assert {w["session_id"]: w["state"] for w in beat["workloads"]} == {
            "wanted-1": "running",
            "unservable-1": "failed",
        }

        # The portal goes away: the agent backs off and leaves the workload running.
        portal.close()
        time.sleep(3)
        assert agent.workload("wanted-1")["state"] == "running"
        assert "heartbeat failed" in agent.log()

        # It comes back and no longer wants the workload: stopped, and not started again.
        portal = StandInPortal(port)
        portal.desired = []
        wait_for(lambda: agent.get("/v1/workloads/wanted-1").status_code == 404, 40, what="wanted-1 to stop")
        portal.beats_after(len(portal.beats), 3)
        assert agent.get("/v1/workloads").json() == {"workloads": []}
        assert all(b["workloads"] == [] for b in portal.beats[-2:])
    finally:
        portal.close()


def test_a_refusal_in_html_is_logged_with_its_title():
    """Django's DisallowedHost answers an HTML 400: the agent names it instead of a bare status."""
    from agents.heartbeat import PortalError, post_heartbeat

    page = b"<html><head><title>DisallowedHost at /api/agent/heartbeat</title></head><body>x</body></html>"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(400)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PortalError) as refused:
            post_heartbeat(f"http://127.0.0.1:{server.server_address[1]}", NODE_TOKEN, {})
        assert str(refused.value) == "portal answered 400: DisallowedHost at /api/agent/heartbeat"
    finally:
        server.shutdown()
        server.server_close()


def test_the_agent_reports_each_home_it_measured_once_and_again_after_a_change(start_agent, tmp_path):
    state = tmp_path / "state"
    home = state / "homes" / "alice-12"
    (home / "work").mkdir(parents=True)
    (home / "work" / "a.txt").write_text("hello")
    port = free_port()
    portal = StandInPortal(port)
    try:
        start_agent(
            state, "--sandbox", "none", "--portal", f"http://127.0.0.1:{port}", "--heartbeat-seconds", "0.5",
            "--home-round-seconds", "0",
        )  # fmt: skip
        wait_for(lambda: any(b.get("homes") for b in portal.beats), 20, what="a heartbeat with homes")
        portal.beats_after(len(portal.beats), 3)  # measured again each beat, unchanged: not sent again
        reported = [h for b in portal.beats for h in b.get("homes", [])]
        assert [(h["user"], h["files"]) for h in reported] == [("alice-12", 2)]
        assert reported[0]["bytes"] > 0
        (home / "work" / "b.txt").write_text("more")
        wait_for(
            lambda: any(h["files"] == 3 for b in portal.beats for h in b.get("homes", [])),
            20,
            what="the home measured again",
        )
    finally:
        portal.close()
