from django.apps import AppConfig


class ProvisionerConfig(AppConfig):
    name = "provisioner"
    verbose_name = "Provisioner"

    def ready(self) -> None:
        from billing import signals

        signals.funds_exhausted.connect(_on_funds_exhausted, dispatch_uid="provisioner.funds_exhausted")


def _on_funds_exhausted(sender, session_refs: list[str] | None = None, **kwargs) -> None:
    from provisioner.services.sessions import sessions_stop_for_funds

    sessions_stop_for_funds(session_refs=list(session_refs or []))
