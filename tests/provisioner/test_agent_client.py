"""The portal's agent client reads the agent's answers as docs/AGENT_PROTOCOL.md says: a 4xx is a
refusal with its code (the session fails at once), a 5xx is the agent's own fault (try again later).
The agent here is a stand-in HTTP server answering what each test sets."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from provisioner import agent_client
from provisioner.models import Node
from provisioner.sealing import seal


@pytest.fixture
def stand_in():
    answer: dict = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the agent's server

        def log_message(self, *args):
            pass

        def do_PUT(self):
            answer.setdefault("peers", []).append(self.client_address)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps(answer["body"]).encode()
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    node = Node(
        name="stand-in", address=f"http://127.0.0.1:{server.server_address[1]}", token_sealed=seal("t")
    )
    yield node, answer
    server.shutdown()
    server.server_close()


def _error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message, "fields": {}}}


@pytest.mark.parametrize(
    ("status", "code"),
    [(422, "environment_unavailable"), (422, "invalid_allocation"), (409, "gpu_busy"), (409, "stopping")],
)
def test_a_refused_start_is_a_refusal_with_the_agents_code(stand_in, status, code):
    node, answer = stand_in
    answer.update(status=status, body=_error(code, "why not"))
    with pytest.raises(agent_client.AgentRefusal) as refused:
        agent_client.workload_put(node, {"session_id": "s-1"})
    assert (refused.value.status, refused.value.code, refused.value.message) == (status, code, "why not")


# start_failed: what agents before the refusal codes answered a refused start with
@pytest.mark.parametrize(
    ("status", "code"), [(500, "internal"), (500, "start_failed"), (502, "x"), (503, "y")]
)
def test_a_5xx_is_the_agents_own_fault_tried_again_later_whatever_its_code(stand_in, status, code):
    node, answer = stand_in
    answer.update(status=status, body=_error(code, "internal error"))
    with pytest.raises(agent_client.AgentUnreachable, match=f"HTTP {status}"):
        agent_client.workload_put(node, {"session_id": "s-1"})


def test_calls_share_one_client_and_its_open_connection_to_the_agent(stand_in):
    """A client per call cost a TLS context each (about half the worker's CPU under load) and a new
    connection: the process keeps one client, and its connection to the agent, between calls."""
    node, answer = stand_in
    answer.update(status=200, body={"state": "starting"})
    assert agent_client.workload_put(node, {"session_id": "s-1"}) == {"state": "starting"}
    assert agent_client.workload_put(node, {"session_id": "s-2"}) == {"state": "starting"}
    assert len(answer["peers"]) == 2
    assert answer["peers"][0] == answer["peers"][1]  # the same client port: one connection
    assert agent_client._client() is agent_client._client()
