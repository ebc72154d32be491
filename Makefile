# `make demo` runs the main job, `make test` runs every test (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The versions installed: those the whole suite last passed on (`make constraints` writes them), so that a new release
# of a dependency cannot change what CI tests between two commits. `make clean test CONSTRAINTS=` takes the newest.
CONSTRAINTS ?= .ci/constraints.txt
INSTALL := $(PY) -m pip install --quiet $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS))

.PHONY: demo test test-main test-fast test-pythons mutations bench bench-bfloat16 constraints clean gpu-prepare gpu-rehearse \
  gpu-gates

# The claimed ranges tested at both ends. The main environment (.venv) is the oldest Python and torch that
# pyproject.toml accepts (3.11, as transformers 5.21 and later need it; torch 2.13.0); `make test` also runs the fast
# test set on the newest Python with the newest torch release, in an environment of its own (.venv-3.13). There
# every version, torch's included, is the one `.ci/constraints-<version>.txt` records (`make constraints-<version>`
# writes it, after the tests passed), and nothing else caps it: PIP_CONSTRAINT names that file alone, so a pip
# configuration's own constraints (a machine may cap torch at the releases on its disk) cannot hold the leg below the
# release it records. `rm -r .venv-3.13; make test-pythons CONSTRAINTS=` takes the newest releases there. Its torch
# is PyPI's build, which brings CUDA libraries (about 5 GB installed; it runs on the CPU): the CPU-only builds are not
# on PyPI.
PYTHONS := 3.13
python_for = $(firstword $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)) python$(1))

# The environment: the CPU build of torch (any other version pulls several GB of CUDA packages).
$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# What the demo needs: the package, the BERT it converts, and ONNX export (the README's chain ends with it). An
# environment made for the tests since pyproject.toml and the constraints last changed has them all (the README's
# `make demo` test runs while the suite imports from it: no install there then).
$(VENV)/.demo: pyproject.toml $(CONSTRAINTS) $(VENV)/.torch
	test $(VENV)/.test -nt pyproject.toml -a $(VENV)/.test -nt $(or $(CONSTRAINTS),pyproject.toml) || \
	  $(INSTALL) -e ".[demo,onnx]"
	touch $@

# What the tests need: every extra, and transformers' own common model tests, from its source distribution on
# PyPI (not copied into the repo).
$(VENV)/.test: pyproject.toml $(CONSTRAINTS) $(VENV)/.torch
	$(INSTALL) -e ".[dev,tf,demo,onnx,triton]"
	$(PY) tests/fetch_transformers_tests.py
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/nezha-hf demo

# The environments' downloads and installs overlap (two at a time: the main one, and the other Pythons' torch); the
# editable installs, which write nezha_hf.egg-info here, do not; then the suites, one after the other.
test:
	$(MAKE) -j2 $(VENV)/.test $(PYTHONS:%=.venv-%/.torch)
	$(MAKE) test-main test-pythons

PYTEST = $(1) -m pytest -q -p no:cacheprovider
# Parallel runs use pytest-xdist workers of one thread each (OMP_NUM_THREADS=1): two workers with two-thread OpenMP
# teams would wait on each other's preempted threads on two cores.
XDIST_WORKERS ?= 2
PARALLEL = OMP_NUM_THREADS=1 $(call PYTEST,$(1)) -n $(XDIST_WORKERS)

# The main suite: the fast set one test at a time with PyTorch's threads, then the slow set (training runs, several
# processes, exports: mostly waiting on processes of their own) in parallel, a file's tests in one worker.
test-main: $(VENV)/.test
	$(call PYTEST,$(PY)) -m "not slow"
	$(call PARALLEL,$(PY)) -m slow --dist loadfile

# The file that alone constrains the environment of Python $(1); /dev/null for none.
leg_constraints = $(or $(if $(CONSTRAINTS),$(wildcard .ci/constraints-$(1).txt)),/dev/null)

.SECONDEXPANSION:
# torch first, on its own (most of the leg's 5 GB): `make test` installs it while the main environment is made.
.venv-%/.torch: $$(wildcard .ci/constraints-$$*.txt)
	test -x .venv-$*/bin/python || $(call python_for,$*) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	PIP_CONSTRAINT=$(call leg_constraints,$*) .venv-$*/bin/python -m pip install --quiet torch
	touch $@

.venv-%/.test: pyproject.toml $$(wildcard .ci/constraints-$$*.txt) .venv-%/.torch
	PIP_CONSTRAINT=$(call leg_constraints,$*) .venv-$*/bin/python -m pip install --quiet -e ".[dev,tf,demo,onnx,triton]"
	.venv-$*/bin/python tests/fetch_transformers_tests.py
	touch $@

# The other Pythons' fast set, in parallel (the main suite runs it with PyTorch's threads, one test at a time).
test-pythons: $(PYTHONS:%=.venv-%/.test)
	for version in $(PYTHONS); do \
	  echo "Python $$version: the fast test set"; \
	  $(call PARALLEL,.venv-$$version/bin/python) -m "not slow" || exit 1; \
	done

test-fast: $(VENV)/.test
	$(call PYTEST,$(PY)) -m "not slow"

# Plants each bug of tests/mutations/mutations.py in a copy of the repo and checks a test catches it (long; not in `test`).
mutations: $(VENV)/.test
	$(PY) tests/mutations/run.py

# Every file of benchmarks/results/, as docs/performance.md and docs/conversion.md quote them (about 50 minutes on 2
# cores). Each names the CPU it ran on and its matmul throughput, and the speed figures go to the folder of that kind
# of CPU (benchmarks/results/amx/, avx512-bf16/, ...); 2 layers of base width keep the long inputs affordable.
# Serving from onnxruntime: 12 layers to 2,048 tokens, 4 at 8,192 and 16,384 (NEZHA alone there: BERT's scores would
# not fit in 24 GiB), every run in a process of its own for its peak memory.
BENCH := $(PY) benchmarks/attention.py --layers 2
bench: $(VENV)/.test bench-bfloat16
	$(BENCH) --lengths 512 2048 8192 --eager-up-to 512 --memory-lengths 8192 --output attention
	$(BENCH) --attention nezha_chunked --lengths 2048 8192 --eager-up-to 0 --memory-lengths --output attention-chunked
	$(BENCH) --attention nezha_chunked --dtype bfloat16 --lengths 2048 8192 --eager-up-to 0 --memory-lengths \
	  --output attention-chunked-bfloat16
	$(BENCH) --attention nezha_three_regions --lengths 2048 8192 --eager-up-to 0 --memory-lengths \
	  --output attention-three-regions
	$(BENCH) --attention nezha_three_regions --dtype bfloat16 --lengths 2048 8192 --eager-up-to 0 --memory-lengths \
	  --output attention-three-regions-bfloat16
	$(BENCH) --dropout 0.1 --lengths 2048 4096 --eager-up-to 0 --memory-lengths 4096 --output attention-dropout
	MALLOC_MMAP_THRESHOLD_=1048576 $(BENCH) --lengths --no-train --memory-lengths 8192 --output attention-memory-mmap
	$(BENCH) --lengths --no-train --memory-lengths 8192 --memory-runs 1 --memory-method tensors \
	  --output attention-memory-tensors
	MALLOC_MMAP_THRESHOLD_=1048576 $(BENCH) --attention nezha_chunked --lengths --memory-lengths 8192 \
	  --output attention-chunked-memory
	$(BENCH) --attention nezha_chunked --lengths --memory-lengths 8192 --memory-runs 1 --memory-method tensors \
	  --output attention-chunked-tensors
	$(PY) benchmarks/generate.py --layers 2 --new-tokens 64
	$(PY) benchmarks/serving.py --repeats 3 --output serving
	$(PY) benchmarks/serving.py --summarizer
	$(PY) benchmarks/long_inputs.py --pretrain-steps 100
	-$(PY) benchmarks/kernel_profile.py --dtype float32 --lengths 512 2048 8192

# The bfloat16 rows alone (about 15 minutes on 2 quiet cores): the kernel's split against SDPA's, the model against
# BERT-SDPA, training with dropout.
bench-bfloat16: $(VENV)/.test
	-$(PY) benchmarks/kernel_profile.py --dtype bfloat16 --lengths 512 2048 8192  # needs Linux perf; make goes on without it
	$(BENCH) --dtype bfloat16 --lengths 512 2048 8192 --eager-up-to 0 --memory-lengths --output attention-bfloat16
	$(BENCH) --dropout 0.1 --dtype bfloat16 --lengths 2048 --eager-up-to 0 --memory-lengths \
	  --output attention-dropout-bfloat16

# The GPU check (benchmarks/gpu/gpu_check.py, one device run; docs/performance.md has the call) runs on a machine with no
# package index, Python 3.12 and transformers 5.17. What it lacks travels in .gpu/ (ignored by git; the device call
# carries it): the wheel of the transformers .ci/constraints.txt names. Its requirements are met there
# (huggingface_hub >= 1.31: 1.33; tokenizers 0.23: 0.23.2; safetensors >= 0.8: 0.8.0), which the check verifies first.
# The next GPU slot: `make gpu-prepare` here, then one device call, `python3 benchmarks/gpu/gpu_check.py` carrying .gpu:
# correctness, the op against SDPA, host against wall time per call (gpu_host_time.py), the model, its profile.
GPU_WHEELS := .gpu/wheels
gpu-prepare:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --dest $(GPU_WHEELS) \
	  "transformers==$$(sed -n 's/^transformers==//p' .ci/constraints.txt)"

# The GPU check rehearsed on this machine: Triton's interpreter, tiny sizes, the wheel installed as on the GPU machine;
# with one variant (the forward pinned to 2 warps), so that the variants' path runs too.
gpu-rehearse: $(VENV)/.test gpu-prepare
	$(PY) benchmarks/gpu/gpu_check.py --rehearse --variant 'narrow NEZHA_CHECK_BLOCKS=forward=16x32x2x1'

# The GPU gates (benchmarks/gpu/gpu_gates.py, docs/performance.md): what NEZHA's Triton launchers launch for the calls
# users make, compiled for an H100 on this CPU through Triton's own autotuner and JIT against a fake GPU driver
# (benchmarks/gpu/gpu_fake_driver.py) and counted, failing where a gate is missed; the counts go to benchmarks/gpu/results/gates.json,
# which the GPU check prints beside its timings (run it before a GPU slot, after the kernels changed). Run by the GPU
# machine's Triton (3.6, in a venv of the same Python that has Triton only; the main environment's packages, PyTorch
# among them, are appended to its path); `make gpu-gates GATES_PYTHON=$(PY)` runs with the installed one instead.
GPU_TRITON := 3.6.0
GATES_PYTHON ?= .venv-triton-$(GPU_TRITON)/bin/python
.venv-triton-$(GPU_TRITON)/bin/python:
	$(PYTHON) -m venv .venv-triton-$(GPU_TRITON)
	.venv-triton-$(GPU_TRITON)/bin/python -m pip install --quiet triton==$(GPU_TRITON)

gpu-gates: $(VENV)/.test $(filter .venv-triton-%,$(GATES_PYTHON))
	$(PY) benchmarks/gpu/gpu_gates.py --triton-python $(GATES_PYTHON) --output benchmarks/gpu/results/gates.json

# After `make test` passes on newer releases: record them as the versions to install (torch stays pinned above).
constraints: $(VENV)/.test
	{ echo "# Written by \`make constraints\` after \`make test\` passed with these versions; see the Makefile."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > $(CONSTRAINTS)

constraints-%: .venv-%/.test
	{ echo "# Written by \`make constraints-$*\` after the fast tests passed on Python $* with these versions."; \
	  .venv-$*/bin/python -m pip freeze --exclude-editable; } > .ci/constraints-$*.txt

clean:
	rm -rf $(VENV) $(PYTHONS:%=.venv-%) build *.egg-info
