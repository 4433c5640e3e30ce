"""The CUDA twins of the kernels (spardl_kernels.cuda) against tests/naive.py and the CPU kernels,
bit for bit, on tiny inputs.

Runs on the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` must be set before numba is first
imported, so it is set on the command line) or on a real GPU; otherwise the module is skipped::

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/test_cuda_kernels.py

Launch parameters are patched small (32 threads per block, 2 items per thread, at most 3 blocks,
4-bit radix digits) so that inputs of a few hundred elements span several blocks, several tiles
per block (grid-stride loops) and many radix passes.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
cuda = pytest.importorskip("numba.cuda")
if not (SIM or cuda.is_available()):
    pytest.skip(
        "needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
        allow_module_level=True,
    )

import naive  # noqa: E402
from cudasim_launch import atomic_shared_arrays, use_small_launches  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import int64  # noqa: E402

import spardl_kernels as sk  # noqa: E402
import spardl_kernels.cpu as cpu  # noqa: E402
import spardl_kernels.cuda as gpu  # noqa: E402
from spardl_kernels import _dispatch, config  # noqa: E402

pytestmark = pytest.mark.cudasim
real_gpu_only = pytest.mark.skipif(SIM, reason="needs a real GPU (too slow on the simulator)")

DTYPES = [np.float16, np.float32, np.float64]
BITS = {
    np.dtype(np.float16): np.int16,
    np.dtype(np.float32): np.int32,
    np.dtype(np.float64): np.int64,
}


@pytest.fixture(scope="module", autouse=True)
def _fast_simulator_threads():
    # The simulator runs each CUDA thread as a Python thread; the default 5 ms GIL switch
    # interval makes every syncthreads() wait for a full round of time slices. At 1 us the
    # simulator's unlocked shared-array allocation races (see atomic_shared_arrays).
    old = sys.getswitchinterval()
    undo = atomic_shared_arrays() if SIM else (lambda: None)
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)
    undo()


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    use_small_launches(monkeypatch)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def host(a):
    assert _dispatch.is_device_array(a), f"expected a device array, got {type(a)}"
    return a.copy_to_host()


def assert_bits_equal(got, want):
    """Same dtype, shape and bit pattern (-0.0, NaN payloads and all)."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.dtype.kind == "f":
        got, want = got.view(BITS[got.dtype]), want.view(BITS[want.dtype])
    np.testing.assert_array_equal(got, want)


def assert_pair(got, *wants):
    i, v = host(got[0]), host(got[1])
    for want_i, want_v in wants:
        assert_bits_equal(i, want_i)
        assert_bits_equal(v, want_v)


def nasty(dtype, n=150, seed=0):
    """Ties, +-0.0, NaN, +-inf and repeated magnitudes of both signs."""
    rng = np.random.default_rng(seed)
    x = rng.choice([-3.0, -1.5, -0.0, 0.0, 0.25, 1.5, 2.0, 3.0], n) * rng.integers(1, 4, n)
    x = x.astype(dtype)
    x[rng.integers(0, n, 12)] = rng.standard_normal(12).astype(dtype)
    x[[5, n // 2]] = np.nan
    x[[17, n - 3]] = np.inf
    x[n // 3] = -np.inf
    return x


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,k",
    [(d, k) for d in DTYPES for k in (0, 37, 150)] + [(np.float32, 1), (np.float32, 149)],
)
def test_topk_abs_matches_naive_and_cpu(dtype, k):
    x = nasty(dtype)
    got = sk.topk_abs(dev(x), k)
    assert_pair(got, naive.topk_abs(x, k), cpu.topk_abs(x, k))


def test_topk_abs_int32_indices_and_default_launch_sizes(monkeypatch):
    # the shipped launch sizes (one block covers the input) and 8-bit digits
    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 256)
    monkeypatch.setattr(config, "CUDA_ITEMS_PER_THREAD", 8)
    monkeypatch.setattr(config, "CUDA_RADIX_BITS", 8)
    x = nasty(np.float32, n=100, seed=3)
    got = gpu.topk_abs(dev(x), 9, index_dtype=np.int32)
    assert_pair(got, naive.topk_abs(x, 9, index_dtype=np.int32))


@settings(max_examples=4, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan, 1e-3]),
        min_size=1,
        max_size=70,
    ),
    st.integers(0, 70),
)
def test_topk_abs_property(values, k):
    x = np.array(values, np.float32)
    k = min(k, x.shape[0])
    assert_pair(gpu.topk_abs(dev(x), k), naive.topk_abs(x, k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kth_largest_abs_and_select_above_agree(dtype):
    x = nasty(dtype, seed=1)
    k = 40
    t = gpu.kth_largest_abs(dev(x), k)
    assert_bits_equal(np.asarray(t), np.asarray(naive.kth_largest_abs(x, k)))
    assert_bits_equal(np.asarray(t), np.asarray(cpu.kth_largest_abs(x, k)))
    # select_above(x, kth) holds the top k (plus ties)
    i, v = gpu.select_above(dev(x), float(t))
    top = naive.topk_abs(x, k)[0]
    assert set(top.tolist()) <= set(host(i).tolist())
    assert_pair((i, v), naive.select_above(x, float(t)))


def test_kth_largest_abs_nan_and_zero():
    x = np.array([np.nan, np.nan, -0.0, 1.0], np.float32)
    assert math.isnan(gpu.kth_largest_abs(dev(x), 2))
    t = gpu.kth_largest_abs(dev(x), 4)
    assert_bits_equal(np.asarray(t), np.asarray(np.float32(0.0)))  # -0.0 comes back as 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_above_and_count_above(dtype):
    x = nasty(dtype, seed=2)
    for t in [1.5, np.inf, np.nan, 0.0] if dtype == np.float32 else [1.5]:
        assert_pair(gpu.select_above(dev(x), t), naive.select_above(x, t), cpu.select_above(x, t))
        assert gpu.count_above(dev(x), t) == naive.count_above(x, t) == cpu.count_above(x, t)


def test_select_above_threshold_between_representable_values():
    # 1 + 2**-30 lies strictly between two float32 values: 1.0 must not be selected
    x = np.array([1.0, np.nextafter(np.float32(1), np.float32(2)), -1.0], np.float32)
    t = 1.0 + 2.0**-30
    assert_pair(gpu.select_above(dev(x), t), naive.select_above(x, t))
    assert gpu.count_above(dev(x), t) == 1


def test_select_above_empty_and_int32():
    assert_pair(
        gpu.select_above(dev(np.zeros(0, np.float64)), 1.0),
        (np.zeros(0, np.int64), np.zeros(0, np.float64)),
    )
    x = nasty(np.float64, n=40)
    assert_pair(
        gpu.select_above(dev(x), 2.0, index_dtype=np.int32),
        naive.select_above(x, 2.0, index_dtype=np.int32),
    )
    assert gpu.count_above(dev(np.zeros(0, np.float16)), 0.0) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimate_threshold_matches_cpu(dtype):
    x = np.random.default_rng(4).standard_normal(250).astype(dtype)
    for k, s in ((25, 60), (10, 250)):
        want = naive.estimate_threshold(x, k, sample_size=s, seed=7)
        got = gpu.estimate_threshold(dev(x), k, sample_size=s, seed=7)
        assert got == want == cpu.estimate_threshold(x, k, sample_size=s, seed=7)
    assert gpu.estimate_threshold(dev(x), 0) == math.inf


# ---------------------------------------------------------------------------------------------
# sparse vectors
# ---------------------------------------------------------------------------------------------


def sparse(rng, n, m, dtype, idt=np.int64):
    idx = np.sort(rng.choice(n, m, replace=False)).astype(idt)
    return idx, rng.standard_normal(m).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_add_matches_naive_and_cpu(dtype):
    rng = np.random.default_rng(5)
    ia, va = sparse(rng, 200, 70, dtype)
    ib, vb = sparse(rng, 200, 90, dtype)
    va[3] = -0.0
    vb[4] = np.nan
    got = gpu.merge_add(dev(ia), dev(va), dev(ib), dev(vb))
    assert_pair(got, naive.merge_add(ia, va, ib, vb), cpu.merge_add(ia, va, ib, vb))


def test_merge_add_edges():
    # one side empty, int32 + int32 stays int32, float16 sums round once
    e_i, e_v = np.zeros(0, np.int32), np.zeros(0, np.float16)
    ib = np.array([2, 2**31 - 5], np.int32)
    vb = np.array([1.0, -2.0], np.float16)
    got = gpu.merge_add(dev(e_i), dev(e_v), dev(ib), dev(vb))
    assert_pair(got, (ib, vb), cpu.merge_add(e_i, e_v, ib, vb))
    ia = np.array([2], np.int32)
    va = np.array([2049.0], np.float16)
    got = gpu.merge_add(dev(ia), dev(va), dev(ia), dev(np.array([1.0], np.float16)))
    assert_pair(got, cpu.merge_add(ia, va, ia, np.array([1.0], np.float16)))
    got = gpu.merge_add(dev(e_i), dev(e_v), dev(e_i), dev(e_v))
    assert host(got[0]).shape == (0,) and host(got[1]).dtype == np.float16


@pytest.mark.parametrize("dtype", DTYPES)
def test_coalesce_matches_naive_and_cpu(dtype):
    rng = np.random.default_rng(6)
    idx = rng.integers(0, 60, 150)
    val = rng.standard_normal(150).astype(dtype)
    val[7] = -0.0
    got = gpu.coalesce(dev(idx), dev(val))
    assert_pair(got, naive.coalesce(idx, val), cpu.coalesce(idx, val))


def test_coalesce_fixed_order_sorted_input_and_int32():
    i, v = gpu.coalesce(dev(np.array([7, 7, 7])), dev(np.array([1e8, 1, -1e8], np.float32)))
    assert host(i).tolist() == [7] and host(v).tolist() == [0.0]
    idx = np.array([0, 0, 3, 3, 3, 9], np.int32)  # already sorted: the sort is skipped
    val = np.array([1, 2, 3, 4, 5, 6], np.float16)
    assert_pair(gpu.coalesce(dev(idx), dev(val)), naive.coalesce(idx, val))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_add_matches_naive_and_cpu(dtype):
    rng = np.random.default_rng(7)
    dense = rng.standard_normal(50).astype(dtype)
    dense[10] = -0.0
    idx = rng.integers(0, 50, 120)
    val = (rng.standard_normal(120) * 100).astype(dtype)
    d = dev(dense)
    out = gpu.scatter_add(d, dev(idx), dev(val))
    assert out is d
    want = naive.scatter_add(dense.copy(), idx, val)
    assert_bits_equal(host(d), want)
    assert_bits_equal(host(d), cpu.scatter_add(dense.copy(), idx, val))


def test_scatter_add_float16_chain_rounds_once_and_empty():
    # 2048 + 1 + 1 in float16 step by step stays 2048; the contract's float32 chain gives 2050
    d = dev(np.array([2048.0, 0.0], np.float16))
    gpu.scatter_add(d, dev(np.array([0, 0])), dev(np.array([1.0, 1.0], np.float16)))
    assert host(d).tolist() == [2050.0, 0.0]
    gpu.scatter_add(d, dev(np.zeros(0, np.int64)), dev(np.zeros(0, np.float16)))
    assert host(d).tolist() == [2050.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_bit_for_bit(dtype):
    dense = nasty(dtype, n=40)
    dense[0] = -0.0
    idx = np.array([0, 5, 17, 33, 39, 5])
    assert_bits_equal(host(gpu.gather(dev(dense), dev(idx))), naive.gather(dense, idx))
    assert_bits_equal(host(gpu.gather(dev(dense), dev(idx))), cpu.gather(dense, idx))
    assert host(gpu.gather(dev(dense), dev(np.zeros(0, np.int32)))).shape == (0,)


def test_gather_strided_device_array():
    dense = np.arange(20, dtype=np.float32)
    got = gpu.gather(dev(dense)[::2], dev(np.array([1, 9])))
    assert host(got).tolist() == [2.0, 18.0]


# ---------------------------------------------------------------------------------------------
# bounds
# ---------------------------------------------------------------------------------------------


def test_uniform_and_balanced_bounds():
    assert host(gpu.uniform_bounds(13, 5)).tolist() == naive.uniform_bounds(13, 5).tolist()
    rng = np.random.default_rng(8)
    idx = rng.integers(0, 500, 90)  # unsorted, with duplicates
    for P in (3, 7):
        got = host(gpu.balanced_bounds(dev(idx), 500, P))
        assert_bits_equal(got, naive.balanced_bounds(idx, 500, P))
        assert_bits_equal(got, cpu.balanced_bounds(idx, 500, P))
    got = host(gpu.balanced_bounds(dev(np.zeros(0, np.int64)), 10, 3))
    assert got.tolist() == naive.uniform_bounds(10, 3).tolist()


def test_block_offsets_matches_searchsorted():
    rng = np.random.default_rng(9)
    idx = np.sort(rng.choice(400, 100, replace=False))
    bounds = np.array([0, 0, 13, 100, 101, 399, 400, 1000])
    assert_bits_equal(
        host(gpu.block_offsets(dev(idx), dev(bounds))), naive.block_offsets(idx, bounds)
    )
    # host bounds in a mixed call are copied to the device
    assert_bits_equal(host(sk.block_offsets(dev(idx), bounds)), naive.block_offsets(idx, bounds))


# ---------------------------------------------------------------------------------------------
# the cases of docs/design.md §9, on the GPU through the public dispatcher
# ---------------------------------------------------------------------------------------------


def test_K1_ties_go_to_the_lower_index():
    assert_pair(
        sk.topk_abs(dev(np.array([3, 2, 3, 2, 1, 1], np.float32)), 2),
        ([0, 2], np.array([3, 3], np.float32)),
    )


def test_K2_ties_at_the_maximum_by_magnitude():
    x = np.array([-0.1944, -0.1944, -0.1945, -0.1945, -0.1945], np.float32)
    assert_pair(sk.topk_abs(dev(x), 1), ([2], x[[2]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_K3_K4_nan_above_inf(dtype):
    x = np.array([np.nan, np.inf, np.inf, 3, np.inf], dtype)
    i, v = sk.topk_abs(dev(x), 1)
    assert host(i).tolist() == [0] and np.isnan(host(v)[0])
    i, v = sk.topk_abs(dev(x), 3)
    assert host(i).tolist() == [0, 1, 2]
    assert_bits_equal(host(v), x[:3])


@pytest.mark.parametrize("n", [0, 5])
def test_K5_k_zero_and_empty(n):
    i, v = sk.topk_abs(dev(np.ones(n, np.float16)), 0)
    assert_pair((i, v), (np.zeros(0, np.int64), np.zeros(0, np.float16)))


def test_K6_k_above_n_names_k():
    with pytest.raises(ValueError, match="^k:"):
        sk.topk_abs(dev(np.zeros(0, np.float32)), 1)


def test_K7_magnitude_not_signed_value():
    assert_pair(sk.topk_abs(dev(np.array([-5, 1, 2], np.float64)), 1), ([0], [-5.0]))


def test_K8_float16():
    x = np.array([0.5, -1.5], np.float16)
    assert_pair(sk.topk_abs(dev(x), 1), ([1], x[[1]]))


def test_K9_kind_indices_above_2_24_exact_small():
    # The fault of K9 (indices passing through float32 lose precision above 2**24) on the
    # kernels whose indices do not need a dense array of that length.
    big = 2**24
    ia = np.array([big + 1, 2**40 + 3])
    ib = np.array([big, big + 1, big + 2])
    got = sk.merge_add(dev(ia), dev(np.ones(2)), dev(ib), dev(np.ones(3)))
    assert host(got[0]).tolist() == [big, big + 1, big + 2, 2**40 + 3]
    i, v = sk.coalesce(dev(np.array([big + 3, big + 1, big + 3, big + 1])), dev(np.ones(4)))
    assert host(i).tolist() == [big + 1, big + 3] and host(v).tolist() == [2.0, 2.0]
    bounds = np.array([0, big + 1, big + 2, 2**40 + 4])
    assert host(sk.block_offsets(dev(ia), dev(bounds))).tolist() == [0, 0, 1, 2]
    got = host(sk.balanced_bounds(dev(np.array([big + 1, big + 3, big + 5])), 2**41, 3))
    assert got.tolist() == [0, big + 3, big + 5, 2**41]


@real_gpu_only
def test_K9_indices_above_2_24_are_exact():
    n = 2**24 + 3
    x = np.zeros(n, np.float32)
    x[2**24 + 1] = 1.0
    d = dev(x)
    assert_pair(sk.select_above(d, 0.5), ([16777217], [np.float32(1.0)]))
    assert host(sk.topk_abs(d, 1)[0]).tolist() == [16777217]


def test_K10_merge_add_sums_the_overlap():
    got = sk.merge_add(
        dev(np.array([0, 5])),
        dev(np.array([1.0, 2.0])),
        dev(np.array([5, 7])),
        dev(np.array([3.0, 4.0])),
    )
    assert_pair(got, ([0, 5, 7], [1.0, 5.0, 4.0]))


def test_K11_coalesce_sums_duplicates():
    got = sk.coalesce(dev(np.array([4, 1, 4, 1])), dev(np.array([1.0, 2.0, 3.0, 4.0])))
    assert_pair(got, ([1, 4], [6.0, 4.0]))


def test_K12_uneven_final_block():
    bounds = gpu.uniform_bounds(13, 5)
    assert host(bounds).tolist() == [0, 3, 6, 9, 11, 13]
    offsets = sk.block_offsets(dev(np.array([0, 2, 3, 9, 12])), bounds)
    assert host(offsets).tolist() == [0, 2, 3, 3, 4, 5]


# ---------------------------------------------------------------------------------------------
# races: many tiny blocks under a 1 us GIL switch interval (simulator threads interleave finely)
# ---------------------------------------------------------------------------------------------


@cuda.jit
def _block_sum_via_shared(out):
    sh = cuda.shared.array(16, int64)
    t = cuda.threadIdx.x
    sh[t] = t + 1
    cuda.syncthreads()
    s = 0
    for j in range(cuda.blockDim.x):
        s += sh[j]
    out[cuda.blockIdx.x * cuda.blockDim.x + t] = s


@pytest.mark.parametrize("tpb", [8, 16])
def test_no_races_with_tiny_blocks_and_fine_interleaving(monkeypatch, tpb):
    # Every thread of a block must see one shared array (the simulator's allocation race, see
    # _atomic_simulator_shared_arrays), and the barrier-heavy kernels (scans, sort, compaction)
    # must give the naive results when threads switch every few bytecodes.
    assert sys.getswitchinterval() <= 1e-5
    out = cuda.device_array(4 * tpb, np.int64)
    for _ in range(5):
        _block_sum_via_shared[4, tpb](out)
        assert (host(out) == tpb * (tpb + 1) // 2).all()
    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", tpb)
    monkeypatch.setattr(config, "CUDA_HIST_THREADS_PER_BLOCK", tpb)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 0)
    rng = np.random.default_rng(tpb)
    for _ in range(2):
        x = nasty(np.float32, n=120, seed=int(rng.integers(1 << 30)))
        assert_pair(gpu.topk_abs(dev(x), 37), naive.topk_abs(x, 37))
        ia = np.sort(rng.choice(300, 90, replace=False))
        ib = np.sort(rng.choice(300, 70, replace=False))
        va, vb = rng.standard_normal(90), rng.standard_normal(70)
        assert_pair(
            gpu.merge_add(dev(ia), dev(va), dev(ib), dev(vb)), naive.merge_add(ia, va, ib, vb)
        )
        idx = rng.integers(0, 60, 150)
        vals = rng.standard_normal(150).astype(np.float32)
        assert_pair(gpu.coalesce(dev(idx), dev(vals)), naive.coalesce(idx, vals))


# ---------------------------------------------------------------------------------------------
# bad input: the same exception type and message as the CPU kernels
# ---------------------------------------------------------------------------------------------

f32 = np.array([1.0, -2.0, 3.0], np.float32)
BAD_CALLS = [
    ("topk_abs", (np.zeros((2, 2), np.float32), 1), {}),
    ("topk_abs", (np.arange(3), 1), {}),
    ("topk_abs", (f32, 4), {}),
    ("topk_abs", (f32, -1), {}),
    ("topk_abs", (f32, 1.0), {}),
    ("topk_abs", (f32, 1), {"index_dtype": np.float32}),
    ("kth_largest_abs", (f32, 0), {}),
    ("select_above", (f32, "a"), {}),
    ("estimate_threshold", (f32, 1), {"sample_size": 0}),
    ("merge_add", (np.array([0, 3, 3]), np.ones(3), np.array([1]), np.ones(1)), {}),
    ("merge_add", (np.array([0]), np.ones(1), np.array([-1, 2]), np.ones(2)), {}),
    ("merge_add", (np.array([0]), np.ones(2), np.array([1]), np.ones(1)), {}),
    ("merge_add", (np.array([0]), np.ones(1), np.array([1]), np.ones(1, np.float32)), {}),
    ("coalesce", (np.array([1, -2]), np.ones(2)), {}),
    ("coalesce", (np.array([1, 2]), np.ones(3)), {}),
    ("gather", (np.ones(4), np.array([0, 4])), {}),
    ("gather", (np.ones(0), np.array([0])), {}),
    ("scatter_add", (np.ones(4), np.array([0, 4]), np.ones(2)), {}),
    ("scatter_add", (np.ones(4), np.array([0, 1]), np.ones(2, np.float32)), {}),
    ("block_offsets", (np.array([3, 1]), np.array([0, 4])), {}),
    ("block_offsets", (np.array([1, 3]), np.array([4, 0])), {}),
    # An index in no block: past the last bound, before the first, or with no bounds at all.
    ("block_offsets", (np.array([1, 5]), np.array([0, 4])), {}),
    ("block_offsets", (np.array([1, 3]), np.array([2, 4])), {}),
    ("block_offsets", (np.array([1]), np.array([1])), {}),
    ("block_offsets", (np.array([1]), np.array([], np.int64)), {}),
    ("balanced_bounds", (np.array([1, 9]), 5, 2), {}),
    ("balanced_bounds", (np.array([1]), 5, 0), {}),
]


@pytest.mark.parametrize("name,args,kwargs", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_like_the_cpu(name, args, kwargs):
    with pytest.raises((ValueError, TypeError)) as cpu_err:
        getattr(cpu, name)(*args, **kwargs)
    dargs = [dev(a) if isinstance(a, np.ndarray) else a for a in args]
    with pytest.raises(cpu_err.type) as gpu_err:
        getattr(gpu, name)(*dargs, **kwargs)
    assert str(gpu_err.value) == str(cpu_err.value)


# ---------------------------------------------------------------------------------------------
# surface and dispatch
# ---------------------------------------------------------------------------------------------


def test_namespace_is_the_fourteen_kernels():
    assert sorted(gpu.__all__) == sorted(cpu.__all__)
    for name in gpu.__all__:
        assert callable(getattr(gpu, name)) and "Parameters" in getattr(gpu, name).__doc__


def test_device_arrays_route_to_cuda_and_stay_on_device():
    d = dev(np.array([1.0, -3.0], np.float32))
    assert _dispatch.is_device_array(d)
    assert _dispatch.backend_for(d) is gpu
    i, v = sk.topk_abs(d, 2)
    assert _dispatch.is_device_array(i) and _dispatch.is_device_array(v)


def test_without_cuda_import_fails_with_one_clear_error():
    # a fresh interpreter with neither the simulator nor (here) a GPU
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = (
        "from numba import cuda\n"
        "if cuda.is_available():\n"
        "    print('HAS-GPU')\n"
        "else:\n"
        "    try:\n"
        "        import spardl_kernels.cuda\n"
        "    except ImportError as e:\n"
        "        print('IMPORT-ERROR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout
    if "HAS-GPU" in out:
        pytest.skip("a GPU is present")
    assert "IMPORT-ERROR" in out and "NUMBA_ENABLE_CUDASIM" in out


@real_gpu_only
def test_torch_cuda_tensors_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    g = torch.randn(1000, device="cuda")
    i, v = sk.topk_abs(g, 10)
    want = naive.topk_abs(g.cpu().numpy(), 10)
    assert_pair((i, v), want)
    dense = torch.zeros(1000, device="cuda")
    out = sk.scatter_add(dense, i, v)
    assert out is dense
    assert torch.equal(dense.cpu()[torch.as_tensor(want[0])], torch.as_tensor(want[1]))


# ---------------------------------------------------------------------------------------------
# bench/gpu.py: the CPU-side argument handling (the GPU part runs on real hardware only)
# ---------------------------------------------------------------------------------------------


def _bench_module():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "bench", "gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, root


def test_bench_gpu_arguments():
    mod, root = _bench_module()
    args = mod.parse_args(["out.json", "--sizes", "1000,2000", "--kernels", "topk_abs,copy"])
    assert args.sizes == [1000, 2000] and args.kernels == ["topk_abs", "copy"]
    assert mod.parse_args(["o.json"]).sizes == [25_000_000, 110_000_000]
    for bad in (
        ["o.json", "--sizes", "x"],
        ["o.json", "--kernels", "nope"],
        ["o.json", "--density", "0"],
        [],
    ):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    help_out = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "gpu.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_out.returncode == 0 and "json_path" in help_out.stdout


# ---------------------------------------------------------------------------------------------
# accumulate_topk
# ---------------------------------------------------------------------------------------------


def _same_values(got, want):
    """Equal dtype and bits: a NaN sum is the canonical NaN on both (docs/design.md §3.4)."""
    assert_bits_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_topk_matches_naive_and_cpu(dtype):
    g = nasty(dtype, seed=4)
    work = np.float32 if dtype == np.float16 else dtype
    e = (np.random.default_rng(5).standard_normal(g.shape[0]) * 0.1).astype(work)
    bounds = np.array([0, 40, 40, 101, 150])
    ks = np.array([7, 0, 61, 3])
    out = cuda.device_array(g.shape[0], work)
    x, i, v = gpu.accumulate_topk(dev(g), dev(e), ks, bounds, out=out)
    assert x is out
    for want in (naive.accumulate_topk(g, e, ks, bounds), cpu.accumulate_topk(g, e, ks, bounds)):
        _same_values(host(x), want[0])
        assert_bits_equal(host(i), want[1])
        _same_values(host(v), want[2])


def test_accumulate_topk_errors_match_the_cpu():
    g = np.arange(6, dtype=np.float32)
    for args in (
        (g, g.astype(np.float64), [1], [0, 6]),
        (g, g, [7], [0, 6]),
        (g, g, [1], [0, 5]),
    ):
        with pytest.raises((TypeError, ValueError)) as cpu_err:
            cpu.accumulate_topk(*args)
        with pytest.raises(cpu_err.type) as gpu_err:
            gpu.accumulate_topk(dev(args[0]), dev(args[1]), *args[2:])
        assert str(gpu_err.value) == str(cpu_err.value)
    d = dev(g)
    with pytest.raises(ValueError, match="^out"):
        gpu.accumulate_topk(d, dev(g), [1], [0, 6], out=d)


# ---------------------------------------------------------------------------------------------
# canonical NaN: every summing kernel writes the same bits on the CPU and the GPU, whatever NaN
# the hardware (here: NumPy, under the simulator) makes of NaN + x or inf - inf
# ---------------------------------------------------------------------------------------------

_LAYOUT = {
    np.dtype(np.float16): (1 << 15, 0x7C00, 10),
    np.dtype(np.float32): (1 << 31, 0x7F800000, 23),
    np.dtype(np.float64): (1 << 63, 0x7FF0000000000000, 52),
}
NAN_SETTINGS = settings(max_examples=5, deadline=None)


def nan_mix(data, dtype, size):
    """``size`` values from bit patterns: NaNs of any payload and sign (quiet and signalling),
    ±inf, ±0.0, ±1.5 and the largest finite value."""
    dtype = np.dtype(dtype)
    sign, exp, frac = _LAYOUT[dtype]
    onehalf = int(np.array([1.5], dtype).view(naive.UNSIGNED[dtype])[0])
    magnitude = st.one_of(
        st.integers(1, (1 << frac) - 1).map(lambda p: exp | p),
        st.sampled_from([exp, 0, onehalf, exp - 1]),
    )
    element = st.tuples(st.booleans(), magnitude).map(lambda t: t[1] | (sign if t[0] else 0))
    return np.array(
        data.draw(st.lists(element, min_size=size, max_size=size)), naive.UNSIGNED[dtype]
    ).view(dtype)


def assert_unsigned_bits_equal(got, want):
    """Same dtype and shape, and equal as unsigned-integer views (floats), or equal (indices)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":
        got, want = naive.bits(got), naive.bits(want)
    np.testing.assert_array_equal(got, want)


def _sorted_unique(data, size):
    return np.array(sorted(data.draw(st.sets(st.integers(0, 7), max_size=size))), np.int64)


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_merge_add_nan_bits_cpu_equals_gpu(data, dtype):
    ia, ib = _sorted_unique(data, 6), _sorted_unique(data, 6)
    va, vb = nan_mix(data, dtype, ia.shape[0]), nan_mix(data, dtype, ib.shape[0])
    want = cpu.merge_add(ia, va, ib, vb)
    got = gpu.merge_add(dev(ia), dev(va), dev(ib), dev(vb))
    for g, w in zip(got, want, strict=True):
        assert_unsigned_bits_equal(host(g), w)
    with np.errstate(all="ignore"):
        assert_unsigned_bits_equal(want[1], naive.merge_add(ia, va, ib, vb)[1])


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_coalesce_nan_bits_cpu_equals_gpu(data, dtype):
    idx = np.array(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=8)), np.int64)
    vals = nan_mix(data, dtype, idx.shape[0])
    want = cpu.coalesce(idx, vals)
    got = gpu.coalesce(dev(idx), dev(vals))
    for g, w in zip(got, want, strict=True):
        assert_unsigned_bits_equal(host(g), w)


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_scatter_add_nan_bits_cpu_equals_gpu(data, dtype):
    dense = nan_mix(data, dtype, 5)
    idx = np.array(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=8)), np.int64)
    vals = nan_mix(data, dtype, idx.shape[0])
    want = cpu.scatter_add(dense.copy(), idx, vals)
    d = dev(dense)
    gpu.scatter_add(d, dev(idx), dev(vals))
    assert_unsigned_bits_equal(host(d), want)


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_accumulate_topk_nan_bits_cpu_equals_gpu(data, dtype):
    work = np.float32 if dtype == np.float16 else dtype
    g, e = nan_mix(data, dtype, 9), nan_mix(data, work, 9)
    ks, bounds = np.array([2, 3]), np.array([0, 4, 9])
    want = cpu.accumulate_topk(g, e, ks, bounds)
    got = gpu.accumulate_topk(dev(g), dev(e), ks, bounds)
    for a, b in zip(got, want, strict=True):
        assert_unsigned_bits_equal(host(a), b)


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_cast_and_canonicalize_nan_bits_cpu_equals_gpu(data, dtype):
    from spardl_kernels.cpu import arrays as host_ops
    from spardl_kernels.cuda import arrays as device_ops

    x = nan_mix(data, dtype, 7)
    for target in (np.float16, np.float32, np.float64):
        with np.errstate(over="ignore", invalid="ignore"):
            assert_unsigned_bits_equal(
                host(device_ops.cast(dev(x), target)), host_ops.cast(x, target)
            )
    d = dev(x)
    device_ops.canonicalize(d)
    assert_unsigned_bits_equal(host(d), host_ops.canonicalize(x.copy()))


def test_cast_and_canonicalize_errors_match_the_cpu():
    """A 2-D array, a non-native target dtype or a non-float target: the CPU function's error,
    word for word (the device twins took them and wrote wrong bits or raised Numba's error)."""
    from spardl_kernels.cpu import arrays as host_ops
    from spardl_kernels.cuda import arrays as device_ops

    cases = [
        ("cast", np.ones((2, 2), np.float32), (np.float16,)),
        ("cast", np.ones((2, 2), np.float64), (np.float32,)),
        ("cast", np.array([np.nan, 1.0]), (">f4",)),
        ("canonicalize", np.ones((2, 2)), ()),
        ("canonicalize", np.ones(3, np.int32), ()),
    ]
    for name, a, args in cases:
        with pytest.raises((TypeError, ValueError)) as cpu_err:
            getattr(host_ops, name)(a.copy(), *args)
        with pytest.raises(cpu_err.type) as gpu_err:
            getattr(device_ops, name)(dev(a), *args)
        assert str(gpu_err.value) == str(cpu_err.value)


@NAN_SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_dense_passes_nan_bits_cpu_equals_gpu(data, dtype):
    from spardl_kernels.cpu import arrays as host_ops
    from spardl_kernels.cuda import arrays as device_ops

    x = nan_mix(data, dtype, 7)
    for name, args in (("divide_max_abs", (3,)), ("canonical_count_nonfinite", ())):
        want = x.copy()
        got = getattr(host_ops, name)(want, *args)
        d = dev(x)
        assert getattr(device_ops, name)(d, *args) == got
        assert_unsigned_bits_equal(host(d), want)
    want = np.empty_like(x)
    peak = host_ops.divide_max_abs(x, 3, out=want)
    d = dev(np.zeros_like(x))
    assert device_ops.divide_max_abs(dev(x), 3, out=d) == peak
    assert_unsigned_bits_equal(host(d), want)
    with pytest.raises(TypeError, match="^x: dtype"):
        device_ops.divide_max_abs(dev(np.ones(3, np.float16)), 2)
    with pytest.raises(ValueError, match="^s: "):
        device_ops.divide_max_abs(dev(x), 0)
    with pytest.raises(ValueError, match="^out: length"):
        device_ops.divide_max_abs(dev(x), 2, out=dev(np.ones(len(x) + 1, dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 1e-40, np.nan, np.inf])
def test_accumulate_above_matches_naive_and_cpu(dtype, threshold):
    g = nasty(dtype, seed=6)
    work = np.float32 if dtype == np.float16 else dtype
    e = (np.random.default_rng(7).standard_normal(g.shape[0]) * 0.1).astype(work)
    out = cuda.device_array(g.shape[0], work)
    x, i, v = gpu.accumulate_above(dev(g), dev(e), threshold, out=out)
    assert x is out
    for want in (naive.accumulate_above(g, e, threshold), cpu.accumulate_above(g, e, threshold)):
        _same_values(host(x), want[0])
        assert_bits_equal(host(i), want[1])
        _same_values(host(v), want[2])


def test_accumulate_above_errors_match_the_cpu():
    g = np.arange(6, dtype=np.float32)
    for args in ((g, g.astype(np.float64), 1.0), (g, g[:5], 1.0), (g, g, "1")):
        with pytest.raises((TypeError, ValueError)) as cpu_err:
            cpu.accumulate_above(*args)
        with pytest.raises(cpu_err.type) as gpu_err:
            gpu.accumulate_above(dev(args[0]), dev(args[1]), args[2])
        assert str(gpu_err.value) == str(cpu_err.value)
