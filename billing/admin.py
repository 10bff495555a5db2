from django.contrib import admin

from billing.models import Account, AuditEntry


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "created_at")
    list_filter = ("kind",)
    search_fields = ("name",)
    readonly_fields = ("created_at",)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """Read-only: the audit trail is appended by the services, never edited."""

    list_display = ("created_at", "actor", "action", "target_type", "target_id", "reason")
    list_filter = ("action", "target_type")
    search_fields = ("action", "target_id", "reason", "actor__username")
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
