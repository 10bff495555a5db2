"""The users of ``make load`` (locust; started by ``load/run.py``, which seeds them and sets LOAD_PLAN).

Each simulated user is one portal user with a personal access token and a logged-in browser cookie. It
looks at its dashboard, launches a 1/8 A100 through the API and stops it at once, and asks one of the
running sessions of the plan (its owner's cookie) for a small Jupyter API answer through the proxy.
Never imports Django: the load generator shares the machine with the portal and stays light (gevent).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import uuid

from locust import FastHttpUser, between, task

PLAN = json.loads(open(os.environ["LOAD_PLAN"]).read())  # noqa: SIM115 - read once at import
_next_user = itertools.count()


class PortalUser(FastHttpUser):
    wait_time = between(0.5, 1.5)

    def on_start(self) -> None:
        me = PLAN["users"][next(_next_user) % len(PLAN["users"])]
        self.api = {"Authorization": f"Bearer {me['token']}"}
        self.browser = {"Cookie": f"{PLAN['cookie_name']}={me['cookie']}"}
        self.target = random.choice(PLAN["proxy_targets"])  # noqa: S311 - spreading load, not security

    def _server_time(self, response, name: str) -> None:
        """The portal's own time for an answer (its Server-Timing header), as a request of type "server"
        under the same name: the load generator shares the 2 cores, so the client's figure includes its
        own queueing."""
        timing = (response.headers or {}).get("Server-Timing", "")
        if timing.startswith("app;dur="):
            self.environment.events.request.fire(
                request_type="server", name=name, response_time=float(timing.removeprefix("app;dur=")),
                response_length=0, exception=None, context={},
            )  # fmt: skip

    @task(3)
    def dashboard(self) -> None:
        answer = self.client.get("/dashboard/", headers=self.browser, name="GET /dashboard/")
        self._server_time(answer, "GET /dashboard/")

    @task(3)
    def jupyter_status(self) -> None:
        session_id, cookie = self.target["session_id"], self.target["cookie"]
        self.client.get(
            f"/jupyter/{session_id}/api/status",
            headers={"Cookie": f"{PLAN['cookie_name']}={cookie}"},
            name="GET /jupyter/<id>/api/status",
        )

    @task(1)
    def launch_and_stop(self) -> None:
        body = {
            "gpu_model": PLAN["gpu_model"],
            "profile": PLAN["profile"],
            "environment": PLAN["environment"],
        }
        headers = {**self.api, "Idempotency-Key": f"load-{uuid.uuid4()}"}
        with self.client.post(
            "/api/v1/sessions", json=body, headers=headers, name="POST /api/v1/sessions", catch_response=True
        ) as launched:
            self._server_time(launched, "POST /api/v1/sessions")
            if launched.status_code != 201:
                launched.failure(f"{launched.status_code}: {launched.text[:200]}")
                return
            session_id = launched.json()["id"]
        with self.client.post(
            f"/api/v1/sessions/{session_id}/stop",
            json={},
            headers=self.api,
            name="POST /api/v1/sessions/<id>/stop",
            catch_response=True,
        ) as stopped:
            self._server_time(stopped, "POST /api/v1/sessions/<id>/stop")
            if stopped.status_code != 200:
                stopped.failure(f"{stopped.status_code}: {stopped.text[:200]}")
