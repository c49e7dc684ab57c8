"""The web server's health command, as a container runs it: `python -m console.healthcheck [--port 8000]`.

Asks this machine's web server for /healthz (liveness: the process answers; answered whatever Host a probe names,
console.middleware.CommonMiddleware) and exits 0 when it answers 200, 1 otherwise, saying why. Standard library
only: it starts no Django. The worker's twin is `python -m jobs.healthcheck` (its heartbeat file)."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=4)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError as error:
        print(f"{url}: no answer ({error})", file=sys.stderr)
        return 1
    if status != 200:
        print(f"{url}: HTTP {status}", file=sys.stderr)
        return 1
    print(f"{url}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
