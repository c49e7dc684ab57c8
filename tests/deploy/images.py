"""The images of tests/deploy's stack, built here where no registry is reachable: base images from Debian's
packages (mmdebstrap, imported into Podman, cached by their recipe), then the console's image from the
Dockerfile on that base, release 1 and release 2 (release 1 plus a migration that adds a column)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
# The machine's own certificate authorities (an egress proxy's, here): pip and apt inside a build trust them.
LOCAL_CAS = Path("/usr/local/share/ca-certificates")

# What the Dockerfile's BASE_IMAGE must have (python:3.12-slim's part of it): Python >= 3.12 with venv. Debian
# bookworm has 3.11; trixie has 3.13, which the project runs on (the image's build checks it).
APP_BASE = ("trixie", ["python3", "python3-venv", "ca-certificates"])
# The stand-ins for the official postgres:15 and haproxy images, and PgBouncer's base (deploy/pgbouncer).
SERVICES_BASE = ("bookworm", ["postgresql-15", "pgbouncer", "haproxy", "ca-certificates"])


def podman(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True, **kwargs)


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], capture_output=True).returncode == 0


def _local_cas() -> list[Path]:
    return sorted(LOCAL_CAS.glob("*.crt")) if LOCAL_CAS.is_dir() else []


def base_image(recipe: tuple[str, list[str]], name: str) -> str:
    """A minimal Debian `suite` with `packages`, tagged by its recipe: built once per machine (about 20 s)."""
    suite, packages = recipe
    digest = hashlib.sha256(repr((suite, packages, MIRROR)).encode())
    for ca in _local_cas():
        digest.update(ca.read_bytes())
    tag = f"localhost/hitl-deploy-{name}:{suite}-{digest.hexdigest()[:12]}"
    if image_exists(tag):
        return tag
    hooks = []
    if _local_cas():
        hooks = [
            f"--customize-hook=copy-in {LOCAL_CAS} /usr/local/share",
            '--customize-hook=chroot "$1" update-ca-certificates',
        ]
    with tempfile.TemporaryDirectory() as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(packages), *hooks, suite, str(tarball), MIRROR],
            check=True,
            capture_output=True,
            text=True,
        )
        podman("import", str(tarball), tag)
    return tag


def build(tag: str, context: Path, **args: str) -> str:
    command = ["build", "--format", "docker", "--tag", tag]  # docker format: OCI images drop HEALTHCHECK
    for name, value in args.items():
        command += ["--build-arg", f"{name}={value}"]
    podman(*command, str(context))
    return tag


def release_2(release_1: str, tag: str) -> str:
    """Release 1 plus a migration that adds a nullable column to the runs' table (expand: release 1's code, still
    running during the roll, neither reads nor minds it)."""
    latest = sorted(p.stem for p in (ROOT / "runs" / "migrations").glob("0*.py"))[-1]
    migration = textwrap.dedent(
        f'''
        from django.db import migrations


        class Migration(migrations.Migration):
            dependencies = [("runs", "{latest}")]
            operations = [
                migrations.RunSQL(
                    "ALTER TABLE runs_run ADD COLUMN deploy_release text NULL",
                    reverse_sql="ALTER TABLE runs_run DROP COLUMN deploy_release",
                )
            ]
        '''
    )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "0999_deploy_release.py").write_text(migration)
        (Path(tmp) / "Dockerfile").write_text(
            f"FROM {release_1}\n"
            "COPY 0999_deploy_release.py /app/runs/migrations/\n"
            'LABEL org.opencontainers.image.version="release-2"\n'
        )
        return build(tag, Path(tmp))


def images() -> dict[str, str]:
    """Every image the stack needs, by compose.yaml's variable."""
    app_base = base_image(APP_BASE, "app-base")
    services = base_image(SERVICES_BASE, "services")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    release_1 = build("localhost/hitl-console:deploy-1", ROOT, BASE_IMAGE=app_base, VCS_REF=commit or "unknown")
    return {
        "APP_IMAGE": release_1,
        "RELEASE_2": release_2(release_1, "localhost/hitl-console:deploy-2"),
        "POSTGRES_IMAGE": build("localhost/hitl-deploy-postgres:15", HERE / "postgres", BASE_IMAGE=services),
        "PGBOUNCER_IMAGE": build(
            "localhost/hitl-console-pgbouncer:deploy", ROOT / "deploy" / "pgbouncer", BASE_IMAGE=services
        ),
        "PROXY_IMAGE": services,
    }
