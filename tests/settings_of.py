"""The settings a process would start with, read in this one: console/settings.py run again, as a module of its
own (runpy), under the environment and command line a test gives, so that a test of what the environment chooses
takes a few milliseconds instead of a Python process of its own (~0.7 s). Django's settings of the test process
(django.conf.settings) are not touched: the module's names come back as a dict. A setting that is wrong raises
here what it raises at a start (ImproperlyConfigured); that a real start then stops and says why on stderr is
tests/integration/console/test_start_up.py's."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

SETTINGS = Path(__file__).resolve().parent.parent / "console" / "settings.py"
# Parsed, never reached: nothing here connects. (Without a DATABASE_URL the settings would start the embedded server.)
NOWHERE = "postgres://nobody@127.0.0.1:1/unused"


def settings_of(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None, *argv: str, without: tuple[str, ...] = ()
) -> dict:
    """The settings of `manage.py <argv>` (`python -m console.webserver` when `argv` is empty) started with this
    process's environment, less the variables whose names start with one of `without`, plus `env`."""
    for name in [name for name in os.environ if without and name.startswith(without)]:
        monkeypatch.delenv(name)
    for name, value in {"DATABASE_URL": NOWHERE, **(env or {})}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["manage.py", *argv])
    return runpy.run_path(str(SETTINGS), run_name="console.settings_of_a_test")
