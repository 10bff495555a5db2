from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _


class Account(models.Model):
    """Who pays: every user has one, every team has one."""

    class Kind(models.TextChoices):
        USER = "user", _("User")
        TEAM = "team", _("Team")

    kind = models.CharField(max_length=8, choices=Kind.choices)
    name = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["kind", "name"])]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} account {self.name}"


class AuditEntry(models.Model):
    """One admin or money action: who did what to which object, with the state before and after."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["target_type", "target_id"])]

    def __str__(self) -> str:
        return f"{self.action} on {self.target_type}:{self.target_id} by {self.actor_id}"
