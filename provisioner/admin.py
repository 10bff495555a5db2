"""The admin site for the fleet. Every change that matters goes through a service, which locks what it
must and leaves an audit row: node cordon / drain / uncordon, a session's force stop, a device's
sharing policy, quotas. Rows the services own (allocations, samples, events) are read-only here."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from core.admin import ReadOnlyAdmin
from core.errors import ApplicationError
from provisioner import selectors
from provisioner.messages import message
from provisioner.models import (
    Allocation,
    Device,
    DeviceSample,
    Environment,
    GpuModel,
    HomeRemoval,
    Node,
    Profile,
    Quota,
    Session,
    SessionEvent,
)
from provisioner.quotas import LIMIT_FIELDS, quota_set
from provisioner.services.environments import environment_publish
from provisioner.services.nodes import device_force_free, device_set_sharing_policy, node_set_state
from provisioner.services.sessions import session_stop


def _report(modeladmin, request, done: int, failures: list[str], verb: str) -> None:
    if done:
        modeladmin.message_user(request, f"{verb}: {done}.", messages.SUCCESS)
    for failure in failures:
        modeladmin.message_user(request, failure, messages.ERROR)


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ("name", "memory_mib", "peak_tflops", "profiles", "placement_policy", "enabled")
    list_filter = ("enabled", "placement_policy")
    search_fields = ("name",)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "eighths", "quota_eighths")
    list_filter = ("kind",)
    search_fields = ("name",)


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    """Publishing goes through ``environment_publish`` (its price tier is audited); users' own
    environments are shown, not edited."""

    list_display = (
        "name", "interface", "python", "image", "surcharge_micros_per_hour", "owner", "home_path", "enabled",
    )  # fmt: skip
    list_filter = ("enabled", "interface", ("owner", admin.EmptyFieldListFilter))
    search_fields = ("name", "python", "image", "owner__username")
    fields = (
        "name", "interface", "python", "image", "surcharge_micros_per_hour",
        "cpu_cores", "memory_mib", "enabled",
    )  # fmt: skip

    def get_readonly_fields(self, request, obj=None):
        if obj is not None and obj.owner_id:
            return (*self.fields, "owner", "base", "home_path")
        return ("name",) if obj is not None else ()

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and not (obj is not None and obj.owner_id)

    def save_model(self, request, obj, form, change):
        saved = environment_publish(
            name=obj.name,
            python=obj.python,
            image=obj.image,
            interface=obj.interface,
            surcharge_micros_per_hour=obj.surcharge_micros_per_hour,
            cpu_cores=obj.cpu_cores,
            memory_mib=obj.memory_mib,
            enabled=obj.enabled,
            actor=request.user,
            reason="admin site",
        )
        obj.pk = saved.pk


class DeviceInline(admin.TabularInline):
    model = Device
    fields = ("index", "uuid", "kind", "gpu_model", "mig_profile", "health", "sharing_policy", "last_seen_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


def _node_action(action: str, label: str):
    def run(modeladmin, request, queryset):
        done, failures = 0, []
        for node in queryset:
            try:
                node_set_state(
                    node_id=node.id, action=action, actor=request.user, reason=f"admin site: {label}"
                )
                done += 1
            except ApplicationError as exc:
                failures.append(f"{node.name}: {exc.message}")
        _report(modeladmin, request, done, failures, label)

    run.__name__ = f"node_{action}"
    return admin.action(description=f"{label} the selected nodes")(run)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "address",
        "state",
        "last_heartbeat_at",
        "agent_version",
        "runtime",
        "live_sessions",
    )
    list_filter = ("state", "runtime")
    search_fields = ("name", "address")
    readonly_fields = (
        "state",
        "state_before_down",
        "agent_version",
        "runtime",
        "driver_version",
        "cuda_version",
        "last_heartbeat_at",
        "created_at",
    )
    fields = ("name", "address", "labels", *readonly_fields)
    inlines = [DeviceInline]
    actions = [
        _node_action("cordon", "Cordon"),
        _node_action("drain", "Drain"),
        _node_action("uncordon", "Uncordon"),
    ]

    @admin.display(description="live sessions")
    def live_sessions(self, node: Node) -> int:
        return node.sessions.filter(state__in=Session.LIVE).count()

    def has_add_permission(self, request):
        return False  # `manage.py node add` or POST /api/v1/admin/nodes: the token is shown once there


class DeviceAdminForm(forms.ModelForm):
    class Meta:
        model = Device
        fields = ("sharing_policy",)


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    form = DeviceAdminForm
    list_display = (
        "__str__",
        "node",
        "kind",
        "gpu_model",
        "health",
        "sharing_policy",
        "topology_group",
        "slots",
        "last_seen_at",
    )
    list_filter = ("kind", "health", "sharing_policy", "gpu_model", "node")
    search_fields = ("uuid", "node__name", "nvml_name", "mig_profile")
    list_select_related = ("node", "gpu_model")
    readonly_fields = (
        "node",
        "uuid",
        "index",
        "kind",
        "parent",
        "gpu_model",
        "nvml_name",
        "pci_bus_id",
        "mig_mode",
        "mig_profile",
        "memory_mib",
        "health",
        "last_metrics",
        "last_seen_at",
        "slot_map",
    )
    fields = ("sharing_policy", *readonly_fields)
    actions = ["force_free"]

    @admin.display(description="slots")
    def slots(self, device: Device) -> str:
        return "".join("■" if cell else "□" for cell in selectors.slot_map(device=device))

    @admin.display(description="slot map")
    def slot_map(self, device: Device) -> str:
        cells = selectors.slot_map(device=device)
        return format_html(
            "<table><tr>{}</tr></table>",
            format_html_join("", "<td style='border:1px solid #999;padding:2px 6px'>{}: {}</td>",
                             ((i, cell or "free") for i, cell in enumerate(cells))),
        )  # fmt: skip

    def has_add_permission(self, request):
        return False  # devices come from heartbeats

    def save_model(self, request, obj, form, change):
        """The sharing policy changes only through the service (refused while slots are held; audited)."""
        if "sharing_policy" not in form.changed_data:
            return
        try:
            device_set_sharing_policy(
                device_id=obj.id,
                sharing_policy=form.cleaned_data["sharing_policy"],
                actor=request.user,
                reason="admin site",
            )
        except ApplicationError as exc:
            self.message_user(request, exc.message, messages.ERROR)

    @admin.action(description="Free slots of ended sessions (the workloads are known to be gone)")
    def force_free(self, request, queryset):
        freed = sum(
            device_force_free(device_id=d.id, actor=request.user, reason="admin site") for d in queryset
        )
        self.message_user(request, f"Freed the slots of {freed} ended sessions.", messages.SUCCESS)


@admin.register(DeviceSample)
class DeviceSampleAdmin(ReadOnlyAdmin):
    list_display = (
        "device",
        "collected_at",
        "gpu_util_percent",
        "memory_used_mib",
        "temperature_c",
        "power_w",
    )
    list_filter = ("device__node",)
    search_fields = ("device__uuid",)
    date_hierarchy = "collected_at"


class SessionEventInline(admin.TabularInline):
    model = SessionEvent
    fields = ("at", "kind", "from_state", "to_state", "message")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Session)
class SessionAdmin(ReadOnlyAdmin):
    """Sessions change only through their lifecycle; the one admin write is the force stop."""

    list_display = ("short_id", "owner", "account", "gpu_model", "profile", "state", "node", "created_at")
    list_filter = ("state", "gpu_model", "profile", "node")
    search_fields = ("id", "owner__username", "account__name", "node__name", "reason")
    list_select_related = ("owner", "account", "gpu_model", "profile", "node")
    date_hierarchy = "created_at"
    exclude = ("jupyter_token_sealed",)
    inlines = [SessionEventInline]
    actions = ["force_stop"]

    @admin.display(description="id")
    def short_id(self, session: Session) -> str:
        return str(session.id)[:8]

    @admin.action(description="Force stop the selected sessions")
    def force_stop(self, request, queryset):
        stopped = 0
        for session in queryset.filter(state__in=Session.LIVE):
            session_stop(session=session, actor=request.user, reason=message("forced_by_admin"))
            stopped += 1
        self.message_user(request, f"Asked {stopped} sessions to stop.", messages.SUCCESS)


@admin.register(HomeRemoval)
class HomeRemovalAdmin(ReadOnlyAdmin):
    """The retention rule's record (docs/STORAGE.md): what is planned, told, removed or cancelled."""

    list_display = (
        "name",
        "node",
        "reason",
        "due_at",
        "warned_at",
        "warned_final_at",
        "removed_at",
        "cancelled_at",
    )
    list_filter = ("reason", "node")
    search_fields = ("name", "user__username")
    list_select_related = ("node", "user")


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin):
    list_display = ("session", "device", "slot_start", "slot_count", "created_at")
    list_filter = ("device__node",)
    search_fields = ("session__id", "device__uuid")
    list_select_related = ("session", "device__node")


class QuotaAdminForm(forms.ModelForm):
    reason = forms.CharField(max_length=200, required=False, help_text="Kept in the audit trail.")

    class Meta:
        model = Quota
        fields = ("user", "account", *LIMIT_FIELDS)

    def clean(self):
        cleaned = super().clean()
        adding = "user" in self.fields
        if adding and not cleaned.get("user") and not cleaned.get("account"):
            raise forms.ValidationError("A quota belongs to a user, a team account, or a member (both).")
        return cleaned


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    form = QuotaAdminForm
    list_display = (
        "__str__",
        "max_eighths",
        "max_sessions",
        "max_session_seconds",
        "monthly_spend_cap_micros",
        "monthly_card_cap_micros",
    )
    search_fields = ("user__username", "account__name")
    list_select_related = ("user", "account")
    readonly_fields = ("updated_at",)

    def get_readonly_fields(self, request, obj=None):
        return ("user", "account", "updated_at") if obj else ("updated_at",)

    def save_model(self, request, obj, form, change):
        """Through ``quota_set``: locks the row, writes the audit row with the limits before and after."""
        limits = {field: form.cleaned_data.get(field) for field in LIMIT_FIELDS}
        user = obj.user if change else form.cleaned_data.get("user")
        account = obj.account if change else form.cleaned_data.get("account")
        try:
            saved = quota_set(
                user=user,
                account=account,
                limits=limits,
                actor=request.user,
                reason=form.cleaned_data.get("reason") or "admin site",
            )
        except ApplicationError as exc:
            self.message_user(request, exc.message, messages.ERROR)
            return
        obj.pk = saved.pk

    def has_delete_permission(self, request, obj=None):
        return False  # set limits to empty instead: the change is audited
