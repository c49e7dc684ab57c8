from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class RunsConfig(AppConfig):
    name = "runs"

    def ready(self):
        for module in settings.WORKFLOW_MODULES:  # each registers its workflows on import
            import_module(module)
