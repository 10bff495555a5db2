from django.apps import AppConfig


class ProvisionerConfig(AppConfig):
    name = "provisioner"
    verbose_name = "Provisioner"

    def ready(self) -> None:
        from billing import signals

        signals.funds_exhausted.connect(_on_funds_exhausted, dispatch_uid="provisioner.funds_exhausted")
        signals.runway_low.connect(_on_runway_low, dispatch_uid="provisioner.runway_low")


def _on_funds_exhausted(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.sessions import sessions_stop_for_funds

    sessions_stop_for_funds(session_refs=list(session_refs or []))


def _on_runway_low(
    sender, account_id: int, runway_seconds: int, session_refs: list[str] | None = None, **kwargs
) -> None:
    from provisioner.services.session_notices import runway_low_notify

    runway_low_notify(
        account_id=account_id, runway_seconds=runway_seconds, session_refs=list(session_refs or [])
    )
