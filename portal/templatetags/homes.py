"""The retention rule for homes on the pages (docs/STORAGE.md, "Retention"): the rule in one line, and a
banner while a removal of the user's home is planned. Read from the request's user (its query carries
the date: ``provisioner.quotas.users_with_home_use``), so a page that shows them makes no query more."""

from __future__ import annotations

from django import template
from django.conf import settings

from provisioner.quotas import home_removal_due_of

register = template.Library()


@register.inclusion_tag("includes/home_removal.html", takes_context=True)
def home_removal_banner(context) -> dict:
    user = getattr(context.get("request"), "user", None)
    due = home_removal_due_of(user) if user is not None and user.is_authenticated else None
    return {"due": due}


@register.inclusion_tag("includes/home_retention_rule.html")
def home_retention_rule() -> dict:
    return {"idle_days": settings.HOMES_RETENTION_IDLE_DAYS, "warn_days": settings.HOMES_RETENTION_WARN_DAYS}
