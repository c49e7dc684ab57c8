"""The deploy tests' stack: built and started once for the module (images cached by Podman between runs), torn
down after, its containers' logs printed when a test failed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.deploy.images import HERE, images
from tests.deploy.stack import Stack


def _containers_run() -> str | None:
    """Why containers cannot run here at all, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (make test-deploy installs it on Debian as root: make containers)"
    done = subprocess.run(
        ["podman", "info"],
        env={**os.environ, "CONTAINERS_CONF": str(HERE / "containers.conf")},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"podman cannot run containers here: {done.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    if why := _containers_run():
        pytest.skip(why)
    stack = Stack(images(), tmp_path_factory.mktemp("stack"))
    try:
        stack.up()
        yield stack
    finally:
        if request.session.testsfailed:
            for service in ("migrate", "web", "worker", "proxy", "pgbouncer"):
                for container in stack.containers(service):
                    print(f"--- {container} ({stack.image_of(container)})\n{stack.logs(container)[-6000:]}")
        stack.down()
