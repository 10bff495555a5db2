from django.contrib import admin

from core.admin import ReadOnlyAdmin
from notices.models import Notice, NoticePreference


@admin.register(Notice)
class NoticeAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "user", "kind", "message", "read_at", "dismissed_at", "emailed_at")
    list_filter = ("kind",)
    search_fields = ("user__username", "message", "dedupe_key")
    list_select_related = ("user",)


@admin.register(NoticePreference)
class NoticePreferenceAdmin(ReadOnlyAdmin):
    list_display = ("user", "kind", "email")
    list_filter = ("kind", "email")
    search_fields = ("user__username",)
    list_select_related = ("user",)
