"""The Jupyter proxy in front of a real JupyterLab, served by a real uvicorn.

The route resolver is the one seam: here it is a function of the test (which cookie may use which
session); the end-to-end tests in tests/browser use the portal's real one over real sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import uvicorn
import websockets

from portal.proxy import JupyterProxy, Refusal, Route
from portal.upstream import UpstreamPool
from portal.ws_relay import WebSocketRelay
from tests.agents.conftest import execute_request


def _run_in_thread(coroutine):
    """asyncio.run on a fresh thread: another test (Playwright, a fake server) may have left an event
    loop running on this one."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    port, token, session_id = _free_port(), secrets.token_hex(24), "s" + uuid.uuid4().hex[:12]
    home = tmp_path_factory.mktemp("jupyter-home")
    process = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.base_url=/jupyter/{session_id}/", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={home}", "--ServerApp.disable_check_xsrf=False", "--allow-root",
         "--ZMQChannelsWebsocketConnection.limit_rate=False"],  # the large-output test wants it whole
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )  # fmt: skip
    upstream = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if (
                httpx.get(
                    f"{upstream}/jupyter/{session_id}/api/status", headers={"Authorization": f"token {token}"}
                ).status_code
                == 200
            ):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        process.kill()
        pytest.fail("JupyterLab did not start")
    yield {"upstream": upstream, "token": token, "session_id": session_id, "home": home}
    process.terminate()
    process.wait(timeout=20)


@pytest.fixture(scope="module", params=["relay", "asgi"])
def proxy_url(request, jupyter):
    """The proxy under uvicorn, its WebSockets relayed as bytes (portal/ws_relay.py, as the portal is
    served) or through the ASGI path (any other server)."""

    def resolve(cookie: str, session_id: str):
        if session_id != jupyter["session_id"]:
            return None
        if cookie == "stopped":
            return Refusal(status=409, state="stopped", session_url=f"/sessions/{session_id}/")
        return Route(jupyter["upstream"], jupyter["token"], scheme="token") if cookie == "owner" else None

    port = _free_port()
    ws = WebSocketRelay if request.param == "relay" else "auto"
    server = uvicorn.Server(
        uvicorn.Config(
            JupyterProxy(resolver=resolve), host="127.0.0.1", port=port, log_level="warning", ws=ws
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _client(proxy_url, cookie="owner"):
    return httpx.Client(
        base_url=f"http://{proxy_url}", cookies={"sessionid": cookie, "csrftoken": "portal-csrf"}
    )


def test_the_owner_reaches_jupyter_without_knowing_the_token(proxy_url, jupyter):
    with _client(proxy_url) as client:
        response = client.get(f"/jupyter/{jupyter['session_id']}/api/status")
        assert response.status_code == 200
        assert "started" in response.json()


def test_anyone_else_gets_a_404_and_no_hint(proxy_url, jupyter):
    for cookie in ("stranger", ""):
        with _client(proxy_url, cookie) as client:
            assert client.get(f"/jupyter/{jupyter['session_id']}/api/status").status_code == 404
    with _client(proxy_url) as client:
        assert client.get("/jupyter/no-such-session/api/status").status_code == 404


def test_a_stopped_session_sends_the_browser_to_its_page(proxy_url, jupyter):
    with _client(proxy_url, "stopped") as client:
        response = client.get(f"/jupyter/{jupyter['session_id']}/lab")
    assert response.status_code == 302
    assert response.headers["location"] == f"/sessions/{jupyter['session_id']}/"


def test_the_token_never_reaches_the_browser(proxy_url, jupyter):
    with _client(proxy_url) as client:
        page = client.get(f"/jupyter/{jupyter['session_id']}/lab")
    assert page.status_code == 200
    assert "jupyter-config-data" in page.text
    assert jupyter["token"] not in page.text
    assert all(jupyter["token"] not in value for value in page.headers.values())


def test_cross_site_requests_are_refused(proxy_url, jupyter):
    with _client(proxy_url) as client:
        response = client.post(
            f"/jupyter/{jupyter['session_id']}/api/kernels",
            headers={"Origin": "https://evil.example"},
            json={},
        )
    assert response.status_code == 403


def test_uploads_and_downloads_stream_through(proxy_url, jupyter):
    blob = secrets.token_bytes(3 * 1024 * 1024)
    import base64

    body = {"type": "file", "format": "base64", "content": base64.b64encode(blob).decode()}
    with _client(proxy_url) as client:
        put = client.put(
            f"/jupyter/{jupyter['session_id']}/api/contents/blob.bin",
            json=body,
            headers={"Origin": f"http://{proxy_url}"},
        )
        assert put.status_code in (200, 201), put.text
        download = client.get(f"/jupyter/{jupyter['session_id']}/files/blob.bin")
    assert download.status_code == 200
    assert download.content == blob
    assert (jupyter["home"] / "blob.bin").read_bytes() == blob


def test_the_portal_cookies_stay_with_the_portal(proxy_url, jupyter):
    # A kernel prints the Cookie header Jupyter received on its own request log; simpler: Jupyter's
    # /api/me echoes the identity, so check with an upstream that records headers instead.
    from portal.proxy import jupyter_cookies

    raw = [(b"cookie", b"sessionid=abc; csrftoken=def; _xsrf=keep; django_language=zh-hans; other=1")]
    assert jupyter_cookies(raw) == b"_xsrf=keep; other=1"


def test_a_kernel_runs_code_over_the_proxied_websocket(proxy_url, jupyter):
    sid = jupyter["session_id"]
    with _client(proxy_url) as client:
        kernel = client.post(
            f"/jupyter/{sid}/api/kernels", json={"name": "python3"}, headers={"Origin": f"http://{proxy_url}"}
        ).json()

    async def run() -> str:
        uri = f"ws://{proxy_url}/jupyter/{sid}/api/kernels/{kernel['id']}/channels"
        async with websockets.connect(
            uri, additional_headers={"Cookie": "sessionid=owner"}, origin=f"http://{proxy_url}"
        ) as ws:
            msg_id, message = execute_request("print(6 * 7)")
            await ws.send(json.dumps(message))
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if message["msg_type"] == "stream" and message["parent_header"].get("msg_id") == msg_id:
                    return message["content"]["text"]

    assert _run_in_thread(run()).strip() == "42"


def test_a_websocket_of_a_stranger_is_closed(proxy_url, jupyter):
    async def run():
        uri = f"ws://{proxy_url}/jupyter/{jupyter['session_id']}/api/events/subscribe"
        async with websockets.connect(uri, additional_headers={"Cookie": "sessionid=stranger"}) as ws:
            await ws.recv()

    with pytest.raises(websockets.exceptions.WebSocketException):
        _run_in_thread(run())


def _handshake_status(url: str, cookie: str, origin: str | None = None) -> int:
    async def run() -> int:
        try:
            async with websockets.connect(url, additional_headers={"Cookie": cookie}, origin=origin):
                return 101
        except websockets.exceptions.InvalidStatus as refused:
            return refused.response.status_code

    return _run_in_thread(run())


def test_a_refused_handshake_says_why(proxy_url, jupyter):
    events = f"/jupyter/{jupyter['session_id']}/api/events/subscribe"
    assert _handshake_status(f"ws://{proxy_url}{events}", "sessionid=stranger") == 404
    assert (
        _handshake_status(f"ws://{proxy_url}/jupyter/elsewhere/api/events/subscribe", "sessionid=owner")
        == 404
    )
    assert _handshake_status(f"ws://{proxy_url}{events}", "sessionid=stopped") == 409
    assert _handshake_status(f"ws://{proxy_url}{events}", "sessionid=owner", "https://evil.example") == 403
    assert _handshake_status(f"ws://{proxy_url}{events}", "sessionid=owner", f"http://{proxy_url}") == 101
    assert _handshake_status(f"ws://{proxy_url}/elsewhere", "sessionid=owner") == 404  # not the proxy's


def test_a_large_output_comes_through_whole(proxy_url, jupyter):
    """Megabytes from a kernel: the relay stops reading the agent while the browser is behind."""
    sid = jupyter["session_id"]
    with _client(proxy_url) as client:
        kernel = client.post(
            f"/jupyter/{sid}/api/kernels", json={"name": "python3"}, headers={"Origin": f"http://{proxy_url}"}
        ).json()

    async def run() -> int:
        uri = f"ws://{proxy_url}/jupyter/{sid}/api/kernels/{kernel['id']}/channels"
        async with websockets.connect(
            uri, additional_headers={"Cookie": "sessionid=owner"}, origin=f"http://{proxy_url}", max_size=None
        ) as ws:
            msg_id, message = execute_request("print('x' * 4_000_000)")
            await ws.send(json.dumps(message))
            received = 0
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if message["parent_header"].get("msg_id") != msg_id:
                    continue
                if message["msg_type"] == "stream":
                    received += message["content"]["text"].count("x")
                if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                    return received

    assert _run_in_thread(run()) == 4_000_000


def test_the_agent_gets_the_upgrade_with_the_nodes_credential_and_without_the_portals_cookies():
    """A recording upstream (a socket of the test's own) answers 101 and echoes; the relay must send
    it the node token, the agent's own host and origin, the Jupyter cookies only, and then bytes as
    they are."""
    heads: list[bytes] = []

    async def run() -> bytes:
        async def upstream(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\r\n"
            )
            while data := await reader.read(65536):
                writer.write(data)  # echo whatever the client sends, frames as they are
            writer.close()

        agent = await asyncio.start_server(upstream, "127.0.0.1", 0)
        agent_port = agent.sockets[0].getsockname()[1]

        def resolve(cookie, session_id):
            return Route(f"http://127.0.0.1:{agent_port}", "node-token") if cookie == "owner" else None

        port = _free_port()
        server = uvicorn.Server(
            uvicorn.Config(JupyterProxy(resolver=resolve), host="127.0.0.1", port=port, log_level="warning",
                           ws=WebSocketRelay, lifespan="off")
        )  # fmt: skip
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /jupyter/s1/api/kernels/k/channels?session_id=x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\nCookie: sessionid=owner; csrftoken=c; _xsrf=keep\r\n"
                b"Authorization: Bearer stolen\r\n\r\n" % port
            )
            answer = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"\x81\x85abcd" + bytes(a ^ b for a, b in zip(b"hello", b"abcdabcd")))
            echoed = await asyncio.wait_for(reader.readexactly(11), 5)
            writer.close()
            return answer.split(b"\r\n", 1)[0], echoed
        finally:
            server.should_exit = True
            await serving
            agent.close()

    status_line, echoed = _run_in_thread(run())
    assert status_line == b"HTTP/1.1 101 Switching Protocols"
    assert echoed[:2] == b"\x81\x85"  # the client's frame, untouched
    head = heads[0].decode().lower().split("\r\n")
    assert head[0] == "get /jupyter/s1/api/kernels/k/channels?session_id=x http/1.1"
    assert "authorization: bearer node-token" in head and "authorization: bearer stolen" not in head
    assert "cookie: _xsrf=keep" in head and not any(
        "sessionid" in line or "csrftoken" in line for line in head
    )
    assert "sec-websocket-key: dghlihnhbxbszsbub25jzq==" in head
    assert any(line.startswith("origin: http://127.0.0.1:") for line in head)


class _CountingPool(UpstreamPool):
    connects = 0

    async def _connect(self, host: str, port: int):
        type(self).connects += 1
        return await super()._connect(host, port)


def test_one_upstream_connection_serves_request_after_request(jupyter):
    """Keep-alive: httptools only knows a response's keep-alive once the message is complete, and a
    connection per request cost a TCP handshake on every proxied request."""
    host, port = jupyter["upstream"].removeprefix("http://").split(":")
    headers = [(b"authorization", f"token {jupyter['token']}".encode())]

    async def run() -> list[int]:
        pool = _CountingPool()
        statuses = []
        for _ in range(5):
            answer = await pool.request(
                host=host,
                port=int(port),
                method="GET",
                target=f"/jupyter/{jupyter['session_id']}/api/status",
                headers=headers,
                body=None,
                content_length=None,
            )
            await answer.read()
            statuses.append(answer.status)
        pool.close()
        return statuses

    assert _run_in_thread(run()) == [200] * 5
    assert _CountingPool.connects == 1


def test_a_lookup_the_database_cannot_answer_is_a_503_to_try_again_never_a_cached_404():
    """The pool ran dry, or the database restarts: the owner is told to try again (503, Retry-After),
    not that their session does not exist, and the next request asks again."""
    import httpx
    from django.conf import settings
    from django.db import OperationalError

    calls = []

    def resolve(cookie: str, session_id: str):
        calls.append(session_id)
        if len(calls) == 1:
            raise OperationalError("couldn't get a connection after 10.00 sec")
        return None

    proxy = JupyterProxy(resolver=resolve)

    async def get_twice():
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            headers = {"Cookie": f"{settings.SESSION_COOKIE_NAME}=owner"}
            first = await client.get("/jupyter/s1/api/status", headers=headers)
            second = await client.get("/jupyter/s1/api/status", headers=headers)
            return first, second

    first, second = _run_in_thread(get_twice())
    assert first.status_code == 503 and first.headers["retry-after"] == "2"
    assert "try again" in first.text
    assert second.status_code == 404 and calls == ["s1", "s1"]  # asked again: nothing was cached
