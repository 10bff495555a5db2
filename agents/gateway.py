"""The agent as its node's gateway: ``/jupyter/<session>/…`` on the agent API, HTTP and WebSocket.

The portal's proxy dials the node's enrolled address (this agent) with the node token; the agent
forwards to the workload's JupyterLab, which listens on a Unix socket in the session's private folder
(bind-mounted into the container with the docker runtime), adds the Jupyter token
itself and scrubs it out of every HTML, JSON or JavaScript answer. A session id the agent does not run
is a 404. Nothing here dials another host.

The forwarding runs on the agent server's event loop (agents/server.py): requests go over kept-alive
connections to the workload's socket, pooled per workload (``UpstreamPool``), answers are parsed by
``httptools`` and bodies stream both ways with back-pressure. A WebSocket upgrade is relayed byte for
byte once its head is rewritten (``Tunnel``): no frame is parsed twice. The synchronous helpers at the
end (``local_request``, ``warm_up``) serve the agent's own calls to a workload from its threads.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools

CHUNK = 64 * 1024
BUFFER_HIGH_BYTES = 256 * 1024  # read no more from a side while this much waits to be passed on
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; longer paths are reached through /proc/self/fd
CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 300.0  # a long-polling Jupyter request may take this long
TARGET_CACHE_SECONDS = 1.0  # how long a session's resolved upstream is reused without asking again
MAX_IDLE_PER_UPSTREAM = 8
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"proxy-connection",
    b"te",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"authorization",
    b"content-length",
    b"accept-encoding",  # an uncompressed answer can be scrubbed of the token
    b"expect",
}
RESPONSE_DROP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"content-length",
    b"server",
    b"date",
    b"proxy-authenticate",
    b"trailers",
    b"upgrade",
}
SCRUBBED_TYPES = (b"text/html", b"application/json", b"text/javascript", b"application/javascript")
NO_BODY_STATUSES = {204, 304}


class GatewayError(Exception):
    """The workload's JupyterLab could not be reached."""


# -- where a workload listens ------------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """A workload's JupyterLab: a Unix socket, or a port on this host's loopback."""

    unix_path: str | None = None
    host: str = ""
    port: int = 0


@dataclass(frozen=True)
class Target:
    """What the gateway needs to forward to one session: where, under which path, with which token."""

    address: Address
    base_url: str
    token: str
    # code-server (the vscode interface) serves at its socket's root, with relative links only: the
    # session's base URL is taken off the path it is sent
    strip_base_url: bool = False

    def upstream_path(self, target: bytes) -> bytes:
        """The request target as the workload expects it (the caller checked it is under base_url)."""
        if not self.strip_base_url:
            return target
        return b"/" + target[len(self.base_url) :]


class Upstream(Protocol):
    """Where a workload's JupyterLab answers: what the gateway reads of a runtime's handle."""

    @property
    def socket_path(self) -> str | None: ...

    @property
    def upstream_url(self) -> str: ...


def upstream_address(handle: Upstream) -> Address:
    """Where a workload's JupyterLab listens: its Unix socket, else the loopback port it published.
    GatewayError for anything else (never another host)."""
    if handle.socket_path:
        return Address(unix_path=handle.socket_path)
    parts = urlsplit(handle.upstream_url or "")
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise GatewayError(f"no local upstream for this workload ({handle.upstream_url!r})")
    return Address(host=parts.hostname, port=parts.port or 80)


def workload_target(workload: Any, runtime: Any) -> Target | None:
    """The one reader of a workload for the gateway: its upstream, base URL and Jupyter token (from
    memory, else from the runtime after a restart; "" while unknown). None while it has no runtime
    handle or no local upstream."""
    handle = workload.handle
    if handle is None:
        return None
    try:
        address = upstream_address(handle)
    except GatewayError:
        return None
    token = workload.token or runtime.jupyter_token(handle) or ""
    base_url = workload.spec.get("base_url") or "/-/"
    return Target(
        address=address, base_url=base_url, token=token, strip_base_url=handle.interface == "vscode"
    )


def _unix_connect_path(path: str) -> tuple[str, int | None]:
    """The path to connect to and a descriptor to close afterwards: a path too long for ``sun_path``
    is reached through a descriptor of its folder (``/proc/self/fd/N/name``)."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        return path, None
    folder, name = os.path.split(path)
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{name}", fd


# -- the gateway's side: on the event loop -----------------------------------------------------------------


def request_head(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    jupyter_token: str,
    framing: bytes = b"",
    *,
    websocket: bool = False,
) -> bytes:
    """The head of a request to the workload: the client's headers (names in lower case) minus
    hop-by-hop ones and its credential, plus the Jupyter token and ``framing`` (a Content-Length or
    Transfer-Encoding line). A WebSocket upgrade keeps its Connection and Upgrade headers."""
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if name in HOP_BY_HOP and not (websocket and name in (b"connection", b"upgrade")):
            continue
        parts += [name, b": ", value, b"\r\n"]
    parts += [b"authorization: token ", jupyter_token.encode(), b"\r\n", framing, b"\r\n"]
    return b"".join(parts)


class Targets:
    """Sessions' resolved targets, each reused for ``TARGET_CACHE_SECONDS``: the lookup takes the
    workload table's lock, which a start or a stop may hold for seconds, so it runs on a thread and
    not on the loop, and not for every request. ``resolve`` raises for a session not served."""

    def __init__(self, resolve: Callable[[str], Target], executor: Any) -> None:
        self._resolve = resolve
        self._executor = executor
        self._cache: dict[str, tuple[float, Target]] = {}

    async def get(self, session_id: str, *, fresh: bool = False) -> tuple[Target, bool]:
        """The session's target and whether it came from the cache."""
        now = time.monotonic()
        cached = None if fresh else self._cache.get(session_id)
        if cached is not None and cached[0] > now:
            return cached[1], True
        loop = asyncio.get_running_loop()
        try:
            target = await loop.run_in_executor(self._executor, self._resolve, session_id)
        except BaseException:
            self._cache.pop(session_id, None)
            raise
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[session_id] = (now + TARGET_CACHE_SECONDS, target)
        return target, False

    def forget(self) -> None:
        self._cache.clear()


class Endpoint(asyncio.Protocol):
    """One side of a forwarded exchange (the client's connection or the workload's): writes with
    back-pressure (``drain``), and, once ``peer`` is set by ``tunnel``, a relay that passes every byte
    read to the peer's transport as it comes and stops reading while the peer cannot keep up."""

    transport: asyncio.Transport
    half_close_on_eof = False  # True on the client's side: its EOF is passed on, the answer may follow

    def __init__(self) -> None:
        self.peer: asyncio.Transport | None = None
        self.closed = False
        self._write_paused = False
        self._drained: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def tunnel(self, peer: asyncio.Transport) -> None:
        self.peer = peer
        if self._write_paused:
            peer.pause_reading()

    def eof_received(self) -> bool:
        if self.peer is not None and self.half_close_on_eof and self.peer.can_write_eof():
            self.peer.write_eof()
            return True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None:
            self.peer.close()  # after what it has buffered is written
        self._wake_drain()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.peer is not None:
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.peer is not None:
            self.peer.resume_reading()
        self._wake_drain()

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the connection is closed")
        if self._write_paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
            if self.closed:
                raise ConnectionResetError("the connection is closed")

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def close(self) -> None:
        if not self.closed:
            self.transport.close()


class UpstreamConnection(Endpoint):
    """A connection to a workload's JupyterLab, for one request at a time; the answer is parsed by
    ``httptools`` as it arrives, and its body waits in a bounded buffer until it is passed on."""

    def __init__(self) -> None:
        super().__init__()
        self._waiter: asyncio.Future | None = None
        self._start(b"GET")

    def _start(self, method: bytes) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = method == b"HEAD"
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False  # known once the answer is complete: may the connection serve another?
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: str | None = None
        self._length_known = False  # the body ends at a length or a last chunk, not at the connection's end
        self._switched: list[bytes] | None = None  # after a 101: bytes for the client, until the tunnel

    def send(self, method: bytes, head: bytes) -> None:
        """Start a request: its head is written at once, its body (if any) with ``write``."""
        self._start(method)
        self.transport.write(head)

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def answer_head(self) -> None:
        """Wait until the answer's head is in; GatewayError when the workload closed or broke first."""
        while not self.headers_done:
            if self._error or self.closed:
                raise GatewayError(self._error or "the workload closed the connection")
            await self._wait()

    async def next_chunk(self) -> bytes:
        """The next piece of the answer's body, b"" at its end; GatewayError when the connection ends
        before a body of known length does."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error or (self.closed and self._length_known):
                raise GatewayError(self._error or "the workload ended its answer early")
            if self.closed:
                return b""
            await self._wait()
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._buffered < BUFFER_HIGH_BYTES and not self.closed:
            self.transport.resume_reading()
        return data

    def switched(self) -> bytes:
        """What the workload sent after its 101 answer's head (a WebSocket's first frames)."""
        rest, self._switched = b"".join(self._switched or ()), None
        return rest

    def body_in_hand(self) -> bool:
        """Whether the whole body has arrived already (most Jupyter API answers: one segment)."""
        return self.complete

    async def read_body(self) -> bytes:
        parts = []
        while data := await self.next_chunk():
            parts.append(data)
        return b"".join(parts)

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and not self._chunks

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(READ_TIMEOUT_SECONDS, self._time_out)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _time_out(self) -> None:
        self._error = f"no answer within {READ_TIMEOUT_SECONDS:.0f} s"
        self.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
            return
        if self._switched is not None:
            self._switched.append(data)
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:  # a 101: what follows is the new protocol's
            self._switched = [data[exc.args[0] :]]
        except httptools.HttpParserError as exc:
            self._error = f"the workload broke HTTP: {exc}"
            self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._wake()

    # httptools' callbacks

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._length_known = (
            self.header(b"content-length") is not None
            or b"chunked" in (self.header(b"transfer-encoding") or b"").lower()
        )
        if self._head_only or self.status in NO_BODY_STATUSES or 100 <= self.status < 200:
            # No body follows. httptools cannot know that of a HEAD answer: its connection is not
            # reused (the parser would read the next answer as this one's body).
            self.complete = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(bytes(body))
        self._buffered += len(body)
        if self._buffered >= BUFFER_HIGH_BYTES:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked here, not at the head: before the message is complete httptools answers False.
        self.keep_alive = self._parser.should_keep_alive() and not self._head_only


async def open_connection(address: Address) -> UpstreamConnection:
    """A new connection to the workload's JupyterLab; GatewayError when it does not answer."""
    loop = asyncio.get_running_loop()
    try:
        if address.unix_path:
            path, fd = _unix_connect_path(address.unix_path)
            try:
                _, connection = await asyncio.wait_for(
                    loop.create_unix_connection(UpstreamConnection, path), CONNECT_TIMEOUT_SECONDS
                )
            finally:
                if fd is not None:
                    os.close(fd)
        else:
            _, connection = await asyncio.wait_for(
                loop.create_connection(UpstreamConnection, address.host, address.port),
                CONNECT_TIMEOUT_SECONDS,
            )
    except (OSError, TimeoutError) as exc:
        raise GatewayError(f"cannot connect to the workload: {exc}") from exc
    return connection


class UpstreamPool:
    """Idle kept-alive connections per workload (its address); a connection serves one request at a
    time, and one the workload closed while idle is dropped when next looked at."""

    def __init__(self, max_idle_per_upstream: int = MAX_IDLE_PER_UPSTREAM) -> None:
        self._idle: dict[Address, list[UpstreamConnection]] = {}
        self._max_idle = max_idle_per_upstream

    async def connection(self, address: Address, *, fresh: bool = False) -> tuple[UpstreamConnection, bool]:
        """A connection to the workload and whether it is a kept-alive one (which the workload may
        have closed meanwhile: a caller retries such a one on a fresh connection)."""
        idle = self._idle.get(address)
        while idle and not fresh:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
        if idle is not None and not idle:
            del self._idle[address]
        return await open_connection(address), False

    def release(self, address: Address, connection: UpstreamConnection) -> None:
        idle = self._idle.setdefault(address, [])
        if connection.reusable and len(idle) < self._max_idle:
            idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


# -- the agent's own calls to a workload, from its threads ---------------------------------------------


def connect_unix(path: str, timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """A connected Unix stream socket (long paths through ``_unix_connect_path``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        target, fd = _unix_connect_path(path)
        try:
            sock.connect(target)
        finally:
            if fd is not None:
                os.close(fd)
    except OSError:
        sock.close()
        raise
    return sock


def open_upstream(handle: Upstream, timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """A socket to the workload's JupyterLab: its Unix socket, else the loopback port it published."""
    address = upstream_address(handle)
    if address.unix_path:
        return connect_unix(address.unix_path, timeout)
    sock = socket.create_connection((address.host, address.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class LocalConnection(http.client.HTTPConnection):
    """``http.client`` over whatever ``open_upstream`` gives for a workload."""

    def __init__(self, handle: Upstream, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
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
    connection = LocalConnection(handle, timeout)
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
