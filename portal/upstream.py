"""A lean HTTP/1.1 and WebSocket client for the Jupyter proxy: kept-alive connections per upstream,
responses parsed by ``httptools`` (the C parser uvicorn uses), bodies streamed both ways; WebSockets on
websockets' sans-I/O protocol without its asyncio layer.

A general client (httpx) costs several hundred microseconds a request in Python; this one does only
what a reverse proxy needs, which is what keeps a proxied request close to a direct one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import httptools
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidHandshake
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.typing import Origin, Subprotocol
from websockets.uri import parse_uri

NO_BODY_STATUSES = {204, 304}


class UpstreamError(Exception):
    """The upstream could not be reached or broke the protocol."""


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class _ResponseParser:
    """Collects httptools callbacks into a status, headers and a queue of body chunks."""

    def __init__(self, method: bytes):
        self.method = method
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False  # known once the message is complete: may the connection serve another?
        self.chunks: collections.deque[bytes] = collections.deque()
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        status = self.parser.get_status_code()
        if self.method == b"HEAD" or status in NO_BODY_STATUSES or 100 <= status < 200:
            # httptools cannot know a HEAD answer has no body: the message ends here, and the connection
            # is not reused (the parser would read the next answer as this one's body).
            self.complete = True
            return
        return None

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked here, not at the headers: before the message is complete httptools answers False.
        self.keep_alive = self.parser.should_keep_alive()


class UpstreamResponse:
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: AsyncIterator[bytes]):
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.body])


class UpstreamPool:
    """Idle kept-alive connections per (host, port); a connection serves one request at a time."""

    def __init__(self, *, max_idle_per_upstream: int = 32, connect_timeout_seconds: float = 5.0):
        self._idle: dict[tuple[str, int], list[_Connection]] = collections.defaultdict(list)
        self._max_idle = max_idle_per_upstream
        self._connect_timeout = connect_timeout_seconds

    async def _connect(self, host: str, port: int) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=2**20), self._connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Connection(reader, writer)

    def _release(self, key: tuple[str, int], connection: _Connection) -> None:
        idle = self._idle[key]
        if len(idle) < self._max_idle and not connection.writer.is_closing():
            idle.append(connection)
        else:
            connection.close()

    async def request(
        self,
        *,
        host: str,
        port: int,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        content_length: int | None,
    ) -> UpstreamResponse:
        """Send one request and return once the response headers are in; the body streams after."""
        key = (host, port)
        method_bytes = method.encode("ascii")
        chunked = body is not None and content_length is None
        request_head = _request_head(
            method_bytes,
            target,
            host=host,
            port=port,
            headers=headers,
            chunked=chunked,
            content_length=content_length,
        )
        # A kept-alive connection may have been closed by the upstream meanwhile: retry once on a new one,
        # but only when no body bytes were consumed (a body iterator cannot be replayed).
        for attempt in (0, 1):
            idle = self._idle[key]
            reused = bool(idle) and attempt == 0
            connection = idle.pop() if reused else await self._connect(host, port)
            try:
                await _request_send(connection, request_head, body, chunked=chunked)
                parser = await _response_head_read(connection, method_bytes)
                break
            except (OSError, UpstreamError, httptools.HttpParserError) as exc:
                connection.close()
                if reused and body is None:
                    continue
                raise UpstreamError(str(exc)) from exc
        status = parser.parser.get_status_code()
        return UpstreamResponse(status, parser.headers, self._response_body(key, connection, parser))

    async def _response_body(
        self, key: tuple[str, int], connection: _Connection, parser: _ResponseParser
    ) -> AsyncIterator[bytes]:
        """The rest of the response as it arrives. The connection goes back to the pool when the message
        ended cleanly and the upstream keeps it alive; otherwise, or on any error, it is closed."""
        reusable = True
        try:
            while True:
                while parser.chunks:
                    yield parser.chunks.popleft()
                if parser.complete:
                    break
                data = await connection.reader.read(65536)
                if not data:  # a body that ends with the connection
                    reusable = False
                    break
                parser.parser.feed_data(data)
        except BaseException:
            connection.close()
            raise
        if reusable and parser.keep_alive:
            self._release(key, connection)
        else:
            connection.close()

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


class UpstreamWebSocket(asyncio.Protocol):
    """A WebSocket to the node's gateway, spoken through websockets' sans-I/O protocol (its parser, its
    framing and masking with their C speedups, its answers to pings and closes) without its asyncio
    connection layer: a message from the gateway costs one parse and, at most, one wake-up of the task
    that passes it on; a message to it, one framing and one write."""

    def __init__(self, protocol: ClientProtocol) -> None:
        self._protocol = protocol
        self._messages: collections.deque[str | bytes] = collections.deque()
        self._fragments: list[Frame] = []
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._write_paused = False
        self._quick_ack: Callable[[], None] = lambda: None
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = False

    @property
    def subprotocol(self) -> str | None:
        return self._protocol.subprotocol

    @property
    def close_code(self) -> int | None:
        return self._protocol.close_code

    # -- what the proxy calls ----------------------------------------------------------------------

    async def recv(self) -> str | bytes | None:
        """The next whole message (text as str, binary as bytes); None once the WebSocket is closed."""
        while not self._messages:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._messages.popleft()

    async def send(self, message: str | bytes) -> None:
        if self.closed:
            raise UpstreamError("the upstream WebSocket is closed")
        if isinstance(message, str):
            self._protocol.send_text(message.encode())
        else:
            self._protocol.send_binary(message)
        self._flush()
        if self._write_paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def close(self, code: int = 1000) -> None:
        if not self.closed and self._protocol.state is State.OPEN:
            self._protocol.send_close(code)
            self._flush()
        self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._quick_ack = _quick_acks(transport.get_extra_info("socket"))
        self._flush()  # the handshake's request

    def data_received(self, data: bytes) -> None:
        self._quick_ack()
        protocol = self._protocol
        protocol.receive_data(data)
        for event in protocol.events_received():
            if isinstance(event, Frame):
                self._frame(event)
            elif not self.opened.done():  # the handshake's answer
                if protocol.handshake_exc is None:
                    self.opened.set_result(None)
                else:
                    self.opened.set_exception(protocol.handshake_exc)
        self._flush()  # pongs, the answer to a close
        if protocol.close_expected() or protocol.state is State.CLOSED:
            self.transport.close()
        self._wake()

    def eof_received(self) -> bool:
        self._protocol.receive_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.opened.done():
            self.opened.set_exception(UpstreamError(f"the upstream closed the connection: {exc}"))
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _frame(self, frame: Frame) -> None:
        if frame.opcode not in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
            return  # pings, pongs and closes: the protocol has answered them
        if not frame.fin or self._fragments:
            self._fragments.append(frame)
            if not frame.fin:
                return
            frame = Frame(self._fragments[0].opcode, b"".join(f.data for f in self._fragments))
            self._fragments = []
        if frame.opcode is Opcode.TEXT:
            try:
                self._messages.append(bytes(frame.data).decode())
            except UnicodeDecodeError:
                self._protocol.fail(1007, "invalid UTF-8")
        else:
            self._messages.append(bytes(frame.data))

    def _flush(self) -> None:
        for data in self._protocol.data_to_send():
            if data:
                self.transport.write(data)
            elif self.transport.can_write_eof():
                self.transport.write_eof()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def open_websocket(
    *,
    host: str,
    port: int,
    target: str,
    authorization: str,
    origin: str,
    subprotocols: list[str],
    timeout_seconds: float = 10.0,
) -> UpstreamWebSocket:
    """A WebSocket to ``target`` on the upstream, opened (its 101 received), uncompressed and with no
    limit on message sizes (the browser's and Jupyter's own limits apply)."""
    protocol = ClientProtocol(
        parse_uri(f"ws://{host}:{port}{target}"),
        origin=Origin(origin),
        subprotocols=[Subprotocol(name) for name in subprotocols] or None,
        max_size=None,
    )
    request = protocol.connect()
    request.headers["Authorization"] = authorization
    protocol.send_request(request)
    loop = asyncio.get_running_loop()
    try:
        _, websocket = await asyncio.wait_for(
            loop.create_connection(lambda: UpstreamWebSocket(protocol), host, port), timeout_seconds
        )
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
    try:
        await asyncio.wait_for(asyncio.shield(websocket.opened), timeout_seconds)
    except (TimeoutError, InvalidHandshake, UpstreamError) as exc:
        websocket.transport.close()
        raise UpstreamError(f"the upstream refused the WebSocket: {exc}") from exc
    return websocket


def _quick_acks(sock) -> Callable[[], None]:
    """A function that puts the upstream socket in quick-ACK mode (Linux), called on each read: an
    upstream that writes a kernel's answer as several small frames without TCP_NODELAY (a JupyterLab
    reached directly) sends each frame after the first only once the one before is acknowledged, which
    the receiver delays by up to 40 ms. The kernel leaves quick-ACK mode by itself, hence a call per
    read. (The agent's gateway sets TCP_NODELAY; this costs one system call a read.)"""
    option = getattr(socket, "TCP_QUICKACK", None)
    if sock is None or option is None:
        return lambda: None

    def ack_now() -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, 1)

    return ack_now


def _request_head(
    method: bytes,
    target: str,
    *,
    host: str,
    port: int,
    headers: list[tuple[bytes, bytes]],
    chunked: bool,
    content_length: int | None,
) -> bytes:
    """The request line and headers, with the framing of the body: chunked, a length, or none."""
    head = [
        method,
        b" ",
        target.encode("latin-1"),
        b" HTTP/1.1\r\nhost: ",
        f"{host}:{port}".encode(),
        b"\r\n",
    ]
    for name, value in headers:
        head += [name, b": ", value, b"\r\n"]
    if chunked:
        head.append(b"transfer-encoding: chunked\r\n")
    elif content_length is not None:
        head += [b"content-length: ", str(content_length).encode(), b"\r\n"]
    head.append(b"\r\n")
    return b"".join(head)


async def _request_send(
    connection: _Connection, request_head: bytes, body: AsyncIterator[bytes] | None, *, chunked: bool
) -> None:
    """Write the head, then stream the body (chunk-framed when ``chunked``), waiting out back-pressure."""
    writer = connection.writer
    writer.write(request_head)
    if body is not None:
        async for chunk in body:
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _response_head_read(connection: _Connection, method: bytes) -> _ResponseParser:
    """Read until the response's headers are parsed; body bytes read with them wait in the parser."""
    parser = _ResponseParser(method)
    while not parser.headers_done:
        data = await connection.reader.read(65536)
        if not data:
            raise UpstreamError("the upstream closed the connection")
        parser.parser.feed_data(data)
    return parser
