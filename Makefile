# The two commands of the README: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
ASSETS_STAMP := node_modules/.installed

.PHONY: run test test-fast lint format install clean

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

# The whole suite, slow system tests included. `make test-fast` skips those.
test: install
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
