"""The public surfaces: spardl_kernels is exactly the fourteen kernels of docs/design.md §3, and
``spardl.__all__`` is exactly the names docs/design.md §6 documents."""

import sys

import numpy as np
import pytest

import spardl_kernels
import spardl_kernels.cpu
from spardl_kernels import _dispatch

KERNELS = [
    "topk_abs",
    "kth_largest_abs",
    "select_above",
    "count_above",
    "estimate_threshold",
    "merge_add",
    "coalesce",
    "uniform_bounds",
    "balanced_bounds",
    "block_offsets",
    "scatter_add",
    "gather",
    "accumulate_topk",
    "accumulate_above",
]


def test_all_is_exactly_the_kernels():
    assert sorted(spardl_kernels.__all__) == sorted(KERNELS)
    assert len(spardl_kernels.__all__) == len(set(spardl_kernels.__all__))
    assert sorted(spardl_kernels.cpu.__all__) == sorted(KERNELS)
    for name in KERNELS:
        f = getattr(spardl_kernels, name)
        assert callable(f) and f.__doc__ and "Parameters" in f.__doc__
        assert f.__name__ == name


def test_spardl_all_is_exactly_the_public_surface():
    import spardl

    assert sorted(spardl.__all__) == sorted(
        [
            "ALGORITHMS",
            "ALGORITHM_NAMES",
            "Allreducer",
            "Comm",
            "abort_on_exception",
            "NonFiniteError",
            "SparseResult",
            "make",
            "__version__",
        ]
    )
    for name in spardl.__all__:
        assert hasattr(spardl, name), name
    assert sorted(spardl.ALGORITHMS) == [
        "dense",
        "gaussiank",
        "gtopk",
        "oktopk",
        "spardl",
        "topka",
        "topkdsa",
    ]


def test_cpu_arrays_stay_on_cpu():
    assert not _dispatch.is_device_array(np.zeros(3))
    assert not _dispatch.is_device_array([1.0])
    assert _dispatch.backend_for(np.zeros(3)) is spardl_kernels.cpu


def test_device_arrays_are_recognised_and_routed(monkeypatch):
    class FakeGpuArray:
        __cuda_array_interface__ = {
            "shape": (3,),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

    assert _dispatch.is_device_array(FakeGpuArray())

    # an import of spardl_kernels.cuda that fails (as without numba-cuda or a driver)
    monkeypatch.setitem(sys.modules, "spardl_kernels.cuda", None)
    with pytest.raises(RuntimeError, match="CUDA support is unavailable"):
        spardl_kernels.topk_abs(FakeGpuArray(), 1)
