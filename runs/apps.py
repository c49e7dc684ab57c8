"""The runs app's start-up: it imports the workflow modules (settings.WORKFLOW_MODULES), which register their
workflows, and resumes the runs a kill switch paused when the switch is released."""

from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class RunsConfig(AppConfig):
    name = "runs"

    def ready(self):
        # Here, not at the top: Django reads apps.py before it loads the models.
        from core.models import kill_switch_released
        from runs.models import Run

        for module in settings.WORKFLOW_MODULES:  # each registers its workflows on import
            import_module(module)
        kill_switch_released.connect(Run.resume_paused_by, dispatch_uid="runs.resume_paused_by")
