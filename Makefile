# The two commands of the README: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
ASSETS_STAMP := node_modules/.installed

.PHONY: run test test-fast browser wrk lint format install clean bench bench-smoke

install: $(VENV_STAMP) $(ASSETS_STAMP)

$(VENV_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "Python >= 3.12 is needed (see .python-version); found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '.[dev]'
	@touch $@

$(ASSETS_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	@touch $@

run: install
	$(PY) manage.py serve

# Browser tests drive Debian's Chromium through Playwright (tests/conftest.py). Installed here when missing and
# we are root with apt (a fresh CI machine or container); otherwise one message says what to do.
CHROMIUM ?= /usr/bin/chromium

browser:
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Debian's chromium for the browser tests (apt-get install chromium)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi; \
	if [ ! -x "$(CHROMIUM)" ]; then \
		echo "The browser tests need Chromium at $(CHROMIUM) and it is not there. Install it as root" \
			"(Debian/Ubuntu: 'sudo apt-get install chromium') and run 'make test' again," \
			"or run 'make test-fast', which skips the browser and other slow tests." >&2; \
		exit 1; \
	fi

# The whole suite, slow system and browser tests included. `make test-fast` skips those.
test: install browser
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m 'not slow' $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) node_modules staticfiles

# Benchmarks (not part of the test suite): every figure of docs/BENCHMARKS.md, each against a baseline measured in
# the same run, on the production server; rewrites docs/BENCHMARKS.md. `make bench-smoke` (CI): tiny sizes, writes
# nothing, so the benchmarks cannot rot. BENCH_SMOKE=1 make bench is the same.
# The load generator of the enqueue and webhook benchmarks: Debian's wrk, installed here like Chromium above.
WRK ?= /usr/bin/wrk

wrk:
	@if [ -x "$(WRK)" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Debian's wrk for the benchmarks (apt-get install wrk)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	fi; \
	if [ ! -x "$(WRK)" ]; then \
		echo "The benchmarks need wrk at $(WRK) and it is not there. Install it as root" \
			"(Debian/Ubuntu: 'sudo apt-get install wrk') and run the benchmarks again." >&2; \
		exit 1; \
	fi

bench: install wrk
	$(PY) manage.py collectstatic --noinput -v0
	$(PY) bench/run_all.py

bench-smoke: install wrk
	$(PY) manage.py collectstatic --noinput -v0
	BENCH_SMOKE=1 $(PY) bench/run_all.py
