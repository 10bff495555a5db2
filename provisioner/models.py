"""Nodes, GPUs and slices, profiles, environments, allocations, sessions and quotas.

The invariant that matters most is held by the database: ``AllocationSlot`` has one row per
(device, eighth) with a unique constraint, so no slot of a GPU is ever handed out twice, whatever
the Python above it does.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from core.choices import ChoiceLabels
from provisioner.messages import KEY_MAX_LENGTH, message_render

SLOTS_PER_GPU = 8


class GpuModel(ChoiceLabels, models.Model):
    """A kind of card the fleet sells (``A100-SXM4-80GB``), matched to NVML names of devices."""

    class Policy(models.TextChoices):
        BINPACK = "binpack", _("Binpack: fill used GPUs first, keep whole cards whole")
        SPREAD = "spread", _("Spread: emptiest GPU first")

    name = models.CharField(max_length=64, unique=True)
    memory_mib = models.PositiveIntegerField()
    peak_tflops = models.FloatField(default=0.0)
    profiles = models.JSONField(default=list, help_text="Offered profiles, e.g. ['whole', '1/2', '1g.18gb'].")
    placement_policy = models.CharField(max_length=8, choices=Policy.choices, default=Policy.BINPACK)
    nvml_names = models.JSONField(
        default=list, help_text="NVML device names that are this model, e.g. ['NVIDIA A100-SXM4-80GB']."
    )
    enabled = models.BooleanField(default=True)

    def __str__(self) -> str:
        return self.name

    def matches(self, nvml_name: str) -> bool:
        wanted = nvml_name.strip().lower()
        names = [n.lower() for n in self.nvml_names] or [self.name.lower(), f"nvidia {self.name.lower()}"]
        return wanted in names


class Profile(ChoiceLabels, models.Model):
    """What a user rents: ``whole``, ``1/2``, ``1/4``, ``1/8`` (aligned eighths of one GPU), a MIG
    profile (a whole MIG device), or ``cpu`` (no GPU)."""

    class Kind(models.TextChoices):
        WHOLE = "whole", _("Whole card")
        SLICE = "slice", _("Slice")
        MIG = "mig", _("MIG device")
        CPU = "cpu", _("No GPU")

    name = models.CharField(max_length=32, unique=True)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    eighths = models.PositiveSmallIntegerField(
        help_text="Slots of the device it takes (MIG: 8 of its device)."
    )
    quota_eighths = models.PositiveSmallIntegerField(help_text="Eighths of a card it counts for in quotas.")
    gpu_count = models.PositiveSmallIntegerField(
        default=1, help_text="Whole GPUs of one node it takes (2x, 4x, 8x); 1 for every other profile."
    )

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(eighths__in=[0, 1, 2, 4, 8]), name="profile_eighths_buddy"),
            models.CheckConstraint(
                condition=Q(gpu_count=1) | Q(kind="whole", gpu_count__in=[2, 4, 8]),
                name="profile_gpu_count_whole",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Environment(ChoiceLabels, models.Model):
    """A software stack (docs/ENVIRONMENTS.md). Published by an admin (no ``owner``): a Python prefix for
    the process runtime (``python``, its interpreter) or an image for docker, with a price tier
    (``surcharge_micros_per_hour``, added to the hourly price of every session that runs it). A user's
    own (``owner``): a virtualenv or conda prefix in their home (``home_path``, relative to it), run on
    the published environment it was made from (``base``), at that one's price. ``interface``: what the
    session serves in the browser (JupyterLab, or VS Code: code-server, process runtime only)."""

    class Interface(models.TextChoices):
        JUPYTERLAB = "jupyterlab", _("JupyterLab")
        VSCODE = "vscode", _("VS Code")

    name = models.CharField(max_length=64)
    interface = models.CharField(max_length=16, choices=Interface.choices, default=Interface.JUPYTERLAB)
    python = models.CharField(max_length=300, blank=True, help_text="Absolute path (process runtime).")
    image = models.CharField(max_length=300, blank=True, help_text="Container image (docker runtime).")
    cpu_cores = models.FloatField(default=2.0)
    memory_mib = models.PositiveIntegerField(default=8192)
    enabled = models.BooleanField(default=True, help_text="Published: offered on the launch page.")
    surcharge_micros_per_hour = models.PositiveBigIntegerField(
        default=0, help_text="Price tier: micro-units per hour added to the session's price."
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="environments",
        help_text="A user's own environment; empty for a published one.",
    )
    base = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="+",
        help_text="A user's own: the published environment its prefix was made from.",
    )  # fmt: skip
    home_path = models.CharField(
        max_length=200, blank=True, help_text="A user's own: the prefix in the home."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["name"], condition=Q(owner__isnull=True), name="environment_published_name_unique"
            ),
            models.UniqueConstraint(
                fields=["owner", "name"], condition=Q(owner__isnull=False), name="environment_own_name_unique"
            ),
            models.CheckConstraint(
                condition=(Q(owner__isnull=True) & Q(base__isnull=True) & Q(home_path=""))
                | (
                    Q(owner__isnull=False)
                    & Q(base__isnull=False)
                    & ~Q(home_path="")
                    & Q(surcharge_micros_per_hour=0)
                ),
                name="environment_published_or_own",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.owner})" if self.owner_id else self.name

    @property
    def runs_on(self) -> Environment:
        """The published environment this one runs on: itself, or a user's own environment's base."""
        return self.base if self.base_id else self


class Node(ChoiceLabels, models.Model):
    """A GPU host with an agent. ``address`` is the agent's base URL."""

    class State(models.TextChoices):
        ACTIVE = "active", _("Active")
        CORDONED = "cordoned", _("Cordoned (no new sessions)")
        DRAINING = "draining", _("Draining (sessions being stopped)")
        DOWN = "down", _("Down (missed heartbeats)")

    name = models.CharField(max_length=100, unique=True)
    address = models.URLField(max_length=300)
    token_hash = models.CharField(max_length=64, unique=True)
    token_sealed = models.TextField()
    state = models.CharField(max_length=10, choices=State.choices, default=State.ACTIVE)
    state_before_down = models.CharField(max_length=10, choices=State.choices, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    # what its workloads can serve, from its heartbeat's capabilities (jupyterlab; vscode with code-server)
    interfaces = models.JSONField(default=list, blank=True)
    agent_version = models.CharField(max_length=32, blank=True)
    runtime = models.CharField(max_length=32, blank=True)
    driver_version = models.CharField(max_length=32, blank=True)
    cuda_version = models.CharField(max_length=32, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The published interpreters the agent has (its last heartbeat's capabilities.environments); None
    # until it reports them (an agent before environments: taken to have them all, as before).
    environments = models.JSONField(null=True, blank=True, default=None)

    class Meta:
        indexes = [models.Index(fields=["state", "last_heartbeat_at"])]

    def __str__(self) -> str:
        return self.name


class Device(ChoiceLabels, models.Model):
    """A physical GPU or a MIG device of one, as the node's agent reports it."""

    class Kind(models.TextChoices):
        PHYSICAL = "physical", _("Physical GPU")
        MIG = "mig", _("MIG device")

    class Health(models.TextChoices):
        OK = "ok", _("OK")
        LOST = "lost", _("Lost (NVML reports it gone)")
        MISSING = "missing", _("Missing from the last inventory")

    class Sharing(models.TextChoices):
        EXCLUSIVE = "exclusive", _("Exclusive (whole card only)")
        FIXED_SHARE = "fixed-share", _("Fixed share (HAMi caps)")
        EQUAL_SHARE = "equal-share", _("Equal share (MPS)")
        BEST_EFFORT = "best-effort", _("Best effort (time-slicing)")

    SHARED = (Sharing.FIXED_SHARE, Sharing.EQUAL_SHARE, Sharing.BEST_EFFORT)

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    uuid = models.CharField(max_length=100, unique=True)
    index = models.PositiveSmallIntegerField(default=0)
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.PHYSICAL)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="mig_devices"
    )
    gpu_model = models.ForeignKey(GpuModel, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    nvml_name = models.CharField(max_length=100, blank=True)
    pci_bus_id = models.CharField(max_length=32, blank=True)
    # GPUs of one node with the same group share an NVLink domain or PCIe switch (the agent's report);
    # blank where the agent could not tell. Multi-GPU placement keeps a session's GPUs in one group.
    topology_group = models.CharField(max_length=64, blank=True)
    mig_mode = models.BooleanField(default=False)
    mig_profile = models.CharField(max_length=32, blank=True)
    memory_mib = models.PositiveIntegerField(default=0)
    health = models.CharField(max_length=8, choices=Health.choices, default=Health.OK)
    sharing_policy = models.CharField(max_length=12, choices=Sharing.choices, default=Sharing.FIXED_SHARE)
    last_metrics = models.JSONField(default=dict, blank=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node_id", "index", "id"]
        indexes = [models.Index(fields=["gpu_model", "health"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind="physical", parent__isnull=True) | Q(kind="mig", parent__isnull=False),
                name="device_mig_has_parent",
            ),
        ]

    def __str__(self) -> str:
        label = self.mig_profile if self.kind == self.Kind.MIG else (self.gpu_model or self.nvml_name)
        return f"{self.node.name}/{self.index} {label} ({self.uuid[:12]})"


class DeviceSample(models.Model):
    """A short history of one device's metrics; the heartbeat keeps the last few per device."""

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="samples")
    collected_at = models.DateTimeField()
    gpu_util_percent = models.SmallIntegerField(null=True)
    memory_used_mib = models.IntegerField(null=True)
    temperature_c = models.SmallIntegerField(null=True)
    power_w = models.FloatField(null=True)

    class Meta:
        indexes = [models.Index(fields=["device", "-collected_at"])]

    def __str__(self) -> str:
        return f"{self.device_id} at {self.collected_at:%H:%M:%S}"


class Session(ChoiceLabels, models.Model):
    """One Jupyter workload on one allocation, and its lifecycle."""

    class State(models.TextChoices):
        QUEUED = "queued", _("Queued")
        PLACING = "placing", _("Placing")
        STARTING = "starting", _("Starting")
        RUNNING = "running", _("Running")
        STOPPING = "stopping", _("Stopping")
        STOPPED = "stopped", _("Stopped")
        FAILED = "failed", _("Failed")
        LOST = "lost", _("Lost")

    class Tier(models.TextChoices):
        ON_DEMAND = "on_demand", _("On demand")
        INTERRUPTIBLE = "interruptible", _("Interruptible")

    LIVE = (State.QUEUED, State.PLACING, State.STARTING, State.RUNNING, State.STOPPING)
    ON_NODE = (State.PLACING, State.STARTING, State.RUNNING)  # what the agent should run
    ENDED = (State.STOPPED, State.FAILED, State.LOST)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="gpu_sessions")
    account = models.ForeignKey("billing.Account", on_delete=models.PROTECT, related_name="gpu_sessions")
    gpu_model = models.ForeignKey(GpuModel, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="+")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="+")
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    # Why the last transition happened: a key of provisioner.messages and its parameters, rendered in the
    # reader's language; ``reason`` is its English text (free text when there is no key).
    reason = models.CharField(max_length=300, blank=True, help_text="Why the last transition happened.")
    reason_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True)
    reason_params = models.JSONField(default=dict, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)

    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.PROTECT, related_name="sessions")
    device = models.ForeignKey(Device, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Every GPU of a multi-GPU session (``device`` is the first of them); empty for one device.
    devices = models.ManyToManyField(Device, blank=True, related_name="+")
    # A multi-GPU session that waited past QUEUE_LARGE_RESERVE_SECONDS holds this node: no other
    # session of its model is placed there until it fits (provisioner/services/sessions.py, the queue).
    reserved_node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="reserved_by"
    )
    slot_start = models.PositiveSmallIntegerField(null=True, blank=True)
    slot_count = models.PositiveSmallIntegerField(null=True, blank=True)
    sharing_policy = models.CharField(max_length=12, blank=True)
    jupyter_token_sealed = models.TextField()
    upstream = models.CharField(max_length=300, blank=True)
    # What the node's agent reports it really enforces of the allocation (agents/gpuplan.enforcement):
    # {"device"|"memory"|"compute": {"enforced": bool, "by": str}}; empty until it runs.
    enforcement = models.JSONField(default=dict, blank=True)

    price_id = models.BigIntegerField(null=True, blank=True)
    price_micros_per_hour = models.BigIntegerField(default=0)
    card_burn_micros_per_hour = models.BigIntegerField(default=0)
    max_seconds = models.PositiveIntegerField()
    idle_seconds = models.PositiveIntegerField(null=True, blank=True)
    queue_priority = models.SmallIntegerField(default=0)
    queue_max_wait_seconds = models.PositiveIntegerField(default=3600)
    # The interruptible tier: a lower price, and an on-demand launch may preempt the session (a warning,
    # a grace period, a stop). ``resume``: re-queue it when preempted. ``preempted_for``: the queued
    # on-demand session it is claimed for (one claimer at a time; cleared while it still runs if that
    # one is placed elsewhere first); ``preempted_at``: when the preemption stopped it (not its owner's
    # own stop during the grace). ``resumed_from``: the preempted session this one re-queues.
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.ON_DEMAND)
    resume = models.BooleanField(default=False)
    # The team folders the session mounts, decided at launch (docs/STORAGE.md, "Team folders"): the
    # spec's ``teams``, [{"key": "<team account id>", "name": "<team slug>", "read_only": bool}].
    team_folders = models.JSONField(default=list, blank=True)
    preempted_for = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="preempting"
    )
    preempted_at = models.DateTimeField(null=True, blank=True)
    resumed_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="resumed_as"
    )

    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    placed_at = models.DateTimeField(null=True, blank=True)
    starting_at = models.DateTimeField(null=True, blank=True)
    running_at = models.DateTimeField(null=True, blank=True)
    stopping_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    last_alive_at = models.DateTimeField(null=True, blank=True)
    last_active_at = models.DateTimeField(null=True, blank=True)
    gpu_util_percent = models.SmallIntegerField(null=True, blank=True)
    # The workload's cumulative CPU seconds at its node's last report of them, and when: the next
    # report's difference is the CPU it used meanwhile (an idle stop's signs of use).
    cpu_seconds = models.FloatField(null=True, blank=True)
    cpu_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="session_idempotency_per_owner",
            ),
            models.CheckConstraint(
                condition=~Q(state__in=["placing", "starting", "running"]) | Q(node__isnull=False),
                name="session_on_node_has_node",
            ),
            models.CheckConstraint(
                condition=Q(tier="interruptible") | Q(preempted_for__isnull=True, preempted_at__isnull=True),
                name="session_only_interruptible_preempted",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "gpu_model"]),
            models.Index(fields=["owner", "state"]),
            models.Index(fields=["account", "state"]),
            models.Index(fields=["node", "state"]),
            # what an on-demand launch may preempt
            models.Index(
                fields=["gpu_model", "state"],
                condition=Q(tier="interruptible"),
                name="session_interruptible",
            ),
        ]

    def __str__(self) -> str:
        return f"session {str(self.id)[:8]} of {self.owner_id} ({self.state})"

    @property
    def ref(self) -> str:
        return str(self.id)

    @property
    def reason_display(self) -> str:
        """The reason of the last transition in the active language."""
        return message_render(self.reason_key, self.reason_params, stored=self.reason)

    @property
    def base_url(self) -> str:
        return f"/jupyter/{self.id}/"

    def gpu_devices(self) -> list[Device]:
        """Every device the session runs on, in id order (``device`` first); empty before placement. A
        one-GPU session's is its ``device``, without reading the many-to-many."""
        if self.profile.gpu_count <= 1 and "devices" not in getattr(self, "_prefetched_objects_cache", {}):
            return [self.device] if self.device_id else []
        several = sorted(self.devices.all(), key=lambda d: d.id)
        if several:
            return several
        return [self.device] if self.device_id else []


class Allocation(models.Model):
    """The slots one session holds on one device, while it holds them. Deleted when freed."""

    session = models.OneToOneField(Session, on_delete=models.CASCADE, related_name="allocation")
    device = models.ForeignKey(Device, on_delete=models.PROTECT, related_name="allocations")
    slot_start = models.PositiveSmallIntegerField()
    slot_count = models.PositiveSmallIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(slot_count__in=[1, 2, 4, 8]) & Q(slot_start__lt=SLOTS_PER_GPU),
                name="allocation_buddy_size",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.device.uuid} slots {self.slot_start}..{self.slot_start + self.slot_count}"


class AllocationSlot(models.Model):
    """One eighth of one device held by one allocation: the unique (device, slot) pair is the guarantee."""

    allocation = models.ForeignKey(Allocation, on_delete=models.CASCADE, related_name="slots")
    device = models.ForeignKey(Device, on_delete=models.PROTECT, related_name="+")
    slot = models.PositiveSmallIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["device", "slot"], name="allocation_slot_once"),
            models.CheckConstraint(condition=Q(slot__lt=SLOTS_PER_GPU), name="allocation_slot_in_range"),
        ]

    def __str__(self) -> str:
        return f"{self.device_id}#{self.slot}"


class SessionEvent(models.Model):
    """A line of a session's history, for its page."""

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True)
    from_state = models.CharField(max_length=10, blank=True)
    to_state = models.CharField(max_length=10, blank=True)
    kind = models.CharField(max_length=32)
    # As Session.reason: a key of provisioner.messages and its parameters; ``message`` is the English text.
    message = models.CharField(max_length=500)
    message_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True)
    message_params = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["session", "at"])]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    @property
    def message_display(self) -> str:
        """The line in the active language."""
        return message_render(self.message_key, self.message_params, stored=self.message)


class Quota(models.Model):
    """Limits for a user (``user`` only), a team account (``account`` only), or a member's cap inside a
    team (both). A null limit means the default from settings (for members: no extra cap)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="gpu_quotas"
    )
    account = models.ForeignKey(
        "billing.Account", null=True, blank=True, on_delete=models.CASCADE, related_name="gpu_quotas"
    )
    max_eighths = models.PositiveIntegerField(
        null=True, blank=True, help_text="Concurrent GPU share, in eighths."
    )
    max_sessions = models.PositiveIntegerField(null=True, blank=True)
    allowed_gpu_models = models.JSONField(null=True, blank=True, help_text="Names; null means all.")
    allowed_profiles = models.JSONField(null=True, blank=True, help_text="Names; null means all.")
    max_session_seconds = models.PositiveIntegerField(null=True, blank=True)
    monthly_spend_cap_micros = models.BigIntegerField(null=True, blank=True)
    monthly_card_cap_micros = models.BigIntegerField(
        null=True, blank=True, help_text="Card-hours a month, in micro card-hours."
    )
    # a user's home on a user's own row; the team's shared folder on a team account's (a member's is not
    # read)
    max_home_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="Bytes in the user's home, or in a team account's team folder."
    )
    max_home_files = models.BigIntegerField(
        null=True, blank=True, help_text="Files in the user's home, or in a team account's team folder."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(user__isnull=False) | Q(account__isnull=False), name="quota_has_subject"
            ),
            models.UniqueConstraint(
                fields=["user"], condition=Q(account__isnull=True), name="quota_one_per_user"
            ),
            models.UniqueConstraint(
                fields=["account"], condition=Q(user__isnull=True), name="quota_one_per_account"
            ),
            models.UniqueConstraint(
                fields=["account", "user"],
                condition=Q(user__isnull=False, account__isnull=False),
                name="quota_one_per_member",
            ),
        ]

    def __str__(self) -> str:
        if self.user_id and self.account_id:
            return f"member quota of {self.user} in {self.account}"
        return f"quota of {self.user or self.account}"

    LIMIT_FIELDS = (
        "max_eighths",
        "max_sessions",
        "allowed_gpu_models",
        "allowed_profiles",
        "max_session_seconds",
        "monthly_spend_cap_micros",
        "monthly_card_cap_micros",
        "max_home_bytes",
        "max_home_files",
    )

    def limits(self) -> dict:
        return {f: getattr(self, f) for f in self.LIMIT_FIELDS}


class HomeUsage(models.Model):
    """What a user's home held when an agent last measured it (agents/home_usage.py): the newest
    measurement wins, whichever node sent it (every node of a shared root measures the same home).
    ``bytes`` are allocated blocks; ``files`` every entry under the home."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="home_usage")
    bytes = models.BigIntegerField()
    files = models.BigIntegerField()
    measured_at = models.DateTimeField()
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(bytes__gte=0, files__gte=0), name="home_usage_not_negative"),
        ]

    def __str__(self) -> str:
        return f"home of user {self.user_id}: {self.bytes} bytes, {self.files} files"


class TeamFolderUsage(models.Model):
    """What a team's shared folder (``<homes>/.teams/<account id>``) held when an agent last measured it,
    as ``HomeUsage`` for a home: the newest measurement wins, whichever node sent it. Keyed by the team's
    account (the provisioner knows accounts, not teams)."""

    account = models.OneToOneField(
        "billing.Account", on_delete=models.CASCADE, related_name="team_folder_usage"
    )
    bytes = models.BigIntegerField()
    files = models.BigIntegerField()
    measured_at = models.DateTimeField()
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(bytes__gte=0, files__gte=0), name="team_folder_usage_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"team folder of account {self.account_id}: {self.bytes} bytes, {self.files} files"


class StopWarning(ChoiceLabels, models.Model):
    """A stop announced to a running session's people before it happens: why (``kind``), when
    (``due_at``) and the line they read (a key of provisioner.messages and its parameters). One live
    warning per session and kind; ``cleared_at`` is set when the cause goes away (activity after an idle
    warning, a top-up after a funds warning) or the session ends. Shown on the portal's pages, by email
    and inside JupyterLab (the session's notices endpoint)."""

    class Kind(models.TextChoices):
        IDLE = "idle", _("Idle")
        FUNDS = "funds", _("Funds")
        MAX_HOURS = "max_hours", _("Longest session time")
        BUDGET = "budget", _("Budget")
        PREEMPT = "preempt", _("Preemption")

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="stop_warnings")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    due_at = models.DateTimeField()
    message_key = models.CharField(max_length=KEY_MAX_LENGTH)
    message_params = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    cleared_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["session", "kind"],
                condition=Q(cleared_at__isnull=True),
                name="stop_warning_live_once",
            )
        ]
        indexes = [models.Index(fields=["session", "cleared_at"])]

    def __str__(self) -> str:
        return f"{self.kind} stop of {self.session_id} at {self.due_at}"

    @property
    def message_display(self) -> str:
        return message_render(self.message_key, self.message_params)


class HomeRemoval(ChoiceLabels, models.Model):
    """A home the retention rule removes (docs/STORAGE.md, "Retention"), one row per home and plan: the
    warnings go out once (``warned_at``, ``warned_final_at`` claimed by conditional updates), the removal
    is done once, and what was removed, when and why stays on record. ``name`` is the home's folder
    (``workload_user``), kept when the user is deleted; ``node`` the GPU host of a ``local`` home, empty
    for a home on the ``shared`` root. Pending while neither ``removed_at`` nor ``cancelled_at`` is set;
    the user's next launch cancels it. ``last_launch_at`` is the clock it was planned from."""

    class Reason(models.TextChoices):
        IDLE = "idle", _("No session for a long time")
        INACTIVE = "inactive", _("Account deactivated")
        DELETED = "deleted", _("Account deleted")

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="home_removals",
    )
    name = models.CharField(max_length=100)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    reason = models.CharField(max_length=10, choices=Reason.choices)
    last_launch_at = models.DateTimeField(null=True, blank=True)
    planned_at = models.DateTimeField()
    due_at = models.DateTimeField()
    warned_at = models.DateTimeField(null=True, blank=True)
    warned_final_at = models.DateTimeField(null=True, blank=True)
    removed_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=300, blank=True)

    PENDING = Q(removed_at__isnull=True, cancelled_at__isnull=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["name", "node"],
                condition=Q(removed_at__isnull=True, cancelled_at__isnull=True, node__isnull=False),
                name="home_removal_pending_once_on_node",
            ),
            models.UniqueConstraint(
                fields=["name"],
                condition=Q(removed_at__isnull=True, cancelled_at__isnull=True, node__isnull=True),
                name="home_removal_pending_once_shared",
            ),
            models.CheckConstraint(
                condition=Q(removed_at__isnull=True) | Q(cancelled_at__isnull=True),
                name="home_removal_removed_or_cancelled",
            ),
        ]
        indexes = [
            models.Index(
                fields=["due_at"],
                condition=Q(removed_at__isnull=True, cancelled_at__isnull=True),
                name="home_removal_pending_due",
            ),
            # the dashboard's and the files page's banner, read with the request's user
            models.Index(
                fields=["user", "due_at"],
                condition=Q(removed_at__isnull=True, cancelled_at__isnull=True),
                name="home_removal_user_pending",
            ),
        ]

    def __str__(self) -> str:
        where = f" on {self.node_id}" if self.node_id else ""
        return f"removal of home {self.name}{where} at {self.due_at} ({self.reason})"
