"""Edge inputs to schedules.num_rounds, the "coo" packing of spardl.comm (pack_blocks,
unpack_blocks, packed_capacity, wire_capacity, wire_index_dtype) and SparseResult: a ValueError
or TypeError naming the argument where they used to wrap, broadcast, or fail with a raw error.
No MPI."""

from __future__ import annotations

import numpy as np
import pytest

from spardl.comm import (
    pack_blocks,
    packed_capacity,
    unpack_blocks,
    wire_capacity,
    wire_index_dtype,
)
from spardl.result import SparseResult
from spardl.schedules import num_rounds, srs_schedule

# -- schedules.num_rounds ------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2.5, np.int64(8), "4", True, None])
def test_num_rounds_checks_p_like_its_siblings(P):
    with pytest.raises(TypeError) as sibling:
        srs_schedule(P, 0)
    with pytest.raises(TypeError, match="^P must be an integer") as got:
        num_rounds(P)
    assert str(got.value) == str(sibling.value)


def test_num_rounds_still_counts():
    assert [num_rounds(P) for P in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    with pytest.raises(ValueError, match="^P must be >= 1"):
        num_rounds(0)


# -- pack_blocks / unpack_blocks -----------------------------------------------------------------


def _block(idx, val, dtype=np.float64):
    return np.array(idx, np.int64), np.array(val, dtype)


@pytest.mark.parametrize(
    ("index", "start", "idt"),
    [
        (2**33, 0, np.int32),  # came back as 0
        (300, 0, np.int8),  # came back as 44
        (2**31, 0, np.int32),  # one past int32
        (5, 10, np.uint16),  # below the start: negative, outside an unsigned dtype
        (2**40 + 7, 7, np.int32),  # relative 2**40
    ],
)
def test_pack_refuses_indices_that_would_wrap(index, start, idt):
    with pytest.raises(ValueError, match=r"^blocks\[1\]: .*index_dtype"):
        pack_blocks([_block([1], [2.0]), _block([index], [1.0])], [0, start], idt, np.float64)


def test_pack_refuses_a_count_past_the_index_dtype():
    idx = np.arange(200, dtype=np.int64) - 100  # every relative index fits int8, the count not
    with pytest.raises(ValueError, match=r"^blocks\[0\] holds 200 pairs"):
        pack_blocks([(idx, np.zeros(200))], [0], np.int8, np.float64)


@pytest.mark.parametrize("idt", [np.int8, np.uint8, np.int16, np.int32])
def test_pack_keeps_indices_at_the_edge_of_the_range(idt):
    hi = int(np.iinfo(idt).max)
    blocks = [_block([5, 6], [1.0, 2.0]), _block([3, hi + 3], [3.0, 4.0])]
    got = unpack_blocks(pack_blocks(blocks, [5, 3], idt, np.float64), 2, [5, 3], idt, np.float64)
    for (i, v), (gi, gv) in zip(blocks, got, strict=True):
        np.testing.assert_array_equal(gi, i)
        np.testing.assert_array_equal(gv, v)


@pytest.mark.parametrize("val", [[1.0], [1.0, 2.0, 3.0, 4.0], 1.0, [[1.0, 2.0, 3.0]]])
def test_pack_refuses_values_not_as_long_as_indices(val):
    with pytest.raises(ValueError, match=r"^blocks\[0\]: values must have the shape"):
        pack_blocks([(np.array([1, 2, 3]), np.array(val))], [0], np.int32, np.float64)


def _two_blocks():
    blocks = [_block([1, 2], [1.0, 2.0]), _block([], [])]
    return pack_blocks(blocks, [0, 0], np.int32, np.float64)


def test_unpack_refuses_a_negative_count():
    buf = _two_blocks().copy()
    buf[:8].view(np.int32)[:] = [3, -1]  # the total, 2, still matches the buffer's length
    with pytest.raises(ValueError, match="negative count"):
        unpack_blocks(buf, 2, [0, 0], np.int32, np.float64)


@pytest.mark.parametrize("starts", [[0], [0, 0, 0], []])
def test_unpack_refuses_starts_not_one_per_block(starts):
    with pytest.raises(ValueError, match=r"^starts must hold nblocks = 2 positions"):
        unpack_blocks(_two_blocks(), 2, starts, np.int32, np.float64)


@pytest.mark.parametrize(
    ("buf", "error", "match"),
    [
        (list(bytes(24)), TypeError, "^buf must be a uint8 NumPy array.*got list"),
        (bytes(24), TypeError, "^buf must be a uint8 NumPy array.*got bytes"),
        (np.zeros(6, np.int32), TypeError, "^buf must be a uint8 NumPy array.*got dtype int32"),
        (np.zeros((3, 8), np.uint8), ValueError, r"^buf must be 1-D, got shape \(3, 8\)"),
    ],
)
def test_unpack_refuses_a_buf_that_is_no_byte_array(buf, error, match):
    with pytest.raises(error, match=match):
        unpack_blocks(buf, 2, [0, 0], np.int32, np.float64)


@pytest.mark.parametrize(
    ("nblocks", "starts", "error", "match"),
    [
        (-1, [], ValueError, "^nblocks must be >= 0"),
        (2.0, [0, 0], TypeError, "^nblocks must be an integer"),
        (2, iter([0, 0]), TypeError, "^starts must be a sequence"),
    ],
)
def test_unpack_checks_nblocks_and_starts(nblocks, starts, error, match):
    with pytest.raises(error, match=match):
        unpack_blocks(_two_blocks(), nblocks, starts, np.int32, np.float64)


def test_unpack_still_takes_its_own_messages():
    got = unpack_blocks(_two_blocks(), np.int64(2), (10, 20), np.int32, np.float64)
    np.testing.assert_array_equal(got[0][0], [11, 12])
    assert got[1][0].shape == (0,) and got[1][0].dtype == np.int64
    assert (
        unpack_blocks(pack_blocks([], [], np.int32, np.float32), 0, [], np.int32, np.float32) == []
    )


# -- wire_capacity / wire_index_dtype ------------------------------------------------------------


@pytest.mark.parametrize("wire", ["coo", "compact", "packed_capacity"])
@pytest.mark.parametrize(
    ("nblocks", "max_pairs", "error", "name"),
    [
        (-2, -3, ValueError, "nblocks"),
        (-1, 5, ValueError, "nblocks"),
        (2, -3, ValueError, "max_pairs"),
        (2.5, 3, TypeError, "nblocks"),
        (2, 3.0, TypeError, "max_pairs"),
        (True, 3, TypeError, "nblocks"),
        (2, "3", TypeError, "max_pairs"),
    ],
)
def test_wire_capacity_checks_its_counts(wire, nblocks, max_pairs, error, name):
    with pytest.raises(error, match=f"^{name} must be"):
        if wire == "packed_capacity":  # the "coo" size, also called on its own
            packed_capacity(nblocks, max_pairs, np.int32, np.float32)
        else:
            wire_capacity(nblocks, max_pairs, np.int32, np.float32, wire)


def test_wire_capacity_still_counts():
    assert wire_capacity(0, 0, np.int32, np.float32) == 0
    assert wire_capacity(np.int64(2), 3, np.int32, np.float32) == 24 + 12  # header padded to 8
    assert wire_capacity(2, np.int32(3), np.int32, np.float32, "compact") == 36 + 24


@pytest.mark.parametrize(
    ("value", "error"),
    [(-5, ValueError), (-1, ValueError), (2.5, TypeError), ("5", TypeError), (True, TypeError)],
)
def test_wire_index_dtype_checks_its_length(value, error):
    with pytest.raises(error, match="^max_block_length must be"):
        wire_index_dtype(value)


def test_wire_index_dtype_still_chooses():
    assert wire_index_dtype(0) == np.int32
    assert wire_index_dtype(np.int64(2**31 - 1)) == np.int32
    assert wire_index_dtype(2**31) == np.int64


# -- SparseResult --------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], ()])
def test_result_takes_empty_lists(empty):
    r = SparseResult(empty, empty, 0)
    assert r.nnz == 0 and r.indices.dtype == np.int64 and r.values.dtype == np.float64
    np.testing.assert_array_equal(SparseResult(empty, np.zeros(0, np.float32), 4).to_dense(), 0)


def test_result_still_refuses_an_empty_float_array_of_indices():
    with pytest.raises(TypeError, match="^indices must have an integer dtype"):
        SparseResult(np.zeros(0), [], 3)


@pytest.mark.parametrize(
    ("vector", "error", "match"),
    [
        ([1.0, 2.0], TypeError, "^vector must be a NumPy array or a device array, got list"),
        (3.0, TypeError, "^vector must be a NumPy array or a device array, got float"),
        (np.zeros((2, 2)), ValueError, r"^vector must be 1-D, got shape \(2, 2\)"),
        (np.zeros(3, np.int64), TypeError, "^vector must have a floating dtype, got int64"),
    ],
)
def test_from_dense_names_vector(vector, error, match):
    with pytest.raises(error, match=match):
        SparseResult.from_dense(vector)


@pytest.mark.parametrize("counts", [[-1, 1], [-3, 0], [0, -2]])
def test_unpack_refuses_negative_counts_whatever_their_total(counts):
    buf = np.zeros(24, np.uint8)
    buf[:8].view(np.int32)[:] = counts
    for nbytes in (0, 8, 16, 24):
        with pytest.raises(ValueError, match="negative count|header"):
            unpack_blocks(buf[:nbytes], 2, [0, 0], np.int32, np.float64)
