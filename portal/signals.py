"""Receivers of the portal app, connected in ``PortalConfig.ready``."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save
from django.dispatch import receiver

from portal.services import user_account_ensure


@receiver(post_save, sender=get_user_model(), dispatch_uid="portal.user_account")
def user_account_on_create(
    sender: type, instance: Any, created: bool, raw: bool = False, **kwargs: Any
) -> None:
    """Every new user gets their own paying account, whatever made them: signup, ``createsuperuser``,
    the admin, single sign-on. A fixture load (``raw``) is left as it is; the ``portal.E001`` check and
    /healthz report a user it left without an account."""
    if created and not raw and instance.account_id is None:
        user_account_ensure(user=instance)
