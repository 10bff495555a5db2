"""Nodes: enrolment, tokens, and the admin's cordon / drain / uncordon."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from django.db import transaction
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing.audit import audit_record
from core.errors import Conflict, NotFound, ValidationFailed
from provisioner.catalog_cache import catalog_changed
from provisioner.messages import message
from provisioner.models import Allocation, AllocationSlot, Device, Node, Session
from provisioner.sealing import new_token, seal, token_hash, unseal
from provisioner.services.sessions import session_stop


@dataclass(frozen=True)
class Enrolment:
    node: Node
    token: str  # plaintext, shown once


def node_enroll(*, name: str, address: str, labels: dict | None = None, actor=None) -> Enrolment:
    """Create a node and its token (returned once in plaintext; stored hashed and sealed).

    Enrolling an existing name rotates its token and updates its address: the old token stops working.
    Raises ValidationFailed on an empty name or a non-http address.
    """
    name = (name or "").strip()
    if not name:
        raise ValidationFailed(_("A node needs a name."), fields={"name": "required"})
    if not address.startswith(("http://", "https://")):
        raise ValidationFailed(
            _("The address is the agent's base URL."), fields={"address": "must be http(s)://…"}
        )
    token = new_token()
    with transaction.atomic():
        node, created = Node.objects.select_for_update().get_or_create(
            name=name,
            defaults={
                "address": address.rstrip("/"),
                "token_hash": token_hash(token),
                "token_sealed": seal(token),
            },
        )
        before = None if created else {"name": node.name, "address": node.address, "labels": node.labels}
        if not created:
            node.address = address.rstrip("/")
            node.token_hash = token_hash(token)
            node.token_sealed = seal(token)
        if labels is not None:
            node.labels = labels
        node.save()  # the catalog is told by the save (provisioner.apps)
        audit_record(
            actor=actor,
            action="node.enroll" if created else "node.token_rotate",
            target=node,
            before=before,
            after={"name": name, "address": node.address, "labels": node.labels},
        )
    return Enrolment(node, token)


def node_by_token(*, token: str) -> Node:
    """The node a bearer token belongs to; raises NotFound (the caller answers 401)."""
    if not token:
        raise NotFound("No such node.")
    digest = token_hash(token)
    node = Node.objects.filter(token_hash=digest).first()
    if node is None or not hmac.compare_digest(node.token_hash, digest):
        raise NotFound("No such node.")
    return node


def node_token(*, node: Node) -> str:
    return unseal(node.token_sealed)


_ALLOWED = {
    "cordon": {Node.State.ACTIVE, Node.State.DRAINING},
    "drain": {Node.State.ACTIVE, Node.State.CORDONED},
    "uncordon": {Node.State.CORDONED, Node.State.DRAINING},
}
_TARGET = {"cordon": Node.State.CORDONED, "drain": Node.State.DRAINING, "uncordon": Node.State.ACTIVE}
# A whole sentence per action (the verb is no fragment to splice into a translation).
_REFUSED_ACTION = {
    "cordon": gettext_lazy("Cannot cordon a node that is %(state)s."),
    "drain": gettext_lazy("Cannot drain a node that is %(state)s."),
    "uncordon": gettext_lazy("Cannot uncordon a node that is %(state)s."),
}


def node_set_state(*, node_id: int, action: str, actor=None, reason: str = "") -> Node:
    """Cordon (no new sessions), drain (cordon and stop its sessions) or uncordon a node.

    A conditional update on the node's state; draining asks every live session on it to stop. A down
    node keeps ``down`` and records the wanted state for when it comes back. Raises Conflict when the
    action does not apply, NotFound for an unknown node.
    """
    if action not in _TARGET:
        raise ValidationFailed(_("Unknown action %(action)s.") % {"action": repr(action)})
    target = _TARGET[action]
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).filter(id=node_id).first()
        if node is None:
            raise NotFound(_("No such node."))
        before = {"state": node.state}
        if node.state == Node.State.DOWN:
            node.state_before_down = target
        elif node.state == target:
            return node
        elif node.state not in _ALLOWED[action]:
            raise Conflict(_REFUSED_ACTION[action] % {"state": node.state})
        else:
            node.state = target
        node.save(update_fields=["state", "state_before_down"])  # tells the catalog
        audit_record(
            actor=actor,
            action=f"node.{action}",
            target=node,
            before=before,
            after={"state": node.state, "state_before_down": node.state_before_down},
            reason=reason,
        )
        if target == Node.State.DRAINING:
            for session in Session.objects.filter(node=node, state__in=Session.ON_NODE):
                session_stop(session=session, actor=actor, reason=reason or message("node_drained"))
    return node


def device_set_sharing_policy(*, device_id: int, sharing_policy: str, actor=None, reason: str = "") -> Device:
    """Set a physical GPU's sharing policy; refused while it holds allocations (the agent would refuse
    to mix policies on one GPU). Locks the device. Writes an audit row."""
    if sharing_policy not in Device.Sharing.values:
        raise ValidationFailed(_("Unknown sharing policy."), fields={"sharing_policy": "unknown"})
    with transaction.atomic():
        device = Device.objects.select_for_update(no_key=True).filter(id=device_id).first()
        if device is None:
            raise NotFound(_("No such device."))
        if device.sharing_policy == sharing_policy:
            return device
        if device.kind == Device.Kind.MIG:
            raise Conflict(_("A MIG device is always passed through whole."))
        if Allocation.objects.filter(device=device).exists():
            raise Conflict(_("Stop the sessions on this GPU before changing its sharing policy."))
        before = {"sharing_policy": device.sharing_policy}
        device.sharing_policy = sharing_policy
        device.save(update_fields=["sharing_policy"])  # tells the catalog
        audit_record(
            actor=actor,
            action="device.sharing_policy",
            target=device,
            before=before,
            after={"sharing_policy": sharing_policy},
            reason=reason,
        )
    return device


def device_force_free(*, device_id: int, actor=None, reason: str = "") -> int:
    """Free the allocations of ended (lost, failed, stopped) sessions on a device (a multi-GPU session's:
    on all of its GPUs), for an admin who knows the workloads are gone. Returns how many were freed; never
    touches a live session's slots."""
    with transaction.atomic():
        on_device = AllocationSlot.objects.filter(device_id=device_id).values("allocation_id")
        freed = Allocation.objects.filter(id__in=on_device, session__state__in=Session.ENDED)
        ids = list(freed.values_list("session_id", flat=True))
        count, _by_model = freed.delete()
        if count:
            catalog_changed()
        if ids:
            device = Device.objects.get(id=device_id)
            audit_record(
                actor=actor,
                action="device.force_free",
                target=device,
                before={"sessions": [str(i) for i in ids]},
                after={"sessions": []},
                reason=reason,
            )
    return len(ids) if count else 0
