# Two entry points for a new user; both set up .venv themselves (Java 17+ must be installed).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The pyspark major.minor versions we test, oldest first, read from their one place,
# sparksteward.config.TESTED_SPARK_VERSIONS: .venv gets the newest, `make compat` one .venv-X.Y each of the others.
TESTED_SPARK := $(shell sed -n 's/^TESTED_SPARK_VERSIONS[^=]*= *(\(.*\))$$/\1/p' python/sparksteward/config.py | tr -d "\"',")
NEWEST_SPARK := $(lastword $(TESTED_SPARK))
COMPAT_SPARK := $(filter-out $(NEWEST_SPARK),$(TESTED_SPARK))
ifeq ($(NEWEST_SPARK),)
$(error no TESTED_SPARK_VERSIONS = (...) line in python/sparksteward/config.py)
endif

.PHONY: bench-tests quickstart example-state example-declared example-sessions example-connect lint test soak compat bench docs dist clean
.PRECIOUS: .venv-%/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' 'pyspark==$(NEWEST_SPARK).*'
	touch $@

# .venv-4.0, .venv-4.1, ...: the same install on an older pyspark, for `make compat`. The dependencies that fit
# come from .venv: a .pth line adds its site-packages folder after the venv's own (without running the .pth
# files in it), so pip installs only pyspark X.Y, what it needs that differs, and the checkout (pip leaves
# what lies outside the venv alone); that saves unpacking the test extras again (about 1 minute a venv)
.venv-%/.installed: setup.cfg pyproject.toml $(VENV)/.installed
	$(PYTHON) -m venv .venv-$*
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	    "$$(.venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/steward-deps.pth"
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -e '.[test]' 'pyspark==$*.*'
	touch $@

quickstart: $(VENV)/.installed
	$(PY) examples/quickstart.py

example-state: $(VENV)/.installed
	$(PY) examples/keyed_state_stream.py

example-declared: $(VENV)/.installed
	$(PY) examples/declared_states.py

example-sessions: $(VENV)/.installed
	$(PY) examples/sessions.py

example-connect: $(VENV)/.installed
	$(PY) examples/connect.py

lint: $(VENV)/.installed
	$(PY) -m ruff check --no-cache .
	$(PY) -m mypy

# the suite in two processes (pytest-xdist), each taking whole modules: a module's tests share its fixtures
# and Spark session, and the machine's 2 cores idle while one process waits on Spark, S3 or a kill
test: lint
	$(PY) -m pytest -q -ra -m "not soak and not bench" -n 2 --dist loadfile --durations=40

# the soak in two processes too, but the tests that measure time or race (marked timing) after the rest, alone
soak: $(VENV)/.installed
	$(PY) -m pytest -q -ra -m "soak and not timing" -n 2 --dist loadfile --durations=25
	$(PY) -m pytest -q -ra -m "soak and timing" -s --durations=10

# the benchmarks run small as tests (marked bench), alone: each shows its table; CI leaves them out
bench-tests: $(VENV)/.installed
	$(PY) -m pytest -q -ra -m bench -s --durations=5

# the compat set (the tests marked compat) on each older tested pyspark; `make compat-4.0` runs one. The
# versions run side by side (each its own venv, Spark applications, ports and pytest tmp dir), their output
# kept apart (-Otarget). All at once (-j3 on two cores): run two then the third, one core idled for the
# third's two minutes, and .ci/run (limit 45 minutes) took 47
compat:
	$(MAKE) -j3 -Otarget $(COMPAT_SPARK:%=compat-%)

compat-%: .venv-%/.installed
	@.venv-$*/bin/python -c 'import pyspark; print("compat: pyspark", pyspark.__version__)'
	.venv-$*/bin/python -m pytest -q -ra -m compat --durations=10

bench: $(VENV)/.installed
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

docs: $(VENV)/.installed
	$(PY) -m sparksteward.config .
	$(PY) -m sparksteward.ops .

# dist/spark_steward-<version>.tar.gz and the wheel built from it (pip install dist/*.whl)
dist: $(VENV)/.installed
	rm -rf dist build
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) .venv-* build dist *.egg-info python/*.egg-info jvm-shim/out jvm-shim/build
