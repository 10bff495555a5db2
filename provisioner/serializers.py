"""Input checks and output shapes of the provisioner's API. The views render their answers through the
``…Out`` classes, and the OpenAPI schema is read from the same classes, so the two cannot differ."""

from __future__ import annotations

from datetime import UTC

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from provisioner.models import Device, Session, SessionEvent, StopWarning
from provisioner.selectors import slot_maps

# --- input -------------------------------------------------------------------------------------------


class LaunchIn(serializers.Serializer):
    gpu_model = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    profile = serializers.CharField(max_length=32)
    environment = serializers.CharField(
        max_length=70, help_text='A published environment\'s name, or "mine:<name>" for one of your own.'
    )
    max_hours = serializers.FloatField(required=False, allow_null=True, min_value=0.001, max_value=24 * 366)
    idle_minutes = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=60 * 24 * 31
    )
    account = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="Paying account id (default: your own)."
    )
    tier = serializers.ChoiceField(
        choices=Session.Tier.choices,
        default=Session.Tier.ON_DEMAND,
        help_text="interruptible: the lower price; an on-demand launch may preempt it (warned first).",
    )
    resume = serializers.BooleanField(
        default=False, help_text="Interruptible: queue it again automatically when preempted."
    )


class StopIn(serializers.Serializer):
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class NodeEnrollIn(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$", max_length=100)
    address = serializers.URLField(max_length=300)
    labels = serializers.DictField(child=serializers.CharField(max_length=200), required=False)


class NodeActionIn(serializers.Serializer):
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class QuotaLimitsIn(serializers.Serializer):
    max_eighths = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=2**31 - 1)
    max_sessions = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=2**31 - 1)
    allowed_gpu_models = serializers.ListField(
        child=serializers.CharField(max_length=64), required=False, allow_null=True, max_length=100
    )
    allowed_profiles = serializers.ListField(
        child=serializers.CharField(max_length=32), required=False, allow_null=True, max_length=100
    )
    max_session_seconds = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**31 - 1
    )
    monthly_spend_cap_micros = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**63 - 1
    )
    monthly_card_cap_micros = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=2**63 - 1,
        help_text="Micro card-hours a month.",
    )
    max_home_bytes = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**63 - 1, help_text="A user's home, bytes."
    )
    max_home_files = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**63 - 1, help_text="A user's home, files."
    )


class QuotaSetIn(serializers.Serializer):
    user = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    account = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    limits = QuotaLimitsIn()
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    def validate(self, attrs):
        if not attrs.get("user") and not attrs.get("account"):
            raise serializers.ValidationError({"user": "give a user, an account, or both"})
        return attrs


# --- output ------------------------------------------------------------------------------------------


class UtcDateTimeField(serializers.DateTimeField):
    """A time as this API has always written it: ISO 8601 in UTC (``…Z``), whatever the reader's zone."""

    def __init__(self, **kwargs):
        super().__init__(default_timezone=UTC, **kwargs)


class QueueOut(serializers.Serializer):
    position = serializers.IntegerField()
    estimate_seconds = serializers.IntegerField(allow_null=True)


class PriceOut(serializers.Serializer):
    currency = serializers.CharField()
    price_micros_per_hour = serializers.IntegerField()
    card_burn_micros_per_hour = serializers.IntegerField()


class CostOut(serializers.Serializer):
    charged_micros = serializers.IntegerField()
    accrued_micros = serializers.IntegerField()
    total_micros = serializers.IntegerField()
    card_micros = serializers.IntegerField()
    wallet_micros = serializers.IntegerField()
    overdraft_micros = serializers.IntegerField()
    billed_seconds = serializers.IntegerField()


class DeviceRefOut(serializers.Serializer):
    uuid = serializers.CharField()
    kind = serializers.ChoiceField(choices=Device.Kind.choices)
    index = serializers.IntegerField()
    name = serializers.CharField()
    memory_mib = serializers.IntegerField()


class EnforcedOut(serializers.Serializer):
    enforced = serializers.BooleanField()
    by = serializers.CharField(
        help_text="device-nodes, device-request, environment, whole-device, mig, mps, "
        "libvgpu, ld-preload-variable, no-libvgpu or time-slicing"
    )


class EnforcementOut(serializers.Serializer):
    """What the node's agent reports it really enforces; null until the session runs."""

    device = EnforcedOut()
    memory = EnforcedOut()
    compute = EnforcedOut()


class LimitsOut(serializers.Serializer):
    device = DeviceRefOut(allow_null=True, help_text="The session's (first) GPU or MIG device.")
    devices = DeviceRefOut(many=True, help_text="Every GPU the session runs on: N for a multi-GPU profile.")
    slot_start = serializers.IntegerField(allow_null=True)
    slot_count = serializers.IntegerField(allow_null=True)
    enforcement = EnforcementOut(allow_null=True)
    memory_cap_mib = serializers.IntegerField(allow_null=True)
    compute_percent = serializers.IntegerField(allow_null=True)
    sharing_policy = serializers.CharField(allow_blank=True)
    cpu_cores = serializers.FloatField()
    memory_mib = serializers.IntegerField()
    max_seconds = serializers.IntegerField()
    idle_seconds = serializers.IntegerField(allow_null=True)


MESSAGE_PARAMS_HELP = (
    "The message's parameters: a name to a string or a number, or to a nested message {key, params}; "
    "null for free text."
)


class PayingAccountOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    kind = serializers.CharField()


# SessionOut, SessionDetailOut and MetricsOut render a SessionView (provisioner/session_view.py).
class SessionOut(serializers.Serializer):
    id = serializers.UUIDField(source="session.id")
    state = serializers.ChoiceField(choices=Session.State.choices)
    reason = serializers.CharField(help_text="Why the last transition happened, in English.")
    reason_code = serializers.CharField(
        allow_null=True, help_text="The reason's message key (e.g. stop_by); null for free text."
    )
    reason_params = serializers.DictField(allow_null=True, help_text=MESSAGE_PARAMS_HELP)
    gpu_model = serializers.CharField(allow_null=True)
    profile = serializers.CharField()
    environment = serializers.CharField()
    account = PayingAccountOut(source="session.account")
    node = serializers.CharField(allow_null=True)
    created_at = UtcDateTimeField(source="session.created_at")
    queued_at = UtcDateTimeField(source="session.queued_at", allow_null=True)
    placed_at = UtcDateTimeField(source="session.placed_at", allow_null=True)
    starting_at = UtcDateTimeField(source="session.starting_at", allow_null=True)
    running_at = UtcDateTimeField(source="session.running_at", allow_null=True)
    stopping_at = UtcDateTimeField(source="session.stopping_at", allow_null=True)
    ended_at = UtcDateTimeField(source="session.ended_at", allow_null=True)
    jupyter_url = serializers.CharField(source="lab_url", allow_null=True)
    tier = serializers.ChoiceField(choices=Session.Tier.choices)
    resume = serializers.BooleanField(help_text="Interruptible: queued again when preempted.")
    preempted = serializers.BooleanField(help_text="Stopped, or being stopped, for an on-demand launch.")
    resumed_from = serializers.UUIDField(allow_null=True, help_text="The preempted session this one resumes.")
    resumed_as = serializers.UUIDField(allow_null=True, help_text="The session that resumes this one.")


class SessionPageOut(serializers.Serializer):
    """A page of sessions (limit/offset)."""

    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = SessionOut(many=True)


class SessionDetailOut(SessionOut):
    last_alive_at = UtcDateTimeField(source="session.last_alive_at", allow_null=True)
    queue = QueueOut(allow_null=True)
    price = PriceOut()
    cost = CostOut(allow_null=True)
    limits = LimitsOut()
    runway_seconds = serializers.IntegerField(
        allow_null=True,
        help_text="While running: until the paying account's cards and money run out at what it spends now.",
    )
    gpu_util_percent = serializers.IntegerField(allow_null=True)


class EventOut(serializers.Serializer):
    at = UtcDateTimeField()
    kind = serializers.CharField()
    from_state = serializers.CharField()
    to_state = serializers.CharField()
    message = serializers.CharField(help_text="The line in English.")
    message_code = serializers.SerializerMethodField(help_text="Its message key; null for free text.")
    message_params = serializers.SerializerMethodField(help_text=MESSAGE_PARAMS_HELP)

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_message_code(self, event: SessionEvent) -> str | None:
        return event.message_key or None

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_message_params(self, event: SessionEvent) -> dict | None:
        return event.message_params if event.message_key else None


class StopNoticeOut(serializers.Serializer):  # renders a selectors.StopNotice
    kind = serializers.ChoiceField(choices=StopWarning.Kind.choices, help_text="Why the session will stop.")
    message = serializers.CharField(help_text="The line in the reader's language.")
    due_at = UtcDateTimeField(help_text="When the session stops unless the cause goes away.")
    seconds_left = serializers.IntegerField(min_value=0)
    still_here = serializers.BooleanField(help_text="Whether POST …/still-here puts it off (idle).")


class StopNoticeLabelsOut(serializers.Serializer):
    still_here = serializers.CharField(help_text="The button of a warning that can be put off.")
    stops_in = serializers.CharField(help_text="The time left; {time} stands for it (e.g. 4:59).")


class NoticesOut(serializers.Serializer):
    """What JupyterLab shows inside a session (agents/labextensions/suanli-notices): every string in the
    reader's language, so the extension has none of its own."""

    warnings = StopNoticeOut(many=True, help_text="Live stop warnings, soonest first.")
    labels = StopNoticeLabelsOut()
    poll_seconds = serializers.IntegerField(help_text="How long the extension waits before asking again.")


class SampleOut(serializers.Serializer):
    at = UtcDateTimeField()
    gpu_util_percent = serializers.IntegerField(allow_null=True)
    memory_used_mib = serializers.IntegerField(allow_null=True)
    temperature_c = serializers.IntegerField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)


class MetricsOut(serializers.Serializer):
    device = serializers.CharField(source="device_uuid", allow_null=True)
    device_wide = serializers.BooleanField(
        help_text="True: the figures are the whole GPU's, shared or not; false: a MIG device's own."
    )
    samples = SampleOut(many=True)


class NodeDeviceOut(serializers.Serializer):
    id = serializers.IntegerField()
    uuid = serializers.CharField()
    index = serializers.IntegerField()
    kind = serializers.ChoiceField(choices=Device.Kind.choices)
    parent = serializers.IntegerField(source="parent_id", allow_null=True)
    gpu_model = serializers.CharField(source="gpu_model.name", allow_null=True)
    nvml_name = serializers.CharField()
    mig_profile = serializers.CharField(allow_blank=True)
    mig_mode = serializers.BooleanField()
    memory_mib = serializers.IntegerField()
    health = serializers.CharField()
    sharing_policy = serializers.CharField()
    slot_map = serializers.SerializerMethodField(
        help_text="Eight cells: the session (short id) holding each slot."
    )
    last_seen_at = UtcDateTimeField(allow_null=True)

    @extend_schema_field(serializers.ListField(child=serializers.CharField(allow_null=True)))
    def get_slot_map(self, device: Device) -> list[str | None]:
        maps = self.context.get("slot_maps")
        if maps is None:  # the fleet's, read once for every device of the answer
            maps = self.context["slot_maps"] = slot_maps()
        return maps[device.id]


class NodeOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    address = serializers.CharField()
    state = serializers.CharField()
    labels = serializers.DictField()
    last_heartbeat_at = UtcDateTimeField(allow_null=True)
    agent_version = serializers.CharField()
    runtime = serializers.CharField()
    environments = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="The published interpreters it has; null: not reported.",
    )
    devices = NodeDeviceOut(source="devices.all", many=True)


class NodeEnrolledOut(NodeOut):
    token = serializers.SerializerMethodField(help_text="Shown once: write it to the agent's --token-file.")

    @extend_schema_field(serializers.CharField())
    def get_token(self, _node) -> str:
        return self.context["token"]


class QuotaOut(serializers.Serializer):
    id = serializers.IntegerField()
    user = serializers.IntegerField(source="user_id", allow_null=True)
    account = serializers.IntegerField(source="account_id", allow_null=True)
    limits = serializers.DictField()
    updated_at = UtcDateTimeField()


class HeartbeatOut(serializers.Serializer):  # renders a services.heartbeats.HeartbeatAnswer
    desired_workloads = serializers.ListField(child=serializers.DictField())
    heartbeat_interval_seconds = serializers.IntegerField()
    environments = serializers.ListField(child=serializers.CharField())
