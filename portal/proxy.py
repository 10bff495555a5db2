"""The authenticated Jupyter proxy: ``/jupyter/<session>/…`` on the portal, HTTP and WebSocket.

A plain ASGI application in front of Django (see ``portal.asgi``), so a proxied request costs a cookie
parse, a dictionary lookup and the upstream round trip — no Django request cycle. It:

- finds the logged-in user from the Django session cookie and asks ``resolve_route`` (a cached database
  read) whether that user may use that session; anyone else gets the same 404 as for a session that does
  not exist;
- refuses cross-site requests (an ``Origin`` that is not the portal's own host) before it adds anything;
- forwards to the session's node, the agent's gateway at the node's enrolled address (never a workload's
  own port: a GPU host is another machine), authenticated as the portal with the node token; the agent
  adds the Jupyter token and refuses a session it does not run. The portal's own cookies are never passed
  on, and a credential is scrubbed out of every HTML or JSON answer, so no token reaches a browser;
- streams bodies both ways (uploads and downloads of any size), and relays WebSocket frames. Served
  by uvicorn with ``--ws portal.ws_relay:WebSocketRelay`` (as the portal is), a WebSocket is relayed as
  bytes instead, after the same checks (``portal/ws_relay.py``); the ASGI path serves any other server.

It can run as its own process with the same code (``uvicorn portal.asgi:proxy_application``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.cookies import SimpleCookie
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError

from portal.upstream import UpstreamError, UpstreamPool, open_websocket

log = logging.getLogger(__name__)

PREFIX = "/jupyter/"
ROUTE_CACHE_SECONDS = 2.0
RETRY_AFTER_SECONDS = 2  # a 503 when the database cannot be asked
SMALL_BODY_BYTES = 64 * 1024  # a body this small is sent to the browser in one piece
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"authorization",
    b"cookie",
    b"origin",
    b"expect",
    b"content-length",
}
RESPONSE_DROP = HOP_BY_HOP | {b"content-encoding"}
SCRUBBED_TYPES = (b"text/html", b"application/json", b"text/javascript", b"application/javascript")
# Cookies the portal sets for itself; the workload never sees them.
PORTAL_COOKIES = {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME, settings.LANGUAGE_COOKIE_NAME}


@dataclass(frozen=True)
class Route:
    """Where to forward a session's requests, and the credential that upstream expects: the node's
    agent (its gateway, ``Bearer`` and the node token) in the portal; a bare JupyterLab (``token`` and
    the Jupyter token) in the proxy's own tests and benchmark."""

    upstream: str  # the node's enrolled address, e.g. http://10.0.3.2:8801
    token: str
    scheme: str = "Bearer"

    @property
    def authorization(self) -> str:
        return f"{self.scheme} {self.token}"

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.upstream)
        return parts.hostname or "127.0.0.1", parts.port or 80


@dataclass(frozen=True)
class Refusal:
    """Why the proxy answers a friendly page instead of forwarding (session exists, is not running)."""

    status: int
    state: str
    session_url: str


Resolver = Callable[[str, str], Route | Refusal | None]


class JupyterProxy:
    def __init__(self, resolver: Resolver, fallback=None):
        self._resolve_sync = resolver
        self._resolve = sync_to_async(self._resolve_sync, thread_sensitive=False)
        self._cache: dict[tuple[str, str], tuple[float, Route | Refusal | None]] = {}
        self.pool = UpstreamPool()
        self._fallback = fallback

    def forget(self) -> None:
        """Drop cached routes (tests; a stop makes the route disappear within ROUTE_CACHE_SECONDS anyway)."""
        self._cache.clear()

    async def route_for(self, cookie_header: str, session_id: str) -> Route | Refusal | None:
        now = time.monotonic()
        cached = self._cache.get((cookie_header, session_id))
        if cached is not None and cached[0] > now:
            return cached[1]
        cookies = SimpleCookie()
        with contextlib.suppress(Exception):
            cookies.load(cookie_header)
        morsel = cookies.get(settings.SESSION_COOKIE_NAME)
        route = await self._resolve(morsel.value, session_id) if morsel is not None and morsel.value else None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[(cookie_header, session_id)] = (now + ROUTE_CACHE_SECONDS, route)
        return route

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        session_id = path[len(PREFIX) :].split("/", 1)[0] if path.startswith(PREFIX) else ""
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        if not session_id:
            await self._plain(scope, send, 404, b"Not found")
            return
        if not same_origin(headers):
            await self._plain(scope, send, 403, b"Cross-origin request refused")
            return
        try:
            route = await self.route_for(headers.get(b"cookie", b"").decode("latin-1"), session_id)
        except DatabaseError:  # no connection (the pool ran dry, the database restarts): not a 404
            log.warning("jupyter proxy: could not look up session %s", session_id, exc_info=True)
            await self._plain(
                scope, send, 503, b"The portal cannot look up sessions right now; try again shortly.",
                retry_after=RETRY_AFTER_SECONDS,
            )  # fmt: skip
            return
        if route is None:
            await self._not_found(scope, receive, send)
            return
        if isinstance(route, Refusal):
            await self._refused(scope, send, route)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, route, headers)
        else:
            await self._http(scope, receive, send, route)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- HTTP -------------------------------------------------------------------------------------------

    async def _http(self, scope, receive, send, route: Route) -> None:
        forwarded = _forward_headers(scope["headers"], route)
        content_length = None
        has_body = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                content_length, has_body = int(value), int(value) > 0
            elif name == b"transfer-encoding":
                has_body = True

        async def body():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return

        host, port = route.address
        try:
            upstream = await self.pool.request(
                host=host,
                port=port,
                method=scope["method"],
                target=_raw_path(scope),
                headers=forwarded,
                body=body() if has_body else None,
                content_length=content_length if has_body else None,
            )
        except UpstreamError as exc:
            log.info("jupyter upstream %s unreachable: %s", route.upstream, exc)
            await self._plain(
                scope, send, 502, b"The session's JupyterLab is not answering yet; try again shortly."
            )
            return
        response_headers = [(name, value) for name, value in upstream.headers if name not in RESPONSE_DROP]
        content_type = upstream.header(b"content-type") or b""
        if content_type.startswith(SCRUBBED_TYPES) and not upstream.header(b"content-encoding"):
            payload = (await upstream.read()).replace(route.token.encode(), b"")
            response_headers.append((b"content-length", str(len(payload)).encode()))
            await send(
                {"type": "http.response.start", "status": upstream.status, "headers": response_headers}
            )
            await send({"type": "http.response.body", "body": payload})
            return
        for name in (b"content-length", b"content-encoding"):
            value = upstream.header(name)
            if value is not None:
                response_headers.append((name, value))
        await send({"type": "http.response.start", "status": upstream.status, "headers": response_headers})
        length = upstream.header(b"content-length")
        if length is not None and length.isdigit() and int(length) <= SMALL_BODY_BYTES:
            # Most Jupyter API answers: one write of the whole body instead of a chunk and an empty end.
            await send({"type": "http.response.body", "body": await upstream.read()})
            return
        async for chunk in upstream.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    # -- WebSocket ----------------------------------------------------------------------------------------

    async def _websocket(self, scope, receive, send, route: Route, headers: dict[bytes, bytes]) -> None:
        connect = await receive()
        if connect["type"] != "websocket.connect":
            return
        host, port = route.address
        try:
            upstream = await open_websocket(
                host=host,
                port=port,
                target=_raw_path(scope),
                authorization=route.authorization,
                origin=route.upstream,
                subprotocols=[p.strip() for p in scope.get("subprotocols", []) if p.strip()],
            )
        except UpstreamError as exc:
            log.info("jupyter websocket upstream %s refused: %s", route.upstream, exc)
            await self._plain(
                scope, send, 502, b"The session's JupyterLab is not answering; try again shortly."
            )
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def client_to_upstream():
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
                elif message.get("text") is not None:
                    await upstream.send(message["text"])

        async def upstream_to_client():
            while (message := await upstream.recv()) is not None:
                if isinstance(message, str):
                    await send({"type": "websocket.send", "text": message})
                else:
                    await send({"type": "websocket.send", "bytes": message})
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": upstream.close_code or 1000})

        tasks = [asyncio.ensure_future(client_to_upstream()), asyncio.ensure_future(upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            upstream.close()

    # -- answers of our own ----------------------------------------------------------------------------------

    async def _plain(self, scope, send, status: int, text: bytes, *, retry_after: int | None = None) -> None:
        """A short text answer with ``status``; to a WebSocket handshake as well, where the server can
        (the ASGI ``websocket.http.response`` extension), so a client learns why (404: no such session,
        409: not running, 502: its JupyterLab is not answering, 503: the portal cannot look it up now)
        instead of a bare 403."""
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        if scope["type"] == "websocket":
            if "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 4000 + status})
                return
            await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": text})
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": text})

    async def _not_found(self, scope, receive, send) -> None:
        """The same 404 page Django gives for any unknown URL: no hint that the session exists."""
        if scope["type"] == "http" and self._fallback is not None:
            await self._fallback(scope, receive, send)
            return
        await self._plain(scope, send, 404, b"Not found")

    async def _refused(self, scope, send, refusal: Refusal) -> None:
        if scope["type"] == "websocket":
            await self._plain(scope, send, refusal.status, f"The session is {refusal.state}.".encode())
            return
        # Let the portal render its friendly page with the session's state and a way back.
        await send(
            {
                "type": "http.response.start",
                "status": 302 if scope["method"] in ("GET", "HEAD") else refusal.status,
                "headers": [(b"location", refusal.session_url.encode()), (b"cache-control", b"no-store")],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _raw_path(scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    text = path.decode("latin-1")
    return text + ("?" + query.decode("latin-1") if query else "")


def _forward_headers(raw_headers, route: Route) -> list[tuple[bytes, bytes]]:
    forwarded = [(name, value) for name, value in raw_headers if name not in HOP_BY_HOP]
    cookie = jupyter_cookies(raw_headers)
    if cookie:
        forwarded.append((b"cookie", cookie))
    forwarded.append((b"authorization", route.authorization.encode()))
    return forwarded


def jupyter_cookies(raw_headers) -> bytes:
    """The browser's cookies minus the portal's own (session, CSRF, language)."""
    kept = []
    for name, value in raw_headers:
        if name != b"cookie":
            continue
        for part in value.split(b";"):
            cookie_name = part.split(b"=", 1)[0].strip().decode("latin-1")
            if cookie_name and cookie_name not in PORTAL_COOKIES:
                kept.append(part.strip())
    return b"; ".join(kept)


def same_origin(headers: dict[bytes, bytes]) -> bool:
    origin = headers.get(b"origin")
    if not origin:
        return True  # not a browser, or a same-origin GET; SameSite=Lax keeps cross-site cookies off
    host = headers.get(b"host", b"").decode("latin-1")
    return urlsplit(origin.decode("latin-1")).netloc == host
