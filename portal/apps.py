from django.apps import AppConfig

from billing.rules import AccountRules, account_rules_register


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        from celery.signals import task_failure

        from portal import checks, signals  # noqa: F401  (registers the receivers and the checks)
        from portal.metrics import task_failure_count
        from portal.selectors import (
            account_managed_by,
            account_managers,
            accounts_payable_by,
            team_folder_grants,
        )

        task_failure.connect(task_failure_count, weak=False)
        account_rules_register(
            AccountRules(
                paying_accounts=accounts_payable_by,
                manages=account_managed_by,
                managers=account_managers,
                folders=team_folder_grants,
            )
        )
