"""The agent as its node's gateway: ``/jupyter/<session>/…`` on the agent API, HTTP and WebSocket.

The portal's proxy dials the node's enrolled address (this agent) with the node token; the agent
forwards to the workload's JupyterLab, which listens on a Unix socket in the session's private folder
(bind-mounted into the container with the docker runtime), adds the Jupyter token
itself and scrubs it out of every HTML, JSON or JavaScript answer. A session id the agent does not run
is a 404. Nothing here dials another host.

HTTP is forwarded with ``http.client`` over one kept-alive upstream connection per client connection
and session (the portal keeps its connections to the agent alive too); bodies stream both ways. A
WebSocket upgrade is relayed byte for byte once its head is rewritten: no frame is parsed twice.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
from typing import Protocol
from urllib.parse import urlsplit

CHUNK = 64 * 1024
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; longer paths are reached through /proc/self/fd
CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 300.0  # a long-polling Jupyter request may take this long
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "authorization",
    "content-length",
    "accept-encoding",  # an uncompressed answer can be scrubbed of the token
    "expect",
}
RESPONSE_DROP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "server",
    "date",
    "proxy-authenticate",
    "trailers",
    "upgrade",
}
SCRUBBED_TYPES = ("text/html", "application/json", "text/javascript", "application/javascript")


class GatewayError(Exception):
    """The workload's JupyterLab could not be reached."""


class Upstream(Protocol):
    """Where a workload's JupyterLab answers: what the gateway reads of a runtime's handle."""

    @property
    def socket_path(self) -> str | None: ...

    @property
    def upstream_url(self) -> str: ...


def connect_unix(path: str, timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """A connected Unix stream socket; a path too long for ``sun_path`` is reached through a
    descriptor of its folder (``/proc/self/fd/N/name``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        if len(os.fsencode(path)) <= UNIX_PATH_MAX:
            sock.connect(path)
        else:
            folder, name = os.path.split(path)
            fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
            try:
                sock.connect(f"/proc/self/fd/{fd}/{name}")
            finally:
                os.close(fd)
    except OSError:
        sock.close()
        raise
    return sock


def open_upstream(handle: Upstream, timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """A socket to the workload's JupyterLab: its Unix socket, else the loopback port it published."""
    if handle.socket_path:
        return connect_unix(handle.socket_path, timeout)
    parts = urlsplit(handle.upstream_url or "")
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise GatewayError(f"no local upstream for this workload ({handle.upstream_url!r})")
    sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class UpstreamConnection(http.client.HTTPConnection):
    """``http.client`` over whatever ``open_upstream`` gives for a workload."""

    def __init__(self, handle: Upstream) -> None:
        super().__init__("localhost", timeout=READ_TIMEOUT_SECONDS)
        self._handle = handle

    def connect(self) -> None:
        try:
            self.sock = open_upstream(self._handle)
        except OSError as exc:
            raise GatewayError(f"cannot connect to the workload: {exc}") from exc
        self.sock.settimeout(self.timeout)


def local_request(
    handle: Upstream,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None = None,
    timeout: float = 1.0,
) -> tuple[int, bytes]:
    """One request to the workload's JupyterLab; its status and body."""
    connection = UpstreamConnection(handle)
    connection.timeout = timeout
    try:
        connection.request(method, path, body=body, headers={"Host": "localhost", **headers})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def local_get(handle: Upstream, path: str, headers: dict[str, str], timeout: float = 1.0) -> int:
    """One GET to the workload's JupyterLab; its status (readiness checks)."""
    return local_request(handle, "GET", path, headers, timeout=timeout)[0]


# The notebook a session opens on (the portal's "Open JupyterLab" links to lab/tree/<it>).
WELCOME_NOTEBOOK = "Welcome.ipynb"
WELCOME_CELLS = [
    {"cell_type": "markdown", "metadata": {}, "source": (
        "# Your GPU session · 你的 GPU 会话\n\n"
        "The kernel below is already running. Files in this folder are your home.\n\n"
        "下面的内核已经启动。此文件夹中的文件就是你的主目录。"
    )},
    {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": (
        "import os\n\nprint('GPU', os.environ.get('CUDA_VISIBLE_DEVICES'))"
    )},
]  # fmt: skip


def warm_up(handle: Upstream, base_url: str, token: str, timeout: float = 10.0) -> bool:
    """Have a kernel running for the welcome notebook before the user opens JupyterLab: it starts
    while the page loads instead of after. The notebook is made (by Jupyter, as the workload's user)
    only if the home has none. Returns whether the kernel session was created."""
    headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}
    contents = f"{base_url}api/contents/{WELCOME_NOTEBOOK}"
    if local_request(handle, "GET", f"{contents}?content=0", headers, timeout=timeout)[0] == 404:
        metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
        content = {"cells": WELCOME_CELLS, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}
        notebook = {"type": "notebook", "format": "json", "content": content}
        local_request(handle, "PUT", contents, headers, json.dumps(notebook).encode(), timeout=timeout)
    kernel = {"name": "python3"}
    session = {"path": WELCOME_NOTEBOOK, "name": WELCOME_NOTEBOOK, "type": "notebook", "kernel": kernel}
    status, _ = local_request(
        handle, "POST", f"{base_url}api/sessions", headers, json.dumps(session).encode(), timeout=timeout
    )
    return status == 201


def forwarded_headers(headers, jupyter_token: str, *, websocket: bool = False) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones and its credential, plus the Jupyter token. A
    WebSocket upgrade keeps its Connection and Upgrade headers."""
    kept = []
    for name, value in headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP and not (websocket and lower in ("connection", "upgrade")):
            continue
        kept.append((name, value))
    kept.append(("Authorization", f"token {jupyter_token}"))
    return kept


def relay_chunked(source, sink) -> None:
    """Copy a chunked request body from ``source`` (the client) to ``sink`` (the upstream), as is."""
    while True:
        line = source.readline(1024)
        if not line:
            raise GatewayError("the client ended a chunked body early")
        sink(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the empty line
                trailer = source.readline(8192)
                sink(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return
        remaining = size + 2  # the chunk and its CRLF
        while remaining:
            data = source.read(min(remaining, CHUNK))
            if not data:
                raise GatewayError("the client ended a chunked body early")
            sink(data)
            remaining -= len(data)


def splice(client: socket.socket, client_reader, upstream: socket.socket) -> None:
    """Relay bytes both ways until either side closes (a WebSocket after its upgrade)."""
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    upstream.settimeout(None)
    client.settimeout(None)

    def client_to_upstream() -> None:
        try:
            while True:
                data = client_reader.read1(CHUNK)
                if not data:
                    break
                upstream.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    pump = threading.Thread(target=client_to_upstream, name="ws-in", daemon=True)
    pump.start()
    try:
        while True:
            data = upstream.recv(CHUNK)
            if not data:
                break
            client.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        client.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        upstream.close()
    pump.join(timeout=5)
