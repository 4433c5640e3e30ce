"""SparseResult: the sparse form and the dense form (the dense allreducer's) mean the same."""

from __future__ import annotations

import numpy as np
import pytest

from spardl import SparseResult


def _vector(dtype):
    v = np.zeros(12, dtype)
    v[[1, 4, 5, 11]] = [2.5, -1.0, np.nan, 7.0]
    v[7] = -0.0  # a signed zero is a zero: not listed
    return v


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dense_form_lists_what_the_sparse_form_lists(dtype):
    v = _vector(dtype)
    d = SparseResult.from_dense(v)
    assert d.is_dense and d.n == 12 and d.dtype == np.dtype(dtype)
    assert d._indices is None and d._values is None  # nothing made before it is read
    assert repr(d) == f"SparseResult(n=12, dense form, dtype={np.dtype(dtype)})"
    np.testing.assert_array_equal(d.indices, [1, 4, 5, 11])
    assert d.indices.dtype == np.int64
    assert d.values.dtype == np.dtype(dtype)
    assert d.values.tobytes() == v[[1, 4, 5, 11]].tobytes()  # NaN included, bit for bit
    assert d.nnz == 4
    s = SparseResult(d.indices, d.values, 12)
    assert not s.is_dense
    assert s.to_dense().tobytes() == np.where(v == 0, dtype(0), v).tobytes()
    assert repr(s) == f"SparseResult(n=12, nnz=4, dtype={np.dtype(dtype)})"


def test_dense_form_to_dense_is_a_copy():
    v = _vector(np.float32)
    d = SparseResult.from_dense(v)
    a = d.to_dense()
    assert a is not v and a.tobytes() == v.tobytes()
    a[:] = 1
    assert d.to_dense().tobytes() == v.tobytes()
    assert d._indices is None  # to_dense never needs the indices
    out = np.full(12, 9.0, np.float32)
    assert d.to_dense(out=out) is out
    np.testing.assert_array_equal(out, v)


def test_dense_form_of_all_zeros_and_of_a_full_vector():
    z = SparseResult.from_dense(np.zeros(5, np.float32))
    assert z.nnz == 0 and z.indices.shape == (0,) and z.values.shape == (0,)
    f = SparseResult.from_dense(np.arange(1, 6, dtype=np.float64))
    np.testing.assert_array_equal(f.indices, np.arange(5))


def test_to_dense_checks_out_for_both_forms():
    for r in (
        SparseResult.from_dense(np.ones(4, np.float32)),
        SparseResult(np.array([1]), np.ones(1, np.float32), 4),
    ):
        with pytest.raises(ValueError, match="shape"):
            r.to_dense(out=np.zeros(5, np.float32))
        for dtype in (np.int32, np.uint8, np.float16, np.float64):
            out = np.full(4, 7, dtype)
            with pytest.raises(TypeError, match=f"out has dtype {np.dtype(dtype)}"):
                r.to_dense(out=out)
            assert (out == 7).all()  # untouched
        for bad in ([0.0] * 4, (0.0,) * 4, "abcd"):
            with pytest.raises(TypeError, match=f"out must be a NumPy array.*{type(bad).__name__}"):
                r.to_dense(out=bad)
        frozen = np.full(4, 7, np.float32)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="out is read-only"):
            r.to_dense(out=frozen)
        assert (frozen == 7).all()


def test_results_are_read_only():
    r = SparseResult.from_dense(np.ones(3, np.float32))
    with pytest.raises(AttributeError):
        r.n = 4
    with pytest.raises(AttributeError):
        r.indices = np.arange(3)


@pytest.mark.parametrize(
    "indices, values, n, error, match",
    [
        ([5], [1.0], 3, ValueError, "ascending in \\[0, 3\\)"),
        ([-1], [1.0], 3, ValueError, "ascending"),
        ([2, 1], [1.0, 1.0], 3, ValueError, "ascending"),
        ([1, 1], [1.0, 1.0], 3, ValueError, "ascending"),
        ([0, 1], [1.0], 3, ValueError, "one length"),
        ([[0]], [[1.0]], 3, ValueError, "indices must be 1-D"),
        ([0.0], [1.0], 3, TypeError, "indices must have an integer dtype"),
        ([0], [1], 3, TypeError, "values must have a floating dtype"),
        ([0], ["a"], 3, TypeError, "values must have a floating dtype"),
        ([0], [1.0], -3, ValueError, "n must be >= 0"),
        ([0], [1.0], 3.0, TypeError, "n must be an integer"),
        ([0], [1.0], True, TypeError, "n must be an integer"),
        # a uint64 position past int64 once wrapped to a negative index
        (np.array([2**63 + 5], np.uint64), [1.0], 2**64, ValueError, "n must be at most 2\\*\\*63"),
    ],
)
def test_the_constructor_refuses_what_is_not_a_sparse_vector(indices, values, n, error, match):
    with pytest.raises(error, match=match):
        SparseResult(indices, values, n)


def test_the_constructor_takes_array_likes_and_keeps_int64_indices():
    r = SparseResult([0, 2], np.array([1.5, -2.0], np.float32), 3)
    assert r.indices.dtype == np.int64 and r.nnz == 2 and r.n == 3
    np.testing.assert_array_equal(r.to_dense(), np.array([1.5, 0.0, -2.0], np.float32))
    empty = SparseResult(np.array([], np.int32), np.array([], np.float64), 0)
    assert empty.to_dense().shape == (0,) and empty.indices.dtype == np.int64


def test_the_largest_n_keeps_the_last_int64_position():
    r = SparseResult(np.array([2**63 - 1], np.uint64), np.array([1.0]), 2**63)
    assert r.indices.dtype == np.int64 and r.indices[0] == 2**63 - 1


@pytest.mark.parametrize("dtype", [">f8", ">f4", np.longdouble])
def test_dense_form_of_a_dtype_the_kernels_do_not_take_lists_its_entries(dtype):
    """A big-endian or longdouble vector was accepted by from_dense, then reading nnz, indices
    or values raised a kernel's TypeError naming an argument ``x``; both forms of the same
    vector now list the same entries (NaN kept, ±0 not)."""
    v = np.array([1.0, 0.0, np.nan, -0.0, 2.5], dtype=dtype)
    r = SparseResult.from_dense(v)
    assert r.nnz == 3 and r.indices.dtype == np.int64
    np.testing.assert_array_equal(r.indices, [0, 2, 4])
    np.testing.assert_array_equal(r.values, v[[0, 2, 4]])
    assert r.values.dtype == np.dtype(dtype)
    sparse = SparseResult(r.indices, r.values, len(v))
    np.testing.assert_array_equal(sparse.to_dense(), r.to_dense())
