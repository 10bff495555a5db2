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
         f"--ServerApp.root_dir={home}", "--ServerApp.disable_check_xsrf=False", "--allow-root"],
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


@pytest.fixture(scope="module")
def proxy_url(jupyter):
    def resolve(cookie: str, session_id: str):
        if session_id != jupyter["session_id"]:
            return None
        if cookie == "stopped":
            return Refusal(status=409, state="stopped", session_url=f"/sessions/{session_id}/")
        return Route(jupyter["upstream"], jupyter["token"], scheme="token") if cookie == "owner" else None

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(JupyterProxy(resolver=resolve), host="127.0.0.1", port=port, log_level="warning")
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
    from portal.proxy import _jupyter_cookies

    raw = [(b"cookie", b"sessionid=abc; csrftoken=def; _xsrf=keep; django_language=zh-hans; other=1")]
    assert _jupyter_cookies(raw) == b"_xsrf=keep; other=1"


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
            msg_id = uuid.uuid4().hex
            await ws.send(json.dumps({
                "header": {"msg_id": msg_id, "username": "t", "session": uuid.uuid4().hex, "msg_type": "execute_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": "print(6 * 7)", "silent": False, "store_history": False,
                            "user_expressions": {}, "allow_stdin": False},
            }))  # fmt: skip
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
