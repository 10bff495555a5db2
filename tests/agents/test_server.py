"""The agent's server forwards ``/jupyter/<session>/…`` on its event loop: kept-alive connections to the
workload pooled per session, the Jupyter token added by the agent and scrubbed from what it answers,
bodies streamed both ways, WebSockets relayed byte for byte. Against a scripted workload on a Unix
socket (the real JupyterLab is in test_gateway.py), so each property can be provoked and counted."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from agents.api import AgentApi
from agents.runtimes import RuntimeHandle
from agents.server import make_server

NODE_TOKEN = "node-token-for-the-server-tests"
JUPYTER_TOKEN = "jupyter-token-0123456789abcdef"
NODE = {"Authorization": f"Bearer {NODE_TOKEN}"}


class _Workload(BaseHTTPRequestHandler):
    """A stand-in JupyterLab: records what reaches it and answers by path."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.server.connections.append(self.connection)

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, content_type: str, body: bytes, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self.server.requests.append((self.command, self.path, self.headers))
        page = self.path.split("?", 1)[0].removeprefix("/jupyter/s1/")
        if page == "lab":
            self._send(200, "text/html; charset=utf-8", f"<script>token='{JUPYTER_TOKEN}'</script>".encode())
        elif page == "api/me":
            self._send(200, "application/json", f'{{"token": "{JUPYTER_TOKEN}"}}'.encode())
        elif page == "files/blob.bin":  # a download: not a page, passed on as it is
            self._send(200, "application/octet-stream", JUPYTER_TOKEN.encode() + b"x" * (3 << 20))
        elif page == "stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index in range(50):
                piece = b"line %d\n" % index
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif page == "ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            self.wfile.write(b"hello from the workload|")  # sent with the 101: must not be lost
            self.wfile.flush()
            while data := self.connection.recv(65536):  # an echo, in raw bytes
                self.connection.sendall(data)
            self.close_connection = True
        else:
            self._send(404, "text/plain", b"no such page")

    def do_POST(self) -> None:  # noqa: N802
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while (size := int(self.rfile.readline().strip(), 16)) != 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((self.command, self.path, self.headers))
        self._send(200, "application/octet-stream", b"%d:%s" % (len(body), body[:16]))


class _Socket(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _Workloads:
    """The part of agents.workloads.Workloads the API and gateway read, with one scripted workload."""

    def __init__(self, socket_path: str) -> None:
        self.runtime = SimpleNamespace(jupyter_token=lambda handle: None)
        self.table = {
            "s1": SimpleNamespace(
                live=True,
                token=JUPYTER_TOKEN,
                spec={"base_url": "/jupyter/s1/"},
                handle=RuntimeHandle(
                    base_url="/jupyter/s1/", upstream_url=f"unix:{socket_path}", socket_path=socket_path
                ),
            )
        }

    def get(self, session_id: str):
        return self.table.get(session_id)

    def delete(self, session_id: str) -> bool:
        return self.table.pop(session_id, None) is not None


@pytest.fixture
def workload(tmp_path: Path):
    server = _Socket(str(tmp_path / "jupyter.sock"), _Workload)
    server.connections, server.requests = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def agent(workload):
    workloads = _Workloads(workload.server_address)
    api = AgentApi(token=NODE_TOKEN, workloads=workloads, runtime_name="process", nvml_name="fake")
    server = make_server("127.0.0.1", 0, api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield SimpleNamespace(url=url, workloads=workloads)
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_requests_of_a_session_share_one_kept_alive_connection_to_its_workload(agent, workload):
    with httpx.Client(base_url=agent.url, headers=NODE) as portal:
        for _ in range(20):
            assert portal.get("/jupyter/s1/api/me").status_code == 200
    with httpx.Client(base_url=agent.url, headers=NODE) as another_portal_connection:
        assert another_portal_connection.get("/jupyter/s1/api/me").status_code == 200
    assert len(workload.requests) == 21
    assert len(workload.connections) == 1


def test_the_agent_adds_the_jupyter_token_and_scrubs_it_from_pages_but_not_downloads(agent, workload):
    with httpx.Client(base_url=agent.url, headers=NODE) as portal:
        lab = portal.get("/jupyter/s1/lab?reset", headers={"Accept-Encoding": "gzip"})
        me = portal.get("/jupyter/s1/api/me")
        blob = portal.get("/jupyter/s1/files/blob.bin")
    assert lab.status_code == 200 and lab.text == "<script>token=''</script>"
    assert me.json() == {"token": ""}
    assert blob.content.startswith(JUPYTER_TOKEN.encode()) and len(blob.content) == len(JUPYTER_TOKEN) + (
        3 << 20
    )
    method, path, headers = workload.requests[0]
    assert (method, path) == ("GET", "/jupyter/s1/lab?reset")
    assert headers["Authorization"] == f"token {JUPYTER_TOKEN}"  # the node token never reaches it
    assert "Accept-Encoding" not in headers  # an uncompressed answer can be scrubbed


def test_bodies_stream_both_ways_in_either_framing(agent, workload):
    upload = b"y" * (5 << 20)

    def pieces():
        for start in range(0, len(upload), 1 << 20):
            yield upload[start : start + (1 << 20)]

    with httpx.Client(base_url=agent.url, headers=NODE, timeout=30) as portal:
        sized = portal.post("/jupyter/s1/api/contents/up", content=upload)
        chunked = portal.post("/jupyter/s1/api/contents/up", content=pieces())
        streamed = portal.get("/jupyter/s1/stream")
        again = portal.get("/jupyter/s1/api/me")
    assert sized.content == b"%d:%s" % (len(upload), b"y" * 16)
    assert chunked.content == sized.content
    assert streamed.text == "".join(f"line {index}\n" for index in range(50))
    assert again.status_code == 200


def test_only_the_node_token_passes_and_only_to_sessions_this_agent_runs(agent, workload):
    assert httpx.get(f"{agent.url}/jupyter/s1/api/me").status_code == 401
    wrong = httpx.get(f"{agent.url}/jupyter/s1/api/me", headers={"Authorization": f"token {JUPYTER_TOKEN}"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorised"
    stranger = httpx.get(f"{agent.url}/jupyter/s2/api/me", headers=NODE)
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "not_found"
    outside = httpx.get(f"{agent.url}/jupyter/s1", headers=NODE)  # not under the session's base URL
    assert outside.status_code == 404
    assert workload.requests == []


def test_a_session_stopped_while_its_target_is_cached_answers_404(agent, workload, tmp_path):
    with httpx.Client(base_url=agent.url, headers=NODE) as portal:
        assert portal.get("/jupyter/s1/api/me").status_code == 200
        # Stopped behind the API's back (a heartbeat's converge): the socket goes with it.
        del agent.workloads.table["s1"]
        workload.shutdown()
        workload.server_close()
        (tmp_path / "jupyter.sock").unlink()
        for connection in workload.connections:
            connection.shutdown(socket.SHUT_RDWR)
        gone = portal.get("/jupyter/s1/api/me")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_a_session_deleted_through_the_api_is_a_404_at_once(agent, workload):
    with httpx.Client(base_url=agent.url, headers=NODE) as portal:
        assert portal.get("/jupyter/s1/api/me").status_code == 200
        assert portal.delete("/v1/workloads/s1").json() == {"deleted": True}
        assert portal.get("/jupyter/s1/api/me").status_code == 404


def test_a_websocket_is_relayed_byte_for_byte_after_its_head_is_rewritten(agent, workload):
    with socket.create_connection(("127.0.0.1", int(agent.url.rsplit(":", 1)[1])), timeout=10) as client:
        client.sendall(
            b"GET /jupyter/s1/ws HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            b"Authorization: Bearer " + NODE_TOKEN.encode() + b"\r\n\r\n"
        )
        received = b""
        while b"hello from the workload|" not in received:
            received += client.recv(65536)
        assert received.startswith(b"HTTP/1.1 101 ")
        for size in (1, 1000, 300_000):  # not frames: the agent must pass any bytes on as they are
            payload = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            client.sendall(payload)
            echoed = b""
            while len(echoed) < size:
                echoed += client.recv(65536)
            assert echoed == payload
    method, path, headers = workload.requests[0]
    assert headers["Authorization"] == f"token {JUPYTER_TOKEN}" and headers["Upgrade"] == "websocket"


def test_an_upgrade_the_workload_refuses_is_answered_scrubbed(agent, workload):
    lab = f"{agent.url.replace('http', 'ws')}/jupyter/s1/lab"
    with pytest.raises(InvalidStatus) as refused, connect(lab, additional_headers=NODE):
        pass
    response = refused.value.response
    assert response.status_code == 200 and JUPYTER_TOKEN.encode() not in response.body


def test_other_routes_still_answer_beside_the_gateway(agent):
    with httpx.Client(base_url=agent.url, headers=NODE) as portal:
        assert portal.get("/v1/nowhere").status_code == 404
        too_large = portal.put("/v1/workloads/x", content=b"{" * ((1 << 20) + 1))
        assert too_large.status_code == 413
    with contextlib.closing(socket.create_connection(("127.0.0.1", int(agent.url.rsplit(":", 1)[1])))) as raw:
        raw.sendall(b"NOT HTTP\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400")
