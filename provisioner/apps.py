from django.apps import AppConfig


class ProvisionerConfig(AppConfig):
    name = "provisioner"
    verbose_name = "Provisioner"
