"""Compute cards: issue in batches with invite codes, redeem, split into parts, gift, revoke, expire.

A card's hours live on its own CARD_H ledger account: issued from ``promotions``, burned into
``card_burn`` by metering, moved to ``card_expiry`` at expiry, and moved between parent and parts by
transfers, so hours issued = hours left + burned + expired, exactly. Every service that moves hours
locks the ledger accounts involved in id order (``select_for_update``); redemption also locks the
invite code row, so any number of concurrent redemptions of one code make exactly one owner.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.codes import CodeMalformed, CodeMistyped, code_generate, code_hash, code_normalize
from billing.models import (
    CARD_UNIT,
    Account,
    Card,
    CardBatch,
    InviteCode,
    LedgerAccount,
    Transfer,
)
from billing.permissions import cards_manager_require
from billing.rules import account_managers
from billing.services.ledger import (
    Leg,
    idempotency_key_check,
    lock_accounts,
    post_legs_locked,
    system_account,
)
from core.clock import db_now
from core.errors import Conflict, NotFound, RateLimited, ValidationFailed
from core.units import micros_to_hours
from notices.services import notify

GIFT_CODE_VALID_DAYS = 14
MAX_BATCH = 10_000


def _team_move_audit(
    *, actor, account: Account, action: str, card: Card, after: dict, held_before_micros: int | None = None
) -> None:
    """A team's card moves are audited (who, which card, what it held before, what moved): its members
    share what it holds."""
    if account.kind == Account.Kind.TEAM:
        before = None
        if held_before_micros is not None:
            before = {"card_id": card.id, "hours_left_micros": held_before_micros}
        audit_record(
            actor=actor, action=action, target=account, before=before, after={"card_id": card.id, **after}
        )


def _hours_micros(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValidationFailed(
            _("%(field)s must be a positive whole number of micro-hours.") % {"field": field},
            fields={field: "invalid"},
        )
    return value


def _new_code(card: Card, *, expires_at: datetime | None = None) -> str:
    code = code_generate()
    InviteCode.objects.create(card=card, code_hash=code_hash(code_normalize(code)), expires_at=expires_at)
    return code


def card_batch_issue(
    *,
    hours_micros: int,
    count: int,
    valid_days: int | None = None,
    valid_until: datetime | None = None,
    gpu_models: list[str] | None = None,
    max_parts: int = 3,
    splittable: bool = True,
    one_per_user: bool = True,
    label: str = "",
    actor=None,
) -> tuple[CardBatch, list[str]]:
    """Issue ``count`` cards of ``hours_micros`` each, funded from the promotions account; returns the
    batch and the codes (shown once: only their keyed hashes are stored). One transaction."""
    _batch_terms_check(
        hours_micros=hours_micros,
        count=count,
        valid_days=valid_days,
        valid_until=valid_until,
        max_parts=max_parts,
    )
    models = sorted({m.strip() for m in (gpu_models or []) if m.strip()})
    source = system_account(kind=LedgerAccount.Kind.PROMOTIONS, unit=CARD_UNIT)
    with transaction.atomic():
        batch = CardBatch.objects.create(
            label=label[:100],
            hours_micros=hours_micros,
            valid_days=valid_days,
            valid_until=valid_until,
            gpu_models=models,
            splittable=splittable and max_parts > 0,
            max_parts=max_parts,
            one_per_user=one_per_user,
            created_by=actor if getattr(actor, "pk", None) else None,
        )
        cards = _batch_cards_create(batch, count=count)
        _batch_cards_fund(cards, source=source, actor=actor)
        codes = _batch_codes_create(cards)
        audit_record(
            actor=actor,
            action="cards.batch_issue",
            target=batch,
            after={"count": count, "hours_micros": hours_micros, "gpu_models": batch.gpu_models},
            reason=label,
        )
    return batch, codes


def _batch_terms_check(
    *, hours_micros: int, count: int, valid_days: int | None, valid_until: datetime | None, max_parts: int
) -> None:
    """Raise ValidationFailed naming the field unless a batch's terms are ones it can be issued with."""
    _hours_micros(hours_micros, "hours_micros")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_BATCH:
        raise ValidationFailed(
            _("Issue between 1 and %(max)s cards at a time.") % {"max": MAX_BATCH},
            fields={"count": "out of range"},
        )
    if valid_days is None and valid_until is None:
        raise ValidationFailed(_("A batch needs a validity."), fields={"valid_days": "required"})
    if valid_days is not None and (not isinstance(valid_days, int) or valid_days <= 0):
        raise ValidationFailed(
            _("valid_days must be a positive number of days."), fields={"valid_days": "invalid"}
        )
    if not isinstance(max_parts, int) or max_parts < 0 or max_parts > 50:
        raise ValidationFailed(_("max_parts must be between 0 and 50."), fields={"max_parts": "invalid"})


def _batch_cards_create(batch: CardBatch, *, count: int) -> list[Card]:
    """``count`` empty cards of the batch, each on a CARD_H ledger account of its own."""
    ledgers = LedgerAccount.objects.bulk_create(
        [LedgerAccount(kind=LedgerAccount.Kind.CARD, unit=CARD_UNIT) for _ in range(count)]
    )
    return Card.objects.bulk_create(
        [
            Card(
                ledger_account=la,
                batch=batch,
                hours_micros=batch.hours_micros,
                gpu_models=batch.gpu_models,
                max_parts=batch.max_parts,
                splittable=batch.splittable,
                expires_at=batch.valid_until,
            )
            for la in ledgers
        ]
    )


def _batch_cards_fund(cards: list[Card], *, source: LedgerAccount, actor) -> None:
    """Move each card's hours onto it from ``source`` (promotions), one CARD_ISSUE transfer a card,
    with the ledger accounts locked in id order."""
    locked = lock_accounts([source.id, *(card.ledger_account_id for card in cards)])
    post_legs_locked(
        legs=[
            Leg(
                source.id,
                card.ledger_account_id,
                card.hours_micros,
                Transfer.Kind.CARD_ISSUE,
                f"card:{card.id}:issue",
            )
            for card in cards
        ],
        locked=locked,
        actor=actor,
    )


def _batch_codes_create(cards: list[Card]) -> list[str]:
    """One invite code for each card; the codes in card order (only their hashes are stored)."""
    codes = [code_generate() for _ in cards]
    rows = [
        InviteCode(card=card, code_hash=code_hash(code_normalize(code)))
        for card, code in zip(cards, codes, strict=True)
    ]
    InviteCode.objects.bulk_create(rows)
    return codes


def _rate_limit(*, user, ip: str | None) -> None:
    limit = settings.CARD_REDEEM_RATE_PER_MINUTE
    for key in (f"card-redeem:user:{user.pk}", f"card-redeem:ip:{ip}" if ip else None):
        if key is None:
            continue
        cache.add(key, 0, timeout=60)
        try:
            attempts = cache.incr(key)
        except ValueError:
            cache.set(key, 1, timeout=60)
            attempts = 1
        if attempts > limit:
            raise RateLimited(_("Too many attempts; wait a minute and try again."))


def card_redeem(*, user, account: Account, code: str, ip: str | None = None) -> Card:
    """Redeem an invite code onto ``account``. Rate limited per user and per IP (Redis cache).

    Locks the code row, then the card: of many concurrent redemptions exactly one wins. Raises
    ValidationFailed ``code_mistyped`` (check symbol fails, no lookup made) or ``code_invalid``,
    NotFound ``code_unknown``, Conflict ``code_used``, ValidationFailed ``code_expired`` /
    ``code_revoked`` / ``card_limit`` (one per user), RateLimited.
    """
    _rate_limit(user=user, ip=ip)
    try:
        data = code_normalize(code)
    except CodeMistyped:
        raise ValidationFailed(
            _("That code has a typo: check it and try again."),
            code="code_mistyped",
            fields={"code": "mistyped"},
        )
    except CodeMalformed:
        raise ValidationFailed(
            _("That is not an invite code."), code="code_invalid", fields={"code": "invalid"}
        )
    return _redeem_code(user=user, account=account, data=data, now=db_now())


def _redeem_code(*, user, account: Account, data: str, now: datetime) -> Card:
    with transaction.atomic():
        invite = InviteCode.objects.select_for_update().filter(code_hash=code_hash(data)).first()
        if invite is None:
            raise NotFound(_("No card has that code."), code="code_unknown")
        card = Card.objects.select_for_update().select_related("batch").get(id=invite.card_id)
        if invite.used_at is not None:
            raise Conflict(_("That code has already been redeemed."), code="code_used")
        if invite.revoked_at is not None or card.state == Card.State.REVOKED:
            raise ValidationFailed(_("That code was withdrawn by its giver."), code="code_revoked")
        if (
            card.state == Card.State.EXPIRED
            or (card.expires_at and card.expires_at <= now)
            or (invite.expires_at and invite.expires_at <= now)
        ):
            raise ValidationFailed(_("That card has expired."), code="code_expired")
        if card.state not in (Card.State.UNREDEEMED, Card.State.GIFTED):
            raise Conflict(_("That code has already been redeemed."), code="code_used")
        if card.batch.one_per_user and card.parent_id is None:
            # two codes of one batch redeemed by one user at once: the user row serialises them
            get_user_model().objects.select_for_update(no_key=True).filter(pk=user.pk).first()
        if (
            card.batch.one_per_user
            and card.parent_id is None
            and Card.objects.filter(batch=card.batch, parent__isnull=True, redeemed_by=user).exists()
        ):
            raise ValidationFailed(_("You already have a card from this batch."), code="card_limit")
        if card.expires_at is None:
            card.expires_at = now + timedelta(days=card.batch.valid_days or 0)
            if card.batch.valid_until and card.batch.valid_until < card.expires_at:
                card.expires_at = card.batch.valid_until
        card.owner = account
        card.state = Card.State.ACTIVE
        card.redeemed_by = user
        card.redeemed_at = now
        card.save(update_fields=["owner", "state", "redeemed_by", "redeemed_at", "expires_at"])
        LedgerAccount.objects.filter(id=card.ledger_account_id).update(owner=account)
        invite.used_at = now
        invite.save(update_fields=["used_at"])
        _team_move_audit(
            actor=user,
            account=account,
            action="cards.redeem",
            card=card,
            after={"hours_micros": card.hours_micros},
        )
        if card.parent_id and card.gifted_by_id != user.pk:
            _gift_received_notify(card=card, user=user)
    return card


def _gift_received_notify(*, card: Card, user) -> None:
    """A gifted part was redeemed: its new holder and its giver are told (``card_received``)."""
    hours = f"{micros_to_hours(card.hours_micros):.2f}"
    giver = card.gifted_by.username if card.gifted_by_id else card.parent.owner.name
    notify(
        users=[user],
        kind="card_received",
        key="card_gift_received",
        params={"card": card.id, "hours": hours, "giver": giver},
        dedupe_key=f"card:{card.id}:received",
        url=reverse("cards"),
    )
    if card.gifted_by_id:
        notify(
            users=[card.gifted_by_id],
            kind="card_received",
            key="card_gift_redeemed",
            params={"card": card.id, "hours": hours, "user": user.username},
            dedupe_key=f"card:{card.id}:redeemed",
            url=reverse("cards"),
        )


def _owned_card_locked(card_id: int, account: Account) -> tuple[Card, LedgerAccount]:
    card = Card.objects.select_for_update().filter(id=card_id, owner=account).first()
    if card is None:
        raise NotFound(_("No such card."))
    ledger = LedgerAccount.objects.select_for_update().get(id=card.ledger_account_id)
    return card, ledger


def _make_parts(
    *,
    card: Card,
    ledger: LedgerAccount,
    amounts: list[int],
    actor,
    now: datetime,
    split_key: str | None = None,
) -> list[tuple[Card, str]]:
    ledgers = LedgerAccount.objects.bulk_create(
        [LedgerAccount(kind=LedgerAccount.Kind.CARD, unit=CARD_UNIT) for _ in amounts]
    )
    parts = Card.objects.bulk_create(
        [
            Card(
                ledger_account=la,
                batch_id=card.batch_id,
                parent=card,
                hours_micros=amount,
                gpu_models=card.gpu_models,
                max_parts=0,
                splittable=False,
                gifted_by=actor if getattr(actor, "pk", None) else None,
                expires_at=card.expires_at,
                state=Card.State.GIFTED,
                split_key=split_key,
            )
            for la, amount in zip(ledgers, amounts, strict=True)
        ]
    )
    locked = lock_accounts([ledger.id, *(la.id for la in ledgers)])
    post_legs_locked(
        legs=[
            Leg(
                ledger.id,
                part.ledger_account_id,
                amount,
                Transfer.Kind.CARD_SPLIT,
                _split_transfer_key(card=card, part=part, index=index, split_key=split_key),
            )
            for index, (part, amount) in enumerate(zip(parts, amounts, strict=True))
        ],
        locked=locked,
        actor=actor,
    )
    for part in parts:
        part.ledger_account = locked[part.ledger_account_id]
    code_expiry = now + timedelta(days=GIFT_CODE_VALID_DAYS)
    if card.expires_at and card.expires_at < code_expiry:
        code_expiry = card.expires_at
    return [(part, _new_code(part, expires_at=code_expiry)) for part in parts]


def _split_transfer_key(*, card: Card, part: Card, index: int, split_key: str | None) -> str:
    """A split under a client's Idempotency-Key names the key (hashed: the ledger's keys are 200
    characters at most) in its transfers' keys, so the ledger's unique key, not only the card lock,
    refuses a second split of the card under that key."""
    if split_key is None:
        return f"card:{part.id}:split"
    digest = hashlib.sha256(split_key.encode()).hexdigest()[:40]
    return f"card:{card.id}:split:{digest}:{index}"


def card_split(
    *, card_id: int, account: Account, parts: list[int], actor=None, idempotency_key: str | None = None
) -> list[tuple[Card, str]]:
    """Split an owned, active card into new unredeemed parts of ``parts`` micro-hours each, each with
    a new code (returned once); the parts keep the card's restrictions and expiry.

    Locks the card and its ledger account, so concurrent splits never take more than it holds.
    Idempotent by ``idempotency_key`` per card: a replay splits nothing and returns the same parts. The
    card lock serialises replays, and the key is in the split's transfer keys, so the ledger's unique
    key refuses a second split under it even where the lock were bypassed.
    Codes are stored hashed, so the first ones cannot be shown again: a replay gives each part not yet
    redeemed a fresh code and retires the old one (the caller that lost the answer never saw it).
    Raises NotFound, ValidationFailed (not splittable, too many parts, a part below the minimum,
    more than remains, expired, a bad key), Conflict (the key was used for other parts), Forbidden
    ``team_role_required`` (``actor`` is a plain member of the team whose card it is).
    """
    cards_manager_require(actor=actor, account=account)
    idempotency_key_check(idempotency_key)
    if not isinstance(parts, list) or not parts:
        raise ValidationFailed(_("Give the parts as a list of hours."), fields={"parts": "required"})
    for amount in parts:
        _hours_micros(amount, "parts")
        if amount < settings.CARD_MIN_PART_MICROS:
            raise ValidationFailed(
                _("Each part needs at least %(hours)s hours.")
                % {"hours": f"{settings.CARD_MIN_PART_MICROS / 1e6:g}"},
                fields={"parts": "too small"},
            )
    now = db_now()
    with transaction.atomic():
        card, ledger = _owned_card_locked(card_id, account)
        if idempotency_key:
            replayed = list(Card.objects.filter(parent=card, split_key=idempotency_key).order_by("id"))
            if replayed:
                return _split_replay(replayed, parts=parts, now=now)
        _require_usable(card, now)
        if not card.splittable:
            raise ValidationFailed(_("This card cannot be split."), code="not_splittable")
        made = Card.objects.filter(parent=card).exclude(state=Card.State.REVOKED).count()
        if made + len(parts) > card.max_parts:
            raise ValidationFailed(
                _("This card can be split into at most %(parts)s parts.") % {"parts": card.max_parts},
                fields={"parts": "too many"},
            )
        if sum(parts) > ledger.balance_micros:
            raise ValidationFailed(
                _("The parts add up to more than the card holds."), fields={"parts": "too much"}
            )
        held_before = ledger.balance_micros
        made = _make_parts(
            card=card, ledger=ledger, amounts=parts, actor=actor, now=now, split_key=idempotency_key
        )
        _team_move_audit(
            actor=actor,
            account=account,
            action="cards.split",
            card=card,
            held_before_micros=held_before,
            after={
                "parts": [{"card_id": part.id, "hours_micros": part.hours_micros} for part, _code in made]
            },
        )
        return made


def _split_replay(replayed: list[Card], *, parts: list[int], now: datetime) -> list[tuple[Card, str]]:
    if [part.hours_micros for part in replayed] != parts:
        raise Conflict(
            _("This Idempotency-Key was used for a split into other parts."), code="idempotency_key_reused"
        )
    answer = []
    for part in replayed:
        code = ""
        if part.state == Card.State.GIFTED:
            old = InviteCode.objects.filter(card=part, used_at__isnull=True, revoked_at__isnull=True)
            expires_at = old.values_list("expires_at", flat=True).first()
            old.update(revoked_at=now)
            code = _new_code(part, expires_at=expires_at)
        answer.append((Card.objects.select_related("ledger_account").get(id=part.id), code))
    return answer


def card_gift(*, card_id: int, account: Account, actor=None) -> tuple[Card, str]:
    """Give away everything a card holds: a new unredeemed part with a code (returned once). The
    card stays, empty, as its parent, so revoking the gift brings the hours back. Locks as split.
    Raises Forbidden ``team_role_required`` for a plain member of the team whose card it is."""
    cards_manager_require(actor=actor, account=account)
    now = db_now()
    with transaction.atomic():
        card, ledger = _owned_card_locked(card_id, account)
        _require_usable(card, now)
        if ledger.balance_micros <= 0:
            raise ValidationFailed(_("This card is empty."), code="card_empty")
        held_before = ledger.balance_micros
        ((part, code),) = _make_parts(card=card, ledger=ledger, amounts=[held_before], actor=actor, now=now)
        _team_move_audit(
            actor=actor,
            account=account,
            action="cards.gift",
            card=card,
            held_before_micros=held_before,
            after={"part_id": part.id, "hours_micros": part.hours_micros},
        )
        return part, code


def _require_usable(card: Card, now: datetime) -> None:
    if card.state != Card.State.ACTIVE or (card.expires_at and card.expires_at <= now):
        raise ValidationFailed(_("This card is not active."), code="card_inactive")


def _return_to_parent_locked(part: Card, *, kind: str, now: datetime, actor=None) -> None:
    """Move an unredeemed part's hours back to its parent (or to expiry when the parent is no longer
    valid) and retire it and its codes. Caller holds the part's row lock."""
    parent = Card.objects.select_for_update().get(id=part.parent_id)
    parent_valid = parent.state == Card.State.ACTIVE and not (parent.expires_at and parent.expires_at <= now)
    target = (
        parent.ledger_account_id
        if parent_valid
        else system_account(kind=LedgerAccount.Kind.CARD_EXPIRY, unit=CARD_UNIT).id
    )
    locked = lock_accounts([part.ledger_account_id, target])
    amount = locked[part.ledger_account_id].balance_micros
    if amount > 0:
        post_legs_locked(
            legs=[Leg(part.ledger_account_id, target, amount, kind, f"card:{part.id}:{kind}")],
            locked=locked,
            actor=actor,
        )
    part.state = Card.State.REVOKED if kind == Transfer.Kind.CARD_REVOKE else Card.State.EXPIRED
    part.save(update_fields=["state"])
    InviteCode.objects.filter(card=part, used_at__isnull=True, revoked_at__isnull=True).update(revoked_at=now)


def card_revoke(*, card_id: int, account: Account, actor=None) -> Card:
    """Withdraw an unredeemed part made from one of ``account``'s cards: its hours go back to the
    parent (to expiry, if the parent has expired) and its code stops working. Locks the part, the
    parent, then the ledger accounts. Raises NotFound, Conflict (already redeemed or retired), Forbidden
    ``team_role_required`` (a plain member of the team whose card it came from)."""
    cards_manager_require(actor=actor, account=account)
    now = db_now()
    with transaction.atomic():
        part = Card.objects.select_for_update().filter(id=card_id, parent__owner=account).first()
        if part is None:
            raise NotFound(_("No such card."))
        if part.state != Card.State.GIFTED:
            raise Conflict(
                _("Only a part nobody has redeemed yet can be revoked."), code="card_not_revocable"
            )
        _return_to_parent_locked(part, kind=Transfer.Kind.CARD_REVOKE, now=now, actor=actor)
        _team_move_audit(
            actor=actor,
            account=account,
            action="cards.revoke",
            card=part,
            after={"parent_id": part.parent_id, "state": part.state},
        )
    return part


def card_expire(*, now: datetime | None = None) -> int:
    """Retire what has expired by ``now`` (default: the database clock): an unredeemed gifted part
    whose code expired goes back to its parent while the parent is valid; the remainder of an expired
    card goes to the ``card_expiry`` account. Idempotent; one transaction per card. Returns cards done."""
    now = now or db_now()
    done = 0
    gift_ids = list(
        InviteCode.objects.filter(
            expires_at__lte=now, used_at__isnull=True, revoked_at__isnull=True, card__state=Card.State.GIFTED
        ).values_list("card_id", flat=True)
    )
    for card_id in gift_ids:
        with transaction.atomic():
            part = Card.objects.select_for_update().filter(id=card_id, state=Card.State.GIFTED).first()
            if part:
                _return_to_parent_locked(part, kind=Transfer.Kind.CARD_EXPIRE, now=now)
                done += 1
    expired_ids = list(
        Card.objects.filter(
            expires_at__lte=now, state__in=[Card.State.ACTIVE, Card.State.GIFTED, Card.State.UNREDEEMED]
        )
        .order_by("-parent_id", "id")
        .values_list("id", flat=True)
    )
    sink = system_account(kind=LedgerAccount.Kind.CARD_EXPIRY, unit=CARD_UNIT)
    for card_id in expired_ids:
        with transaction.atomic():
            card = Card.objects.select_for_update().filter(id=card_id, expires_at__lte=now).first()
            if card is None or card.state in (Card.State.EXPIRED, Card.State.REVOKED):
                continue
            locked = lock_accounts([card.ledger_account_id, sink.id])
            amount = locked[card.ledger_account_id].balance_micros
            if amount > 0:
                post_legs_locked(
                    legs=[
                        Leg(
                            card.ledger_account_id,
                            sink.id,
                            amount,
                            Transfer.Kind.CARD_EXPIRE,
                            f"card:{card.id}:expire",
                        )
                    ],
                    locked=locked,
                )
            card.state = Card.State.EXPIRED
            card.save(update_fields=["state"])
            InviteCode.objects.filter(card=card, used_at__isnull=True, revoked_at__isnull=True).update(
                revoked_at=now
            )
            done += 1
    return done


REMINDER_DAYS = (7, 1)


def card_remind(*, now: datetime | None = None) -> int:
    """Remind the people of an active card with hours left, 7 days and again 1 day before it expires: a
    ``card_expiring`` notice (and email, after commit) to whoever redeemed it and the account's managers.

    Idempotent: one reminder per card, lead time and person (the notice's dedupe key); a card found
    inside the last day gets only the 1-day reminder. Returns notices made.
    """
    now = now or db_now()
    made = 0
    with transaction.atomic():
        for days, sooner in zip(REMINDER_DAYS, [*REMINDER_DAYS[1:], 0], strict=True):
            cards = Card.objects.filter(
                state=Card.State.ACTIVE,
                owner__isnull=False,
                ledger_account__balance_micros__gt=0,
                expires_at__gt=now + timedelta(days=sooner),
                expires_at__lte=now + timedelta(days=days),
            ).select_related("ledger_account", "owner")
            for card in cards:
                made += notify(
                    users=[*account_managers(account=card.owner), card.redeemed_by_id],
                    kind="card_expiring",
                    key="card_expiring",
                    params={
                        "card": card.id,
                        "hours": f"{micros_to_hours(card.ledger_account.balance_micros):.2f}",
                        "expires": f"{card.expires_at:%Y-%m-%d %H:%M}",
                    },
                    dedupe_key=f"card:{card.id}:expiry:{days}d",
                    url=reverse("cards"),
                )
    return made


def card_daily_grant(*, user, account: Account, now: datetime | None = None) -> Card | None:
    """The daily grant (admin policy, off unless CARD_DAILY_GRANT_MICROS > 0): CARD_DAILY_GRANT_MICROS
    free card-hours a day for ``user`` on ``account``, not cumulative (one card per user per local day)
    and expiring at the end of that day. Idempotent per user and day; the grant card cannot be split.
    Returns the day's card, or None when the policy is off."""
    hours = settings.CARD_DAILY_GRANT_MICROS
    if hours <= 0:
        return None
    local = timezone.localtime(now or db_now())
    label = f"daily grant {local.date().isoformat()}"
    end_of_day = local.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    with transaction.atomic():
        # one grant per user and day, also when two requests race: lock the user row first
        get_user_model().objects.select_for_update(no_key=True).filter(pk=user.pk).first()
        existing = Card.objects.filter(batch__label=label, redeemed_by=user).first()
        if existing:
            return existing
        _batch, (code,) = card_batch_issue(
            hours_micros=hours, count=1, valid_until=end_of_day, max_parts=0, label=label
        )
        return _redeem_code(user=user, account=account, data=code_normalize(code), now=local)
