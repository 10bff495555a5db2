"""The demo that ``make run`` seeds. Each app contributes a step (a function returning lines to print)
with ``register_step``; steps are idempotent so a second ``make run`` refreshes, never duplicates."""

from __future__ import annotations

from collections.abc import Callable

from portal.models import Team, User
from portal.services import team_create, user_create

DemoStep = Callable[..., list[str]]
_steps: list[DemoStep] = []


def register_step(step: DemoStep) -> DemoStep:
    if step not in _steps:
        _steps.append(step)
    return step


def ensure_user(*, username: str, password: str, is_staff: bool = False) -> User:
    user = User.objects.filter(username=username).first()
    if user is None:
        return user_create(
            username=username, email=f"{username}@example.com", password=password, is_staff=is_staff
        )
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


@register_step
def demo_team(*, url: str) -> list[str]:
    lead = User.objects.get(username="teamlead")
    team = Team.objects.filter(slug="vision-lab").first() or team_create(creator=lead, name="Vision Lab")
    return [f"team:               {team.name} (owner teamlead) {url}/teams/{team.slug}/"]


def run_steps(*, url: str) -> list[str]:
    import importlib

    from django.apps import apps

    for config in apps.get_app_configs():  # apps register their steps in <app>/demo.py
        try:
            importlib.import_module(f"{config.name}.demo")
        except ModuleNotFoundError as exc:
            if exc.name != f"{config.name}.demo":
                raise
    lines: list[str] = []
    for step in _steps:
        lines += step(url=url)
    return lines
