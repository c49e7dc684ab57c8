"""compose.yaml, started by podman-compose as a user would start it, and what the deploy tests do to it: the
console's API through HAProxy, management commands in its containers, SQL in its PostgreSQL, its containers by
service, and deploy/rollout.sh."""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.images import HERE, ROOT

PODMAN_COMPOSE = str(Path(sys.executable).with_name("podman-compose"))


@dataclass
class Answer:
    status: int  # 0: no HTTP answer at all (connection refused, reset, timed out)
    body: dict | list | None
    at: float
    what: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    images: dict[str, str]
    workdir: Path
    project: str = field(default_factory=lambda: "hitldeploy" + secrets.token_hex(3))
    port: int = field(default_factory=free_port)
    answers: list[Answer] = field(default_factory=list)  # every API call the tests made, in order

    def __post_init__(self) -> None:
        settings = {
            "APP_IMAGE": self.images["APP_IMAGE"],
            "POSTGRES_IMAGE": self.images["POSTGRES_IMAGE"],
            "PGBOUNCER_IMAGE": self.images["PGBOUNCER_IMAGE"],
            "PROXY_IMAGE": self.images["PROXY_IMAGE"],
            "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
            "SECRET_KEY": secrets.token_urlsafe(50),
            "CONSOLE_PORT": str(self.port),
            "WEB_PROCESSES": "1",  # two replicas of one process each on two cores
            "CONSOLE_ENV": "production",
            "SECURE_SSL_REDIRECT": "0",
            "SESSION_COOKIE_SECURE": "0",
            "DEMO_ENABLED": "1",
            "DEMO_PASSWORD": secrets.token_urlsafe(12),
            # The demo marks personal data (the customer's name and email): outside development it needs a key.
            "PII_KEYS": base64.b64encode(secrets.token_bytes(32)).decode(),
            # The production shape, with the demo's slow steps (`latency:` faults) honoured.
            "DEMO_FAULTS_ENABLED": "1",
            # Shorter than the defaults, so a case takes minutes: a worker waits 5 s for its steps on SIGTERM
            # (payments here take 2 to 20 s: most of those in flight outlive it and are recovered), its container
            # 15 s (the timeout plus the margin, as compose.yaml's).
            "WORKER_SHUTDOWN_GRACEFUL_TIMEOUT": "5",
            "WORKER_STOP_GRACE_PERIOD": "15s",
            "WORKER_CONCURRENCY": "4",
            "STALLED_AFTER_SECONDS": "15",
        }
        self.settings = settings
        self.env_file = self.workdir / "stack.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(HERE / "containers.conf"),
            "CONSOLE_ENV_FILE": str(self.env_file),
            "COMPOSE_PROJECT_NAME": self.project,
        }
        self.tokens: dict[str, str] = {}

    # --- the tools ----------------------------------------------------------------------------------------------

    def compose_command(self) -> list[str]:
        return [PODMAN_COMPOSE, "--env-file", str(self.env_file), "-p", self.project, "-f", str(ROOT / "compose.yaml")]

    def compose(self, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.compose_command(), *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )

    def podman(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def containers(self, service: str) -> list[str]:
        out = self.podman(
            "ps",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--format",
            "{{.Names}}",
        ).stdout
        return sorted(out.split())

    def image_of(self, container: str) -> str:
        return self.podman("inspect", "--format", "{{.ImageName}}", container).stdout.strip()

    def manage(self, *args: str, service: str = "worker") -> str:
        """`manage.py ARGS` in a running container of `service`: its stdout."""
        container = self.containers(service)[0]
        done = self.podman("exec", container, "python", "manage.py", *args, timeout=120, check=False)
        assert done.returncode == 0, f"manage.py {' '.join(args)} in {container}: exit {done.returncode}\n{done.stderr}"
        return done.stdout

    def migrated(self) -> bool:
        """The one-shot `migrate` container has exited 0: the migrations and the demo's users are there (the web
        and the workers wait for the migrations only, and may be ready before `demo_setup` has run)."""
        names = self.podman(
            "ps",
            "--all",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            "label=com.docker.compose.service=migrate",
            "--format",
            "{{.Names}}",
        ).stdout.split()
        if not names:
            return False
        state = self.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", names[0]).stdout.split()
        if state[0] == "exited" and state[1] != "0":
            raise AssertionError(f"the migrate container failed (exit {state[1]}):\n{self.logs(names[0])[-3000:]}")
        return state == ["exited", "0"]

    def sql(self, query: str) -> str:
        (container,) = self.containers("postgres")
        return self.podman("exec", container, "psql", "-U", "console", "-d", "console", "-tAc", query).stdout.strip()

    def logs(self, container: str) -> str:
        done = self.podman("logs", container, check=False)
        return done.stdout + done.stderr

    # --- the stack's life ---------------------------------------------------------------------------------------

    def up(self) -> None:
        self.compose("up", "-d")
        self.wait(self.migrated, "the migrations and the demo's setup done", 240)
        self.wait(lambda: self.call("GET", "/readyz", record=False).status == 200, "the console ready", 240)
        for user in ("admin", "reviewer"):
            self.tokens[user] = self.manage("create_api_token", user, service="web").strip()

    def down(self) -> None:
        subprocess.run([*self.compose_command(), "down", "-v", "-t", "0"], cwd=ROOT, env=self.env, capture_output=True)
        # The layers that each run's build left untagged: the machine keeps the tagged images (the cache), not these.
        self.podman("image", "prune", "--force", check=False)

    def rollout(self, image: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(ROOT / "deploy" / "rollout.sh")],
            cwd=ROOT,
            env={
                **self.env,
                "APP_IMAGE": image,
                "COMPOSE": " ".join(self.compose_command()),
                "ENGINE": "podman",
                "WORKER_STOP_GRACE_PERIOD": self.settings["WORKER_STOP_GRACE_PERIOD"],
            },
            capture_output=True,
            text=True,
            timeout=600,
        )

    # --- the API ------------------------------------------------------------------------------------------------

    def call(self, method: str, path: str, body: dict | None = None, *, user: str = "admin", record=True) -> Answer:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if user in self.tokens:
            request.add_header("Authorization", f"Bearer {self.tokens[user]}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = Answer(response.status, json.loads(response.read() or b"null"), time.time(), path)
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = {"raw": raw[:300].decode(errors="replace")}
            answer = Answer(error.code, parsed, time.time(), path)
        except (OSError, urllib.error.URLError) as error:
            answer = Answer(0, {"error": repr(error)}, time.time(), path)
        if record:
            self.answers.append(answer)
        return answer

    @staticmethod
    def wait(condition, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            found = condition()
            if found:
                return found
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(0.5)

    def sandbox(self) -> dict:
        return json.loads(self.manage("sandbox_stats"))
