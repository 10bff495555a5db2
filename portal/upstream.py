"""A lean HTTP/1.1 client for the Jupyter proxy: kept-alive connections per upstream, responses parsed
by ``httptools`` (the C parser uvicorn uses), bodies streamed both ways.

A general client (httpx) costs several hundred microseconds a request in Python; this one does only
what a reverse proxy needs, which is what keeps a proxied request close to a direct one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import httptools

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
        head = [
            method_bytes,
            b" ",
            target.encode("latin-1"),
            b" HTTP/1.1\r\nhost: ",
            f"{host}:{port}".encode(),
            b"\r\n",
        ]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        chunked = body is not None and content_length is None
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        elif content_length is not None:
            head += [b"content-length: ", str(content_length).encode(), b"\r\n"]
        head.append(b"\r\n")
        request_head = b"".join(head)

        # A kept-alive connection may have been closed by the upstream meanwhile: retry once on a new one,
        # but only when no body bytes were consumed (a body iterator cannot be replayed).
        for attempt in (0, 1):
            idle = self._idle[key]
            reused = bool(idle) and attempt == 0
            connection = idle.pop() if reused else await self._connect(host, port)
            try:
                connection.writer.write(request_head)
                if body is not None:
                    async for chunk in body:
                        if chunked:
                            connection.writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                        else:
                            connection.writer.write(chunk)
                        await connection.writer.drain()
                    if chunked:
                        connection.writer.write(b"0\r\n\r\n")
                await connection.writer.drain()
                parser = _ResponseParser(method_bytes)
                while not parser.headers_done:
                    data = await connection.reader.read(65536)
                    if not data:
                        raise UpstreamError("the upstream closed the connection")
                    parser.parser.feed_data(data)
                break
            except (OSError, UpstreamError, httptools.HttpParserError) as exc:
                connection.close()
                if reused and body is None:
                    continue
                raise UpstreamError(str(exc)) from exc
        status = parser.parser.get_status_code()

        async def stream() -> AsyncIterator[bytes]:
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

        return UpstreamResponse(status, parser.headers, stream())

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
