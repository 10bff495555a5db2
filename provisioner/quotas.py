"""Admission: quotas per user, per team account and per member of a team, with defaults from settings.

``quota_admit`` runs inside ``session_launch``'s transaction after the account and user rows are locked,
so one user's (and one account's) concurrent launches are checked one at a time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from datetime import datetime
from functools import reduce

from django.conf import settings
from django.db import transaction
from django.db.models import CharField, Count, F, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Cast, Coalesce
from django.template.defaultfilters import filesizeformat
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing.audit import audit_record
from billing.models import Account, AccruedNow, Meter
from billing.rules import folder_grants_of
from core.compiled import Lookup
from core.errors import QuotaExceeded, ValidationFailed
from provisioner.messages import Message, message
from provisioner.models import HomeRemoval, HomeUsage, Profile, Quota, Session, TeamFolderUsage

LIMIT_FIELDS = Quota.LIMIT_FIELDS


@dataclass(frozen=True)
class Limits:
    max_eighths: int | None
    max_sessions: int | None
    allowed_gpu_models: list[str] | None
    allowed_profiles: list[str] | None
    max_session_seconds: int | None
    monthly_spend_cap_micros: int | None
    monthly_card_cap_micros: int | None = None
    max_home_bytes: int | None = None  # read from a user's own limits only (``home_use``)
    max_home_files: int | None = None


def _defaults() -> Limits:
    cap = settings.QUOTA_DEFAULT_MONTHLY_SPEND_CAP_MICROS
    return Limits(
        settings.QUOTA_DEFAULT_MAX_EIGHTHS,
        settings.QUOTA_DEFAULT_MAX_SESSIONS,
        None,
        None,
        settings.QUOTA_DEFAULT_MAX_SESSION_SECONDS,
        cap or None,
        settings.QUOTA_DEFAULT_MONTHLY_CARD_CAP_MICROS or None,
        settings.HOMES_QUOTA_BYTES or None,
        settings.HOMES_QUOTA_FILES or None,
    )


def _overlay(base: Limits, quota: Quota | None) -> Limits:
    if quota is None:
        return base
    values = {f: getattr(quota, f) for f in LIMIT_FIELDS}
    return Limits(**{f: (values[f] if values[f] is not None else getattr(base, f)) for f in LIMIT_FIELDS})


def _no_limits() -> Limits:
    return Limits(None, None, None, None, None, None, None)


def limits_of_quota(quota: Quota | None, *, user_default: bool) -> Limits:
    """A quota row's limits over the defaults: settings' for a user's own (``user_default``), none for
    a team's or a member's."""
    return _overlay(_defaults() if user_default else _no_limits(), quota)


# Read by every launch: compiled once per process.
_OWN_QUOTA = Lookup(
    lambda user_id: Quota.objects.filter(user_id=user_id, account__isnull=True), key_types=(int,)
)


def limits_for_user(*, user) -> Limits:
    return _overlay(_defaults(), _OWN_QUOTA.first(user.pk))


def limits_for_account(*, account: Account) -> Limits:
    """A team account has only the limits its quota row sets; a personal account follows its user."""
    return _overlay(_no_limits(), Quota.objects.filter(account=account, user__isnull=True).first())


def limits_for_member(*, user, account: Account) -> Limits:
    return _overlay(_no_limits(), Quota.objects.filter(account=account, user=user).first())


def month_start(now: datetime | None = None) -> datetime:
    now = timezone.localtime(now or timezone.now())
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Usage:
    sessions: int
    eighths: int
    spend_micros: int
    card_micros: int = 0  # card-hours burned this month, in micro card-hours


def _use(month: datetime) -> dict:
    """The one way use is summed, over sessions that are live or began in ``month``'s month: live
    sessions and eighths, and this month's spend and card burn from each session's meter."""
    live, this_month = Q(state__in=Session.LIVE), Q(created_at__gte=month)

    def meter(figure):
        of_session = Meter.objects.filter(session_ref=Cast(OuterRef("id"), CharField()))
        return Subquery(of_session.annotate(figure=figure).values("figure")[:1])

    return {
        "live_sessions": Count("id", filter=live),
        "live_eighths": Coalesce(Sum("profile__quota_eighths", filter=live), 0),
        "spend": Coalesce(Sum(meter(F("charged_micros") + AccruedNow()), filter=this_month), 0),
        "card": Coalesce(Sum(meter(F("card_charged_micros")), filter=this_month), 0),
    }


def _counted(sessions: QuerySet[Session], month: datetime) -> QuerySet[Session]:
    return sessions.filter(Q(state__in=Session.LIVE) | Q(created_at__gte=month))


def _usage(sessions: QuerySet[Session]) -> Usage:
    """Live sessions and eighths, this month's spend and card burn: one query."""
    month = month_start()
    figures = _counted(sessions, month).aggregate(**_use(month))
    return Usage(figures["live_sessions"], figures["live_eighths"], figures["spend"], figures["card"])


def usage_of_user(*, user) -> Usage:
    return _usage(Session.objects.filter(owner=user))


def usage_of_account(*, account: Account) -> Usage:
    return _usage(Session.objects.filter(account=account))


def usage_of_member(*, user, account: Account) -> Usage:
    return _usage(Session.objects.filter(owner=user, account=account))


@dataclass(frozen=True)
class AccountUse:
    """A team account's own limits and use, and each member's cap inside it and use of it."""

    limits: Limits
    usage: Usage
    members: dict[int, tuple[Limits, Usage]]  # users missing here have no cap and no use


# The team page reads these at every look: compiled once per process.
_ACCOUNT_QUOTAS = Lookup(
    lambda account_id: Quota.objects.filter(account_id=account_id), key_types=(int,), many=True
)
_ACCOUNT_USE_BY_OWNER = Lookup(
    lambda account_id, month: (
        _counted(Session.objects.filter(account_id=account_id), month)
        .values("owner_id")
        .annotate(**_use(month))
        .values_list("owner_id", "live_sessions", "live_eighths", "spend", "card")
    ),
    key_types=(int, datetime),
    many=True,
)


def account_use(*, account: Account) -> AccountUse:
    """``limits_for_account``, ``usage_of_account`` and ``members_of_account`` at once, in two queries
    however many members and sessions: the account's quota rows, and ``_use`` over its sessions grouped
    by owner."""
    rows = _ACCOUNT_QUOTAS.all(account.pk)
    own = next((q for q in rows if q.user_id is None), None)
    caps = {q.user_id: _overlay(_no_limits(), q) for q in rows if q.user_id is not None}
    used = {
        owner: Usage(*figures) for owner, *figures in _ACCOUNT_USE_BY_OWNER.all(account.pk, month_start())
    }
    nothing = Usage(0, 0, 0)
    members = {
        user: (caps.get(user, _no_limits()), used.get(user, nothing)) for user in caps.keys() | used.keys()
    }
    total = Usage(
        sum(u.sessions for u in used.values()),
        sum(u.eighths for u in used.values()),
        sum(u.spend_micros for u in used.values()),
        sum(u.card_micros for u in used.values()),
    )
    return AccountUse(_overlay(_no_limits(), own), total, members)


def members_of_account(*, account: Account) -> dict[int, tuple[Limits, Usage]]:
    """For every user with sessions or a cap on a team ``account``: their cap inside it and their use of
    it (``limits_for_member`` and ``usage_of_member`` for all at once; see ``account_use``)."""
    return account_use(account=account).members


# One whole sentence per subject and limit, never a translated subject spliced into a translated
# sentence: word order differs between languages. Lazy: translated when raised, inside the request, into
# the user's language.
_REFUSALS = {
    "you": {
        "gpu_model": gettext_lazy("You may not use %(gpu_model)s."),
        "profile": gettext_lazy("You may not use the %(profile)s profile."),
        "sessions": gettext_lazy("You already have %(used)s of at most %(limit)s sessions."),
        "eighths": gettext_lazy(
            "You already have %(used)s/8 of at most %(limit)s/8 of a GPU in use; "
            "this needs %(needed)s/8 more."
        ),
        "hours": gettext_lazy("You may run a session for at most %(hours)s hours."),
        "spend": gettext_lazy("You reached this month's spending cap."),
        "card": gettext_lazy("You reached this month's card-hour budget."),
    },
    "team": {
        "gpu_model": gettext_lazy("This team may not use %(gpu_model)s."),
        "profile": gettext_lazy("This team may not use the %(profile)s profile."),
        "sessions": gettext_lazy("This team already has %(used)s of at most %(limit)s sessions."),
        "eighths": gettext_lazy(
            "This team already has %(used)s/8 of at most %(limit)s/8 of a GPU in use; "
            "this needs %(needed)s/8 more."
        ),
        "hours": gettext_lazy("This team may run a session for at most %(hours)s hours."),
        "spend": gettext_lazy("This team reached this month's spending cap."),
        "card": gettext_lazy("This team reached this month's card-hour budget."),
    },
    "member": {
        "gpu_model": gettext_lazy("Your share of this team may not use %(gpu_model)s."),
        "profile": gettext_lazy("Your share of this team may not use the %(profile)s profile."),
        "sessions": gettext_lazy(
            "Your share of this team already has %(used)s of at most %(limit)s sessions."
        ),
        "eighths": gettext_lazy(
            "Your share of this team already has %(used)s/8 of at most %(limit)s/8 of a GPU in use; "
            "this needs %(needed)s/8 more."
        ),
        "hours": gettext_lazy("Your share of this team may run a session for at most %(hours)s hours."),
        "spend": gettext_lazy("Your share of this team reached this month's spending cap."),
        "card": gettext_lazy("Your share of this team reached this month's card-hour budget."),
    },
}


def _check(
    limits: Limits, usage: Usage, *, subject: str, gpu_model: str, profile: Profile, max_seconds: int
) -> None:
    """Raise QuotaExceeded when one more session breaks a limit. ``subject`` ("you", "team", "member")
    picks the sentences of the message (``_REFUSALS``)."""
    refusal = _REFUSALS[subject]
    if limits.allowed_gpu_models is not None and gpu_model and gpu_model not in limits.allowed_gpu_models:
        raise QuotaExceeded(
            refusal["gpu_model"] % {"gpu_model": gpu_model}, fields={"gpu_model": "not allowed by quota"}
        )
    if limits.allowed_profiles is not None and profile.name not in limits.allowed_profiles:
        raise QuotaExceeded(
            refusal["profile"] % {"profile": profile.name}, fields={"profile": "not allowed by quota"}
        )
    if limits.max_sessions is not None and usage.sessions + 1 > limits.max_sessions:
        raise QuotaExceeded(
            refusal["sessions"] % {"used": usage.sessions, "limit": limits.max_sessions},
            code="quota_sessions",
        )
    if limits.max_eighths is not None and usage.eighths + profile.quota_eighths > limits.max_eighths:
        raise QuotaExceeded(
            refusal["eighths"]
            % {"used": usage.eighths, "limit": limits.max_eighths, "needed": profile.quota_eighths},
            code="quota_gpu_share",
        )
    if limits.max_session_seconds is not None and max_seconds > limits.max_session_seconds:
        raise QuotaExceeded(
            refusal["hours"] % {"hours": f"{limits.max_session_seconds / 3600:g}"},
            fields={"max_hours": "longer than the quota allows"},
        )
    if limits.monthly_spend_cap_micros is not None and usage.spend_micros >= limits.monthly_spend_cap_micros:
        raise QuotaExceeded(str(refusal["spend"]), code="quota_spend")
    if limits.monthly_card_cap_micros is not None and usage.card_micros >= limits.monthly_card_cap_micros:
        raise QuotaExceeded(str(refusal["card"]), code="quota_card_hours")


@dataclass(frozen=True)
class Subject:
    """One set of limits a launch must fit, and whose sessions count against it."""

    limits: Limits
    sessions: Q  # the sessions that count, as a filter on Session
    subject: str  # whose limits, for the message: "you", "team" or "member" (see ``_REFUSALS``)


def quota_subjects(*, user, account: Account) -> list[Subject]:
    """The limits a launch by ``user`` paying with ``account`` must fit: the user's, and for a team
    account the team's and the member's. Read before the launch's transaction: quotas change only by an
    admin's hand, and a change committed a moment later would have been read a moment later anyway."""
    subjects = [Subject(limits_for_user(user=user), Q(owner=user), "you")]
    if account.kind == Account.Kind.TEAM:
        subjects += [
            Subject(limits_for_account(account=account), Q(account=account), "team"),
            Subject(limits_for_member(user=user, account=account), Q(owner=user, account=account), "member"),
        ]
    return subjects


def quota_admit(
    *,
    user,
    account: Account,
    gpu_model: str,
    profile: Profile,
    max_seconds: int,
    subjects: list[Subject] | None = None,
) -> None:
    """Raise QuotaExceeded unless one more session fits every subject's limits (``quota_subjects``, read
    now unless given). Reads only: the caller holds the account and user row locks. The live sessions
    and eighths of every subject come from one query; this month's spend, only where a cap applies."""
    if subjects is None:
        subjects = quota_subjects(user=user, account=account)
    live = Session.objects.filter(
        reduce(operator.or_, (s.sessions for s in subjects)), state__in=Session.LIVE
    )
    totals = live.aggregate(
        **{f"n{i}": Count("id", filter=s.sessions) for i, s in enumerate(subjects)},
        **{f"e{i}": Sum("profile__quota_eighths", filter=s.sessions) for i, s in enumerate(subjects)},
    )
    for i, subject in enumerate(subjects):
        month = Usage(0, 0, 0)
        if (
            subject.limits.monthly_spend_cap_micros is not None
            or subject.limits.monthly_card_cap_micros is not None
        ):
            month = _usage(Session.objects.filter(subject.sessions))
        _check(
            subject.limits,
            Usage(totals[f"n{i}"], totals[f"e{i}"] or 0, month.spend_micros, month.card_micros),
            subject=subject.subject,
            gpu_model=gpu_model,
            profile=profile,
            max_seconds=max_seconds,
        )
    home_admit(user=user)


@dataclass(frozen=True)
class HomeUse:
    """A user's home as last measured (``HomeUsage``) beside their limits; None limits are none."""

    bytes: int
    files: int
    measured_at: datetime
    max_bytes: int | None
    max_files: int | None

    WARN_FRACTION = 0.9

    def _fractions(self) -> list[float]:
        pairs = ((self.bytes, self.max_bytes), (self.files, self.max_files))
        return [used / limit if limit else 0.0 for used, limit in pairs if limit is not None]

    @property
    def over_bytes(self) -> bool:
        return self.max_bytes is not None and self.bytes > self.max_bytes

    @property
    def over_files(self) -> bool:
        return self.max_files is not None and self.files > self.max_files

    @property
    def over(self) -> bool:
        return self.over_bytes or self.over_files

    @property
    def near(self) -> bool:
        """At WARN_FRACTION of a limit or past it: the pages warn."""
        return any(f >= self.WARN_FRACTION for f in self._fractions()) or self.over

    @property
    def files_text(self) -> str:
        return f"{self.files:,}"


def _own_limit(field: str, user_ref: str) -> Subquery:
    return Subquery(Quota.objects.filter(user=OuterRef(user_ref), account__isnull=True).values(field)[:1])


def _home_use(usage: HomeUsage, own_bytes: int | None, own_files: int | None) -> HomeUse:
    """The figures beside the user's own limits, the settings' defaults where the row sets none (0: none)."""
    defaults = _defaults()
    max_bytes = own_bytes if own_bytes is not None else defaults.max_home_bytes
    max_files = own_files if own_files is not None else defaults.max_home_files
    return HomeUse(usage.bytes, usage.files, usage.measured_at, max_bytes or None, max_files or None)


def home_use(*, user) -> HomeUse | None:
    """The user's home as last measured, with their limits (their own quota row over the settings'
    defaults), in one query; None before any agent measured it."""
    usage = _HOME_USAGE.first(user.pk)
    return None if usage is None else _home_use(usage, usage.own_bytes, usage.own_files)


_HOME_USAGE = Lookup(  # every launch reads it under its locks: compiled once per process
    lambda user_id: HomeUsage.objects.filter(user_id=user_id).annotate(
        own_bytes=_own_limit("max_home_bytes", "user"), own_files=_own_limit("max_home_files", "user")
    ),
    key_types=(int,),
)


def users_with_home_use(users: QuerySet) -> QuerySet:
    """``users`` read with their home's last measurement, their own home limits and the date their
    home is to be removed (the retention rule) in the same query: the request's user is read so
    (portal.backends), and ``home_use_of`` and ``home_removal_due_of`` then need no query."""
    planned = HomeRemoval.objects.filter(HomeRemoval.PENDING, user=OuterRef("pk")).order_by("due_at")
    return users.select_related("home_usage").annotate(
        home_max_bytes=_own_limit("max_home_bytes", "pk"),
        home_max_files=_own_limit("max_home_files", "pk"),
        home_removal_due=Subquery(planned.values("due_at")[:1]),
    )


def home_removal_due_of(user) -> datetime | None:
    """When the user's home (the first of them, on local homes) is to be removed, None while no removal
    is planned (docs/STORAGE.md, "Retention"); no query for a user read by ``users_with_home_use``."""
    if hasattr(user, "home_removal_due"):
        return user.home_removal_due
    planned = HomeRemoval.objects.filter(HomeRemoval.PENDING, user_id=user.pk).order_by("due_at")
    return planned.values_list("due_at", flat=True).first()


def home_use_of(user) -> HomeUse | None:
    """``home_use`` of a user read by ``users_with_home_use`` without a query (else with one)."""
    if not hasattr(user, "home_max_bytes"):
        return home_use(user=user)
    try:
        usage = user.home_usage
    except HomeUsage.DoesNotExist:
        return None
    return _home_use(usage, user.home_max_bytes, user.home_max_files)


_HOME_REFUSALS = {
    ("local", "bytes"): gettext_lazy(
        "Your home holds %(used)s of at most %(limit)s: delete files from it (in JupyterLab, while a "
        "session of yours runs) or ask an administrator to raise your limit before you start another "
        "session."
    ),
    ("local", "files"): gettext_lazy(
        "Your home holds %(used)s files of at most %(limit)s: delete files from it (in JupyterLab, while "
        "a session of yours runs) or ask an administrator to raise your limit before you start another "
        "session."
    ),
    # A shared home can be emptied from the portal's Files page, with no session running.
    ("shared", "bytes"): gettext_lazy(
        "Your home holds %(used)s of at most %(limit)s: delete files from it on the Files page, or ask an "
        "administrator to raise your limit, before you start another session."
    ),
    ("shared", "files"): gettext_lazy(
        "Your home holds %(used)s files of at most %(limit)s: delete files from it on the Files page, or "
        "ask an administrator to raise your limit, before you start another session."
    ),
}


def home_admit(*, user) -> None:
    """Raise QuotaExceeded (``quota_storage``) while the user's home, as last measured, is over a limit.
    Reads only; nothing in the home is touched, and running sessions go on. The soft path for homes
    without kernel quotas (docs/STORAGE.md)."""
    use = home_use(user=user)
    if use is None:
        return
    if use.over_bytes:
        used, limit = filesizeformat(use.bytes), filesizeformat(use.max_bytes)
        raise QuotaExceeded(
            _HOME_REFUSALS[(settings.HOMES_BACKEND, "bytes")] % {"used": used, "limit": limit},
            code="quota_storage",
            fields={"home_bytes": f"{use.bytes} > {use.max_bytes}"},
        )
    if use.over_files:
        used, limit = f"{use.files:,}", f"{use.max_files:,}"
        raise QuotaExceeded(
            _HOME_REFUSALS[(settings.HOMES_BACKEND, "files")] % {"used": used, "limit": limit},
            code="quota_storage",
            fields={"home_files": f"{use.files} > {use.max_files}"},
        )


def home_upload_admit(*, user, size_bytes: int) -> None:
    """Raise QuotaExceeded (``quota_storage``) when a file of ``size_bytes`` would take the user's home,
    as last measured, over its byte limit, or the home is over its file limit already. Uploads from the
    portal count against the same limits as what sessions write."""
    use = home_use(user=user)
    if use is None:
        return
    if use.bytes + size_bytes > use.max_bytes:
        raise QuotaExceeded(
            _(
                "This file (%(size)s) would take your home over its limit: it holds %(used)s of at most "
                "%(limit)s. Delete files on the Files page, or ask an administrator to raise your limit."
            )
            % {
                "size": filesizeformat(size_bytes),
                "used": filesizeformat(use.bytes),
                "limit": filesizeformat(use.max_bytes),
            },
            code="quota_storage",
            fields={"home_bytes": f"{use.bytes} + {size_bytes} > {use.max_bytes}"},
        )
    if use.over_files:
        home_admit(user=user)


def team_folder_limit(field: str, account_ref: str = "account_id") -> Subquery:
    """A team account's own limit of its folder (``max_home_bytes`` or ``max_home_files`` of its quota
    row), as a subquery on the account that ``account_ref`` names."""
    return Subquery(Quota.objects.filter(account=OuterRef(account_ref), user__isnull=True).values(field)[:1])


def _team_folder_use(usage: TeamFolderUsage, own_bytes: int | None, own_files: int | None) -> HomeUse:
    """A team folder's figures beside its limits: the team account's quota row, else the settings'."""
    max_bytes = own_bytes if own_bytes is not None else settings.TEAM_FOLDER_QUOTA_BYTES
    max_files = own_files if own_files is not None else settings.TEAM_FOLDER_QUOTA_FILES
    return HomeUse(usage.bytes, usage.files, usage.measured_at, max_bytes or None, max_files or None)


def team_folder_uses(*, account_ids) -> dict[int, HomeUse]:
    """The team folders of these team accounts as last measured, with their limits, by account id, in
    one query; a folder no agent measured yet is missing (and never over)."""
    rows = TeamFolderUsage.objects.filter(account_id__in=list(account_ids)).annotate(
        own_bytes=team_folder_limit("max_home_bytes"), own_files=team_folder_limit("max_home_files")
    )
    return {row.account_id: _team_folder_use(row, row.own_bytes, row.own_files) for row in rows}


@dataclass(frozen=True)
class TeamFolder:
    """A team folder for its pages: its last measurement (None before any) and its limits."""

    use: HomeUse | None
    max_bytes: int | None
    max_files: int | None


def team_folder_of(*, account: Account, max_bytes: int | None, max_files: int | None) -> TeamFolder:
    """The team account's folder as last measured, beside its own limits ``max_bytes`` and ``max_files``
    (its quota row's: None takes the settings' defaults). No query for an account read with
    ``select_related("team_folder_usage")``, one otherwise."""
    try:
        usage = account.team_folder_usage
    except TeamFolderUsage.DoesNotExist:
        usage = None
    measured = usage or TeamFolderUsage(bytes=0, files=0)
    use = _team_folder_use(measured, max_bytes, max_files)
    return TeamFolder(use if usage is not None else None, use.max_bytes, use.max_files)


def _figures(use: HomeUse) -> dict[str, str]:
    unlimited = "∞"
    return {
        "used": filesizeformat(use.bytes),
        "limit": filesizeformat(use.max_bytes) if use.max_bytes else unlimited,
        "files": f"{use.files:,}",
        "max_files": f"{use.max_files:,}" if use.max_files else unlimited,
    }


def team_folders_admit(*, user) -> tuple[list[dict], list[Message]]:
    """The team folders a launch by ``user`` mounts (the spec's ``teams``: every team they belong to,
    whichever account pays) and the warnings for its history. A folder over a limit, as last measured, is
    mounted read-only for its members (the kernel refuses their writes; nothing is deleted) and read-write
    for the team's owners and admins, so that they can delete files from it; the launch goes on either
    way. Reads only: two queries."""
    grants = folder_grants_of(user=user)
    uses = team_folder_uses(account_ids=[g.account_id for g in grants])
    folders, warnings = [], []
    for grant in grants:
        use = uses.get(grant.account_id)
        over = use is not None and use.over
        folders.append(
            {
                "key": str(grant.account_id),
                "name": grant.name,
                "read_only": grant.read_only or (over and not grant.manages),
            }
        )
        if over and not grant.read_only:
            key = "team_folder_over_manager" if grant.manages else "team_folder_over_read_only"
            warnings.append(message(key, team=grant.name, **_figures(use)))
    return folders, warnings


def _clean_limits(limits: dict) -> dict:
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise ValidationFailed(_("Unknown quota fields."), fields=dict.fromkeys(sorted(unknown), "unknown"))
    for field in (
        "max_eighths",
        "max_sessions",
        "max_session_seconds",
        "monthly_spend_cap_micros",
        "monthly_card_cap_micros",
        "max_home_bytes",
        "max_home_files",
    ):
        value = limits.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValidationFailed(_("A limit is a whole number ≥ 0 or empty."), fields={field: "invalid"})
    for field in ("allowed_gpu_models", "allowed_profiles"):
        value = limits.get(field)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise ValidationFailed(_("A list of names or empty."), fields={field: "invalid"})
    return limits


@transaction.atomic
def quota_set(
    *, user=None, account: Account | None = None, limits: dict, actor=None, reason: str = ""
) -> Quota:
    """Create or change the quota of a user, a team account or a member (both). Locks the row; writes an
    audit row with the limits before and after. Raises ValidationFailed."""
    if user is None and account is None:
        raise ValidationFailed(_("A quota belongs to a user, an account or both."))
    limits = _clean_limits(dict(limits))
    quota = Quota.objects.select_for_update().filter(user=user, account=account).first()
    before = quota.limits() if quota else None
    if quota is None:
        quota = Quota(user=user, account=account)
    for field, value in limits.items():
        setattr(quota, field, value)
    quota.save()
    audit_record(
        actor=actor, action="quota.set", target=quota, before=before, after=quota.limits(), reason=reason
    )
    return quota
