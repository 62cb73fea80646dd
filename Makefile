# Two entry points for a new user; both set up .venv themselves (Java 17+ must be installed).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: quickstart example-state example-declared lint test soak bench docs dist clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

quickstart: $(VENV)/.installed
	$(PY) examples/quickstart.py

example-state: $(VENV)/.installed
	$(PY) examples/keyed_state_stream.py

example-declared: $(VENV)/.installed
	$(PY) examples/declared_states.py

lint: $(VENV)/.installed
	$(PY) -m ruff check --no-cache .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -ra -m "not soak" --durations=15

soak: $(VENV)/.installed
	$(PY) -m pytest -q -ra -m soak -s

bench: $(VENV)/.installed
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

docs: $(VENV)/.installed
	$(PY) -m sparksteward.config .

# dist/spark_steward-<version>.tar.gz and the wheel built from it (pip install dist/*.whl)
dist: $(VENV)/.installed
	rm -rf dist build
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) build dist *.egg-info python/*.egg-info jvm-shim/out jvm-shim/build
