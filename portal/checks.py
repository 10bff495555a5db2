"""System checks of the portal app (``manage.py check --database default``; ``migrate`` runs them too)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.checks import Error, Tags, register
from django.db import DatabaseError, connections
from django.utils.translation import gettext as _


def users_without_account_count(*, using: str = "default") -> int | None:
    """How many users have no paying account, or None where that cannot be asked yet: the database is
    unreachable or the user table is not migrated."""
    user_model = get_user_model()
    try:
        if user_model._meta.db_table not in connections[using].introspection.table_names():
            return None
        return user_model.objects.using(using).filter(account__isnull=True).count()
    except DatabaseError:
        return None


@register(Tags.database)
def check_every_user_has_an_account(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list:
    """Every user has their own account (the ``post_save`` receiver makes it; migration 0003 made the
    missing ones). Silent before migrations are applied."""
    errors = []
    for using in databases or []:
        missing = users_without_account_count(using=using)
        if missing:
            errors.append(
                Error(
                    _("%(count)s user(s) have no paying account.") % {"count": missing},
                    hint=_("Open each such user in the admin and save them: saving gives them an account."),
                    obj=get_user_model(),
                    id="portal.E001",
                )
            )
    return errors
