"""Periodic work is set as a period in seconds; the cron expression built from it runs at that period, and a
schedule that does not (the croniter sixth-field trap) stops the process at start-up, naming the variable. A real
worker keeping one: tests/system/test_schedules_worker.py."""

from __future__ import annotations

import re

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from console import schedules
from tests.settings_of import settings_of


@pytest.mark.parametrize(
    ("seconds", "cron"),
    [
        (1, "* * * * * *"),
        (2, "* * * * * */2"),
        (10, "* * * * * */10"),
        (30, "* * * * * */30"),
        (60, "* * * * *"),
        (300, "*/5 * * * *"),
        (1800, "*/30 * * * *"),
        (3600, "0 * * * *"),
        (21600, "0 */6 * * *"),
        (86400, "0 0 * * *"),
    ],
)
def test_it_builds_a_cron_expression_that_runs_at_the_period(seconds, cron):
    assert schedules.cron_every(seconds) == cron
    schedules.check_schedule("X_SECONDS", cron, seconds)
    for start in schedules._start_points():
        first, *gaps = schedules.tick_gaps(cron, start, ticks=6)
        assert 0 < first <= seconds
        assert gaps == [seconds] * 5


@pytest.mark.parametrize(("seconds", "nearest"), [(7, "6 or 10"), (45, "30 or 60"), (90, "60 or 120"), (5000, "3600")])
def test_it_refuses_periods_cron_cannot_repeat_evenly(seconds, nearest):
    with pytest.raises(ValueError, match=f"every {seconds} s evenly.*nearest: {nearest}"):
        schedules.cron_every(seconds)


@pytest.mark.parametrize("seconds", [0, -5, 100_000])
def test_it_refuses_periods_out_of_range(seconds):
    with pytest.raises(ValueError):
        schedules.cron_every(seconds)


def test_the_croniter_trap_every_second_of_some_minutes():
    # What the settings used to say: a sixth field is seconds, so this fires every second of minutes :00, :10, ...
    start = schedules._start_points()[0]  # 1.5 s before midnight
    assert schedules.tick_gaps("*/10 * * * * *", start) == [1.5, 1, 1, 1]
    trap = r"STALLED_SWEEP_CRON: the schedule '\*/10 \* \* \* \* \*' does not run every 10 s.*sixth field as seconds"
    with pytest.raises(ImproperlyConfigured, match=trap):
        schedules.check_schedule("STALLED_SWEEP_CRON", "*/10 * * * * *", 10)
    # Five fields mean minutes: "every 10 s" written that way runs every 10 minutes.
    with pytest.raises(ImproperlyConfigured, match="does not run every 10 s"):
        schedules.check_schedule("STALLED_SWEEP_CRON", "*/10 * * * *", 10)
    # Seven does not divide a minute: :56, then :00 four seconds later.
    with pytest.raises(ImproperlyConfigured, match="does not run every 7 s"):
        schedules.check_schedule("X_CRON", "* * * * * */7", 7)


def test_a_broken_expression_names_the_setting():
    with pytest.raises(ImproperlyConfigured, match="X_CRON: 'every ten seconds' is not a valid cron expression"):
        schedules.check_schedule("X_CRON", "every ten seconds", 10)


def test_it_reads_the_period_from_the_environment(monkeypatch):
    monkeypatch.delenv("STALLED_SWEEP_CRON", raising=False)
    monkeypatch.delenv("STALLED_SWEEP_SECONDS", raising=False)
    assert schedules.periodic_from_env("STALLED_SWEEP", default_seconds=10) == (10, "* * * * * */10")
    monkeypatch.setenv("STALLED_SWEEP_SECONDS", "120")
    assert schedules.periodic_from_env("STALLED_SWEEP", default_seconds=10) == (120, "*/2 * * * *")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ten", "STALLED_SWEEP_SECONDS must be a whole number of seconds, got 'ten'"),
        ("2.5", "STALLED_SWEEP_SECONDS must be a whole number of seconds"),
        ("45", "STALLED_SWEEP_SECONDS=45: cron cannot run something every 45 s evenly"),
        ("0", "STALLED_SWEEP_SECONDS=0: a period must be a positive number of seconds"),
    ],
)
def test_it_refuses_a_bad_period(monkeypatch, value, message):
    monkeypatch.delenv("STALLED_SWEEP_CRON", raising=False)
    monkeypatch.setenv("STALLED_SWEEP_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match=message):
        schedules.periodic_from_env("STALLED_SWEEP", default_seconds=10)


def test_it_refuses_the_old_cron_variable(monkeypatch):
    monkeypatch.setenv("SLA_SWEEP_CRON", "*/30 * * * * *")
    with pytest.raises(ImproperlyConfigured, match="SLA_SWEEP_CRON is no longer read: set SLA_SWEEP_SECONDS"):
        schedules.periodic_from_env("SLA_SWEEP", default_seconds=30)


def test_every_cron_setting_needs_its_period():
    schedules.check_settings({"A_SECONDS": 5, "A_CRON": "* * * * * */5", "lower_CRON": "nonsense"})
    with pytest.raises(ImproperlyConfigured, match="B_CRON: a schedule is configured as a period, B_SECONDS"):
        schedules.check_settings({"B_CRON": "* * * * * */5"})
    with pytest.raises(ImproperlyConfigured, match="C_CRON: .* does not run every 5 s"):
        schedules.check_settings({"C_SECONDS": 5, "C_CRON": "*/5 * * * * *"})


def test_the_settings_build_the_sweeps_from_periods():
    assert (settings.STALLED_SWEEP_SECONDS, settings.STALLED_SWEEP_CRON) == (10, "* * * * * */10")
    assert (settings.SLA_SWEEP_SECONDS, settings.SLA_SWEEP_CRON) == (30, "* * * * * */30")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STALLED_SWEEP_CRON": "*/10 * * * * *"}, "STALLED_SWEEP_CRON is no longer read: set STALLED_SWEEP_SECONDS"),
        ({"SLA_SWEEP_SECONDS": "45"}, "SLA_SWEEP_SECONDS=45: cron cannot run something every 45 s evenly"),
    ],
)
def test_a_wrong_schedule_stops_the_process_at_start_up(monkeypatch, env, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        settings_of(monkeypatch, env, without=("STALLED_SWEEP_", "SLA_SWEEP_"))
