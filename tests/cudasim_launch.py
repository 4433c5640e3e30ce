"""Small CUDA launch settings for the simulator, shared by tests/test_cuda_kernels.py and
tests/mpi_cudasim/: with them n = 40 already spans several blocks and tiles, so the multi-block
paths run at sizes the simulator can afford."""

from __future__ import annotations

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
