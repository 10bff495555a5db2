"""The node's egress proxy: its policy per destination, and ``--outbound off`` from inside a kernel."""

from __future__ import annotations

import shutil
import socket

import pytest

from agents.egress import EgressPolicy, Refused
from tests.agents.conftest import run_in_kernel, workload_spec


def _own_address() -> str | None:
    """A non-loopback address of this host, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.254", 9))  # no packet is sent: only the route is looked up
            return probe.getsockname()[0]
        except OSError:
            return None


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("localhost", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link-local"),  # a cloud's metadata service
        ("0.0.0.0", "loopback"),
        ("224.0.0.1", "multicast"),
        ("no-such-host.invalid", "does not resolve"),
    ],
)
def test_the_policy_refuses_the_host_itself_and_special_addresses(host, why):
    with pytest.raises(Refused, match=why):
        EgressPolicy().check(host, 80)


def test_the_policy_refuses_this_nodes_own_addresses_the_portal_and_denied_networks():
    own = _own_address()
    if own:
        with pytest.raises(Refused, match="an address of this node itself"):
            EgressPolicy().check(own, 8801)
    with pytest.raises(Refused, match="the portal"):
        EgressPolicy(portal_url="http://192.0.2.10:8000").check("192.0.2.10", 443)
    with pytest.raises(Refused, match="--egress-deny"):
        EgressPolicy(deny=["198.51.100.0/24"]).check("198.51.100.7", 443)
    assert EgressPolicy(deny=["198.51.100.0/24"]).check("203.0.113.5", 443) == (socket.AF_INET, "203.0.113.5")
    with pytest.raises(ValueError):
        EgressPolicy(deny=["not-a-network"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_outbound_off_leaves_the_sandbox_no_way_out(start_agent):
    agent = start_agent(None, "--sandbox", "bwrap", "--outbound", "off")
    spec = workload_spec("off-1", None)
    assert agent.put_workload(spec).status_code == 201
    agent.wait_state("off-1", ("running",))
    code = (
        "import os, socket\n"
        "s = socket.socket(); s.settimeout(2)\n"
        "try:\n    s.connect(('127.0.0.1', 3128)); r = 'connected'\n"
        "except OSError as e:\n    r = type(e).__name__\n"
        "print(os.environ.get('HTTPS_PROXY'), r, os.path.exists('/run/suanli-egress'))"
    )
    assert run_in_kernel(agent.url, spec["base_url"], code).strip().splitlines()[-1] == (
        "None ConnectionRefusedError False"
    )
