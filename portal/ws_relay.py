"""uvicorn's WebSocket protocol for the portal: a ``/jupyter/<session>/…`` upgrade is relayed as bytes.

uvicorn hands every WebSocket upgrade to a protocol class (``--ws``); its own classes parse each frame
into an ASGI message, and the proxy's ASGI path (``JupyterProxy._websocket``) builds a frame again for
the agent: two parses and two encodings a message, about 0.8 ms of the portal's CPU a kernel round
trip. ``WebSocketRelay`` does what configurable-http-proxy does instead: it asks the same
``JupyterProxy`` whether the logged-in user may use the session (same cookie, same origin rule, same
404 for a stranger), sends the upgrade to the node's agent with its head rewritten (the node token, the
Jupyter cookies only, never the portal's), and once the agent answers 101, passes bytes both ways as
they come, reading no more from a side while the other cannot keep up. No frame is parsed.

Any other WebSocket (and every upgrade when the served application has no ``JupyterProxy``) goes to
uvicorn's own protocol, so ``portal.asgi`` answers it as before. Serve with::

    uvicorn portal.asgi:application --ws portal.ws_relay:WebSocketRelay
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

if TYPE_CHECKING:
    from portal.proxy import JupyterProxy, Route

# Nothing of Django here at import: uvicorn imports this class before the application, and settings
# read that early would miss what portal.asgi sets first (the web process's connection pool).
log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 5.0
ANSWER_TIMEOUT_SECONDS = 30.0  # the agent's answer to the upgrade (it dials the workload's socket first)
MAX_HEAD_BYTES = 64 * 1024
EARLY_BYTES_HIGH = 256 * 1024  # what a client may send before the tunnel is up, before it is paused
REASONS = {403: b"Forbidden", 404: b"Not Found", 409: b"Conflict", 502: b"Bad Gateway"}


def jupyter_proxy_of(app: Any) -> JupyterProxy | None:
    """The ``JupyterProxy`` an application serves: itself, its ``jupyter_proxy`` attribute
    (``portal.asgi.application``), or one found through the ``app`` of uvicorn's wrapping middleware."""
    from portal.proxy import JupyterProxy

    for _ in range(8):
        if isinstance(app, JupyterProxy):
            return app
        found = getattr(app, "jupyter_proxy", None)
        if isinstance(found, JupyterProxy):
            return found
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


class _Side(asyncio.Protocol):
    """Flow control shared by both ends: while this end's transport cannot take more, the peer's
    transport is not read; whatever this end reads goes to the peer's transport as it comes."""

    transport: asyncio.Transport
    peer: asyncio.Transport | None = None
    _write_paused = False

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.peer is not None:
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.peer is not None:
            self.peer.resume_reading()

    def tunnel(self, peer: asyncio.Transport) -> None:
        self.peer = peer
        if self._write_paused:
            peer.pause_reading()


class _AgentSide(_Side):
    """The connection to the node's agent: first its answer's head, then relayed bytes."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.answered: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
            return
        self.head += data
        if not self.answered.done() and (b"\r\n\r\n" in self.head or len(self.head) > MAX_HEAD_BYTES):
            self.answered.set_result(None)
        if len(self.head) > MAX_HEAD_BYTES:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost closes the client's side after its buffer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.answered.done():
            self.answered.set_result(None)
        if self.peer is not None:
            self.peer.close()


class WebSocketRelay(_Side):
    """The client's end. uvicorn calls it with the upgrade's head, rebuilt from what it parsed."""

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.connections = server_state.connections
        self.head = b""
        self.early: list[bytes] = []
        self.early_bytes = 0
        self.agent: _AgentSide | None = None
        self.task: asyncio.Task | None = None
        self.closed = False

    # -- the asyncio protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
        elif self.head:
            self.early.append(data)  # a client that did not wait for the 101
            self.early_bytes += len(data)
            if self.early_bytes > EARLY_BYTES_HIGH:
                self.transport.pause_reading()
        else:
            self._begin(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.agent is not None:
            self.agent.transport.close()

    def shutdown(self) -> None:
        """uvicorn is stopping: the tunnel is cut (the browser's JupyterLab reconnects to another web
        process). Bytes are relayed without knowing frame edges, so no close frame can be added."""
        self.transport.close()

    # -- the upgrade -----------------------------------------------------------------------------------

    def _begin(self, head: bytes) -> None:
        from portal.proxy import PREFIX

        method_line, _, header_block = head.partition(b"\r\n")
        parts = method_line.split(b" ")
        target = parts[1].decode("latin-1") if len(parts) == 3 else ""
        path = target.split("?", 1)[0]
        proxy = jupyter_proxy_of(self.config.loaded_app)
        if proxy is None or not path.startswith(PREFIX):
            self._hand_to_uvicorn(head)
            return
        self.head = head
        headers: list[tuple[bytes, bytes]] = []
        for line in header_block.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if sep:
                headers.append((name.strip().lower(), value.strip()))
        self.task = asyncio.get_running_loop().create_task(self._open(proxy, target, path, headers))

    def _hand_to_uvicorn(self, head: bytes) -> None:
        self.connections.discard(self)
        protocol = AutoWebSocketsProtocol(  # type: ignore[misc]
            config=self.config, server_state=self.server_state, app_state=self.app_state
        )
        protocol.connection_made(self.transport)
        self.transport.set_protocol(protocol)
        protocol.data_received(head)

    async def _open(self, proxy: JupyterProxy, target: str, path: str, headers: list) -> None:
        from portal.proxy import PREFIX, Refusal, same_origin

        first = {}
        for name, value in headers:
            first.setdefault(name, value)
        session_id = path[len(PREFIX) :].split("/", 1)[0]
        if not session_id:
            self._answer(404, b"Not found")
            return
        if not same_origin(first):
            self._answer(403, b"Cross-origin request refused")
            return
        try:
            route = await proxy.route_for(first.get(b"cookie", b"").decode("latin-1"), session_id)
        except Exception:
            log.exception("jupyter websocket: the route lookup failed")
            self._answer(502, b"The session's JupyterLab is not answering; try again shortly.")
            return
        if route is None:
            self._answer(404, b"Not found")
            return
        if isinstance(route, Refusal):
            self._answer(route.status, f"The session is {route.state}.".encode())
            return
        await self._connect(route, target, headers)

    async def _connect(self, route: Route, target: str, headers: list) -> None:
        host, port = route.address
        loop = asyncio.get_running_loop()
        try:
            _, agent = await asyncio.wait_for(
                loop.create_connection(_AgentSide, host, port), CONNECT_TIMEOUT_SECONDS
            )
        except (TimeoutError, OSError) as exc:
            log.info("jupyter websocket upstream %s unreachable: %s", route.upstream, exc)
            self._answer(502, b"The session's JupyterLab is not answering; try again shortly.")
            return
        self.agent = agent
        if self.closed:
            agent.transport.close()
            return
        agent.transport.write(_upgrade_head(target, headers, route, host, port))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agent.answered, ANSWER_TIMEOUT_SECONDS)
        answer = bytes(agent.head)
        end = answer.find(b"\r\n\r\n")
        status_line = answer.split(b"\r\n", 1)[0].split(b" ")
        if end < 0 or len(status_line) < 2 or status_line[1] != b"101":
            log.info("jupyter websocket upstream %s refused: %r", route.upstream, status_line[:3])
            agent.transport.close()
            self._answer(502, b"The session's JupyterLab is not answering; try again shortly.")
            return
        if self.closed:
            agent.transport.close()
            return
        self.transport.write(answer)  # the 101 head and any frame that came with it
        agent.head.clear()
        self.tunnel(agent.transport)
        agent.tunnel(self.transport)
        if not self._write_paused:
            agent.transport.resume_reading()  # paused if more than a head came before the tunnel
        if self.early:
            agent.transport.write(b"".join(self.early))
            self.early.clear()
            self.transport.resume_reading()

    def _answer(self, status: int, text: bytes) -> None:
        """A short plain answer to the handshake, so a client learns why (as ``JupyterProxy._plain``)."""
        if self.closed:
            return
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncache-control: no-store\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, REASONS.get(status, b"Error"), len(text), text)
        )
        with contextlib.suppress(Exception):
            self.transport.close()


def _upgrade_head(target: str, headers: list, route: Route, host: str, port: int) -> bytes:
    """The upgrade as the agent gets it: the client's WebSocket headers (key, version, subprotocols,
    extensions), the Jupyter cookies only, the node's credential, and the agent's own host and origin."""
    from portal.proxy import HOP_BY_HOP, jupyter_cookies

    lines = [b"GET %s HTTP/1.1" % target.encode("latin-1"), b"host: %s:%d" % (host.encode(), port)]
    lines += [name + b": " + value for name, value in headers if name not in HOP_BY_HOP]
    lines += [b"connection: Upgrade", b"upgrade: websocket"]
    cookie = jupyter_cookies(headers)
    if cookie:
        lines.append(b"cookie: " + cookie)
    lines.append(b"authorization: " + route.authorization.encode())
    lines.append(b"origin: " + route.upstream.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"
