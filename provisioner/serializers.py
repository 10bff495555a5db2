"""Input checks and OpenAPI shapes of the provisioner's API. The views build the answers from the
selectors; these classes say what goes in and, for the schema, what comes out."""

from __future__ import annotations

from rest_framework import serializers

from provisioner.models import Device, Session

# --- input -------------------------------------------------------------------------------------------


class LaunchIn(serializers.Serializer):
    gpu_model = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    profile = serializers.CharField(max_length=32)
    environment = serializers.CharField(max_length=64)
    max_hours = serializers.FloatField(required=False, allow_null=True, min_value=0.001, max_value=24 * 366)
    idle_minutes = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=60 * 24 * 31
    )
    account = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="Paying account id (default: your own)."
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


class QuotaSetIn(serializers.Serializer):
    user = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    account = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    limits = QuotaLimitsIn()
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    def validate(self, attrs):
        if not attrs.get("user") and not attrs.get("account"):
            raise serializers.ValidationError({"user": "give a user, an account, or both"})
        return attrs


# --- output (for the schema) -------------------------------------------------------------------------


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
    device = DeviceRefOut(allow_null=True)
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


class SessionOut(serializers.Serializer):
    id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=Session.State.choices)
    reason = serializers.CharField(help_text="Why the last transition happened, in English.")
    reason_code = serializers.CharField(
        allow_null=True, help_text="The reason's message key (e.g. stop_by); null for free text."
    )
    reason_params = serializers.DictField(allow_null=True, help_text=MESSAGE_PARAMS_HELP)
    gpu_model = serializers.CharField(allow_null=True)
    profile = serializers.CharField()
    environment = serializers.CharField()
    account = serializers.DictField()
    node = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()
    queued_at = serializers.DateTimeField(allow_null=True)
    placed_at = serializers.DateTimeField(allow_null=True)
    starting_at = serializers.DateTimeField(allow_null=True)
    running_at = serializers.DateTimeField(allow_null=True)
    stopping_at = serializers.DateTimeField(allow_null=True)
    ended_at = serializers.DateTimeField(allow_null=True)
    jupyter_url = serializers.CharField(allow_null=True)


class SessionPageOut(serializers.Serializer):
    """A page of sessions (limit/offset)."""

    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = SessionOut(many=True)


class SessionDetailOut(SessionOut):
    last_alive_at = serializers.DateTimeField(allow_null=True)
    queue = QueueOut(allow_null=True)
    price = PriceOut()
    cost = CostOut(allow_null=True)
    limits = LimitsOut()
    gpu_util_percent = serializers.IntegerField(allow_null=True)


class EventOut(serializers.Serializer):
    at = serializers.DateTimeField()
    kind = serializers.CharField()
    from_state = serializers.CharField()
    to_state = serializers.CharField()
    message = serializers.CharField(help_text="The line in English.")
    message_code = serializers.CharField(allow_null=True, help_text="Its message key; null for free text.")
    message_params = serializers.DictField(allow_null=True, help_text=MESSAGE_PARAMS_HELP)


class SampleOut(serializers.Serializer):
    at = serializers.DateTimeField()
    gpu_util_percent = serializers.IntegerField(allow_null=True)
    memory_used_mib = serializers.IntegerField(allow_null=True)
    temperature_c = serializers.IntegerField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)


class MetricsOut(serializers.Serializer):
    device = serializers.CharField(allow_null=True)
    device_wide = serializers.BooleanField(help_text="True: the figures are the whole GPU's, shared or not.")
    samples = SampleOut(many=True)


class NodeOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    address = serializers.CharField()
    state = serializers.CharField()
    labels = serializers.DictField()
    last_heartbeat_at = serializers.DateTimeField(allow_null=True)
    agent_version = serializers.CharField()
    runtime = serializers.CharField()
    devices = serializers.ListField(child=serializers.DictField())


class NodeEnrolledOut(NodeOut):
    token = serializers.CharField(help_text="Shown once: write it to the agent's --token-file.")


class QuotaOut(serializers.Serializer):
    id = serializers.IntegerField()
    user = serializers.IntegerField(allow_null=True)
    account = serializers.IntegerField(allow_null=True)
    limits = serializers.DictField()
    updated_at = serializers.DateTimeField()


class HeartbeatOut(serializers.Serializer):
    desired_workloads = serializers.ListField(child=serializers.DictField())
    heartbeat_interval_seconds = serializers.IntegerField()
