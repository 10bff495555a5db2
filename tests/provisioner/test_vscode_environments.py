"""VS Code environments: offered only where a node's agent reports code-server in its heartbeat, carried
to the agent in the workload spec, and opened at the session's base URL."""

from __future__ import annotations

import json
import sys

import pytest
from rest_framework.test import APIClient

from core.errors import ValidationFailed
from provisioner import selectors
from provisioner.models import Environment, Node
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import ENV, gpu, heartbeat_body, make_user

pytestmark = pytest.mark.django_db
VSCODE_ENV = "VS Code"


def _beat(token: str, interfaces: list[str] | None):
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    if interfaces is not None:
        body["capabilities"] = {"sharing_policies": [], "interfaces": interfaces}
    response = APIClient().post(
        "/api/agent/heartbeat",
        json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 200, response.content
    return response.json()


@pytest.fixture
def node_and_token(catalog):
    from provisioner.services.nodes import node_enroll

    Environment.objects.create(
        name=VSCODE_ENV, python=sys.executable, interface=Environment.Interface.VSCODE, memory_mib=4096
    )
    enrolment = node_enroll(name="node-a", address="http://127.0.0.1:9")
    return enrolment.node, enrolment.token


def _offered() -> list[str]:
    return [e["name"] for e in selectors.catalog()["environments"]]


def _launch(user, environment: str):
    return session_launch(
        user=user,
        account=user.account,
        gpu_model="",
        profile="cpu",
        environment=environment,
        max_hours=1,
        idle_minutes=30,
        idempotency_key=None,
    ).session


def test_vscode_is_offered_only_while_a_node_reports_code_server(node_and_token):
    node, token = node_and_token
    _beat(token, None)  # an agent from before the interfaces: JupyterLab only
    assert Node.objects.get(id=node.id).interfaces == ["jupyterlab"]
    assert _offered() == [ENV]
    with pytest.raises(ValidationFailed) as refused:
        _launch(make_user(), VSCODE_ENV)
    assert refused.value.fields == {"environment": "no active node serves vscode"}

    _beat(token, ["jupyterlab", "vscode"])
    assert Node.objects.get(id=node.id).interfaces == ["jupyterlab", "vscode"]
    assert VSCODE_ENV in _offered()  # the catalog was told (its cached copy replaced)

    _beat(token, ["jupyterlab"])  # the agent restarted without code-server
    assert _offered() == [ENV]


def test_a_vscode_session_carries_its_interface_to_the_agent_and_opens_at_its_base_url(node_and_token):
    _node, token = node_and_token
    _beat(token, ["jupyterlab", "vscode"])
    user = make_user()
    vscode = _launch(user, VSCODE_ENV)
    jupyter = _launch(user, ENV)
    assert selectors.workload_spec(vscode)["environment"]["interface"] == "vscode"
    # a JupyterLab spec is the one agents before the interface knew (its fingerprint unchanged)
    assert "interface" not in selectors.workload_spec(jupyter)["environment"]
    assert selectors.session_lab_url(vscode) == vscode.base_url
    assert selectors.session_lab_url(jupyter) == f"{jupyter.base_url}lab/tree/Welcome.ipynb"


def test_a_heartbeat_with_malformed_interfaces_is_refused(node_and_token):
    _node, token = node_and_token
    body = heartbeat_body([gpu(0, "GPU-a-0")]) | {
        "capabilities": {"sharing_policies": [], "interfaces": "vscode"}
    }
    response = APIClient().post(
        "/api/agent/heartbeat",
        json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 400, response.content
    assert "capabilities.interfaces" in json.dumps(response.json())


def test_a_vscode_session_goes_only_to_a_node_that_serves_it(node_and_token):
    """In a pool where some nodes have code-server, placement passes over the others, however they rank."""
    from provisioner.services.nodes import node_enroll

    node_a, token_a = node_and_token
    _beat(token_a, ["jupyterlab"])  # enrolled first: the CPU pick's first choice
    node_b = node_enroll(name="node-b", address="http://127.0.0.1:9")
    body = heartbeat_body([gpu(0, "GPU-b-0")])
    body["capabilities"] = {"sharing_policies": [], "interfaces": ["jupyterlab", "vscode"]}
    answer = APIClient().post(
        "/api/agent/heartbeat", json.dumps(body), content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {node_b.token}",
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    user = make_user()
    assert {_launch(user, VSCODE_ENV).node_id for _ in range(3)} == {node_b.node.id}
    assert _launch(user, ENV).node_id in (node_a.id, node_b.node.id)
