"""The portal's client of the agent API (docs/AGENT_PROTOCOL.md): httpx, bearer token, timeouts."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import httpx
from django.conf import settings

from provisioner.models import Node
from provisioner.sealing import unseal


class AgentUnreachable(Exception):
    """The agent could not be reached or answered 5xx (its own fault, nothing recorded): try again
    later."""


@dataclass(frozen=True)
class AgentRefusal(Exception):
    """The agent answered 4xx with a code (docs/AGENT_PROTOCOL.md): the request, or the node's
    state, refuses it (a refused start included); retrying the same request will not help."""

    status: int
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


_client_lock = threading.Lock()
_clients: dict[int, httpx.Client] = {}


def _client() -> httpx.Client:
    """The process's one client of every agent (thread-safe; one per process, as a forked child must not
    share its parent's sockets). A client per call cost a TLS context each (loading the CA bundle: about
    half the worker's CPU under load, whether the agent speaks TLS or not) and a new TCP connection; this
    one keeps the connections to each agent open between calls."""
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        with _client_lock:
            client = _clients.get(pid)
            if client is None:
                _clients.clear()  # a parent's client, inherited by this forked child: never used here
                client = _clients[pid] = httpx.Client()
    return client


def _call(node: Node, method: str, path: str, *, json: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {unseal(node.token_sealed)}"}
    try:
        response = _client().request(
            method,
            f"{node.address.rstrip('/')}{path}",
            json=json,
            headers=headers,
            timeout=settings.AGENT_HTTP_TIMEOUT_SECONDS,
        )
    except httpx.HTTPError as exc:
        raise AgentUnreachable(f"{node.name}: {exc.__class__.__name__}: {exc}") from exc
    if response.status_code >= 500:
        raise AgentUnreachable(f"{node.name}: HTTP {response.status_code}")
    if response.status_code >= 400:
        try:
            error = response.json().get("error", {})
        except ValueError:
            error = {}
        raise AgentRefusal(
            response.status_code, str(error.get("code", "error")), str(error.get("message", ""))
        )
    return response


def workload_put(node: Node, spec: dict) -> dict:
    return _call(node, "PUT", f"/v1/workloads/{spec['session_id']}", json=spec).json()


def workload_get(node: Node, session_id: str) -> dict | None:
    try:
        return _call(node, "GET", f"/v1/workloads/{session_id}").json()
    except AgentRefusal as exc:
        if exc.status == 404:
            return None
        raise


def workload_delete(node: Node, session_id: str) -> bool:
    return bool(_call(node, "DELETE", f"/v1/workloads/{session_id}").json().get("deleted"))


def home_delete(node: Node, name: str) -> bool:
    """Remove the home ``name`` from the node (the retention rule, docs/STORAGE.md): True when removed,
    False when the node has no such home. AgentRefusal ``home_in_use`` while a workload of that user is
    on the node."""
    try:
        return bool(_call(node, "DELETE", f"/v1/homes/{name}").json().get("deleted"))
    except AgentRefusal as exc:
        if exc.status == 404:
            return False
        raise
