# `make demo` runs the main job, `make test` runs every test (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast mutations bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch; any other version pulls several GB of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,tf,demo,onnx]"
	# transformers' own common model tests, from its source distribution on PyPI (not copied into the repo).
	$(PY) tests/fetch_transformers_tests.py
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nezha-hf demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# Plants each bug of tests/mutations/mutations.py in a copy of the repo and checks a test catches it (long; not in `test`).
mutations: $(STAMP)
	$(PY) tests/mutations/run.py

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info
