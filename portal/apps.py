from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        from celery.signals import task_failure

        from portal import checks, signals  # noqa: F401  (registers the receivers and the checks)
        from portal.metrics import task_failure_count

        task_failure.connect(task_failure_count, weak=False)
