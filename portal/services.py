"""Writes of the portal app: users and teams, and deletes from a user's home."""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.text import slugify
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import Account
from billing.permissions import TEAM_ROLE_REQUIRED
from core.errors import Conflict, Forbidden, NotFound, ValidationFailed
from portal.auth import token_generate, token_hash
from portal.homes import home_storage
from portal.homes.base import DeleteIncomplete, Removed, Upload
from portal.models import AccessToken, Membership, Team, TeamInvite, User
from provisioner import quotas
from provisioner.models import Quota
from provisioner.selectors import workload_user
from provisioner.services.homes import home_usage_lower

INVITE_ALPHABET = "ABCDEFGHJKMNPQRSTVWXYZ23456789"


def user_create(
    *, username: str, email: str, password: str, is_staff: bool = False, language: str = "en"
) -> User:
    """Create a user with their own paying account, in one transaction.

    Raises ValidationFailed when the username is taken or the password is too weak.
    """
    user_model = get_user_model()
    username = username.strip()
    if not username:
        raise ValidationFailed(_("Choose a username."), fields={"username": _("This field is required.")})
    candidate = user_model(username=username, email=email)
    try:
        validate_password(password, candidate)
    except DjangoValidationError as exc:
        raise ValidationFailed(" ".join(exc.messages), fields={"password": " ".join(exc.messages)}) from None
    with transaction.atomic():
        if user_model.objects.filter(username__iexact=username).exists():
            raise ValidationFailed(
                _("That username is taken."), fields={"username": _("That username is taken.")}
            )
        user = user_model(
            username=username,
            email=email,
            is_staff=is_staff,
            is_superuser=is_staff,
            language=language,
        )
        user.set_password(password)
        try:
            user.save()
        except IntegrityError:
            raise ValidationFailed(
                _("That username is taken."), fields={"username": _("That username is taken.")}
            ) from None
        # the post_save receiver gave the user their account (user_account_ensure) in this transaction
    return user


def user_create_sso(*, subject: str, username: str, email: str, language: str = "en") -> User:
    """Create the user a single sign-on identity (``subject``: issuer#sub) signs in as, with no local
    password; the ``post_save`` receiver gives them their account. The provider's username is kept
    when free, else the first free ``name-2``, ``name-3``…; a local user is never taken over. Raises
    ValidationFailed for an empty username."""
    user_model = get_user_model()
    base = username.strip()[:140]
    if not base:
        raise ValidationFailed(_("The sign-in provider gave no username."), code="sso_no_username")
    with transaction.atomic():
        candidate, n = base, 1
        while user_model.objects.filter(username__iexact=candidate).exists():
            n += 1
            candidate = f"{base}-{n}"
        user = user_model(username=candidate, email=email, sso_subject=subject, language=language)
        user.set_unusable_password()
        user.save()
    return user


def team_join_by_claim(*, user: User, slugs: list[str]) -> list[Membership]:
    """Make ``user`` a member of each existing team whose slug the sign-in provider named (a course
    group claim, ``OIDC_TEAM_CLAIM``). Never creates a team and never changes a role the user already
    has; each join leaves an audit row. Returns the memberships made."""
    made = []
    with transaction.atomic():
        for team in Team.objects.filter(slug__in=[s.strip().lower() for s in slugs if s.strip()]):
            membership, created = Membership.objects.get_or_create(
                team=team, user=user, defaults={"role": Membership.Role.MEMBER}
            )
            if created:
                made.append(membership)
                audit_record(
                    actor=user,
                    action="team.member_join_sso",
                    target=team,
                    after={"role": membership.role},
                    reason=user.username,
                )
    return made


def user_account_ensure(*, user: User) -> Account:
    """Give ``user`` their own paying account unless they have one; return it.

    The one way a user gets an account, whatever made the user (signup, ``createsuperuser``, the admin,
    single sign-on): the ``post_save`` receiver in ``portal.signals`` calls it. Idempotent and safe
    under concurrent calls: it locks the user row and re-reads ``account_id`` before making one, and
    sets it with an update (no second ``post_save``)."""
    if user.account_id:
        return user.account
    with transaction.atomic():
        locked = get_user_model().objects.select_for_update().only("account_id").get(pk=user.pk)
        if locked.account_id is None:
            account = Account.objects.create(kind=Account.Kind.USER, name=user.get_username())
            get_user_model().objects.filter(pk=user.pk).update(account=account)
        else:
            account = Account.objects.get(pk=locked.account_id)
    user.account = account
    return account


def user_update_profile(*, user: User, email: str, language: str, time_zone: str) -> User:
    user.email = email
    user.language = language
    user.time_zone = time_zone
    user.save(update_fields=["email", "language", "time_zone"])
    return user


def team_create(*, creator: User, name: str) -> Team:
    """Create a team with its own account; the creator becomes its owner."""
    name = name.strip()
    if not name:
        raise ValidationFailed(_("Give the team a name."), fields={"name": _("This field is required.")})
    base = slugify(name)[:80] or "team"
    with transaction.atomic():
        slug, n = base, 1
        while Team.objects.filter(slug=slug).exists():
            n += 1
            slug = f"{base}-{n}"
        account = Account.objects.create(kind=Account.Kind.TEAM, name=name)
        team = Team.objects.create(name=name, slug=slug, account=account, created_by=creator)
        Membership.objects.create(team=team, user=creator, role=Membership.Role.OWNER)
    return team


def _membership(team: Team, user: User) -> Membership:
    found = Membership.objects.filter(team=team, user=user).first()
    if found is None:
        raise NotFound(_("No such team."))
    return found


def _require_manager(team: Team, user: User) -> Membership:
    membership = _membership(team, user)
    if not membership.manages_team:
        raise Forbidden(_("Only the team's owners and admins can do that."), code=TEAM_ROLE_REQUIRED)
    return membership


def team_invite_create(
    *, team: Team, actor: User, role: str = Membership.Role.MEMBER, valid_days: int = 7, max_uses: int = 50
) -> TeamInvite:
    """A new invite code for the team. Only owners and admins may invite; nobody invites an owner."""
    actor_membership = _require_manager(team, actor)
    if role not in (Membership.Role.ADMIN, Membership.Role.MEMBER):
        raise ValidationFailed(
            _("An invite grants the admin or member role."), fields={"role": _("Invalid role.")}
        )
    if role == Membership.Role.ADMIN and actor_membership.role != Membership.Role.OWNER:
        raise Forbidden(_("Only an owner can invite admins."), code="team_owner_required")
    if not 1 <= valid_days <= 90 or not 1 <= max_uses <= 1000:
        raise ValidationFailed(_("An invite lasts 1 to 90 days and 1 to 1000 uses."))
    code = "".join(secrets.choice(INVITE_ALPHABET) for _ in range(12))
    return TeamInvite.objects.create(
        team=team,
        code=code,
        role=role,
        created_by=actor,
        expires_at=timezone.now() + timedelta(days=valid_days),
        max_uses=max_uses,
    )


def team_invite_revoke(*, invite: TeamInvite, actor: User) -> None:
    _require_manager(invite.team, actor)
    TeamInvite.objects.filter(pk=invite.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())


def team_join(*, user: User, code: str) -> Membership:
    """Join the team an invite code belongs to.

    The use count is a conditional update, so an invite is never used more often than it allows, even
    under concurrent joins. Raises NotFound for an unknown, expired, used-up or revoked code alike.
    """
    code = code.strip().upper().replace("-", "")
    with transaction.atomic():
        invite = TeamInvite.objects.select_for_update().filter(code=code).first()
        if invite is None or not invite.usable:
            raise NotFound(_("That invite code is not valid. Ask the team for a new one."))
        if Membership.objects.filter(team=invite.team, user=user).exists():
            raise Conflict(_("You are already in this team."))
        updated = TeamInvite.objects.filter(pk=invite.pk, uses__lt=F("max_uses")).update(uses=F("uses") + 1)
        if updated != 1:
            raise NotFound(_("That invite code is not valid. Ask the team for a new one."))
        return Membership.objects.create(team=invite.team, user=user, role=invite.role)


def team_leave(*, team: Team, user: User) -> None:
    """Leave a team. The last owner cannot leave: they hand the team over first."""
    with transaction.atomic():
        Team.objects.select_for_update().get(pk=team.pk)
        membership = _membership(team, user)
        if (
            membership.role == Membership.Role.OWNER
            and not Membership.objects.filter(team=team, role=Membership.Role.OWNER)
            .exclude(pk=membership.pk)
            .exists()
        ):
            raise Conflict(_("You are the team's last owner: make someone else an owner before you leave."))
        membership.delete()


def team_member_remove(*, team: Team, actor: User, member: User) -> None:
    """Remove a member. Admins remove members; only owners remove admins; owners are never removed."""
    with transaction.atomic():
        Team.objects.select_for_update().get(pk=team.pk)
        actor_membership = _require_manager(team, actor)
        target = _membership(team, member)
        if target.role == Membership.Role.OWNER:
            raise Forbidden(_("An owner cannot be removed; they can leave."), code="team_owner_protected")
        if target.role == Membership.Role.ADMIN and actor_membership.role != Membership.Role.OWNER:
            raise Forbidden(_("Only an owner can remove an admin."), code="team_owner_required")
        before = {"role": target.role}
        target.delete()
        audit_record(
            actor=actor,
            action="team.member_remove",
            target=team,
            before=before,
            after=None,
            reason=f"removed {member.username}",
        )


def team_member_set_role(*, team: Team, actor: User, member: User, role: str) -> Membership:
    """Change a member's role. Only owners change roles; the last owner cannot step down."""
    if role not in Membership.Role.values:
        raise ValidationFailed(_("Unknown role."), fields={"role": _("Invalid role.")})
    with transaction.atomic():
        Team.objects.select_for_update().get(pk=team.pk)
        actor_membership = _membership(team, actor)
        if actor_membership.role != Membership.Role.OWNER:
            raise Forbidden(_("Only an owner can change roles."), code="team_owner_required")
        target = _membership(team, member)
        if (
            target.role == Membership.Role.OWNER
            and role != Membership.Role.OWNER
            and not Membership.objects.filter(team=team, role=Membership.Role.OWNER)
            .exclude(pk=target.pk)
            .exists()
        ):
            raise Conflict(_("A team needs at least one owner."))
        before = {"role": target.role}
        target.role = role
        target.save(update_fields=["role"])
        audit_record(
            actor=actor,
            action="team.member_role",
            target=team,
            before=before,
            after={"role": role},
            reason=member.username,
        )
        return target


def team_member_folder_access_set(*, team: Team, actor: User, member: User, read_only: bool) -> Membership:
    """Make the team folder read-only (or read-write again) for one member: their sessions launched from
    now on mount it so (docs/STORAGE.md, "Team folders"); a running session keeps what it mounted. Only
    the team's owners and admins may, and an owner or admin is never made read-only (they clean the
    folder up when it is over its quota). Locks the team row; writes an audit row. Raises NotFound (the
    actor or ``member`` is not in the team), Forbidden."""
    with transaction.atomic():
        Team.objects.select_for_update().get(pk=team.pk)
        _require_manager(team, actor)
        target = _membership(team, member)
        if read_only and target.manages_team:
            raise Forbidden(
                _("An owner or admin always has the team folder read-write."), code="team_folder_manager"
            )
        before = {"folder_read_only": target.folder_read_only}
        if target.folder_read_only != read_only:
            target.folder_read_only = read_only
            target.save(update_fields=["folder_read_only"])
        audit_record(
            actor=actor,
            action="team.member_folder_access",
            target=team,
            before=before,
            after={"folder_read_only": read_only},
            reason=member.username,
        )
        return target


def team_member_cap_set(
    *,
    team: Team,
    actor: User,
    member: User,
    max_eighths: int | None,
    monthly_spend_cap_micros: int | None,
    monthly_card_cap_micros: int | None = None,
) -> Quota:
    """Cap one member of ``team`` inside the team's own quota: at most ``max_eighths`` eighths of a GPU
    at once, ``monthly_spend_cap_micros`` a month on the team's account and ``monthly_card_cap_micros``
    of the team's card-hours a month (None: no cap of their own).
    Only the team's owners and admins may, and never above the team's limit. ``quota_set`` locks the
    member's quota row and writes the audit row. Raises NotFound (the actor or ``member`` is not in the
    team), Forbidden, ValidationFailed."""
    if not _membership(team, actor).manages_team:
        raise Forbidden(_("Only the team's owners and admins set caps."), code=TEAM_ROLE_REQUIRED)
    if not Membership.objects.filter(team=team, user=member).exists():
        raise NotFound(_("No such member in this team."))
    team_limits = quotas.limits_for_account(account=team.account)
    # quota_set checks that the limits are whole numbers ≥ 0; only the team's ceiling is checked here.
    if (
        max_eighths is not None
        and team_limits.max_eighths is not None
        and max_eighths > team_limits.max_eighths
    ):
        raise ValidationFailed(
            _("A member's cap cannot exceed the team's (%(n)s/8).") % {"n": team_limits.max_eighths},
            fields={"max_eighths": "over the team's limit"},
        )
    caps = {
        "monthly_spend_cap_micros": monthly_spend_cap_micros,
        "monthly_card_cap_micros": monthly_card_cap_micros,
    }
    for field, cap in caps.items():
        team_cap = getattr(team_limits, field)
        if cap is not None and team_cap is not None and cap > team_cap:
            raise ValidationFailed(
                _("A member's monthly cap cannot exceed the team's."), fields={field: "over the team's limit"}
            )
    return quotas.quota_set(
        user=member,
        account=team.account,
        limits={"max_eighths": max_eighths, **caps},
        actor=actor,
        reason="team admin: member cap",
    )


def access_token_create(
    *, user: User, name: str, scopes: list[str], expires_in_days: int | None = 90
) -> tuple[AccessToken, str]:
    """A new personal access token; the raw token is returned once and only its hash is kept."""
    name = name.strip()[:100]
    if not name:
        raise ValidationFailed(_("Give the token a name."), fields={"name": _("This field is required.")})
    unknown = sorted(set(scopes) - set(AccessToken.Scope.values))
    if unknown or not scopes:
        raise ValidationFailed(
            _("Choose at least one known scope."), fields={"scopes": ", ".join(unknown) or "empty"}
        )
    if expires_in_days is not None and not 1 <= expires_in_days <= 366:
        raise ValidationFailed(_("A token lasts 1 to 366 days."), fields={"expires_in_days": "out of range"})
    raw = token_generate()
    token = AccessToken.objects.create(
        user=user,
        name=name,
        prefix=raw[:10],
        token_hash=token_hash(raw),
        scopes=sorted(set(scopes)),
        expires_at=timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None,
    )
    return token, raw


def access_token_revoke(*, user: User, token_id: int) -> None:
    updated = AccessToken.objects.filter(pk=token_id, user=user, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    if not updated:
        raise NotFound(_("No such token."))


def home_upload_begin(*, user: User, path: str, size_bytes: int) -> Upload:
    """Begin a resumable upload into the user's own home (``HomeStorage.upload_create``), refused with
    ``quota_storage`` when the file would take the home over its limit (``quotas.home_upload_admit``) and
    with ``uploads_open`` when the user has the most uploads under way."""
    quotas.home_upload_admit(user=user, size_bytes=size_bytes)
    return home_storage().upload_create(
        owner_id=user.pk, folder=workload_user(user), path=path, size_bytes=size_bytes
    )


def home_file_delete(*, user: User, path: str) -> Removed:
    """Delete a file, link or folder tree from the user's own home (``HomeStorage.delete``: never
    through a link, never the home itself), then lower their measured home use by what went, so a
    launch refused for ``quota_storage`` is admitted at once. Raises what the storage raises
    (``files_unavailable``, ``not_found``, ``invalid``: nothing deleted, nothing lowered), or
    DeleteIncomplete once what went before it stopped is counted."""
    stopped = None
    try:
        removed = home_storage().delete(folder=workload_user(user), path=path)
    except DeleteIncomplete as exc:
        stopped, removed = exc, exc.removed
    home_usage_lower(user_id=user.pk, bytes_removed=removed.bytes, entries_removed=removed.entries)
    if stopped is not None:
        raise stopped
    return removed
