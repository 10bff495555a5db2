"""``python manage.py node add NAME --address URL [--token-file PATH] [--label KEY=VALUE …]``: enrol a node
and print its one-time token (or write it, mode 0600, to ``--token-file``); ``node list``; ``node cordon |
drain | uncordon NAME``. Enrolling a name that exists rotates its token: the old one stops working."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from provisioner.models import Node, Session
from provisioner.services.nodes import node_enroll, node_set_state


def write_token_file(path: Path, token: str) -> None:
    """Write a node token readable by its owner only (created 0600, never world-readable on the way)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class Command(BaseCommand):
    help = "Enrol GPU nodes and print their one-time token; list nodes; cordon, drain or uncordon one."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="verb", required=True)
        add = sub.add_parser("add", help="enrol a node (or rotate its token) and print the token once")
        add.add_argument("name")
        add.add_argument("--address", required=True, help="the agent's base URL, e.g. http://10.0.0.5:8701")
        add.add_argument("--token-file", help="write the token here (mode 0600) instead of printing it")
        add.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
        sub.add_parser("list", help="nodes, their state and last heartbeat")
        for verb in ("cordon", "drain", "uncordon"):
            action = sub.add_parser(verb, help=f"{verb} a node")
            action.add_argument("name")
            action.add_argument("--reason", default="")

    def handle(self, *args, verb: str, **options):
        try:
            if verb == "add":
                self._add(**options)
            elif verb == "list":
                self._list()
            else:
                node = Node.objects.filter(name=options["name"]).first()
                if node is None:
                    raise CommandError(f"no node named {options['name']!r}")
                node = node_set_state(
                    node_id=node.id, action=verb, reason=options["reason"] or "manage.py node"
                )
                self.stdout.write(f"{node.name}: {node.state}")
        except ApplicationError as exc:
            raise CommandError(exc.message) from None

    def _add(self, *, name: str, address: str, token_file: str | None, label: list[str], **_options) -> None:
        labels = {}
        for item in label:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise CommandError(f"--label must be KEY=VALUE, got {item!r}")
            labels[key] = value
        enrolment = node_enroll(name=name, address=address, labels=labels or None)
        if token_file:
            write_token_file(Path(token_file), enrolment.token)
            self.stdout.write(f"{enrolment.node.name}: token written to {token_file}")
        else:
            self.stdout.write(enrolment.token)
        self.stderr.write(
            f"start its agent with: python -m agents --listen HOST:PORT --token-file FILE --portal URL "
            f"(the agent's address as enrolled: {enrolment.node.address})"
        )

    def _list(self) -> None:
        rows = [("name", "state", "address", "last heartbeat", "devices", "live sessions")]
        for node in Node.objects.order_by("name"):
            rows.append(
                (
                    node.name,
                    node.state,
                    node.address,
                    node.last_heartbeat_at.isoformat(timespec="seconds")
                    if node.last_heartbeat_at
                    else "never",
                    str(node.devices.count()),
                    str(node.sessions.filter(state__in=Session.LIVE).count()),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            self.stdout.write(
                "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            )
