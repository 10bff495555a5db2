from django.apps import AppConfig


class ProvisionerConfig(AppConfig):
    name = "provisioner"
    verbose_name = "Provisioner"

    def ready(self) -> None:
        from billing import signals

        signals.funds_exhausted.connect(_on_funds_exhausted, dispatch_uid="provisioner.funds_exhausted")
        signals.runway_low.connect(_on_runway_low, dispatch_uid="provisioner.runway_low.warn")
        signals.runway_recovered.connect(_on_runway_recovered, dispatch_uid="provisioner.runway_recovered")
        signals.metered.connect(_on_metered, dispatch_uid="provisioner.metered.budgets")


def _on_funds_exhausted(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.limits import sessions_stop_for_funds

    sessions_stop_for_funds(session_refs=list(session_refs or []))


def _on_runway_low(sender, session_refs: list[str] | None = None, runway_seconds: int = 0, **kwargs) -> None:
    from provisioner.services.limits import sessions_warn_for_funds

    sessions_warn_for_funds(session_refs=list(session_refs or []), runway_seconds=runway_seconds)


def _on_runway_recovered(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.limits import sessions_funds_recovered

    sessions_funds_recovered(session_refs=list(session_refs or []))


def _on_metered(sender, at=None, **kwargs) -> None:
    from provisioner.services.budgets import budgets_enforce

    budgets_enforce()
