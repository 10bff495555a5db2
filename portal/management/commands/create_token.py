"""``python manage.py create_token USERNAME [--name N] [--scopes read sessions …] [--days D]``:
prints a new personal access token once."""

from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from portal.models import AccessToken, User
from portal.services import access_token_create


class Command(BaseCommand):
    help = "Create a personal access token for a user and print it (shown only once)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--scopes", nargs="+", default=["read"], choices=AccessToken.Scope.values)
        parser.add_argument("--days", type=int, default=90, help="expiry in days (0: never)")

    def handle(self, *args, username, name, scopes, days, **options):
        user = User.objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        try:
            _token, raw = access_token_create(
                user=user, name=name, scopes=scopes, expires_in_days=days or None
            )
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(raw)
