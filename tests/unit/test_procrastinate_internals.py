"""The start-up check of the procrastinate internals we rely on (jobs/internals.py), its Python side: it passes on
the installed procrastinate, and a mismatch (a method gone or reshaped, an attribute its Worker no longer sets, a
name of ours that now shadows one of its) stops start-up with a message naming the installed version, the pinned
one and what differs. Its SQL side (functions and types that changed), against the database:
tests/integration/jobs/test_procrastinate_internals.py. A real worker refusing to start:
tests/system/test_procrastinate_internals_worker.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from django.apps import apps
from django.conf import settings
from procrastinate import worker as procrastinate_worker
from procrastinate.contrib.django import app

from jobs import internals
from jobs.internals import InternalsMismatch
from jobs.worker import Worker


def test_the_installed_procrastinate_has_every_python_internal_we_rely_on():
    assert internals.installed_version() == internals.PINNED_VERSION
    assert internals.python_problems(Worker) == []
    check_python()


def test_the_pinned_version_is_the_one_pyproject_pins():
    pyproject = tomllib.loads((Path(settings.BASE_DIR) / "pyproject.toml").read_text())
    assert f"procrastinate[django]=={internals.PINNED_VERSION}" in pyproject["project"]["dependencies"]


def check_python() -> None:
    internals.check_python(Worker)


def _mismatch(call) -> str:
    with pytest.raises(InternalsMismatch) as raised:
        call()
    message = str(raised.value)
    assert f"procrastinate {internals.installed_version()} is installed" in message
    assert f"pinned to procrastinate=={internals.PINNED_VERSION}" in message
    return message


def test_a_worker_method_gone_stops_start_up(monkeypatch):
    monkeypatch.delattr(procrastinate_worker.Worker, "_shutdown")

    message = _mismatch(check_python)

    assert "procrastinate.worker.Worker._shutdown is missing (used by jobs/worker.py" in message


def test_a_worker_method_with_other_parameters_stops_start_up(monkeypatch):
    async def persist(self, job, status, retry_decision, context):  # job_result gone
        pass

    monkeypatch.setattr(procrastinate_worker.Worker, "_persist_job_status", persist)

    message = _mismatch(check_python)

    assert (
        "procrastinate.worker.Worker._persist_job_status is async (self, job, status, retry_decision, context), "
        "expected async (self, job, status, retry_decision, context, job_result)"
    ) in message


def test_a_method_that_is_no_longer_a_coroutine_stops_start_up(monkeypatch):
    monkeypatch.setattr(procrastinate_worker.Worker, "_shutdown", lambda self, side_tasks: None)

    assert "_shutdown is (self, side_tasks), expected async (self, side_tasks)" in _mismatch(check_python)


def test_a_stop_event_procrastinate_no_longer_sets_stops_start_up(monkeypatch):
    original = procrastinate_worker.Worker.__init__

    def without_stop_event(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self._stop_event

    monkeypatch.setattr(procrastinate_worker.Worker, "__init__", without_stop_event)

    message = _mismatch(check_python)

    assert "procrastinate.worker.Worker()._stop_event is missing (used by jobs/worker.py, runs/tasks.py" in message


def test_a_name_of_ours_that_procrastinate_now_has_too_stops_start_up(monkeypatch):
    monkeypatch.setattr(procrastinate_worker.Worker, "_reconcile", lambda self: None, raising=False)

    message = _mismatch(check_python)

    assert "procrastinate.worker.Worker._reconcile now exists, and jobs.worker.Worker._reconcile replaces it" in message


def test_the_names_our_worker_adds_are_the_ones_the_check_knows():
    ours = set(vars(Worker(app=app))) - set(vars(procrastinate_worker.Worker(app=app)))
    assert ours == set(internals.OUR_WORKER_ATTRIBUTES)


def test_the_check_runs_when_the_jobs_app_is_ready(monkeypatch):
    monkeypatch.delattr(procrastinate_worker.Worker, "_run_loop")

    assert "procrastinate.worker.Worker._run_loop is missing" in _mismatch(apps.get_app_config("jobs").ready)


def test_an_upgraded_procrastinate_is_named_in_the_message(monkeypatch):
    monkeypatch.setattr(internals, "installed_version", lambda: "3.11.0")
    monkeypatch.delattr(procrastinate_worker.Worker, "_log_extra")

    message = _mismatch(check_python)

    assert message.startswith("procrastinate 3.11.0 is installed; this app is pinned to procrastinate==3.10.0")


def test_design_notes_list_every_internal_the_check_knows():
    notes = (Path(settings.BASE_DIR) / "docs" / "DESIGN-NOTES.md").read_text()
    section = notes.split("### Procrastinate internals", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`]+)`", section))
    expected = {internal.name.removeprefix("procrastinate.") for internal in internals.PYTHON}
    expected |= {f"sql.queries['{query}']" for query in internals.SQL_QUERIES}
    expected |= {f"Worker().{name}" for name in internals.WORKER_ATTRIBUTES}
    expected |= {f"PsycopgConnector().{name}" for name in internals.CONNECTOR_ATTRIBUTES}
    expected |= set(internals.SQL_FUNCTIONS) | set(internals.SQL_TYPES) | set(internals.SQL_ENUMS)
    expected |= set(internals.SQL_REPLACED)
    expected |= set(internals.SQL_COLUMNS)
    assert expected - named == set()
