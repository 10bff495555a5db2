from django.apps import AppConfig


class ProvisionerConfig(AppConfig):
    name = "provisioner"
    verbose_name = "Provisioner"

    def ready(self) -> None:
        from billing import signals

        signals.funds_exhausted.connect(_on_funds_exhausted, dispatch_uid="provisioner.funds_exhausted")
        signals.runway_low.connect(_on_runway_low, dispatch_uid="provisioner.runway_low")
        signals.runway_recovered.connect(_on_runway_recovered, dispatch_uid="provisioner.runway_recovered")
        signals.metered.connect(_on_metered, dispatch_uid="provisioner.metered.budgets")
        _catalog_signals_connect()
        _homes_signals_connect()


def _catalog_signals_connect() -> None:
    from django.db.models.signals import post_delete, post_save

    from billing.models import CardBurnRate, Price
    from provisioner.catalog_cache import on_node_saved, on_offer_saved
    from provisioner.models import Device, Environment, GpuModel, Node, Profile

    for model in (GpuModel, Profile, Environment, Price, CardBurnRate, Device):
        post_save.connect(on_offer_saved, sender=model, dispatch_uid=f"catalog.saved.{model.__name__}")
    for model in (GpuModel, Profile, Environment, Price, CardBurnRate, Node, Device):
        post_delete.connect(on_offer_saved, sender=model, dispatch_uid=f"catalog.deleted.{model.__name__}")
    post_save.connect(on_node_saved, sender=Node, dispatch_uid="catalog.saved.Node")


def _homes_signals_connect() -> None:
    from django.conf import settings
    from django.db.models.signals import pre_delete

    pre_delete.connect(_on_user_deleting, sender=settings.AUTH_USER_MODEL, dispatch_uid="provisioner.homes")


def _on_user_deleting(sender, instance, **kwargs) -> None:
    """A deleted user's home is removed HOMES_RETENTION_DELETED_DAYS later (docs/STORAGE.md)."""
    from provisioner.services.home_retention import home_removals_plan_deleted

    home_removals_plan_deleted(user=instance)


def _on_funds_exhausted(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.limits import sessions_stop_for_funds

    sessions_stop_for_funds(session_refs=list(session_refs or []))


def _on_runway_low(
    sender, account_id: int, runway_seconds: int, session_refs: list[str] | None = None, **kwargs
) -> None:
    """The sessions' owners are warned of the stop to come (a stop warning each); the account's other
    managers, who can top it up, are told its funds run low."""
    from provisioner.services.limits import sessions_warn_for_funds
    from provisioner.services.session_notices import runway_low_notify

    refs = list(session_refs or [])
    sessions_warn_for_funds(session_refs=refs, runway_seconds=runway_seconds)
    runway_low_notify(account_id=account_id, runway_seconds=runway_seconds, session_refs=refs)


def _on_runway_recovered(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.limits import sessions_funds_recovered

    sessions_funds_recovered(session_refs=list(session_refs or []))


def _on_metered(sender, at=None, **kwargs) -> None:
    from provisioner.services.budgets import budgets_enforce

    budgets_enforce(now=at)
