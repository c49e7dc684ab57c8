"""Installs the front-end packages of package-lock.json into node_modules/ without Node.js: each package's tarball
from the npm registry, checked against the lockfile's integrity hash before anything of it is written.

The image's build stage runs it (Dockerfile): `collectstatic` copies htmx from node_modules/, and the build
image needs no Node.js for one file. On a checkout `npm ci` does the same (make install).

    python deploy/assets.py [--registry URL] [--into DIR]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install(registry: str, into: Path) -> list[str]:
    lock = json.loads((ROOT / "package-lock.json").read_text())
    done = []
    for path, package in lock["packages"].items():
        if not path.startswith("node_modules/"):
            continue
        name = path.removeprefix("node_modules/")
        tarball = f"{registry.rstrip('/')}/{name}/-/{name.rsplit('/', 1)[-1]}-{package['version']}.tgz"
        with urllib.request.urlopen(tarball, timeout=60) as response:
            data = response.read()
        algorithm, expected = package["integrity"].split("-", 1)
        if base64.b64encode(hashlib.new(algorithm, data).digest()).decode() != expected:
            raise SystemExit(f"{tarball}: its {algorithm} is not the one package-lock.json records; nothing written")
        target = into / name
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            # npm's tarballs hold one folder, `package/`: its contents are the package's.
            for member in archive.getmembers():
                member.name = member.name.split("/", 1)[-1]
            archive.extractall(target, filter="data")
        done.append(f"{name}@{package['version']}")
    return done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="https://registry.npmjs.org")
    parser.add_argument("--into", type=Path, default=ROOT / "node_modules")
    args = parser.parse_args(argv)
    for installed in install(args.registry, args.into):
        print(f"installed {installed}", file=sys.stderr)


if __name__ == "__main__":
    main()
