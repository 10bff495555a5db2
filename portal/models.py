from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from core.choices import ChoiceLabels


class User(ChoiceLabels, AbstractUser):
    """A person who logs in. Pays from their own account or, as their role allows, a team's."""

    account = models.OneToOneField(
        "billing.Account", null=True, blank=True, on_delete=models.PROTECT, related_name="user"
    )
    language = models.CharField(
        _("language"), max_length=10, choices=settings.LANGUAGES, default=settings.LANGUAGE_CODE
    )
    time_zone = models.CharField(_("time zone"), max_length=64, default=settings.TIME_ZONE)
    sso_subject = models.CharField(
        max_length=400,
        null=True,
        blank=True,
        unique=True,
        help_text="The single sign-on identity (issuer#sub) this user signs in as; empty for local users.",
    )

    def __str__(self) -> str:
        return self.username


class Team(models.Model):
    """A group sharing one wallet and its cards: a lab, a course, a company."""

    name = models.CharField(_("name"), max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    account = models.OneToOneField("billing.Account", on_delete=models.PROTECT, related_name="team")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Membership(ChoiceLabels, models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", _("Owner")
        ADMIN = "admin", _("Admin")
        MEMBER = "member", _("Member")

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(_("role"), max_length=8, choices=Role.choices, default=Role.MEMBER)
    joined_at = models.DateTimeField(auto_now_add=True)
    # The team folder (docs/STORAGE.md, "Team folders"): read-write unless a manager made it read-only.
    folder_read_only = models.BooleanField(_("team folder read-only"), default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_once_per_team")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} as {self.role}"

    @property
    def manages_team(self) -> bool:
        return self.role in (self.Role.OWNER, self.Role.ADMIN)


class TeamInvite(ChoiceLabels, models.Model):
    """A code (or the link that carries it) that lets whoever has it join a team with a role."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invites")
    code = models.CharField(max_length=32, unique=True)
    role = models.CharField(max_length=8, choices=Membership.Role.choices, default=Membership.Role.MEMBER)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(default=50)
    uses = models.PositiveIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(uses__lte=models.F("max_uses")), name="invite_uses_within_max"
            ),
            models.CheckConstraint(condition=~Q(role="owner"), name="invite_never_grants_owner"),
        ]

    def __str__(self) -> str:
        return f"invite to {self.team} ({self.role})"

    @property
    def usable(self) -> bool:
        return self.revoked_at is None and self.uses < self.max_uses and self.expires_at > timezone.now()


class AccessToken(models.Model):
    """A personal access token for the API (``Authorization: Bearer sl_…``). Only its hash is stored."""

    class Scope(models.TextChoices):
        READ = "read", _("Read everything the user can see")
        SESSIONS = "sessions", _("Launch and stop sessions")
        CARDS = "cards", _("Redeem, split and gift compute cards")
        BILLING = "billing", _("Top up the wallet")
        FILES = "files", _("Upload and download the files of your home")

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="access_tokens")
    name = models.CharField(_("name"), max_length=100)
    prefix = models.CharField(
        max_length=12, help_text="The first characters, to recognise a token in a list."
    )
    token_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["user", "revoked_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…) of {self.user}"

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())
