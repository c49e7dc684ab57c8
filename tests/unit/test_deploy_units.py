"""deploy/systemd's units say what the image says, and give a stopping process the time it needs.

A worker on SIGTERM finishes its running steps within WORKER_SHUTDOWN_GRACEFUL_TIMEOUT; a supervisor that stops
waiting sooner SIGKILLs it mid-drain, and its steps wait STALLED_AFTER_SECONDS for another worker's sweep. So the
worker unit's TimeoutStopSec is that grace period (console/settings.py's default, or the unit's own Environment=)
plus a margin. The web server waits out its longest request, an approval-request long-poll (external/api.py,
MAX_WAIT). The commands are the image's (Dockerfile). The values are read from the sources, never copied here.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
MARGIN_SECONDS = 10  # the process's exit and its connections' closing, after the last step ends


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values, in order]}}: systemd repeats keys (Environment=, After=), which configparser
    would merge or refuse. Comments, blank lines and backslash continuations as systemd reads them."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert values, f"[{section}] {key}= is missing"
    return values[-1]  # systemd: the last assignment wins


def seconds(value: str) -> float:
    """A systemd time span as these units write it: 30, 30s, 1min 10s, infinity."""
    if value == "infinity":
        return float("inf")
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def environment(unit: dict) -> dict[str, str]:
    pairs = [shlex.split(value) for value in unit["Service"].get("Environment", [])]
    return dict(pair.split("=", 1) for group in pairs for pair in group)


def command(unit: dict) -> list[str]:
    return shlex.split(one(unit, "Service", "ExecStart"))


def settings_default(variable: str) -> float:
    """The default console/settings.py gives `variable` in its env_float/env_int call."""
    tree = ast.parse((ROOT / "console" / "settings.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("env_float", "env_int")
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == variable
        ):
            return float(ast.literal_eval(node.args[1]))
    raise AssertionError(f"console/settings.py does not read {variable} with a default")


def module_constant(path: str, name: str) -> float:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return float(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no {name}")


def image_command() -> list[str]:
    cmd = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(encoding="utf-8"), re.MULTILINE)
    assert cmd, "Dockerfile has no CMD [...]"
    return json.loads(cmd.group(1))


def web() -> dict:
    return parse_unit(UNITS / "hitl-console-web.service")


def worker() -> dict:
    return parse_unit(UNITS / "hitl-console-worker@.service")


def migrate() -> dict:
    return parse_unit(UNITS / "hitl-console-migrate.service")


def test_the_worker_outlasts_its_grace_period():
    unit = worker()
    grace = float(environment(unit).get("WORKER_SHUTDOWN_GRACEFUL_TIMEOUT", 0)) or settings_default(
        "WORKER_SHUTDOWN_GRACEFUL_TIMEOUT"
    )
    assert seconds(one(unit, "Service", "TimeoutStopSec")) >= grace + MARGIN_SECONDS


def test_the_web_server_outlasts_its_longest_request():
    longest = module_constant("external/api.py", "MAX_WAIT")
    assert seconds(one(web(), "Service", "TimeoutStopSec")) >= longest + MARGIN_SECONDS


def test_sigterm_goes_to_the_main_process_and_sigkill_to_the_group_at_the_timeout():
    for unit in (web(), worker()):
        assert one(unit, "Service", "KillSignal") == "SIGTERM"
        assert one(unit, "Service", "KillMode") == "mixed"
        assert one(unit, "Service", "Restart") in ("always", "on-failure")


def test_the_commands_are_the_images():
    image = image_command()  # python -m console.webserver --host ... --workers 2
    assert image[:3] == ["python", "-m", "console.webserver"]
    web_cmd, worker_cmd, migrate_cmd = command(web()), command(worker()), command(migrate())
    for cmd, unit in ((web_cmd, web()), (worker_cmd, worker()), (migrate_cmd, migrate())):
        # The virtualenv's python, in the install directory the process runs in.
        directory = one(unit, "Service", "WorkingDirectory")
        assert cmd[0].startswith(directory + "/") and cmd[0].endswith("/bin/python"), cmd
    assert web_cmd[1:3] == image[1:3]
    assert "--host" in web_cmd and "--port" in web_cmd
    assert worker_cmd[1:] == ["manage.py", "worker"]
    assert migrate_cmd[1:] == ["manage.py", "migrate", "--noinput"]


def test_migrations_run_once_before_the_processes():
    unit = migrate()
    assert one(unit, "Service", "Type") == "oneshot"
    assert one(unit, "Service", "RemainAfterExit") == "yes"  # a restart of a process does not migrate again
    assert "Install" not in unit  # pulled in by the others, run by hand per release: never enabled on its own
    for other in (web(), worker()):
        after = " ".join(other["Unit"].get("After", [])).split()
        wants = " ".join(other["Unit"].get("Wants", [])).split()
        assert "hitl-console-migrate.service" in after and "hitl-console-migrate.service" in wants
        # Requires= would restart every process at once when a release restarts the migration.
        assert "Requires" not in other["Unit"]


def test_every_unit_runs_confined_with_the_same_settings():
    for unit in (web(), worker(), migrate()):
        service = unit["Service"]
        assert one(unit, "Service", "EnvironmentFile") == "/etc/hitl-console/env"  # required: no "-"
        assert one(unit, "Service", "User") not in ("", "root", "0")
        assert environment(unit).get("CONSOLE_ENV") == "production"
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
        }.items():
            assert service.get(key, [None])[-1] == value, key
        assert "ReadWritePaths" not in service  # the app writes nowhere but its private /tmp


def test_the_parser_reads_what_systemd_reads(tmp_path):
    unit = tmp_path / "x.service"
    unit.write_text("# c\n[Service]\nEnvironment=A=1 'B=two words'\nEnvironment=C=3\nExecStart=/bin/x \\\n  -y\n")
    parsed = parse_unit(unit)
    assert environment(parsed) == {"A": "1", "B": "two words", "C": "3"}
    assert command(parsed) == ["/bin/x", "-y"]
    assert seconds("1min 10s") == 70 and seconds("30") == 30


# --- docs/deploy.md, "On Kubernetes (on paper)": its manifests parse, and give the same times -----------------------


def manifests() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    assert blocks, "docs/deploy.md has no ```yaml block"
    documents = [doc for block in blocks for doc in yaml.safe_load_all(block)]
    for doc in documents:
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), doc
    return documents


def pod_spec(name: str) -> dict:
    (deployment,) = [d for d in manifests() if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]


def test_the_kubernetes_manifests_give_a_stopping_pod_the_time_it_needs():
    worker_grace = settings_default("WORKER_SHUTDOWN_GRACEFUL_TIMEOUT")
    assert pod_spec("hitl-console-worker")["terminationGracePeriodSeconds"] >= worker_grace + MARGIN_SECONDS
    web = pod_spec("hitl-console-web")
    (container,) = web["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    longest = module_constant("external/api.py", "MAX_WAIT")
    assert web["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + longest + MARGIN_SECONDS


def test_the_kubernetes_manifests_probe_and_run_what_the_image_runs():
    (web,) = pod_spec("hitl-console-web")["containers"]
    assert "command" not in web  # the image's CMD, python -m console.webserver
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (worker,) = pod_spec("hitl-console-worker")["containers"]
    assert worker["command"] == ["python", "manage.py", "worker"]
    assert worker["livenessProbe"]["exec"]["command"] == ["python", "-m", "jobs.healthcheck"]
    (job,) = [d for d in manifests() if d["kind"] == "Job"]
    (migrate_container,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate_container["command"] == ["python", "manage.py", "migrate", "--noinput"]
    budgets = {d["metadata"]["name"]: d["spec"] for d in manifests() if d["kind"] == "PodDisruptionBudget"}
    assert budgets.keys() == {"hitl-console-web", "hitl-console-worker"}
