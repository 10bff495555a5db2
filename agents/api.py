"""The agent's HTTP API (docs/AGENT_PROTOCOL.md): what each call answers. The server that carries it,
and the gateway beside it, are agents/server.py.

Every call needs ``Authorization: Bearer <node token>``, compared in constant time. Errors are
``{"error": {"code", "message", "fields"}}``.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any

from agents import __version__, gateway, homes, prometheus
from agents.gpuplan import PlanError
from agents.spec import SpecError, parse_spec
from agents.workloads import WorkloadConflict, WorkloadRefused, Workloads, WorkloadStopping

log = logging.getLogger("agents.api")
MAX_BODY_BYTES = 1 << 20
_WORKLOAD_PATH = re.compile(r"^/v1/workloads/(?P<sid>[^/]+)$")
_HOME_PATH = re.compile(r"^/v1/homes/(?P<name>[^/]+)$")
GATEWAY_PREFIX = "/jupyter/"
# A PUT the node refuses is a 4xx naming why (docs/AGENT_PROTOCOL.md): 422 for a valid spec this node
# can never serve, 409 for one its present state refuses; 5xx only for the agent's own faults.
REFUSAL_STATUS = {
    "invalid_allocation": 422,
    "environment_unavailable": 422,
    "gpu_busy": 409,
    "mps_unavailable": 409,
    "sandbox_unavailable": 409,
    "runtime_unavailable": 409,
    "runtime_refused": 409,
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, fields: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}

    def answer(self) -> tuple[int, str, bytes]:
        error = {"error": {"code": self.code, "message": self.message, "fields": self.fields}}
        return self.status, "application/json", json.dumps(error).encode()


class AgentApi:
    """What the handler calls; holds the agent's parts."""

    def __init__(self, *, token: str, workloads: Workloads, runtime_name: str, nvml_name: str) -> None:
        self.token = token.encode()
        self.workloads = workloads
        self.runtime_name = runtime_name
        self.nvml_name = nvml_name

    def authorised(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), self.token)

    def gateway_target(self, session_id: str) -> gateway.Target:
        """Where the gateway forwards ``/jupyter/<session_id>/…``: ApiError 404 for a session this agent
        does not run, 503 while it cannot answer. Takes the workload table's lock: call it off the loop."""
        workload = self.workloads.get(session_id)
        target = (
            gateway.workload_target(workload, self.workloads.runtime) if workload and workload.live else None
        )
        if target is None:
            raise ApiError(404, "not_found", "no such session on this node")
        if not target.token:
            raise ApiError(503, "not_ready", "the workload's token is not known yet; try again shortly")
        return target

    def answer(
        self, method: str, path: str, authorization: str | None, body: bytes
    ) -> tuple[int, str, bytes]:
        """One call of the API, other than the gateway: its status, content type and body."""
        if path == "/metrics":  # Prometheus's text format: agents/prometheus.py
            return prometheus.answer(self.workloads, method, authorised=self.authorised(authorization))
        try:
            if not self.authorised(authorization):
                raise ApiError(
                    401, "unauthorised", "a valid 'Authorization: Bearer <node token>' is required"
                )
            status, payload = self.route(method, path, body)
        except ApiError as exc:
            return exc.answer()
        except Exception:
            log.exception("%s %s failed", method, path)
            return ApiError(500, "internal", "internal error").answer()
        return status, "application/json", json.dumps(payload).encode()

    def route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        workloads = self.workloads
        if path == "/v1/health" and method == "GET":
            inventory = workloads.reader.inventory()
            return 200, {
                "status": "ok",
                "agent_version": __version__,
                "runtime": self.runtime_name,
                "nvml": self.nvml_name,
                "gpus": len(inventory["gpus"]),
                "workloads": len(workloads.all()),
            }
        if path == "/v1/inventory" and method == "GET":
            return 200, workloads.reader.inventory()
        if path == "/v1/metrics" and method == "GET":
            metrics, _ = workloads.reader.metrics()
            return 200, metrics
        if path == "/v1/workloads" and method == "GET":
            _, per_session = workloads.reader.metrics(workloads.pids_by_session(), workloads.gpu_of_session())
            return 200, {"workloads": workloads.statuses(per_session)}
        home = _HOME_PATH.match(path)
        if home is not None:
            return self._home(method, path, home["name"])
        match = _WORKLOAD_PATH.match(path)
        if match is None:
            raise ApiError(404, "not_found", f"no such endpoint: {path}")
        session_id = match["sid"]
        if method == "GET":
            workload = workloads.get(session_id)
            if workload is None:
                raise ApiError(404, "not_found", f"no workload {session_id}")
            return 200, workload.status()
        if method == "DELETE":
            return 200, {"deleted": workloads.delete(session_id)}
        if method == "PUT":
            return self._put(session_id, body)
        raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path}")

    def _home(self, method: str, path: str, name: str) -> tuple[int, Any]:
        """``DELETE /v1/homes/<name>``: remove a user's home from this node (the portal's retention rule,
        docs/STORAGE.md). Never while a workload of that user is on the node."""
        if method != "DELETE":
            raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path}")
        if not homes.home_name_valid(name):
            fields = {"name": "must match [A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"}
            raise ApiError(400, "invalid_name", "not a home's name: the agent's rule for user names", fields)
        try:
            self.workloads.home_remove(name)
        except homes.HomeInUse:
            raise ApiError(409, "home_in_use", f"a workload of {name} is on this node; stop it first")
        except FileNotFoundError:
            raise ApiError(404, "not_found", f"no home {name} on this node")
        return 200, {"deleted": True}

    def _put(self, session_id: str, body: bytes) -> tuple[int, Any]:
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}", {"": "not valid JSON"})
        try:
            spec = parse_spec(data, session_id=session_id)
        except SpecError as exc:
            raise ApiError(400, "invalid_spec", "the workload spec is invalid", exc.fields)
        try:
            created, workload = self.workloads.put(spec)
        except WorkloadConflict:
            raise ApiError(
                409,
                "conflict",
                f"a different spec already exists for {session_id}",
                {"session_id": "already used"},
            )
        except WorkloadStopping:
            raise ApiError(409, "stopping", f"the workload {session_id} is being deleted; put it again after")
        except PlanError as exc:
            status = REFUSAL_STATUS.get(exc.code, 422)
            raise ApiError(status, exc.code, "the allocation cannot be served on this node", exc.fields)
        except WorkloadRefused as exc:
            raise ApiError(REFUSAL_STATUS.get(exc.code, 409), exc.code, exc.reason)
        return (201 if created else 200), workload.status()
