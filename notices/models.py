from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.choices import ChoiceLabels
from core.messages import KEY_MAX_LENGTH, message_render
from notices.kinds import KIND_CHOICES, KIND_MAX_LENGTH, KINDS
from notices.messages import TEMPLATES  # noqa: F401  (registers the notices' message keys)


class Notice(ChoiceLabels, models.Model):
    """Something one person is told: shown under the bell until dismissed, emailed unless they opted out.

    The line is a message key and its parameters, rendered in the reader's language when read; ``message``
    keeps the English text (the admin, and the line shown for a key this code no longer knows)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notices")
    kind = models.CharField(max_length=KIND_MAX_LENGTH, choices=KIND_CHOICES)
    message_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True)
    message_params = models.JSONField(default=dict, blank=True)
    message = models.CharField(max_length=500, blank=True)
    url = models.CharField(max_length=500, blank=True)
    dedupe_key = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)
    dismissed_at = models.DateTimeField(null=True, blank=True)
    emailed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "dedupe_key"], name="notice_once_per_user")]
        indexes = [
            # the bell's list and its unread count
            models.Index(
                fields=["user", "-created_at"],
                condition=Q(dismissed_at__isnull=True),
                name="notice_user_live",
            ),
            models.Index(
                fields=["user"],
                condition=Q(read_at__isnull=True, dismissed_at__isnull=True),
                name="notice_user_unread",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} for {self.user_id}"

    @property
    def text(self) -> str:
        """The line in the active language."""
        return message_render(self.message_key, self.message_params, stored=self.message)

    @property
    def title(self) -> str:
        kind = KINDS.get(self.kind)
        return str(kind.title) if kind else self.kind


class NoticePreference(ChoiceLabels, models.Model):
    """A person's choice to be emailed, or not, about one kind; a row only where it differs from the
    kind's default."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notice_preferences"
    )
    kind = models.CharField(max_length=KIND_MAX_LENGTH, choices=KIND_CHOICES)
    email = models.BooleanField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "kind"], name="notice_preference_once")]

    def __str__(self) -> str:
        return f"{self.kind} email {'on' if self.email else 'off'} for {self.user_id}"
