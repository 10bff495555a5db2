"""The lines people read about their sessions: lifecycle events and the reason of the last transition.

They are written by workers, heartbeats and sweeps, where no reader's language is known, so a line is
stored as a key of ``TEMPLATES`` and its parameters and rendered when it is read, in the reader's
language: the machinery is ``core.messages``, re-exported here so the provisioner's callers keep their
imports. The English rendering is stored beside the key for the admin, the logs and the API's ``reason``.
"""

from __future__ import annotations

from django.utils.translation import gettext_noop

from core.messages import (
    KEY_MAX_LENGTH,
    TEXT_PARAM_MAX_LENGTH,
    Message,
    message,
    message_columns,
    message_load,
    message_render,
    templates_register,
)

__all__ = [
    "KEY_MAX_LENGTH",
    "TEMPLATES",
    "TEXT_PARAM_MAX_LENGTH",
    "Message",
    "message",
    "message_columns",
    "message_load",
    "message_render",
]

TEMPLATES: dict[str, str] = {
    "launched_by": gettext_noop("Launched by %(user)s"),
    "placed_on": gettext_noop("Placed on %(node)s"),
    "placed_away_from_home": gettext_noop(
        "Placed on %(node)s: the nodes that hold your home folder had no room, so this session has the home "
        "folder kept on %(node)s, not your latest files."
    ),
    "team_folder_over_read_only": gettext_noop(
        "The team folder %(team)s holds %(used)s and %(files)s files, over its limit of %(limit)s and "
        "%(max_files)s files: this session sees it read-only. Ask a team owner or admin to delete files from "
        "it, or an administrator to raise the team's limit."
    ),
    "team_folder_over_manager": gettext_noop(
        "The team folder %(team)s holds %(used)s and %(files)s files, over its limit of %(limit)s and "
        "%(max_files)s files: members' sessions see it read-only until it is under. As a team owner or "
        "admin you may delete files from it in this session."
    ),
    "no_room": gettext_noop("No free %(gpu_model)s %(profile)s right now: waiting in the queue."),
    "reserved_node": gettext_noop(
        "Waited long enough to reserve %(node)s: nothing else of this model starts there until this fits."
    ),
    "cancelled": gettext_noop("Cancelled: %(why)s"),
    "cancelled_by": gettext_noop("Cancelled by %(actor)s: %(why)s"),
    "stop": gettext_noop("Stop: %(why)s"),
    "stop_by": gettext_noop("Stop by %(actor)s: %(why)s"),
    "starting": gettext_noop("The agent is starting Jupyter"),
    "running": gettext_noop("Jupyter is running"),
    "stopped": gettext_noop("Stopped"),
    "queue_timeout": gettext_noop("Waited longer than %(minutes)s minutes in the queue"),
    "longest_reached": gettext_noop("longest session time reached"),
    "idle_for": gettext_noop("idle for %(minutes)s minutes"),
    "idle_warning": gettext_noop("No activity: this session stops in about %(minutes)s minutes unless used."),
    "funds_exhausted": gettext_noop("funds exhausted"),
    "budget_reached": gettext_noop("monthly budget reached"),
    "stop_warning_idle": gettext_noop(
        "No activity: this session stops in about %(minutes)s minutes unless it is used. "
        "Your home folder is kept."
    ),
    "stop_warning_funds": gettext_noop(
        "Funds are running out: this session stops in about %(minutes)s minutes unless you top up or redeem "
        "a card. Your home folder is kept."
    ),
    "stop_warning_max_hours": gettext_noop(
        "This session reaches its longest time and stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_you": gettext_noop(
        "You reached this month's budget: this session stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_team": gettext_noop(
        "This team reached this month's budget: this session stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_member": gettext_noop(
        "Your share of this team reached this month's budget: this session stops in about %(minutes)s "
        "minutes. Your home folder is kept."
    ),
    "stop_warning_preempt": gettext_noop(
        "An on-demand launch needs this GPU: this session stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "preempted": gettext_noop("preempted by an on-demand launch"),
    "preempting": gettext_noop(
        "No free room: interruptible sessions asked to stop for this one: %(count)s. "
        "It starts when they have."
    ),
    "resumed_from": gettext_noop("Re-queued to resume the preempted session %(session)s"),
    "resumed_as": gettext_noop("Re-queued to resume as session %(session)s"),
    "budget_threshold_you": gettext_noop(
        "You have used %(percent)s%% of this month's budget (%(spent)s spent, %(card_hours)s card-hours)."
    ),
    "budget_threshold_team": gettext_noop(
        "This team has used %(percent)s%% of this month's budget (%(spent)s spent, "
        "%(card_hours)s card-hours)."
    ),
    "budget_threshold_member": gettext_noop(
        "Your share of this team has used %(percent)s%% of this month's budget (%(spent)s spent, "
        "%(card_hours)s card-hours)."
    ),
    "asked_by_owner": gettext_noop("asked by its owner"),
    "kept_alive": gettext_noop("Kept alive by its owner"),
    "from_session_page": gettext_noop("from the session page"),
    "forced_by_admin": gettext_noop("forced by an admin"),
    "node_drained": gettext_noop("node drained by an admin"),
    "jupyter_exited": gettext_noop("Jupyter exited: %(why)s"),
    "jupyter_exited_plain": gettext_noop("Jupyter exited"),
    "workload_failed": gettext_noop("the workload failed"),
    "failed_on": gettext_noop("Failed on %(node)s: %(why)s"),
    "node_silent": gettext_noop("Node %(node)s stopped answering (no heartbeat since %(time)s)"),
    "start_timeout": gettext_noop("Jupyter did not start within %(seconds)s s"),
    "node_refused": gettext_noop("The node refused the workload (%(code)s): %(why)s"),
    "could_not_start": gettext_noop("Jupyter could not start: %(why)s"),
    "environment_unavailable": gettext_noop(
        "The environment %(environment)s is not available on %(node)s: %(why)s"
    ),
    "home_removal": gettext_noop(
        "Your home folder will be removed on %(date)s UTC: you have launched no session for a long time "
        "(homes unused for %(days)s days are removed). Launch a session before then to keep it."
    ),
}
templates_register(TEMPLATES)
