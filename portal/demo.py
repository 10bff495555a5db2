"""The demo that ``make run`` seeds. Each app has a step (a function returning lines to print) in its
``demo`` module; the portal, on top, runs them in order. Steps are idempotent so a second ``make run``
refreshes, never duplicates."""

from __future__ import annotations

from pathlib import Path

from billing.demo import demo_billing
from portal.models import Team, User
from portal.services import team_create, user_create
from provisioner.demo import demo_fleet


def ensure_user(*, username: str, password: str, is_staff: bool = False) -> User:
    user = User.objects.filter(username=username).first()
    if user is None:
        return user_create(
            username=username, email=f"{username}@example.com", password=password, is_staff=is_staff
        )
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


def demo_team(*, url: str) -> list[str]:
    lead = User.objects.get(username="teamlead")
    team = Team.objects.filter(slug="vision-lab").first() or team_create(creator=lead, name="Vision Lab")
    return [f"team:               {team.name} (owner teamlead) {url}/teams/{team.slug}/"]


def run_steps(*, url: str, data_dir: Path) -> list[str]:
    """The team first (billing funds its wallet), then cards and prices, then the fleet."""
    return [
        *demo_team(url=url),
        *demo_billing(url=url, data_dir=data_dir),
        *demo_fleet(url=url, data_dir=data_dir),
    ]
