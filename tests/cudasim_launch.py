"""Helpers for the tests on the Numba CUDA simulator, shared by tests/test_cuda_kernels.py,
tests/test_gpu_pipeline.py and tests/mpi_cudasim/:

* small launch settings: with them n = 40 already spans several blocks and tiles, so the
  multi-block paths run at sizes the simulator can afford;
* a lock around the simulator's shared-array allocation, whose race otherwise gives a kernel
  garbage now and then (:func:`atomic_shared_arrays`).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from spardl_kernels import config

SMALL_LAUNCHES = {
    "CUDA_THREADS_PER_BLOCK": 32,
    "CUDA_HIST_THREADS_PER_BLOCK": 32,
    "CUDA_ITEMS_PER_THREAD": 2,
    "CUDA_MAX_BLOCKS": 3,
    "CUDA_RADIX_BITS": 4,
    "CUDA_SORT_RADIX_BITS": 4,
}


def use_small_launches(monkeypatch) -> None:
    """Set :data:`SMALL_LAUNCHES` in ``spardl_kernels.config`` for one test."""
    for name, value in SMALL_LAUNCHES.items():
        monkeypatch.setattr(config, name, value)


def atomic_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` allocation atomic; returns an undo function.

    The simulator (numba-cuda 0.30) gives each call site one array per launch with an unlocked
    check-then-insert (``_allocations.get(site)``, then ``np.empty`` and a store). When the GIL
    switches between the two, two threads of a block each create an array: the earlier one keeps
    a private, uninitialised "shared" array nobody else sees, and the kernel computes garbage
    (wrong scan offsets, histograms, positions). A simulator artefact, not a race of the kernels
    (on a GPU a block has one shared array per declaration). At the 5 ms default switch interval
    it is rare but happens on a loaded machine (simulated ranks sharing the cores with other
    tests); at a 1 us interval it breaks a launch now and then. Same key (file and line of the
    caller) as the simulator.
    """
    from numba.cuda.simulator import kernelapi

    shared = getattr(kernelapi, "FakeCUDAShared", None)
    if shared is None or not hasattr(shared, "array"):
        return lambda: None
    original = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: no allocation race
            return original(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            res = self._allocations.get(site)
            if res is None:
                res = np.empty(
                    shape,
                    kernelapi.numpy_support.as_dtype(dtype)
                    if isinstance(dtype, kernelapi.types.Type)
                    else dtype,
                )
                self._allocations[site] = res
        return res

    shared.array = array

    def undo():
        shared.array = original

    return undo
