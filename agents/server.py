"""The agent's HTTP server: one asyncio event loop on the agent's port, HTTP/1.1 parsed by ``httptools``.

``/jupyter/<session>/…`` (agents/gateway.py) is served on the loop itself: it is the node's hot path,
every notebook request and kernel message of every session on the node. Every other route (``/v1/…``,
``/metrics``) has its body read in full and is answered by ``AgentApi.answer`` on a small thread pool:
those calls may wait on the runtime (a workload starting or stopping) and never hold up the loop.

Every call needs ``Authorization: Bearer <node token>`` (compared in constant time by ``AgentApi``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import http
import logging
import socket
import threading
from collections.abc import Callable

import httptools

from agents import gateway
from agents.api import GATEWAY_PREFIX, MAX_BODY_BYTES, AgentApi, ApiError

try:
    import uvloop  # comes with uvicorn[standard]; the agent also runs where only asyncio is
except ImportError:
    uvloop = None

log = logging.getLogger("agents.server")
API_THREADS = 16
KEEP, CLOSE, TUNNEL = "keep", "close", "tunnel"  # what becomes of a connection after a request
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class RequestBody:
    """A request's body as it arrives; reading it lets the client send more (back-pressure)."""

    def __init__(self, connection: HttpConnection, expect_continue: bool) -> None:
        self._connection = connection
        self._expect_continue = expect_continue
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self.complete = False
        self._lost = False
        self._waiter: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= gateway.BUFFER_HIGH_BYTES:
            self._connection.transport.pause_reading()
        self._wake()

    def end(self) -> None:
        self.complete = True
        self._wake()

    def lose(self) -> None:
        self._lost = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self) -> bytes:
        """The next piece of the body, b"" at its end; ConnectionResetError if the client left."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._lost:
                raise ConnectionResetError("the client went away mid-body")
            if self._expect_continue:
                self._expect_continue = False
                self._connection.transport.write(CONTINUE)
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._buffered < gateway.BUFFER_HIGH_BYTES:
            self._connection.transport.resume_reading()
        return data

    async def read_all(self, limit: int) -> bytes | None:
        """The whole body; None when it is longer than ``limit``."""
        parts, size = [], 0
        while data := await self.read():
            size += len(data)
            if size > limit:
                return None
            parts.append(data)
        return b"".join(parts)


class Request:
    __slots__ = ("method", "target", "headers", "keep_alive", "upgrade", "body", "answered")

    def __init__(self) -> None:
        self.answered = False  # whether any of the answer has been written
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []  # names in lower case

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def path(self) -> str:
        return self.target.split(b"?", 1)[0].decode("latin-1")


class HttpConnection(gateway.Endpoint):
    """A client's connection: requests are parsed as bytes arrive and answered one at a time, in order,
    by ``AgentServer.handle``; after a WebSocket upgrade it is the client's end of a tunnel."""

    half_close_on_eof = True

    def __init__(self, server: AgentServer) -> None:
        super().__init__()
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._request: Request | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._task: asyncio.Task | None = None
        self._upgraded: list[bytes] | None = None  # bytes after an upgrade's head, until the tunnel is up
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # asyncio sets TCP_NODELAY only on sockets it made itself with IPPROTO_TCP; a kernel answer is
        # several small writes, each of which would otherwise wait for the ACK of the one before.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
            return
        if self._upgraded is not None:
            self._upgraded.append(data)
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded = [data[exc.args[0] :]]
        except httptools.HttpParserError:
            if self._task is None:
                self.transport.write(_response_head(400, [(b"content-length", b"0")], close=True))
            self.transport.close()

    def eof_received(self) -> bool:
        if self.peer is None and self._task is not None:
            self._eof = True
            return True  # a client that half-closes after its request still gets the answer
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for request in self._queue:
            request.body.lose()
        if self._task is not None:
            self._task.cancel()

    def tunnel_to(self, upstream: gateway.UpstreamConnection) -> None:
        """Relay bytes both ways between this client and ``upstream`` (which has answered 101)."""
        early, self._upgraded = b"".join(self._upgraded or ()), None
        if early:
            upstream.write(early)
        self.transport.write(upstream.switched())
        upstream.tunnel(self.transport)
        self.tunnel(upstream.transport)
        if self.closed:
            upstream.close()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._request = Request()

    def on_url(self, url: bytes) -> None:
        self._request.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._request.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        request, parser = self._request, self._parser
        request.method = parser.get_method()
        request.keep_alive = parser.should_keep_alive()
        request.upgrade = parser.should_upgrade()
        request.body = RequestBody(self, (request.header(b"expect") or b"").lower() == b"100-continue")
        self._queue.append(request)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve())

    def on_body(self, body: bytes) -> None:
        self._request.body.feed(bytes(body))

    def on_message_complete(self) -> None:
        self._request.body.end()

    async def _serve(self) -> None:
        try:
            while self._queue:
                request = self._queue[0]
                try:
                    after = await self._server.handle(request, self)
                except Exception:
                    log.exception("%s %s failed", request.method.decode(), request.path)
                    if not request.answered:
                        _answer_error(self, ApiError(500, "internal", "internal error"), close=True)
                    after = CLOSE
                self._queue.popleft()
                if after == TUNNEL:
                    return
                if after == CLOSE or not request.keep_alive or not request.body.complete:
                    self.transport.close()  # an unread body is not a next request
                    return
            if self._eof:
                self.transport.close()
        finally:
            self._task = None


class AgentServer:
    """The agent API and gateway on one listening socket; ``serve_forever`` runs the loop (on a thread
    of the caller's), ``shutdown`` stops it from another thread."""

    def __init__(self, sock: socket.socket, api: AgentApi) -> None:
        self._socket = sock
        self.server_address = sock.getsockname()
        self.api = api
        self._executor = concurrent.futures.ThreadPoolExecutor(API_THREADS, thread_name_prefix="api")
        self.targets = gateway.Targets(api.gateway_target, self._executor)
        self.pool = gateway.UpstreamPool()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._serve())
        finally:
            self._stopped.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await self._loop.create_server(lambda: HttpConnection(self), sock=self._socket)
        try:
            await self._stop.wait()
        finally:
            server.close()
            self.pool.close()

    def shutdown(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped.wait(10)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        self._socket.close()

    # -- requests ----------------------------------------------------------------------------------------

    async def handle(self, request: Request, connection: HttpConnection) -> str:
        """Answer one request; what becomes of the connection afterwards."""
        path = request.path
        if path.startswith(GATEWAY_PREFIX):
            return await self._gateway(request, connection, path)
        body = await request.body.read_all(MAX_BODY_BYTES)
        if body is None:
            _answer_error(connection, ApiError(413, "too_large", "the body is too large"), close=True)
            return CLOSE
        authorization = request.header(b"authorization")
        status, content_type, data = await self._loop.run_in_executor(
            self._executor,
            self.api.answer,
            request.method.decode("latin-1"),
            path,
            authorization.decode("latin-1") if authorization is not None else None,
            body,
        )
        if request.method != b"GET":
            self.targets.forget()  # a workload deleted (or made) through the API is seen at once
        headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(data))]
        connection.transport.write(_response_head(status, headers, close=request.upgrade) + data)
        return CLOSE if request.upgrade else KEEP  # after an upgrade's head, no next request is parsed

    async def _target(
        self, session_id: str, path: str, *, fresh: bool = False
    ) -> tuple[gateway.Target, bool]:
        """The session's target (ApiError 404 for a session not run here or a path outside its base
        URL, 503 while its token is not known) and whether it was cached."""
        target, cached = await self.targets.get(session_id, fresh=fresh)
        if not path.startswith(target.base_url):
            raise ApiError(404, "not_found", "no such session on this node")
        return target, cached

    async def _connect(
        self, session_id: str, path: str, target: gateway.Target, cached: bool, *, pooled: bool, fresh: bool
    ) -> tuple[gateway.UpstreamConnection, bool, gateway.Target, bool]:
        """A connection to the session's JupyterLab (kept-alive from the pool where ``pooled``), whether
        it was kept alive, and the target it serves and whether that is a cached one. A cached target
        that no longer answers is looked up again first: a session that stopped meanwhile is a 404,
        not a 502."""
        try:
            if pooled:
                connection, reused = await self.pool.connection(target.address, fresh=fresh)
            else:
                connection, reused = await gateway.open_connection(target.address), False
        except gateway.GatewayError:
            if not cached:
                raise
            target, _ = await self._target(session_id, path, fresh=True)
            return await self._connect(session_id, path, target, False, pooled=pooled, fresh=True)
        return connection, reused, target, cached

    async def _gateway(self, request: Request, connection: HttpConnection, path: str) -> str:
        """Forward one request of the portal to the workload's JupyterLab."""
        authorization = request.header(b"authorization")
        session_id = path[len(GATEWAY_PREFIX) :].split("/", 1)[0]
        try:
            if not self.api.authorised(authorization.decode("latin-1") if authorization else None):
                raise ApiError(
                    401, "unauthorised", "a valid 'Authorization: Bearer <node token>' is required"
                )
            target, cached = await self._target(session_id, path)
            if request.upgrade:
                return await self._websocket(request, connection, session_id, path, target, cached)
            return await self._forward(request, connection, session_id, path, target, cached)
        except ApiError as exc:
            close = request.upgrade or not request.body.complete
            _answer_error(connection, exc, close=close)
            return CLOSE if close else KEEP
        except (gateway.GatewayError, OSError) as exc:
            log.info("gateway %s %s: %s", request.method.decode(), path, exc)
            unreachable = ApiError(502, "upstream_unreachable", "the workload's JupyterLab is not answering")
            _answer_error(connection, unreachable, close=True)
            return CLOSE

    async def _websocket(
        self,
        request: Request,
        connection: HttpConnection,
        session_id: str,
        path: str,
        target: gateway.Target,
        cached: bool,
    ) -> str:
        """Send the upgrade with its head rewritten; on a 101, relay bytes both ways from then on (no
        frame is parsed twice). Any other answer is relayed as an ordinary one, scrubbed."""
        upstream, _, target, _ = await self._connect(
            session_id, path, target, cached, pooled=False, fresh=True
        )
        try:
            head = gateway.request_head(
                request.method,
                target.upstream_path(request.target),
                request.headers,
                target.token,
                websocket=True,
            )
            upstream.send(request.method, head)
            await upstream.answer_head()
            if upstream.status != 101:
                await self._relay_answer(request, connection, upstream, target)
                upstream.close()
                return CLOSE
        except BaseException:
            upstream.close()
            raise
        connection.transport.write(_response_head(101, upstream.headers, upstream.reason))
        connection.tunnel_to(upstream)
        return TUNNEL

    async def _forward(
        self,
        request: Request,
        connection: HttpConnection,
        session_id: str,
        path: str,
        target: gateway.Target,
        cached: bool,
    ) -> str:
        length = request.header(b"content-length")
        chunked = b"chunked" in (request.header(b"transfer-encoding") or b"").lower()
        if chunked:
            framing = b"transfer-encoding: chunked\r\n"
        elif (length and length != b"0") or request.method in (b"POST", b"PUT", b"PATCH"):
            framing = b"content-length: %s\r\n" % (length or b"0")
        else:
            framing = b""
        has_body = chunked or bool(length and length != b"0")
        fresh = False
        while True:
            upstream, reused, target, cached = await self._connect(
                session_id, path, target, cached, pooled=True, fresh=fresh
            )
            head = gateway.request_head(
                request.method, target.upstream_path(request.target), request.headers, target.token, framing
            )
            try:
                upstream.send(request.method, head)
                if has_body:
                    while data := await request.body.read():
                        upstream.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
                        await upstream.drain()
                    if chunked:
                        upstream.write(b"0\r\n\r\n")
                await upstream.answer_head()
                break
            except (OSError, gateway.GatewayError):
                upstream.close()
                if reused and not has_body:
                    fresh = True  # a kept-alive connection the workload closed meanwhile
                    continue
                raise
        try:
            await self._relay_answer(request, connection, upstream, target)
        except (OSError, gateway.GatewayError) as exc:
            upstream.close()
            if not request.answered:
                raise
            log.info("gateway %s %s: %s", request.method.decode(), path, exc)
            return CLOSE  # the answer has begun: no other can follow
        except BaseException:
            upstream.close()
            raise
        self.pool.release(target.address, upstream)
        return KEEP

    async def _relay_answer(
        self,
        request: Request,
        connection: HttpConnection,
        upstream: gateway.UpstreamConnection,
        target: gateway.Target,
    ) -> None:
        status = upstream.status
        headers = [(name, value) for name, value in upstream.headers if name not in gateway.RESPONSE_DROP]
        content_type = (upstream.header(b"content-type") or b"").lower()
        length = upstream.header(b"content-length")

        def write(data: bytes) -> None:
            request.answered = True
            connection.transport.write(data)

        if request.method == b"HEAD" or status in gateway.NO_BODY_STATUSES or 100 <= status < 200:
            headers.append((b"content-length", length or b"0"))
            write(_response_head(status, headers, upstream.reason))
        elif content_type.startswith(gateway.SCRUBBED_TYPES) and not upstream.header(b"content-encoding"):
            body = (await upstream.read_body()).replace(target.token.encode(), b"")
            headers.append((b"content-length", b"%d" % len(body)))
            write(_response_head(status, headers, upstream.reason) + body)
        elif upstream.body_in_hand():
            body = await upstream.read_body()  # one write: one segment, one wake-up of the portal's proxy
            headers.append((b"content-length", b"%d" % len(body)))
            write(_response_head(status, headers, upstream.reason) + body)
        elif length is not None:
            headers.append((b"content-length", length))
            write(_response_head(status, headers, upstream.reason))
            while data := await upstream.next_chunk():
                write(data)
                await connection.drain()
        else:
            headers.append((b"transfer-encoding", b"chunked"))
            write(_response_head(status, headers, upstream.reason))
            while data := await upstream.next_chunk():
                write(b"%x\r\n%b\r\n" % (len(data), data))
                await connection.drain()
            write(b"0\r\n\r\n")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop where it is installed (it comes with uvicorn[standard], as the portal's does): a
    forwarded request costs about half as much Python around it."""
    return uvloop.new_event_loop if uvloop is not None else asyncio.new_event_loop


def _response_head(
    status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"", *, close: bool = False
) -> bytes:
    if not reason:
        try:
            reason = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b"Unknown"
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in headers:
        parts += [name, b": ", value, b"\r\n"]
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _answer_error(connection: HttpConnection, exc: ApiError, *, close: bool = False) -> None:
    status, content_type, data = exc.answer()
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(data))]
    connection.transport.write(_response_head(status, headers, close=close) + data)


def make_server(host: str, port: int, api: AgentApi) -> AgentServer:
    """Bind now (an address in use fails here, not later on the loop's thread)."""
    return AgentServer(socket.create_server((host, port), backlog=128), api)
