# The two commands of the README: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
ASSETS_STAMP := node_modules/.installed

.PHONY: run test test-fast test-unit test-client-matrix test-deploy containers browser pgbouncer wrk lint format install clean bench bench-smoke

install: $(VENV_STAMP) $(ASSETS_STAMP)

# The Python client (clients/python) is installed editable beside the server: its tests run in the same suite, and
# its `test` extra brings the agent frameworks its adapters' tests drive.
$(VENV_STAMP): pyproject.toml clients/python/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "Python >= 3.12 is needed (see .python-version); found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '.[dev,embedded]'
	$(PY) -m pip install --quiet -e 'clients/python[test]'
	@touch $@

$(ASSETS_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	@touch $@

run: install
	$(PY) manage.py serve

# A program from a Debian package, installed when missing and we are root with apt (a fresh CI machine or a
# container); otherwise one message says what to do. $(1): its path, $(2): the package, $(3): who needs it, $(4):
# what to do once it is installed.
define debian_program
	@if [ -x "$(1)" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Debian's $(2), which $(3) need (apt-get install $(2))"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	fi; \
	if [ ! -x "$(1)" ]; then \
		echo "$(2) is not at $(1), and $(3) need it. Install it as root" \
			"(Debian/Ubuntu: 'sudo apt-get install $(2)') and $(4)" >&2; \
		exit 1; \
	fi
endef

# Browser tests drive Debian's Chromium through Playwright (tests/conftest.py).
CHROMIUM ?= /usr/bin/chromium
SLOW_TESTS_AFTER := run 'make test' again, or run 'make test-fast', which skips the browser and other slow tests.

browser:
	$(call debian_program,$(CHROMIUM),chromium,the browser tests,$(SLOW_TESTS_AFTER))

# The PgBouncer system test (tests/system/test_pgbouncer.py) starts Debian's pgbouncer on a port and ini of its own
# (the Debian service is not used): 16 workers through a session pool, one refused behind a transaction pool.
PGBOUNCER ?= /usr/sbin/pgbouncer

pgbouncer:
	$(call debian_program,$(PGBOUNCER),pgbouncer,the PgBouncer system tests,$(SLOW_TESTS_AFTER))

# The deploy tests (tests/deploy) run Debian's Podman: runc (crun is refused in this machine kind's sandbox),
# netavark and aardvark-dns (the compose network and its names), and mmdebstrap (the base images, built from
# Debian's packages where no image registry is reachable).
CONTAINER_PACKAGES := podman runc netavark aardvark-dns iptables nftables catatonit uidmap slirp4netns fuse-overlayfs mmdebstrap
DEPLOY_TESTS_AFTER := run 'make test-deploy' again.

containers:
	$(call debian_program,/usr/bin/podman,$(CONTAINER_PACKAGES),the deploy tests,$(DEPLOY_TESTS_AFTER))
	$(call debian_program,/usr/sbin/runc,$(CONTAINER_PACKAGES),the deploy tests,$(DEPLOY_TESTS_AFTER))
	$(call debian_program,/usr/bin/mmdebstrap,$(CONTAINER_PACKAGES),the deploy tests,$(DEPLOY_TESTS_AFTER))

# compose.yaml's stack, built from the Dockerfile and started by podman-compose, under load while a new release
# rolls out (deploy/rollout.sh), and a worker container SIGKILLed mid-payment (tests/deploy; docs/RELIABILITY.md).
# No database of the suite's own: the tests talk to the stack's.
test-deploy: install containers
	DEPLOY_TESTS=1 DATABASE_URL=postgres://no-database-in-the-deploy-tests@127.0.0.1:1/none \
		$(PY) -m pytest tests/deploy -p no:cacheprovider -s $(PYTEST_ARGS)

# The whole suite, slow system and browser tests included. `make test-fast` skips those.
test: install browser pgbouncer
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast suite (unit and integration: in-process, against the database) on every core, each pytest-xdist worker
# with a test database of its own. The unit tier alone (no database: the rules, the client) is `make test-unit`.
test-fast: install
	$(PY) -m pytest -m 'not slow' -n auto $(PYTEST_ARGS)

# No database at all: the URL names a server that is not there (port 1), so the embedded one is not started, and a
# unit test that connects fails with this URL's name in the error.
test-unit: install
	DATABASE_URL=postgres://no-database-in-the-unit-tier@127.0.0.1:1/none $(PY) -m pytest tests/unit clients/python/tests $(PYTEST_ARGS)

# The Python client's own tests (clients/python/tests: a fake console, no server) against both ends of its
# frameworks' ranges (its extras): each in a throwaway venv built from a constraints file, the frameworks at their
# oldest (clients/python/constraints-oldest.txt) and at their newest (-newest.txt). `make test` runs the same tests
# against the dev venv's pins (the `test` extra).
CLIENT_MATRIX := oldest newest

test-client-matrix: $(CLIENT_MATRIX:%=.venv-client-%/.installed)
	@for end in $(CLIENT_MATRIX); do \
		echo "The Python client's tests, its frameworks at their $$end:"; \
		(cd clients/python && ../../.venv-client-$$end/bin/python -m pytest -q -p no:cacheprovider) || exit 1; \
	done

.venv-client-%/.installed: clients/python/constraints-%.txt clients/python/pyproject.toml
	rm -rf .venv-client-$*
	$(PYTHON) -m venv .venv-client-$*
	.venv-client-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-client-$*/bin/python -m pip install --quiet -c $< 'clients/python[openai-agents,langgraph,pydantic-ai,mcp,otel]' opentelemetry-sdk pytest
	@touch $@

# ruff (style, and imports at the top: PLC0415), then import-linter: the floors of pyproject.toml's
# [tool.importlinter] (console on top, core at the bottom, the engine's floors inside runs, no circle in an app,
# nothing below the views importing django.http or ninja); then mypy --strict on the Python client's source; then
# the migrations newer than its baseline against the expand/contract rule of a rolling deploy (docs/deploy.md).
# lint_migrations reads the migration files, no database: the URL names none (port 1), as the unit tier's does, so
# the settings start no embedded one; LOG_LEVEL hides the workers' periodic tasks registering at start-up.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	cd clients/python && ../../$(VENV)/bin/mypy
	DATABASE_URL=postgres://no-database-in-lint@127.0.0.1:1/none LOG_LEVEL=WARNING $(PY) manage.py lint_migrations

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .venv-client-oldest .venv-client-newest .bench-peers-venv node_modules staticfiles

# Benchmarks (not part of the test suite): every figure of docs/BENCHMARKS.md, each against a baseline measured in
# the same run, on the production server; rewrites docs/BENCHMARKS.md. `make bench-smoke` (CI): tiny sizes, writes
# nothing, so the benchmarks cannot rot. BENCH_SMOKE=1 make bench is the same. The peers section (bench/peers.py:
# DBOS and LangGraph on the same workload) installs them into a virtualenv of its own, .bench-peers-venv, and is
# left out of bench-smoke.
# The load generator of the enqueue and webhook benchmarks: Debian's wrk.
WRK ?= /usr/bin/wrk

wrk:
	$(call debian_program,$(WRK),wrk,the benchmarks,run the benchmarks again.)

bench: install wrk
	$(PY) manage.py collectstatic --noinput -v0
	$(PY) bench/run_all.py

bench-smoke: install wrk
	$(PY) manage.py collectstatic --noinput -v0
	BENCH_SMOKE=1 $(PY) bench/run_all.py
