"""Seed the demo: an admin, a student, a team lead with a team. Passwords are generated on every run
and printed, never fixed. ``portal.demo`` runs the other apps' parts (fleet, prices, card batches)."""

from __future__ import annotations

import secrets

from django.core.management.base import BaseCommand
from django.db import transaction

from portal import demo, embedded


class Command(BaseCommand):
    help = "Create or refresh the demo users, team and whatever the other apps seed; print the logins."

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8000")

    def handle(self, *args, url: str, **options):
        with transaction.atomic():
            logins = {}
            for username, staff in (("admin", True), ("student", False), ("teamlead", False)):
                password = secrets.token_urlsafe(9)
                demo.ensure_user(username=username, password=password, is_staff=staff)
                logins[username] = password
            lines = demo.run_steps(url=url, data_dir=embedded.data_dir())
        self.stdout.write("")
        self.stdout.write(f"  Suanli is starting at {url}/")
        self.stdout.write(f"  admin pages:        {url}/admin/")
        for username, password in logins.items():
            self.stdout.write(f"  login {username:<10}  password {password}")
        for line in lines:
            self.stdout.write(f"  {line}")
        self.stdout.write("")
