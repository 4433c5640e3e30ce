"""The cases K1..K12 of docs/design.md §9, each with the answer docs/design.md §3 requires."""

import numpy as np
import pytest

import spardl_kernels as sk

DTYPES = [np.float16, np.float32, np.float64]


def check(got, indices, values=None):
    i, v = got
    assert i.dtype == np.int64
    assert i.tolist() == indices
    if values is not None:
        np.testing.assert_array_equal(v, np.asarray(values, dtype=v.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_K1_ties_go_to_the_lower_index(dtype):
    x = np.array([3, 2, 3, 2, 1, 1], dtype)
    check(sk.topk_abs(x, 2), [0, 2], [3, 3])


def test_K2_ties_at_the_maximum_by_magnitude():
    x = np.array([-0.1944, -0.1944, -0.1945, -0.1945, -0.1945], np.float32)
    i, v = sk.topk_abs(x, 1)
    check((i, v), [2], [-0.1945])
    assert v.dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_K3_nan_ranks_above_inf(dtype):
    i, v = sk.topk_abs(np.array([np.nan, np.inf, np.inf, 3, np.inf], dtype), 1)
    assert i.tolist() == [0] and np.isnan(v[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_K4_nan_then_infs_by_index(dtype):
    i, v = sk.topk_abs(np.array([np.nan, np.inf, np.inf, 3, np.inf], dtype), 3)
    assert i.tolist() == [0, 1, 2] and np.isnan(v[0]) and (v[1:] == np.inf).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_K5_k_zero_and_empty(dtype, n):
    i, v = sk.topk_abs(np.ones(n, dtype), 0)
    assert i.shape == (0,) and i.dtype == np.int64
    assert v.shape == (0,) and v.dtype == dtype


def test_K6_k_above_n_names_k():
    with pytest.raises(ValueError, match="k"):
        sk.topk_abs(np.array([], np.float32), 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_K7_magnitude_not_signed_value(dtype):
    check(sk.topk_abs(np.array([-5, 1, 2], dtype), 1), [0], [-5])


def test_K8_float16_on_cpu():
    i, v = sk.topk_abs(np.array([0.5, -1.5], np.float16), 1)
    check((i, v), [1], [-1.5])
    assert v.dtype == np.float16


def test_K9_indices_above_2_24_are_exact():
    n = 2**24 + 3
    x = np.zeros(n, np.float32)
    x[2**24 + 1] = 1.0
    i, v = sk.select_above(x, 0.5)
    check((i, v), [16777217], [1.0])
    assert sk.topk_abs(x, 1)[0].tolist() == [16777217]


def test_K10_merge_add_sums_the_overlap():
    got = sk.merge_add(
        np.array([0, 5]), np.array([1.0, 2.0]), np.array([5, 7]), np.array([3.0, 4.0])
    )
    check(got, [0, 5, 7], [1.0, 5.0, 4.0])


def test_K11_coalesce_sums_duplicates():
    check(sk.coalesce(np.array([4, 1, 4, 1]), np.array([1.0, 2.0, 3.0, 4.0])), [1, 4], [6.0, 4.0])


def test_K12_uneven_final_block():
    bounds = sk.uniform_bounds(13, 5)
    assert bounds.dtype == np.int64 and bounds.tolist() == [0, 3, 6, 9, 11, 13]
    offsets = sk.block_offsets(np.array([0, 2, 3, 9, 12]), bounds)
    assert offsets.dtype == np.int64 and offsets.tolist() == [0, 2, 3, 3, 4, 5]


def test_fixed_order_sum_float32():
    # docs/design.md §3: coalescing float32 [1e8, 1, -1e8] at one index gives exactly 0.0
    i, v = sk.coalesce(np.array([7, 7, 7]), np.array([1e8, 1, -1e8], np.float32))
    assert i.tolist() == [7] and v.tolist() == [0.0] and v.dtype == np.float32
