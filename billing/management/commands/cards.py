"""``python manage.py cards issue --hours H --count N --valid-days D …``: issue a batch of compute cards
and print one invite code a line (the codes are shown once: only their keyed hashes are stored)."""

from __future__ import annotations

import os
from datetime import datetime, time
from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from billing.codes import codes_csv
from billing.services.cards import card_batch_issue
from core.errors import ApplicationError
from core.units import hours_to_micros


def _hours(text: str) -> int:
    try:
        micros = hours_to_micros(Decimal(text))
    except InvalidOperation:
        raise CommandError(f"--hours: {text!r} is not a number")
    except ValueError:  # a fraction of a micro-hour, or not finite
        micros = 0
    if micros <= 0:
        raise CommandError("--hours must be positive, with at most six decimals")
    return micros


def _until(text: str | None) -> datetime | None:
    if not text:
        return None
    day = parse_date(text) if len(text) == 10 else None
    moment = datetime.combine(day, time.max) if day else parse_datetime(text)  # a day: through its end
    if moment is None:
        raise CommandError(f"--valid-until: {text!r} is not a date (YYYY-MM-DD) or an ISO datetime")
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


class Command(BaseCommand):
    help = "Compute cards: `cards issue` issues a batch and prints one invite code a line."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        issue = sub.add_parser("issue", help="issue a batch of cards")
        issue.add_argument("--hours", required=True, help="card-hours per card (reference GPU)")
        issue.add_argument("--count", type=int, required=True)
        issue.add_argument("--valid-days", type=int, help="validity counted from redemption")
        issue.add_argument("--valid-until", help="or a fixed last day (YYYY-MM-DD or ISO datetime)")
        issue.add_argument("--models", nargs="*", default=[], help="GPU models it may pay for (default any)")
        issue.add_argument("--max-parts", type=int, default=3, help="0: the card cannot be split")
        issue.add_argument("--label", default="", help="the course or promotion")
        issue.add_argument(
            "--many-per-user", action="store_true", help="allow more than one card of the batch per user"
        )
        issue.add_argument("--csv", help="also write the codes as CSV to this path (created 0600)")

    def handle(self, *args, action: str, **options):
        if action != "issue":  # pragma: no cover: argparse refuses other actions
            raise CommandError(f"unknown action {action}")
        models = [m for value in options["models"] for m in value.split(",") if m.strip()]
        try:
            batch, codes = card_batch_issue(
                hours_micros=_hours(options["hours"]),
                count=options["count"],
                valid_days=options["valid_days"],
                valid_until=_until(options["valid_until"]),
                gpu_models=models,
                max_parts=options["max_parts"],
                splittable=options["max_parts"] > 0,
                one_per_user=not options["many_per_user"],
                label=options["label"],
            )
        except ApplicationError as exc:
            raise CommandError(exc.message)
        if options["csv"]:
            fd = os.open(options["csv"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", newline="") as out:
                out.write(codes_csv(batch=batch, codes=codes))
        for code in codes:
            self.stdout.write(code)
        self.stderr.write(f"issued batch {batch.pk} ({batch.label or 'no label'}): {len(codes)} codes")
