# Two entry points on a fresh machine (Python 3.10+ with venv and pip; nothing else needed):
#   make train   the main job: data-parallel training on real data across 4 MPI ranks,
#                SparDL at 1% density beside the dense allreduce baseline
#   make test    the whole test suite (kernels, collectives under mpiexec, CUDA simulator, lint)
# Each target creates .venv and installs what it needs into it.

PYTHON ?= python3
VENV   ?= .venv
# Extra pip options for the install, e.g. where pip's index serves torch's CUDA build (PyPI's
# does, several GB) and the CPU build is wanted:
#   make train PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_ARGS ?=
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.spardl-installed

.PHONY: install test test-local test-bounds test-cluster test-cudasim test-cudasim-kernels \
	test-fast lint train bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_ARGS) -c constraints.txt -e '.[mpi,torch,test]'
	touch $(STAMP)

install: $(STAMP)

# The stages below run two at a time, in this order (longest first, so that no long one is
# left to run alone at the end), each one's output printed whole when it ends: the
# single-process tests (they compile the kernels into Numba's on-disk cache), the CUDA
# simulator's pipeline at P = 4, the bounds-checked kernels (their own cache), the simulator's
# kernels, its pipeline at P = 1 and, last, the runs across emulated nodes (by then the first
# stage has compiled the kernels, so their ranks load them instead of each compiling them at
# once). Then the tests under mpiexec, which oversubscribe every core by themselves, run alone.
test: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-local test-cudasim-pipeline-4 \
		test-bounds test-cudasim-kernels test-cudasim-pipeline-1 test-cluster
	$(PY) -m pytest -q --durations=10 -m mpi

test-local: $(STAMP)
	$(PY) -m pytest -q --durations=5 -m "not mpi and not cluster"

test-bounds: $(STAMP)
	NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=$(VENV)/numba-boundscheck $(PY) -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_cases.py

test-cluster: $(STAMP)
	$(PY) -m pytest -q --durations=3 -m "cluster and not mpi"

# The CUDA kernels and the GPU pipeline (under mpiexec at P = 1 and 4) on the Numba simulator.
test-cudasim: test-cudasim-kernels test-cudasim-pipeline-1 test-cudasim-pipeline-4

test-cudasim-kernels: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -q -p no:cacheprovider -m cudasim tests/test_cuda_kernels.py

test-cudasim-pipeline-%: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -q -p no:cacheprovider -m cudasim \
		"tests/test_gpu_pipeline.py::test_gpu_pipeline_under_mpiexec[$*]"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not mpi"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

train: $(STAMP)
	$(PY) -m spardl demo --world-size 4

bench: $(STAMP)
	$(PY) bench/kernels.py
	$(VENV)/bin/mpiexec -n 4 $(PY) bench/allreduce.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
