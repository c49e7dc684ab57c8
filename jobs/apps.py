"""The jobs app's configuration: at start-up every process refuses to run on a procrastinate whose Python internals,
which the app relies on, have changed (jobs.internals; the SQL ones are checked when a worker starts)."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs and dead letters"

    def ready(self):
        from jobs import internals, worker

        # Every process (web server, workers, manage.py) refuses to start on a procrastinate whose internals we
        # rely on have changed; the SQL ones are checked when a worker starts (jobs.worker.Worker._register).
        internals.check_python(worker.Worker)
