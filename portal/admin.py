from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as DjangoUserAdmin

from portal.models import Membership, Team, TeamInvite, User
from portal.services import user_account_ensure


@admin.register(User)
class UserAdmin(DjangoUserAdmin):
    list_display = ("username", "email", "is_staff", "is_active", "language", "date_joined", "last_login")
    list_filter = ("is_staff", "is_superuser", "is_active", "language")
    search_fields = ("username", "email")
    readonly_fields = ("account", "date_joined", "last_login")
    fieldsets = (*DjangoUserAdmin.fieldsets, ("Suanli", {"fields": ("account", "language", "time_zone")}))

    def save_model(self, request, obj, form, change) -> None:
        super().save_model(request, obj, form, change)
        # a new user got their account from the post_save receiver; an old one left without (portal.E001)
        # gets it here
        user_account_ensure(user=obj)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)
    readonly_fields = ("joined_at",)


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "created_by", "created_at")
    search_fields = ("name", "slug")
    readonly_fields = ("account", "created_by", "created_at")
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("team", "user", "role", "folder_read_only", "joined_at")
    list_filter = ("role", "folder_read_only")
    search_fields = ("team__name", "user__username")
    readonly_fields = ("joined_at",)


@admin.register(TeamInvite)
class TeamInviteAdmin(admin.ModelAdmin):
    list_display = ("team", "role", "uses", "max_uses", "expires_at", "revoked_at")
    list_filter = ("role",)
    search_fields = ("team__name",)
    readonly_fields = ("code", "created_by", "created_at", "uses")
