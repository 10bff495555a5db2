"""The agent's HTTP API (docs/AGENT_PROTOCOL.md), on the standard library's threading server.

Every call needs ``Authorization: Bearer <node token>``, compared in constant time. Errors are
``{"error": {"code", "message", "fields"}}``.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agents import __version__, gateway, prometheus
from agents.gpuplan import PlanError
from agents.runtimes import RuntimeHandle
from agents.spec import SpecError, parse_spec
from agents.workloads import WorkloadConflict, WorkloadRefused, Workloads, WorkloadStopping

log = logging.getLogger("agents.api")
MAX_BODY_BYTES = 1 << 20
_WORKLOAD_PATH = re.compile(r"^/v1/workloads/(?P<sid>[^/]+)$")
GATEWAY_PREFIX = "/jupyter/"
# A PUT the node refuses is a 4xx naming why (docs/AGENT_PROTOCOL.md): 422 for a valid spec this node
# can never serve, 409 for one its present state refuses; 5xx only for the agent's own faults.
REFUSAL_STATUS = {
    "invalid_allocation": 422,
    "environment_unusable": 422,
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

    def gateway_target(self, path: str) -> tuple[RuntimeHandle, str]:
        """The runtime handle and Jupyter token of the running workload a ``/jupyter/<id>/…`` path
        names; ApiError 404 for a session this agent does not run, 503 while it cannot answer."""
        session_id = path[len(GATEWAY_PREFIX) :].split("/", 1)[0]
        workload = self.workloads.get(session_id)
        if (
            workload is None
            or not workload.live
            or workload.handle is None
            or not path.startswith(workload.spec.get("base_url") or "/-/")
        ):
            raise ApiError(404, "not_found", "no such session on this node")
        token = workload.token or self.workloads.runtime.jupyter_token(workload.handle)
        if not token:
            raise ApiError(503, "not_ready", "the workload's token is not known yet; try again shortly")
        return workload.handle, token

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


class _Handler(BaseHTTPRequestHandler):
    server_version = f"suanli-agent/{__version__}"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    api: AgentApi  # set on the subclass made by make_server

    def setup(self) -> None:
        super().setup()
        self._upstreams: dict[str, gateway.UpstreamConnection] = {}

    def finish(self) -> None:
        for connection in self._upstreams.values():
            connection.close()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: ApiError) -> None:
        self._answer(exc.status, {"error": {"code": exc.code, "message": exc.message, "fields": exc.fields}})

    def _gateway(self, method: str) -> None:
        """Forward one request of the portal to the workload's JupyterLab (see agents/gateway.py)."""
        try:
            if not self.api.authorised(self.headers.get("Authorization")):
                raise ApiError(
                    401, "unauthorised", "a valid 'Authorization: Bearer <node token>' is required"
                )
            handle, token = self.api.gateway_target(self.path.split("?", 1)[0])
        except ApiError as exc:
            self._discard_body()
            self._error(exc)
            return
        if "websocket" in (self.headers.get("Upgrade") or "").lower():
            self._websocket(handle, token)
            return
        try:
            self._forward(method, handle, token)
        except (gateway.GatewayError, OSError, http.client.HTTPException) as exc:
            log.info("gateway %s %s: %s", method, self.path, exc)
            self.close_connection = True
            if not getattr(self, "_answered", False):
                self._error(
                    ApiError(502, "upstream_unreachable", "the workload's JupyterLab is not answering")
                )

    def _discard_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)
        elif length or self.headers.get("Transfer-Encoding"):
            self.close_connection = True

    def _forward(self, method: str, handle: RuntimeHandle, token: str) -> None:
        self._answered = False
        session_id = self.path[len(GATEWAY_PREFIX) :].split("/", 1)[0]
        headers = gateway.forwarded_headers(self.headers, token)
        length = int(self.headers.get("Content-Length") or 0)
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        for attempt in (0, 1):
            connection = self._upstreams.pop(session_id, None)
            reused = connection is not None and attempt == 0
            if connection is None:
                connection = gateway.UpstreamConnection(handle)
            try:
                connection.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    connection.putheader(name, value)
                if chunked:
                    connection.putheader("Transfer-Encoding", "chunked")
                elif length or method in ("POST", "PUT", "PATCH"):
                    connection.putheader("Content-Length", str(length))
                connection.endheaders()
                if chunked:
                    gateway.relay_chunked(self.rfile, connection.send)
                else:
                    remaining = length
                    while remaining:
                        data = self.rfile.read(min(remaining, gateway.CHUNK))
                        if not data:
                            raise gateway.GatewayError("the client ended its body early")
                        connection.send(data)
                        remaining -= len(data)
                response = connection.getresponse()
                break
            except (OSError, http.client.HTTPException):
                connection.close()
                if reused and not length and not chunked:
                    continue  # a kept-alive connection the upstream closed meanwhile
                raise
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in gateway.RESPONSE_DROP]
        content_type = (response.getheader("Content-Type") or "").lower()
        no_body = method == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        self.send_response(response.status, response.reason)
        for name, value in kept:
            self.send_header(name, value)
        if no_body:
            response.read()
            self.send_header("Content-Length", response.getheader("Content-Length") or "0")
            self.end_headers()
        elif content_type.startswith(gateway.SCRUBBED_TYPES) and not response.getheader("Content-Encoding"):
            payload = response.read().replace(token.encode(), b"")
            self.send_header("Content-Length", str(len(payload)))
            self._end_headers_with(payload)
        elif response.length is not None and response.length <= gateway.CHUNK:
            self.send_header("Content-Length", str(response.length))
            self._end_headers_with(response.read())
        elif response.length is not None:
            self.send_header("Content-Length", str(response.length))
            self.end_headers()
            while data := response.read(gateway.CHUNK):
                self.wfile.write(data)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while data := response.read1(gateway.CHUNK):
                self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
        self._answered = True
        if response.will_close:
            connection.close()
        else:
            self._upstreams[session_id] = connection

    def _end_headers_with(self, body: bytes) -> None:
        """End the head and send it with the whole body in one write: one segment, one wake-up of
        the portal's proxy, where the head and the body apart cost two."""
        self._headers_buffer.append(b"\r\n")
        self._headers_buffer.append(body)
        self.flush_headers()

    def _websocket(self, handle: RuntimeHandle, token: str) -> None:
        """Rewrite the upgrade's head (the Jupyter token in, the node token out) and relay bytes."""
        self.close_connection = True
        try:
            upstream = gateway.open_upstream(handle)
        except (OSError, gateway.GatewayError) as exc:
            log.info("gateway websocket %s: %s", self.path, exc)
            self._error(ApiError(502, "upstream_unreachable", "the workload's JupyterLab is not answering"))
            return
        head = [f"{self.command} {self.path} HTTP/1.1\r\n"]
        head += [
            f"{name}: {value}\r\n"
            for name, value in gateway.forwarded_headers(self.headers, token, websocket=True)
        ]
        head.append("\r\n")
        try:
            upstream.sendall("".join(head).encode("latin-1"))
        except OSError:
            upstream.close()
            return
        gateway.splice(self.connection, self.rfile, upstream)

    def _handle(self, method: str) -> None:
        if self.path.startswith(GATEWAY_PREFIX):
            self._gateway(method)
            return
        if self.path.split("?", 1)[0] == "/metrics":  # Prometheus's text format: agents/prometheus.py
            authorised = self.api.authorised(self.headers.get("Authorization"))
            self._send_metrics(*prometheus.answer(self.api.workloads, method, authorised=authorised))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise ApiError(413, "too_large", "the body is too large")
            body = self.rfile.read(length) if length else b""
            if not self.api.authorised(self.headers.get("Authorization")):
                raise ApiError(
                    401, "unauthorised", "a valid 'Authorization: Bearer <node token>' is required"
                )
            status, payload = self.api.route(method, self.path.split("?", 1)[0], body)
        except ApiError as exc:
            status, payload = (
                exc.status,
                {"error": {"code": exc.code, "message": exc.message, "fields": exc.fields}},
            )
        except Exception:
            log.exception("%s %s failed", method, self.path)
            status, payload = 500, {"error": {"code": "internal", "message": "internal error", "fields": {}}}
        self._answer(status, payload)

    def _send_metrics(self, status: int, content_type: str, data: bytes) -> None:
        self.close_connection = self.command != "GET"  # a body it did not read is not a next request
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle("HEAD")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._handle("OPTIONS")


def make_server(host: str, port: int, api: AgentApi) -> ThreadingHTTPServer:
    handler = type("AgentHandler", (_Handler,), {"api": api})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
