"""Session reasons and events written as English text before they were stored as a message key and its
parameters: parse each line once into key + parameters, by the templates it was made from.

The templates are frozen here as they were when these lines were written; the portal no longer parses
English anywhere else. A line made from no template (an agent's own words, a staff member's reason, a
line cut at the column's length) keeps no key and is shown as stored, as before.
"""

import re

from django.db import migrations

# The English templates of provisioner.messages when lines were stored as text, by the key they have now.
ENGLISH = {
    "launched_by": "Launched by %(user)s",
    "placed_on": "Placed on %(node)s",
    "no_room": "No free %(gpu_model)s %(profile)s right now: waiting in the queue.",
    "cancelled": "Cancelled: %(why)s",
    "cancelled_by": "Cancelled by %(actor)s: %(why)s",
    "stop": "Stop: %(why)s",
    "stop_by": "Stop by %(actor)s: %(why)s",
    "starting": "The agent is starting Jupyter",
    "running": "Jupyter is running",
    "stopped": "Stopped",
    "queue_timeout": "Waited longer than %(minutes)s minutes in the queue",
    "longest_reached": "longest session time reached",
    "idle_for": "idle for %(minutes)s minutes",
    "idle_warning": "No activity: this session stops in about %(minutes)s minutes unless used.",
    "funds_exhausted": "funds exhausted",
    "asked_by_owner": "asked by its owner",
    "from_session_page": "from the session page",
    "forced_by_admin": "forced by an admin",
    "node_drained": "node drained by an admin",
    "jupyter_exited": "Jupyter exited: %(why)s",
    "jupyter_exited_plain": "Jupyter exited",
    "workload_failed": "the workload failed",
    "failed_on": "Failed on %(node)s: %(why)s",
    "node_silent": "Node %(node)s stopped answering (no heartbeat since %(time)s)",
    "start_timeout": "Jupyter did not start within %(seconds)s s",
    "node_refused": "The node refused the workload (%(code)s): %(why)s",
    "could_not_start": "Jupyter could not start: %(why)s",
}
REASON_PARAMS = {"why"}  # a parameter that may be a message itself; the others are names, numbers, times
NUMBER_PARAMS = {"minutes", "seconds"}
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
BATCH = 1000


def _pattern(template):
    parts = _PLACEHOLDER.split(template)  # literal, name, literal, name, …, literal
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>.+?)" for i, part in enumerate(parts))
    return re.compile(f"^{regex}$", re.DOTALL)


# Templates with more literal text first, so "Stop by %(actor)s: …" wins over "Stop: …".
_PATTERNS = sorted(
    ((key, _pattern(template)) for key, template in ENGLISH.items()),
    key=lambda pair: -len(_PLACEHOLDER.sub("", ENGLISH[pair[0]])),
)


def line_parse(stored, *, depth=2):
    """``stored`` as (key, params), or None when it was made from no template. A reason inside it
    ("Stop by bob: funds exhausted") becomes a nested {"key", "params"} when it too was made from one;
    names, and words that match nothing, stay text."""
    for key, pattern in _PATTERNS:
        match = pattern.match(stored)
        if match is None:
            continue
        params = {}
        for name, value in match.groupdict().items():
            nested = line_parse(value, depth=depth - 1) if name in REASON_PARAMS and depth > 0 else None
            if nested is not None:
                params[name] = {"key": nested[0], "params": nested[1]}
            elif name in NUMBER_PARAMS and value.isdigit():
                params[name] = int(value)
            else:
                params[name] = value
        return key, params
    return None


def _convert(model, text_field, key_field, params_field):
    rows = model.objects.filter(**{key_field: ""}).exclude(**{text_field: ""}).only("id", text_field)
    changed = []
    for row in rows.iterator(chunk_size=BATCH):
        parsed = line_parse(getattr(row, text_field))
        if parsed is None:
            continue
        setattr(row, key_field, parsed[0])
        setattr(row, params_field, parsed[1])
        changed.append(row)
        if len(changed) >= BATCH:
            model.objects.bulk_update(changed, [key_field, params_field])
            changed = []
    if changed:
        model.objects.bulk_update(changed, [key_field, params_field])


def messages_from_english(apps, schema_editor):
    _convert(apps.get_model("provisioner", "Session"), "reason", "reason_key", "reason_params")
    _convert(apps.get_model("provisioner", "SessionEvent"), "message", "message_key", "message_params")


class Migration(migrations.Migration):
    dependencies = [
        ("provisioner", "0004_message_keys"),
    ]

    # Backwards: nothing to undo, the English text was kept beside the keys.
    operations = [migrations.RunPython(messages_from_english, migrations.RunPython.noop)]
