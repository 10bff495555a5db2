"""Outbound network for sandboxed workloads: the node's egress proxy (HTTP and HTTPS CONNECT).

A workload's network namespace has a loopback of its own and nothing else. For ``pip install``, a
``git clone`` over HTTPS or a model download, each sandbox gets ``HTTP_PROXY``/``HTTPS_PROXY`` naming
``127.0.0.1:3128`` inside it, where a small relay (``egress_relay``, started in the sandbox before
JupyterLab) passes each connection to this proxy's Unix socket, bound into the sandbox read-only.

The proxy runs in the agent, on the host's network, and decides per destination: it resolves the name
once, refuses every address that is loopback, link-local, multicast, unspecified or reserved, any
address of this host itself (the agent API, the node's own services: an address it can bind to), the
portal's addresses and every ``--egress-deny`` network, and connects to the address it checked (so a
second DNS answer cannot swap it). A refusal is a 403 that says why.

Why not a user-mode stack (pasta, slirp4netns): they open the workload's sockets on the host's network
stack with no per-destination rule, so the node's own address (where the agent listens) would answer.
Plain TCP other than HTTP(S) (ssh, a database driver) is not carried.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

log = logging.getLogger("agents.egress")

SANDBOX_DIR = "/run/suanli-egress"  # where the proxy's folder appears in a sandbox
SOCKET_NAME = "egress.sock"
RELAY_PORT = 3128
HEAD_LIMIT = 64 * 1024
CONNECT_TIMEOUT_SECONDS = 10.0
CHUNK = 64 * 1024


class Refused(Exception):
    """A destination the policy refuses; the message says why."""


class EgressPolicy:
    def __init__(self, deny: Iterable[str] = (), portal_url: str | None = None) -> None:
        self.deny = [ipaddress.ip_network(cidr, strict=False) for cidr in deny]
        self.portal_host = urlsplit(portal_url).hostname if portal_url else None

    def _portal_addresses(self) -> set[str]:
        if not self.portal_host:
            return set()
        with contextlib.suppress(OSError):
            return {info[4][0] for info in socket.getaddrinfo(self.portal_host, None)}
        return set()

    def check(self, host: str, port: int) -> tuple[int, str]:
        """The (family, address) to connect to for host:port, or Refused."""
        if not 0 < port < 65536:
            raise Refused(f"port {port} is not a port")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Refused(f"{host} does not resolve ({exc.strerror or exc})")
        portal = self._portal_addresses()
        for family, _type, _proto, _name, sockaddr in infos:
            address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            why = self._refusal(address, family, portal)
            if why:
                raise Refused(f"{host} ({address}) is {why}")
        return infos[0][0], infos[0][4][0]

    def _refusal(self, address, family: int, portal: set[str]) -> str | None:
        if address.is_loopback or address.is_unspecified:
            return "this host's loopback"
        if address.is_link_local or address.is_multicast or address.is_reserved:
            return "a link-local, multicast or reserved address"
        if str(address) in portal:
            return "the portal"
        if any(address in network for network in self.deny):
            return "in a network this node denies (--egress-deny)"
        if _is_own(address, family):
            return "an address of this node itself"
        return None


def _is_own(address, family: int) -> bool:
    """Whether this host holds the address: only a local address can be bound to."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
        return True


def _splice(a: socket.socket, b: socket.socket, first: bytes = b"") -> None:
    """Relay bytes both ways until both sides are done."""
    if first:
        b.sendall(first)

    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    back = threading.Thread(target=pump, args=(b, a), daemon=True)
    back.start()
    pump(a, b)
    back.join(timeout=600)


class _Handler(socketserver.BaseRequestHandler):
    server: EgressServer

    def handle(self) -> None:
        client: socket.socket = self.request
        client.settimeout(60)
        head = b""
        while b"\r\n\r\n" not in head:
            data = client.recv(CHUNK)
            if not data:
                return
            head += data
            if len(head) > HEAD_LIMIT:
                return self._answer(client, 431, "request head too large")
        head, rest = head.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            return self._answer(client, 400, "malformed request line")
        try:
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                family, address = self.server.policy.check(host.strip("[]"), int(port or 443))
                upstream = socket.create_connection((address, int(port or 443)), CONNECT_TIMEOUT_SECONDS)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = rest
            else:
                parts = urlsplit(target)
                if parts.scheme != "http" or not parts.hostname:
                    return self._answer(client, 400, "only http:// URLs and CONNECT are proxied")
                port = parts.port or 80
                family, address = self.server.policy.check(parts.hostname, port)
                upstream = socket.create_connection((address, port), CONNECT_TIMEOUT_SECONDS)
                path = parts.path or "/"
                if parts.query:
                    path += f"?{parts.query}"
                kept = [
                    line
                    for line in lines[1:]
                    if not line.lower().startswith(("proxy-", "connection:", "keep-alive:"))
                ]
                request = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""])
                first = request.encode("latin-1") + rest
        except Refused as exc:
            log.info("egress refused %s %s: %s", method, target, exc)
            return self._answer(client, 403, f"outbound refused: {exc}")
        except (OSError, ValueError) as exc:
            return self._answer(client, 502, f"cannot reach {target}: {exc}")
        client.settimeout(None)
        upstream.settimeout(None)
        with upstream:
            _splice(client, upstream, first)

    @staticmethod
    def _answer(client: socket.socket, status: int, text: str) -> None:
        reason = {400: "Bad Request", 403: "Forbidden", 431: "Too Large", 502: "Bad Gateway"}[status]
        body = f"{text}\n".encode()
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}"
        with contextlib.suppress(OSError):
            client.sendall(f"{head}\r\nConnection: close\r\n\r\n".encode() + body)


class EgressServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, folder: str, policy: EgressPolicy) -> None:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        os.chmod(folder, 0o755)  # noqa: S103 - tenants reach the socket; the folder holds only it
        self.path = os.path.join(folder, SOCKET_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.policy = policy
        super().__init__(self.path, _Handler)
        os.chmod(self.path, 0o666)  # noqa: S103 - every tenant may ask; the policy decides

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="egress", daemon=True).start()


# The relay inside a sandbox, run with the workload's own Python as ``python -I -c RELAY``: listens on
# 127.0.0.1:<port> of the sandbox's network, passes each connection to the proxy's socket, runs the
# command after ``--`` (JupyterLab) and ends with it.
RELAY = r"""
import os, signal, socket, subprocess, sys, threading
sock_path, port, command = sys.argv[1], int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:]
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def serve(client):
    upstream = socket.socket(socket.AF_UNIX)
    try:
        upstream.connect(sock_path)
    except OSError:
        client.close()
        return
    t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    t.start()
    pump(client, upstream)
    t.join()
    client.close()
    upstream.close()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(64)
def accept():
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
child = subprocess.Popen(command)
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, lambda s, f: child.send_signal(s))
sys.exit(child.wait())
"""


def relay_command(python: str, command: list[str]) -> list[str]:
    return [python, "-I", "-c", RELAY, f"{SANDBOX_DIR}/{SOCKET_NAME}", str(RELAY_PORT), "--", *command]


def proxy_env() -> dict[str, str]:
    url = f"http://127.0.0.1:{RELAY_PORT}"
    return {
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "http_proxy": url,
        "https_proxy": url,
        "NO_PROXY": "localhost,127.0.0.1",
        "no_proxy": "localhost,127.0.0.1",
    }
