# Two entry points, each creating .venv on first use:
#   make demo   install the engine and generate with it
#   make test   install the engine with its test extra and run the whole suite
# and, for contributors and CI, `make lint` (ruff and mypy, from the same test extra).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint

$(VENV)/.engine: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.engine
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.engine
	$(VENV)/bin/compiled-mtp demo

test: $(VENV)/.test
	$(PY) -m pytest tests

lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
