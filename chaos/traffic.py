"""A steady mix of users: launch through the API (personal access token, Idempotency-Key, retried through
outages with the same key), wait for Jupyter, use it through the portal's proxy (HTTP ``api/status``;
for some users a WebSocket to a kernel with a ``kernel_info_request`` every second, reconnecting after a
drop), look at the dashboard, and stop through the API. Runs on its own asyncio loop in a thread; what it
saw is kept per endpoint, for the report. The checks do not trust it: they read the database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
import websockets

from chaos.stack import A100, ENVIRONMENT, H200, T4, User

# (gpu model, profile, weight): mostly slices of the A100s on node-a and ci-small, some T4s and H200s
PLANS = [(A100, "1/4", 4), (A100, "1/8", 3), (A100, "1/2", 2), (T4, "whole", 2), (H200, "1g.18gb", 2)]
PLANS += [(H200, "whole", 1), (A100, "whole", 1)]
RUNNING_WAIT_SECONDS = 150.0
RECONNECT_GRACE_SECONDS = 30.0  # how long past its planned use a dropped kernel WebSocket is reconnected


@dataclass
class Endpoint:
    ok: int = 0
    errors: Counter = field(default_factory=Counter)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


@dataclass
class WsStats:
    round_trips: int = 0
    connects: int = 0
    drops: int = 0
    ok_at: list[float] = field(default_factory=list)  # wall-clock times of answered round trips
    open_now: int = 0
    reconnects: int = 0  # connections to a kernel after its first one
    kernels_kept: int = 0  # reconnects that answered from the same kernel process
    kernels_changed: list[str] = field(default_factory=list)  # kernel ids that answered from another


@dataclass
class Failure:
    """A request that got no answer or an answer >= 500, when (wall clock) and on which session."""

    at: float
    endpoint: str
    outcome: str  # the status code, or the exception's name when no answer came
    session_id: str | None = None


class Traffic:
    def __init__(self, *, base_url: str, users: list[User], ws_users: int, cookie_name: str, seed: int = 7):
        self.base_url = base_url
        self.users = users
        self.ws_users = ws_users
        self.cookie_name = cookie_name
        self.rng = random.Random(seed)
        self.endpoints: dict[str, Endpoint] = {}
        self.ws = WsStats()
        self.launched: list[str] = []
        self.ran: set[str] = set()
        self.failures: list[Failure] = []  # no answer, or an answer >= 500
        self.logouts: list[tuple[float, str, str]] = []  # (when, endpoint, what): a login that was lost
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 90) -> None:
        """Users stop their current session and leave; waits for them."""
        self._stopping.set()
        self._thread.join(timeout)

    def _count(self, name: str, outcome: str | None) -> None:
        endpoint = self.endpoints.setdefault(name, Endpoint())
        if outcome is None:
            endpoint.ok += 1
        else:
            endpoint.errors[outcome] += 1

    # -- the loop --------------------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        await asyncio.gather(
            *(self._user(u, with_kernel=i < self.ws_users) for i, u in enumerate(self.users))
        )

    async def _user(self, user: User, *, with_kernel: bool) -> None:
        await asyncio.sleep(self.rng.uniform(0, 5))
        headers = {"Authorization": f"Bearer {user.token}"}
        cookies = {self.cookie_name: user.cookie}
        async with (
            httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=15) as api,
            httpx.AsyncClient(base_url=self.base_url, cookies=cookies, timeout=15) as browser,
        ):
            while not self._stopping.is_set():
                try:
                    await self._one_session(api, browser, user, with_kernel=with_kernel)
                except Exception as exc:  # a user never dies of a surprise; it is counted
                    self._count("user loop", type(exc).__name__)
                await asyncio.sleep(self.rng.uniform(1, 4))

    async def _one_session(self, api, browser, user: User, *, with_kernel: bool) -> None:
        model, profile = self.rng.choices([(m, p) for m, p, _ in PLANS], [w for *_, w in PLANS])[0]
        session_id = await self._launch(api, model, profile)
        if session_id is None:
            return
        state = await self._wait_running(api, session_id)
        if state == "running":
            self.ran.add(session_id)
            use_seconds = self.rng.uniform(30, 90)
            if with_kernel:
                await self._use_kernel(browser, user, session_id, use_seconds)
            else:
                await self._use_http(browser, session_id, use_seconds)
        await self._stop(api, session_id)

    async def _request(
        self, name: str, client, method: str, url: str, *, ok=(200,), session_id: str | None = None, **kwargs
    ):
        try:
            response = await client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            self._count(name, type(exc).__name__)
            self.failures.append(Failure(time.time(), name, type(exc).__name__, session_id))
            return None
        status = response.status_code
        self._count(name, None if status in ok else str(status))
        if status >= 500:
            self.failures.append(Failure(time.time(), name, str(status), session_id))
        if status in (301, 302) and "/login" in response.headers.get("location", ""):
            self.logouts.append((time.time(), name, f"{status} to the login page"))
        elif status in (401, 403) and url.startswith("/api/"):
            self.logouts.append((time.time(), name, f"{status} for a valid token"))
        return response

    async def _launch(self, api, model: str, profile: str) -> str | None:
        key = f"chaos-{uuid.uuid4()}"
        body = {"gpu_model": model, "profile": profile, "environment": ENVIRONMENT, "max_hours": 1}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            response = await self._request(
                "POST /api/v1/sessions", api, "POST", "/api/v1/sessions", ok=(200, 201), json=body,
                headers={"Idempotency-Key": key},
            )  # fmt: skip
            if response is not None and response.status_code in (200, 201):
                session_id = response.json()["id"]
                self.launched.append(session_id)
                return session_id
            if response is not None and response.status_code < 500 and response.status_code != 429:
                return None  # refused (quota, funds): a real answer, not an outage
            await asyncio.sleep(1)
        return None

    async def _wait_running(self, api, session_id: str) -> str:
        deadline = time.monotonic() + RUNNING_WAIT_SECONDS
        state = "unknown"
        while time.monotonic() < deadline and not self._stopping.is_set():
            response = await self._request(
                "GET /api/v1/sessions/<id>",
                api,
                "GET",
                f"/api/v1/sessions/{session_id}",
                session_id=session_id,
            )
            if response is not None and response.status_code == 200:
                state = response.json()["state"]
                if state in ("running", "stopped", "failed", "lost"):
                    return state
            await asyncio.sleep(1)
        return state

    async def _stop(self, api, session_id: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            response = await self._request(
                "POST /api/v1/sessions/<id>/stop", api, "POST", f"/api/v1/sessions/{session_id}/stop",
                json={}, session_id=session_id,
            )  # fmt: skip
            if response is not None and response.status_code == 200:
                return
            await asyncio.sleep(1)

    async def _use_http(self, browser, session_id: str, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until and not self._stopping.is_set():
            response = await self._request(
                "GET /jupyter/<id>/api/status", browser, "GET", f"/jupyter/{session_id}/api/status",
                session_id=session_id,
            )  # fmt: skip
            if response is not None and response.status_code in (302, 404, 409):
                return  # the session ended under us (lost with its node): the user moves on
            if self.rng.random() < 0.2:
                await self._request("GET /dashboard/", browser, "GET", "/dashboard/")
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))

    async def _use_kernel(self, browser, user: User, session_id: str, seconds: float) -> None:
        response = await self._request(
            "POST /jupyter/<id>/api/kernels",
            browser,
            "POST",
            f"/jupyter/{session_id}/api/kernels",
            ok=(201,),
            json={"name": "python3"},
            session_id=session_id,
        )
        if response is None or response.status_code != 201:
            return
        kernel_id = response.json()["id"]
        uri = f"ws{self.base_url.removeprefix('http')}/jupyter/{session_id}/api/kernels/{kernel_id}/channels"
        headers = {"Cookie": f"{self.cookie_name}={user.cookie}"}
        name = "WS /jupyter/<id>/api/kernels/<k>/channels"
        until = time.monotonic() + seconds
        kernel_session: list[str] = []  # the kernel process's own session id, from its first reply
        # A dropped connection is reconnected even when the planned use is over, as JupyterLab does: a
        # drop near its end (a web restart) is still followed by a reconnect, up to RECONNECT_GRACE_SECONDS.
        dropped = False
        while not self._stopping.is_set() and (
            time.monotonic() < until or (dropped and time.monotonic() < until + RECONNECT_GRACE_SECONDS)
        ):
            try:
                async with websockets.connect(
                    uri, additional_headers=headers, origin=self.base_url, open_timeout=10, max_size=None
                ) as ws:
                    self.ws.connects += 1
                    self.ws.open_now += 1
                    try:
                        await self._kernel_rounds(ws, until, kernel_id, kernel_session)
                        dropped = False
                    finally:
                        self.ws.open_now -= 1
            except (OSError, websockets.WebSocketException, TimeoutError) as exc:
                dropped = True
                self.ws.drops += 1
                status = exc.response.status_code if isinstance(exc, websockets.InvalidStatus) else None
                outcome = str(status) if status else type(exc).__name__
                self._count(name, outcome)
                if status is None or status >= 500:
                    self.failures.append(Failure(time.time(), name, outcome, session_id))
                if status in (302, 404, 409):
                    return  # the session is gone
                await asyncio.sleep(1)

    async def _kernel_rounds(self, ws, until: float, kernel_id: str, kernel_session: list[str]) -> None:
        """kernel_info round trips; the first reply of a reconnect must come from the same kernel process
        (the session id in its reply header) as the first reply ever: a reconnect never loses a kernel."""
        first = True
        session = uuid.uuid4().hex
        while (first or time.monotonic() < until) and not self._stopping.is_set():  # one round at least
            msg_id = uuid.uuid4().hex
            message = {
                "header": {"msg_id": msg_id, "username": "chaos", "session": session,
                           "msg_type": "kernel_info_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell",
            }  # fmt: skip
            await ws.send(json.dumps(message))
            async with asyncio.timeout(15):
                while True:
                    reply = json.loads(await ws.recv())
                    if reply.get("parent_header", {}).get("msg_id") == msg_id and reply.get("msg_type") == (
                        "kernel_info_reply"
                    ):
                        break
            if first:
                first = False
                process = reply.get("header", {}).get("session", "")
                if not kernel_session:
                    kernel_session.append(process)
                else:
                    self.ws.reconnects += 1
                    if process == kernel_session[0]:
                        self.ws.kernels_kept += 1
                    else:
                        self.ws.kernels_changed.append(kernel_id)
            self.ws.round_trips += 1
            self.ws.ok_at.append(time.time())
            self._count("WS /jupyter/<id>/api/kernels/<k>/channels", None)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(1)
