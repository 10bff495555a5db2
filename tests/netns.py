"""Network namespaces a test makes and removes: a GPU host of its own, reached over a veth pair.

``node_namespace()`` creates a namespace with one end of a veth pair (``10.213.N.2``) and leaves the
other end (``10.213.N.1``) in the test's namespace, where the portal listens. Only these two addresses
carry traffic; both disappear with the namespace. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Namespace:
    name: str
    host_address: str  # the test's end of the link: where the portal listens
    node_address: str  # the namespace's end: where the agent listens

    def command(self, *argv: str) -> list[str]:
        """argv run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=20)


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


@contextlib.contextmanager
def node_namespace() -> Iterator[Namespace]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    name, outside, inside = f"suanli-{tag}", f"slh{tag}", f"sln{tag}"
    subnet = 16 + int(tag[:2], 16) % 224  # 10.213.16-239.0/30, a link of our own
    host_address, node_address = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{host_address}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", name, "addr", "add", f"{node_address}/30", "dev", inside)
        _ip("-n", name, "link", "set", inside, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield Namespace(name, host_address, node_address)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", outside)  # takes its peer with it
        _ip("netns", "del", name)


@contextlib.contextmanager
def linked_namespace(node: Namespace) -> Iterator[Namespace]:
    """Another namespace linked to ``node``'s only (a host on the internet, as the node sees it):
    ``host_address`` is the node's end of the link, ``node_address`` this namespace's end."""
    tag = secrets.token_hex(3)
    name, near, far = f"suanli-{tag}", f"slh{tag}", f"sln{tag}"
    subnet = 16 + int(tag[:2], 16) % 224
    near_address, far_address = f"10.214.{subnet}.1", f"10.214.{subnet}.2"
    _ip("netns", "add", name)
    try:
        _ip("-n", node.name, "link", "add", near, "type", "veth", "peer", "name", far)
        _ip("-n", node.name, "link", "set", far, "netns", name)
        _ip("-n", node.name, "addr", "add", f"{near_address}/30", "dev", near)
        _ip("-n", node.name, "link", "set", near, "up")
        _ip("-n", name, "addr", "add", f"{far_address}/30", "dev", far)
        _ip("-n", name, "link", "set", far, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield Namespace(name, near_address, far_address)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("-n", node.name, "link", "del", near)
        _ip("netns", "del", name)
