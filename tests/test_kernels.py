"""Property tests: every CPU kernel equals its NumPy reference in tests/naive.py bit for bit."""

import contextlib

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import spardl_kernels as sk
from spardl_kernels import config
from spardl_kernels.cpu import arrays as host_arrays
from spardl_kernels.cpu._simd import hit_mask, not_below_mask
from tests import naive

DTYPES = [np.float16, np.float32, np.float64]
SETTINGS = settings(deadline=None, max_examples=60)

# values drawn from a tiny set make heavy ties; the special values are the ones the total order
# has to place: NaN above inf, -0.0 == 0.0, sign ignored
SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, np.inf, -np.inf, np.nan]


def _numpy_vector(seed, size, dtype, kind):
    """A large vector from NumPy (hypothesis draws only the seed: big draws are slow)."""
    rng = np.random.default_rng(seed)
    if kind == 0:  # heavy ties and every special value
        return rng.choice(np.array(SPECIAL, dtype), size)
    x = rng.laplace(size=size) * 10.0 ** rng.integers(-3, 3, size)
    x[rng.random(size) < 0.3] = 0.0  # gradients have many exact zeros
    x[rng.random(size) < 0.01] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0]))
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@st.composite
def vectors(draw, max_size=300, dtype=None):
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    if draw(st.integers(0, 9)) == 0:
        # sometimes large enough for the radix path with the default cutoff
        size = draw(st.sampled_from([600, 10_000]))
        return _numpy_vector(draw(st.integers(0, 2**32)), size, dtype, draw(st.integers(0, 1)))
    size = draw(st.one_of(st.integers(0, 40), st.integers(0, max_size)))
    width = np.dtype(dtype).itemsize * 8
    elements = draw(
        st.sampled_from(
            [
                st.sampled_from(SPECIAL),
                st.sampled_from([0.0, -0.0, 3.0, -3.0]),
                st.floats(width=width, allow_nan=True, allow_infinity=True),
                st.floats(-10, 10, width=width),
            ]
        )
    )
    return draw(hnp.arrays(dtype, size, elements=elements))


@contextlib.contextmanager
def tuning(cutoff=None, lanes=None, chunk=None, window_min_n=None, sigmas=None):
    """Patch config (the wrappers read it per call) to reach every code path on small inputs."""
    names = ["SMALL_N_CUTOFF", "HIST_LANES", "SELECT_CHUNK", "WINDOW_MIN_N", "WINDOW_SIGMAS"]
    saved = {name: getattr(config, name) for name in names}
    try:
        for name, value in zip(names, (cutoff, lanes, chunk, window_min_n, sigmas), strict=True):
            if value is not None:
                setattr(config, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def same_bits(a, b):
    """Equal dtype, shape and values, NaN == NaN, and signs of zeros equal."""
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        assert (nan == np.isnan(b)).all()
        assert (a[~nan] == b[~nan]).all()
        assert (np.signbit(a[~nan]) == np.signbit(b[~nan])).all()
    else:
        assert (a == b).all()


def same_pair(got, ref):
    same_bits(got[0], ref[0])
    same_bits(got[1], ref[1])


# (cutoff, lanes, chunk, window_min_n, sigmas): default; radix only; sampled window (wide, and
# so narrow that it often misses and falls back to the radix passes)
paths = st.sampled_from(
    [
        (None, None, None, None, None),
        (0, 4, None, 1 << 62, None),
        (0, 1, None, 1 << 62, None),
        (0, 3, None, 1 << 62, None),
        (0, 4, None, 0, None),
        (0, 4, None, 0, 0.0),
        (0, 4, None, 0, 1.0),
    ]
)


@SETTINGS
@given(x=vectors(), data=st.data(), path=paths)
def test_topk_abs(x, data, path):
    k = data.draw(st.one_of(st.just(0), st.just(x.shape[0]), st.integers(0, x.shape[0])))
    with tuning(*path):
        got = sk.topk_abs(x, k)
    same_pair(got, naive.topk_abs(x, k))


@SETTINGS
@given(x=vectors(), data=st.data(), path=paths)
def test_kth_largest_abs_and_select_superset(x, data, path):
    if x.shape[0] == 0:
        return
    k = data.draw(st.integers(1, x.shape[0]))
    with tuning(*path):
        t = sk.kth_largest_abs(x, k)
        idx, _ = sk.select_above(x, t)
        top, _ = sk.topk_abs(x, k)
    same_bits(np.array([t]), np.array([naive.kth_largest_abs(x, k)]))
    assert np.isin(top, idx).all()
    assert sk.count_above(x, t) == idx.shape[0] >= k


thresholds = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 0.5, 1.0, 2.0, 3.0, np.inf, -np.inf, np.nan, 1e-300, 7e4]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-5, 5),
)


@SETTINGS
@given(x=vectors(), t=thresholds, chunk=st.sampled_from([None, 1, 7, 64]))
def test_select_above_and_count_above(x, t, chunk):
    with tuning(chunk=chunk):
        got = sk.select_above(x, t)
    same_pair(got, naive.select_above(x, t))
    assert sk.count_above(x, t) == naive.count_above(x, t)


@SETTINGS
@given(x=vectors(), data=st.data())
def test_int32_indices(x, data):
    k = data.draw(st.integers(0, x.shape[0]))
    i, _ = sk.topk_abs(x, k, index_dtype=np.int32)
    assert i.dtype == np.int32
    same_pair(sk.topk_abs(x, k, index_dtype=np.int32), naive.topk_abs(x, k, index_dtype=np.int32))
    j, _ = sk.select_above(x, 1.0, index_dtype=np.int32)
    assert j.dtype == np.int32
    same_bits(j, naive.select_above(x, 1.0, index_dtype=np.int32)[0])


@SETTINGS
@given(x=vectors(max_size=2000), data=st.data())
def test_estimate_threshold(x, data):
    n = x.shape[0]
    k = data.draw(st.integers(0, n))
    s = data.draw(st.integers(1, max(1, 2 * n)))
    seed = data.draw(st.integers(0, 2**70))
    got = sk.estimate_threshold(x, k, sample_size=s, seed=seed)
    ref = naive.estimate_threshold(x, k, sample_size=s, seed=seed)
    assert got == ref or (np.isnan(got) and np.isnan(ref))
    assert got == sk.estimate_threshold(x, k, sample_size=s, seed=seed) or np.isnan(got)


@st.composite
def sparse_vectors(draw, dtype, unique=True, max_index=60):
    itype = draw(st.sampled_from([np.int64, np.int32]))
    if draw(st.integers(0, 9)) == 0:
        rng = np.random.default_rng(draw(st.integers(0, 2**32)))
        m = 3000
        idx = rng.choice(4 * m, m, replace=not unique)
        idx = np.sort(idx) if unique else idx
        return idx.astype(itype), _numpy_vector(rng.integers(2**32), m, dtype, rng.integers(2))
    m = draw(st.integers(0, 30))
    idx = draw(hnp.arrays(np.int64, m, elements=st.integers(0, max_index), unique=unique))
    if unique:
        idx = np.sort(idx)
    width = np.dtype(dtype).itemsize * 8
    vals = draw(hnp.arrays(dtype, m, elements=st.floats(width=width) | st.sampled_from(SPECIAL)))
    return idx.astype(itype), vals


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_merge_add(data, dtype):
    ia, va = data.draw(sparse_vectors(dtype))
    ib, vb = data.draw(sparse_vectors(dtype))
    with np.errstate(all="ignore"):
        ref = naive.merge_add(ia, va, ib, vb)
    same_pair(sk.merge_add(ia, va, ib, vb), ref)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_coalesce(data, dtype):
    idx, vals = data.draw(sparse_vectors(dtype, unique=False, max_index=8))
    if data.draw(st.booleans()):
        order = np.argsort(idx, kind="stable")
        idx, vals = idx[order], vals[order]  # the already-sorted fast path
    with np.errstate(all="ignore"):
        ref = naive.coalesce(idx, vals)
    same_pair(sk.coalesce(idx, vals), ref)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), runs=st.integers(2, 70))
def test_coalesce_of_sorted_runs(data, dtype, runs):
    """A concatenation of sorted vectors (an all-gather's output) takes the run-merge path."""
    parts = [data.draw(sparse_vectors(dtype, max_index=50)) for _ in range(runs)]
    idx = np.concatenate([p[0].astype(np.int64) for p in parts])
    vals = np.concatenate([p[1] for p in parts])
    with np.errstate(all="ignore"):
        ref = naive.coalesce(idx, vals)
    same_pair(sk.coalesce(idx, vals), ref)


@pytest.mark.parametrize("runs", [1, 2, 3, 64, 65, 2000])
def test_coalesce_run_counts(runs):
    """Odd and even run counts, and many short runs, agree with the reference bit for bit."""
    rng = np.random.default_rng(runs)
    idx = np.concatenate([np.sort(rng.integers(0, 3000, 40)) for _ in range(runs)])
    vals = rng.standard_normal(idx.size).astype(np.float32) * np.float32(1e4)
    same_pair(sk.coalesce(idx, vals), naive.coalesce(idx, vals))


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_scatter_add_and_gather(data, dtype):
    dense = data.draw(vectors(max_size=100, dtype=dtype))
    n = dense.shape[0]
    if n == 0:
        return
    m = data.draw(st.integers(0, 3 * n))
    idx = data.draw(hnp.arrays(np.int64, m, elements=st.integers(0, n - 1)))
    vals = data.draw(vectors(dtype=dtype))
    vals = np.resize(vals, m) if vals.shape[0] else np.zeros(m, dtype)
    idx = idx.astype(data.draw(st.sampled_from([np.int64, np.int32])))
    ref = dense.copy()
    with np.errstate(all="ignore"):
        naive.scatter_add(ref, idx, vals)
    got = dense.copy()
    out = sk.scatter_add(got, idx, vals)
    assert out is got
    same_bits(got, ref)
    same_bits(sk.gather(dense, idx), naive.gather(dense, idx))


@SETTINGS
@given(n=st.integers(0, 2**62), P=st.integers(1, 70))
def test_uniform_bounds(n, P):
    b = sk.uniform_bounds(n, P)
    same_bits(b, naive.uniform_bounds(n, P))
    lengths = np.diff(b)
    assert (lengths[: n % P] == n // P + 1).all() and (lengths[n % P :] == n // P).all()


@SETTINGS
@given(data=st.data(), P=st.integers(1, 9))
def test_balanced_bounds_and_block_offsets(data, P):
    n = data.draw(st.integers(1, 10**6))
    m = data.draw(st.integers(0, 50))
    idx = data.draw(hnp.arrays(np.int64, m, elements=st.integers(0, n - 1)))
    b = sk.balanced_bounds(idx, n, P)
    same_bits(b, naive.balanced_bounds(idx, n, P))
    assert b[0] == 0 and b[-1] == n and (np.diff(b) >= 0).all()
    u = np.unique(idx).astype(data.draw(st.sampled_from([np.int64, np.int32])))
    for bounds in (b, sk.uniform_bounds(n, P)):
        same_bits(sk.block_offsets(u, bounds), naive.block_offsets(u, bounds))


# ---------------------------------------------------------------------------------------------
# beyond 2**31 and 2**32: exact int64 arithmetic, no dense array needed
# ---------------------------------------------------------------------------------------------


def test_indices_above_2_31_are_exact():
    n = 2**33 + 5
    b = sk.uniform_bounds(n, 3)
    same_bits(b, naive.uniform_bounds(n, 3))
    idx = np.array([1, 2**31 + 1, 2**32 + 3, 2**33 + 1, 2**33 + 4], np.int64)
    bb = sk.balanced_bounds(idx, n, 4)
    same_bits(bb, np.array([0, 2**31 + 1, 2**32 + 3, 2**33 + 1, n]))
    same_bits(sk.block_offsets(idx, b), naive.block_offsets(idx, b))
    i, v = sk.merge_add(idx, np.ones(5), idx[1:] + 1, np.ones(4))
    same_bits(i, np.sort(np.concatenate([idx, idx[1:] + 1])))
    ci, cv = sk.coalesce(idx[::-1].copy(), np.arange(5.0))
    same_bits(ci, idx)
    with pytest.raises(ValueError, match="index_dtype"):
        sk.topk_abs(
            np.lib.stride_tricks.as_strided(np.zeros(1), (2**31 + 1,), (0,)),
            1,
            index_dtype=np.int32,
        )


def test_gather_scatter_add_above_2_31_on_a_strided_view():
    # A zero-stride view of length > 2**31 costs no memory; the kernels must index it exactly.
    base = np.zeros(1, np.float32)
    dense = np.lib.stride_tricks.as_strided(base, (2**31 + 10,), (0,))
    assert sk.gather(dense, np.array([2**31 + 9], np.int64))[0] == 0.0
    with pytest.raises(ValueError, match="indices"):
        sk.gather(dense, np.array([2**31 + 10], np.int64))


# ---------------------------------------------------------------------------------------------
# invalid input: ValueError/TypeError naming the argument
# ---------------------------------------------------------------------------------------------

X = np.arange(6, dtype=np.float32)
I = np.array([0, 2, 4])
V = np.ones(3)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda: sk.topk_abs(X.reshape(2, 3), 1), ValueError, "x"),
        (lambda: sk.topk_abs(X.astype(np.int64), 1), TypeError, "x"),
        (lambda: sk.topk_abs(X, -1), ValueError, "k"),
        (lambda: sk.topk_abs(X, 7), ValueError, "k"),
        (lambda: sk.topk_abs(X, 2.0), TypeError, "k"),
        (lambda: sk.topk_abs(X, True), TypeError, "k"),
        (lambda: sk.topk_abs(X, 1, index_dtype=np.float32), TypeError, "index_dtype"),
        (lambda: sk.kth_largest_abs(X, 0), ValueError, "k"),
        (lambda: sk.kth_largest_abs(X[:0], 1), ValueError, "k"),
        (lambda: sk.select_above(X, "a"), TypeError, "threshold"),
        (lambda: sk.select_above(X, [1.0]), TypeError, "threshold"),
        (lambda: sk.count_above(X[None], 1.0), ValueError, "x"),
        (lambda: sk.estimate_threshold(X, 7), ValueError, "k"),
        (lambda: sk.estimate_threshold(X, 1, sample_size=0), ValueError, "sample_size"),
        (lambda: sk.estimate_threshold(X, 1, seed=1.5), TypeError, "seed"),
        (lambda: sk.merge_add(I[::-1], V, I, V), ValueError, "ia"),
        (lambda: sk.merge_add(I, V, np.array([1, 1, 2]), V), ValueError, "ib"),
        (lambda: sk.merge_add(I, V, -I[::-1], V), ValueError, "ib"),
        (lambda: sk.merge_add(I, V[:2], I, V), ValueError, "va"),
        (lambda: sk.merge_add(I, V, I, V.astype(np.float32)), TypeError, "vb"),
        (lambda: sk.merge_add(I.astype(np.float64), V, I, V), TypeError, "ia"),
        (lambda: sk.merge_add(I.astype(np.uint64), V, I, V), TypeError, "ia"),
        (lambda: sk.coalesce(np.array([1, -1]), np.ones(2)), ValueError, "indices"),
        (lambda: sk.coalesce(I, np.ones(2)), ValueError, "values"),
        (lambda: sk.uniform_bounds(-1, 2), ValueError, "n"),
        (lambda: sk.uniform_bounds(5, 0), ValueError, "P"),
        (lambda: sk.uniform_bounds(5, 2**63), ValueError, "P: must be <= 2\\*\\*31 - 1"),
        (lambda: sk.balanced_bounds(I, 9, 2**31), ValueError, "P: must be <= 2\\*\\*31 - 1"),
        (lambda: sk.uniform_bounds(5.0, 2), TypeError, "n"),
        (lambda: sk.balanced_bounds(np.array([0, 9]), 9, 2), ValueError, "indices"),
        (lambda: sk.balanced_bounds(I, 9, 0), ValueError, "P"),
        (lambda: sk.block_offsets(np.array([0, 2, 2]), I), ValueError, "indices"),
        (lambda: sk.block_offsets(np.array([2, 0]), I), ValueError, "indices"),
        (lambda: sk.block_offsets(I, I[::-1]), ValueError, "bounds"),
        (lambda: sk.block_offsets(I, np.array([0, 1])), ValueError, "indices: every index must"),
        (lambda: sk.block_offsets(I, np.array([1, 9])), ValueError, "indices: every index must"),
        (lambda: sk.block_offsets(I, np.array([0])), ValueError, "indices: every index must"),
        (lambda: sk.block_offsets(I, np.array([], np.int64)), ValueError, "indices: every index"),
        (lambda: sk.scatter_add(np.zeros(3), np.array([3]), np.ones(1)), ValueError, "indices"),
        (lambda: sk.scatter_add(np.zeros(3), np.array([-1]), np.ones(1)), ValueError, "indices"),
        (lambda: sk.scatter_add(np.zeros(3), I[:1], np.ones(2)), ValueError, "values"),
        (lambda: sk.scatter_add(np.zeros(3), I[:1], np.ones(1, np.float32)), TypeError, "values"),
        (lambda: sk.gather(np.zeros(3), np.array([5])), ValueError, "indices"),
        (lambda: sk.gather(np.zeros(0), np.array([0])), ValueError, "indices"),
        (lambda: sk.accumulate_topk(X, X.astype(np.float64), [1], [0, 6]), TypeError, "e"),
        (lambda: sk.accumulate_topk(X, X[:5], [1], [0, 6]), ValueError, "e"),
        (lambda: sk.accumulate_topk(X, X, [1], [0, 5]), ValueError, "bounds"),
        (lambda: sk.accumulate_topk(X, X, [1], [0.0, 6.0]), TypeError, "bounds"),
        (lambda: sk.accumulate_topk(X, X, [7], [0, 6]), ValueError, "ks"),
        (lambda: sk.accumulate_topk(X, X, [1, 1], [0, 6]), ValueError, "ks"),
        (lambda: sk.accumulate_topk(X, X, [1], [0, 6], out=X), ValueError, "out"),
        (lambda: sk.accumulate_topk(X, X, [1], [0, 6], out=np.zeros(5)), ValueError, "out"),
    ],
)
def test_invalid_input_names_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        call()


def test_scatter_add_error_writes_nothing_and_read_only_rejected():
    d = np.zeros(3)
    with pytest.raises(ValueError, match="indices"):
        sk.scatter_add(d, np.array([0, 1, 7]), np.ones(3))
    assert (d == 0).all()
    d.flags.writeable = False
    with pytest.raises(ValueError, match="dense"):
        sk.scatter_add(d, np.array([0]), np.ones(1))


def test_in_place_targets_that_numpy_can_only_copy_are_refused():
    """A list as an in-place target would receive the writes in a temporary copy and come back
    unchanged: a TypeError naming it. A buffer NumPy views (array.array) is written."""
    import array

    g, e = np.ones(4, np.float32), np.zeros(4, np.float32)
    bounds = np.array([0, 4], np.int64)
    calls = {
        "dense": lambda t: sk.scatter_add(t, np.array([1]), np.ones(1)),
        "out": lambda t: sk.accumulate_above(g, e, 0.5, out=t),
        "x": lambda t: host_arrays.divide_max_abs(t, 2),
        "s": lambda t: host_arrays.zero_members(t, np.array([0]), np.array([0])),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"^{name} is written in place"):
            call([0.0, 0.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="^out is written in place"):
        sk.accumulate_topk(g, e, np.array([1]), bounds, out=[0.0] * 4)
    with pytest.raises(TypeError, match="^x is written in place"):
        host_arrays.canonicalize([float("nan")])
    buf = array.array("d", [0.0, 0.0, 0.0])
    sk.scatter_add(buf, np.array([1]), np.ones(1))
    assert list(buf) == [0.0, 1.0, 0.0]


def test_cast_and_canonicalize_refuse_what_their_bits_would_get_wrong():
    """The canonical NaN's bits are native: a big-endian array or target dtype would turn a NaN
    into a tiny finite number, so it is a TypeError; a 2-D array is a ValueError naming it."""
    big = np.array([1.0, np.nan], ">f8")
    with pytest.raises(TypeError, match="^x: dtype must be in native byte order"):
        host_arrays.canonicalize(big)
    with pytest.raises(TypeError, match="^a: dtype must be in native byte order"):
        host_arrays.cast(big, np.float32)
    with pytest.raises(TypeError, match="^dtype: must be in native byte order"):
        host_arrays.cast(np.array([np.nan, 3.0]), ">f4")
    for dt in (np.float16, np.float32):
        with pytest.raises(ValueError, match="^a: expected a 1-D array"):
            host_arrays.cast(np.ones((2, 2), dt), np.float32 if dt == np.float16 else np.float16)
    with pytest.raises(ValueError, match="^x: expected a 1-D array"):
        host_arrays.canonicalize(np.ones((2, 2)))
    with pytest.raises(TypeError, match="^x: dtype must be float16"):
        host_arrays.canonicalize(np.ones(2, np.int32))
    ro = np.array([np.nan])
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="^x: array is read-only"):
        host_arrays.canonicalize(ro)
    assert np.isnan(host_arrays.cast(np.array([np.nan, 3.0]), np.float32)[0])


def test_accepts_cpu_torch_tensors_and_strided_views():
    torch = pytest.importorskip("torch")
    t = torch.tensor([0.5, -3.0, 2.0, -0.0])
    i, v = sk.topk_abs(t, 2)
    assert isinstance(i, np.ndarray) and i.tolist() == [1, 2] and v.tolist() == [-3.0, 2.0]
    d = torch.zeros(4)
    assert sk.scatter_add(d, np.array([1, 1]), np.ones(2, np.float32)) is d
    assert d.tolist() == [0.0, 2.0, 0.0, 0.0]
    x = np.arange(20, dtype=np.float64)[::-3]
    same_pair(sk.topk_abs(x, 3), naive.topk_abs(x, 3))
    same_pair(sk.select_above(x, 5.0), naive.select_above(x, 5.0))


@njit
def _masks(a, xs, s, stop, K, mask, t):
    return hit_mask(a, s, stop, K, mask), not_below_mask(xs, s, stop, t)


@SETTINGS
@given(x=vectors(), data=st.data(), step=st.sampled_from([1, 1, 2, -3]))
def test_hit_masks_of_64_entries(x, data, step):
    """The vector-compare masks of 64 entries (full blocks, C-contiguous or strided) and of a
    last, short block equal the per-entry tests."""
    x = np.concatenate([x, x[::-1], x])[::step]
    if x.shape[0] == 0:
        return
    kinfo = {np.float16: np.int16, np.float32: np.int32, np.float64: np.int64}[x.dtype.type]
    bits = x.view(kinfo)  # a strided view keeps its stride
    mask = kinfo(np.iinfo(kinfo).max)
    K = kinfo(data.draw(st.integers(0, int(mask))))
    t = data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, np.inf, np.nan]))
    # float16: the integer view and an integer t, as the scans pass them (never used there)
    xs, t = (bits, kinfo(0)) if x.dtype == np.float16 else (x, x.dtype.type(t))
    s = data.draw(st.integers(0, x.shape[0]))
    stop = min(s + 64, x.shape[0])  # a full block, the last, short one, or none (s = stop)
    got_key, got_float = _masks(bits, xs, s, stop, K, mask, t)
    lanes = np.arange(stop - s)
    ref_key = int(sum(1 << int(l) for l in lanes if (int(bits[s + l]) & int(mask)) >= int(K)))
    assert int(got_key) == ref_key
    if x.dtype != np.float16:
        with np.errstate(invalid="ignore"):
            hits = ~(np.abs(x[s:stop]) < t)
        assert int(got_float) == int(sum(1 << int(l) for l in lanes if hits[l]))


def test_scans_of_strided_views_equal_the_contiguous_copy():
    """Strided inputs long enough for full 64-entry blocks and the sampled window."""
    rng = np.random.default_rng(5)
    for dtype in DTYPES:
        base = _numpy_vector(7, 3 * 70_000, dtype, 1)
        for view in (base[::3], base[::-2]):
            dense = view.copy()
            t = float(np.sort(np.abs(dense[~np.isnan(dense)]))[-700])
            same_pair(sk.select_above(view, t), naive.select_above(dense, t))
            assert sk.count_above(view, t) == naive.select_above(dense, t)[0].shape[0]
            k = int(rng.integers(1, 2000))
            with tuning(window_min_n=0):
                same_pair(sk.topk_abs(view, k), naive.topk_abs(dense, k))


@pytest.mark.parametrize("n", [64, 128, 4096, 1 << 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scans_whose_length_is_a_multiple_of_64(n, dtype):
    """No short last block: the scans must neither file the last full block twice nor read past
    the end (a last, empty block once did both)."""
    x = _numpy_vector(n, n, dtype, 1)
    work = np.float32 if dtype == np.float16 else dtype
    e = (_numpy_vector(n + 1, n, work, 1) * 1e-3).astype(work)
    t = float(np.sort(np.abs(x[~np.isnan(x)]))[-max(1, n // 50)])
    bounds = naive.uniform_bounds(n, 2)
    ks = np.diff(bounds) // 20 + 1
    with tuning(window_min_n=0), np.errstate(all="ignore"):
        for k in (1, n // 100 + 1):
            same_pair(sk.topk_abs(x, k), naive.topk_abs(x, k))
            same_bits(sk.kth_largest_abs(x, k), naive.kth_largest_abs(x, k))
        for got, want in zip(
            sk.accumulate_above(x, e, t), naive.accumulate_above(x, e, t), strict=True
        ):
            same_bits(got, want)
        for got, want in zip(
            sk.accumulate_topk(x, e, ks, bounds),
            naive.accumulate_topk(x, e, ks, bounds),
            strict=True,
        ):
            same_bits(got, want)
        same_bits(
            sk.estimate_threshold(x, n // 10 + 1, sample_size=n),
            naive.estimate_threshold(x, n // 10 + 1, sample_size=n),
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_selections_of_read_only_arrays(dtype):
    """Read-only inputs (np.frombuffer, memory maps) on every selection path, the sampled
    window included."""
    x = _numpy_vector(3, 70_003, dtype, 1)
    x.flags.writeable = False
    t = float(np.sort(np.abs(x[~np.isnan(x)]))[-500])
    for window_min_n in (None, 0):
        with tuning(window_min_n=window_min_n):
            same_pair(sk.topk_abs(x, 700), naive.topk_abs(x, 700))
            same_bits(sk.kth_largest_abs(x, 700), naive.kth_largest_abs(x, 700))
            same_pair(sk.select_above(x, t), naive.select_above(x, t))
            assert sk.count_above(x, t) == naive.count_above(x, t)


# ---------------------------------------------------------------------------------------------
# multithreaded CPU paths: thresholds patched down so tiny inputs take them; 1, 2 and 3 threads
# must give the serial result bit for bit
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def threaded(threads, **names):
    """Patch config.CPU_THREADS and the given size thresholds (the wrappers read them per call)."""
    names["CPU_THREADS"] = threads
    saved = {name: getattr(config, name) for name in names}
    try:
        for name, value in names.items():
            setattr(config, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@pytest.mark.parametrize(
    ("env", "cores", "share"),
    [
        ({}, 2, None),  # not under a launcher: Numba's own setting stands
        ({"MPI_LOCALNRANKS": "4"}, 2, 1),  # 4 ranks on 2 cores: one thread each
        ({"MPI_LOCALNRANKS": "2"}, 8, 4),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 8, 2),
        ({"MV2_COMM_WORLD_LOCAL_SIZE": "16"}, 8, 1),
        ({"MPI_LOCALNRANKS": "x"}, 8, None),  # not a count: ignored
    ],
)
def test_parallel_kernels_do_not_oversubscribe_the_node(monkeypatch, env, cores, share):
    """Under an MPI launcher the kernels' threads per rank are capped at cores / ranks on the
    node (with config.CPU_THREADS left at None); an explicit CPU_THREADS is used as given."""
    from spardl_kernels.cpu import _common

    for var in _common._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(_common.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(_common.numba, "get_num_threads", lambda: 8)
    monkeypatch.setattr(_common.numba.config, "NUMBA_NUM_THREADS", 8)
    _common.node_share.cache_clear()
    try:
        assert _common.node_share() == share
        assert _common.cpu_threads(1 << 20, 1) == (8 if share is None else share)
        assert _common.cpu_threads(10, 100) == 1
        with threaded(3):
            assert _common.cpu_threads(1 << 20, 1) == 3
    finally:
        _common.node_share.cache_clear()


@SETTINGS
@given(
    x=vectors(),
    t=thresholds,
    threads=st.sampled_from([1, 2, 3]),
    chunk=st.sampled_from([16, 20, 4096]),
    fraction=st.sampled_from([0.0, 1.0 / 32.0, 1.0]),
)
def test_select_above_and_count_above_threaded(x, t, threads, chunk, fraction):
    # fraction 0 gives each part room for one chunk only: the redo with full room runs
    ref = naive.select_above(x, t)
    with threaded(
        threads, SELECT_PARALLEL_MIN_N=0, SELECT_CHUNK=chunk, SELECT_INITIAL_FRACTION=fraction
    ):
        got = sk.select_above(x, t)
        count = sk.count_above(x, t)
        got32 = sk.select_above(x, t, index_dtype=np.int32)
    same_pair(got, ref)
    same_bits(got32[0], ref[0].astype(np.int32))
    assert count == naive.count_above(x, t)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), threads=st.sampled_from([1, 2, 3]))
def test_merge_add_threaded(data, dtype, threads):
    ia, va = data.draw(sparse_vectors(dtype))
    ib, vb = data.draw(sparse_vectors(dtype))
    if data.draw(st.booleans()):
        ib, vb = ia.copy(), vb[: ia.shape[0]] if vb.shape[0] >= ia.shape[0] else va[::-1].copy()
    with np.errstate(all="ignore"):
        ref = naive.merge_add(ia, va, ib, vb)
    with threaded(threads, MERGE_PARALLEL_MIN=0):
        got = sk.merge_add(ia, va, ib, vb)
    same_pair(got, ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_merge_add_threaded_rejects_unsorted_input(threads):
    good = np.arange(0, 40, 2)
    for bad in (np.array([0, 5, 5, 9]), np.array([3, 1]), np.array([-1, 2]), good[::-1].copy()):
        with threaded(threads, MERGE_PARALLEL_MIN=0), pytest.raises(ValueError, match="ib"):
            sk.merge_add(good, np.ones(good.shape[0]), bad, np.ones(bad.shape[0]))


def test_large_inputs_equal_for_every_thread_count():
    # real part sizes (several chunks and groups of 128 per part) on the default thresholds
    rng = np.random.default_rng(7)
    x = _numpy_vector(3, 300_001, np.float32, 1)
    ref = naive.select_above(x, 1.0)
    ia = np.sort(rng.choice(1_000_000, 70_000, replace=False))
    ib = np.sort(rng.choice(1_000_000, 50_000, replace=False))
    va = rng.standard_normal(ia.shape[0]).astype(np.float32)
    vb = rng.standard_normal(ib.shape[0]).astype(np.float32)
    mref = naive.merge_add(ia, va, ib, vb)
    for threads in (1, 2):
        with threaded(threads, MERGE_PARALLEL_MIN=1 << 16):
            same_pair(sk.select_above(x, 1.0), ref)
            assert sk.count_above(x, 1.0) == ref[0].shape[0]
            same_pair(sk.merge_add(ia, va, ib, vb), mref)


# ---------------------------------------------------------------------------------------------
# accumulate_topk: X = g + E and the top-k of blocks of X in one pass
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(x=vectors(), data=st.data(), path=paths)
def test_accumulate_topk(x, data, path):
    n = x.shape[0]
    work = np.float32 if x.dtype == np.float16 else x.dtype
    with np.errstate(all="ignore"):
        e = data.draw(st.sampled_from([0.0, 0.5, -1e-3])) * x[::-1].astype(work)
    P = data.draw(st.integers(1, 5))
    bounds = naive.uniform_bounds(n, P)
    lengths = np.diff(bounds)
    ks = np.array([data.draw(st.integers(0, int(length))) for length in lengths], np.int64)
    out = np.empty(n, work) if data.draw(st.booleans()) else None
    with tuning(*path):
        got = sk.accumulate_topk(x, e, ks, bounds, out=out)
    with np.errstate(all="ignore"):
        ref = naive.accumulate_topk(x, e, ks, bounds)
    for a, b in zip(got, ref, strict=True):
        same_bits(a, b)
    if out is not None:
        assert got[0] is out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("sigmas", [None, 0.0])
def test_accumulate_topk_fused_window_on_large_blocks(dtype, sigmas):
    # blocks above WINDOW_MIN_N take the fused pass (sigmas 0: a window that often misses, so
    # the fallback from the finished sum runs too); NaN, inf and ties included
    rng = np.random.default_rng(7)
    n = 3 * (1 << 15) + 11
    g = _numpy_vector(1, n, dtype, 1)
    work = np.float32 if dtype == np.float16 else dtype
    e = (rng.standard_normal(n) * 0.01).astype(work)
    bounds = naive.uniform_bounds(n, 2)
    for ks in ([n // 200, 0], [1, n // 2 - 5], [n // 2 + 1, 3]):
        with tuning(sigmas=sigmas):
            got = sk.accumulate_topk(g, e, np.array(ks), bounds)
        for a, b in zip(got, naive.accumulate_topk(g, e, np.array(ks), bounds), strict=True):
            same_bits(a, b)


THRESHOLDS_SMALL = st.sampled_from([0.0, 0.5, 1.0, 3.0, np.inf, np.nan, 1e-40])


@SETTINGS
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    threshold=THRESHOLDS_SMALL,
    window=st.sampled_from([0, 1 << 62]),
)
def test_summing_passes_with_streaming_stores(data, dtype, threshold, window):
    """STREAM_STORE_MIN_BYTES = 0 streams every X: blocks from out's first 64-byte boundary,
    non-temporal stores, hit bits recomputed from g and e. Into outs that start at every
    offset from a 64-byte boundary, both summing passes give NumPy's result bit for bit, the
    fused window (WINDOW_MIN_N 0; k about 1% of each block, where the window hits) and the
    plain sum (2**62) alike, from arrays shorter than a block to 10**5 entries."""
    large = data.draw(st.booleans())
    size = data.draw(st.integers(40_000, 100_000) if large else st.integers(0, 200))
    x = _numpy_vector(data.draw(st.integers(0, 2**32)), size, dtype, 1 if large else 0)
    if large:
        # 1% of one special value would fill the whole top 1%: the window is to select sums
        x[~np.isfinite(x)] = 1.0
    n = x.shape[0]
    work = np.float32 if x.dtype == np.float16 else x.dtype
    scales = [0.5, -1e-3] if large else [0.0, 0.5, -1e-3]
    with np.errstate(all="ignore"):
        e = data.draw(st.sampled_from(scales)) * x[::-1].astype(work)
    shift = data.draw(st.integers(0, 64 // np.dtype(work).itemsize - 1))
    raw = np.empty(n + 128, work)
    base = (-raw.ctypes.data % 64) // raw.itemsize
    out = raw[base + shift : base + shift + n]
    P = data.draw(st.integers(1, 5))
    bounds = naive.uniform_bounds(n, P)
    few = st.integers(0, 3).map(lambda d: d - 1)  # -1: all but none
    ks = np.array([int(m) // 100 + data.draw(few) for m in np.diff(bounds)], np.int64)
    ks = np.clip(ks, 0, np.diff(bounds))
    saved = config.STREAM_STORE_MIN_BYTES
    config.STREAM_STORE_MIN_BYTES = 0
    try:
        with tuning(cutoff=0, window_min_n=window):
            got_topk = sk.accumulate_topk(x, e, ks, bounds, out=out)
            got_topk = tuple(np.array(a, copy=True) for a in got_topk)
            got_above = sk.accumulate_above(x, e, threshold, out=out)
    finally:
        config.STREAM_STORE_MIN_BYTES = saved
    with np.errstate(all="ignore"):
        ref_topk = naive.accumulate_topk(x, e, ks, bounds)
        ref_above = naive.accumulate_above(x, e, threshold)
    for a, b in zip(got_topk + got_above, ref_topk + ref_above, strict=True):
        same_bits(a, b)


# ---------------------------------------------------------------------------------------------
# canonical NaN (docs/design.md §3.4): a computed NaN is one bit pattern, a copied one keeps its
# own; compared as unsigned bits, payloads included
# ---------------------------------------------------------------------------------------------

# (sign bit, exponent bits, fraction bits) of each value dtype
_LAYOUT = {
    np.dtype(np.float16): (1 << 15, 0x7C00, 10),
    np.dtype(np.float32): (1 << 31, 0x7F800000, 23),
    np.dtype(np.float64): (1 << 63, 0x7FF0000000000000, 52),
}


def nan_mix_elements(dtype):
    """Bit patterns: NaNs of any payload (quiet and signalling) and sign, ±inf, ±0.0, ±1, ±1.5
    and the largest finite value (so that sums overflow)."""
    sign, exp, frac = _LAYOUT[np.dtype(dtype)]
    one = int(np.array([1.0], dtype).view(naive.UNSIGNED[np.dtype(dtype)])[0])
    onehalf = int(np.array([1.5], dtype).view(naive.UNSIGNED[np.dtype(dtype)])[0])
    special = [exp, 0, one, onehalf, exp - 1]
    magnitude = st.one_of(
        st.integers(1, (1 << frac) - 1).map(lambda p: exp | p), st.sampled_from(special)
    )
    return st.tuples(st.booleans(), magnitude).map(lambda t: t[1] | (sign if t[0] else 0))


def nan_mix(data, dtype, size):
    """A value array of ``size`` entries drawn from :func:`nan_mix_elements`."""
    u = naive.UNSIGNED[np.dtype(dtype)]
    return data.draw(hnp.arrays(u, size, elements=nan_mix_elements(dtype))).view(dtype)


def assert_same_bits(got, want):
    """Equal dtype, shape and bit patterns (NaN payloads included; indices as they are)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":
        got, want = naive.bits(got), naive.bits(want)
    np.testing.assert_array_equal(got, want)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_merge_add_nan_bits(data, dtype):
    ia = np.sort(
        data.draw(hnp.arrays(np.int64, st.integers(0, 8), elements=st.integers(0, 9), unique=True))
    )
    ib = np.sort(
        data.draw(hnp.arrays(np.int64, st.integers(0, 8), elements=st.integers(0, 9), unique=True))
    )
    va, vb = nan_mix(data, dtype, ia.shape[0]), nan_mix(data, dtype, ib.shape[0])
    got = sk.merge_add(ia, va, ib, vb)
    with np.errstate(all="ignore"):
        want = naive.merge_add(ia, va, ib, vb)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_coalesce_nan_bits(data, dtype):
    idx = data.draw(hnp.arrays(np.int64, st.integers(0, 12), elements=st.integers(0, 4)))
    vals = nan_mix(data, dtype, idx.shape[0])
    got = sk.coalesce(idx, vals)
    with np.errstate(all="ignore"):
        want = naive.coalesce(idx, vals)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_scatter_add_nan_bits(data, dtype):
    dense = nan_mix(data, dtype, data.draw(st.integers(1, 6)))
    idx = data.draw(
        hnp.arrays(np.int64, st.integers(0, 10), elements=st.integers(0, dense.shape[0] - 1))
    )
    vals = nan_mix(data, dtype, idx.shape[0])
    got, want = dense.copy(), dense.copy()
    sk.scatter_add(got, idx, vals)
    with np.errstate(all="ignore"):
        naive.scatter_add(want, idx, vals)
    assert_same_bits(got, want)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), path=paths)
def test_accumulate_topk_nan_bits(data, dtype, path):
    n = data.draw(st.integers(0, 40))
    work = np.float32 if dtype == np.float16 else dtype
    g, e = nan_mix(data, dtype, n), nan_mix(data, work, n)
    bounds = naive.uniform_bounds(n, 2)
    ks = np.array([data.draw(st.integers(0, int(b))) for b in np.diff(bounds)])
    with tuning(*path):
        got = sk.accumulate_topk(g, e, ks, bounds)
    with np.errstate(all="ignore"):
        want = naive.accumulate_topk(g, e, ks, bounds)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b)


def test_accumulate_topk_nan_bits_without_the_fused_pass():
    # config.WINDOW_SELECT off: the sum runs apart from the selection, NaN canonical all the same
    g = np.array([np.inf, 1.0, np.nan, 2.0], np.float32)
    g.view(np.uint32)[2] |= 0x80000005  # a negative NaN with a payload
    e = np.array([-np.inf, np.nan, 0.5, 1.0], np.float32)
    saved = config.WINDOW_SELECT
    config.WINDOW_SELECT = False
    try:
        x, i, v = sk.accumulate_topk(g, e, [2], [0, 4])
    finally:
        config.WINDOW_SELECT = saved
    assert naive.bits(x).tolist() == [0x7FC00000] * 3 + [0x40400000]
    assert i.tolist() == [0, 1] and naive.bits(v).tolist() == [0x7FC00000] * 2


def test_float16_widening_is_exact_for_every_bit_pattern():
    from spardl_kernels.cpu._common import narrow_half, widen_half

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    w = widen_half(h)
    nan = np.isnan(h)
    assert_same_bits(w[~nan], h[~nan].astype(np.float32))
    hb = naive.bits(h[nan]).astype(np.uint32)
    want = ((hb & 0x8000) << 16) | 0x7F800000 | ((hb & 0x3FF) << 13)
    np.testing.assert_array_equal(naive.bits(w[nan]), want)
    assert_same_bits(narrow_half(w), h)
    assert naive.bits(narrow_half(np.array([np.nan, 70000.0], np.float32))).tolist() == [
        0x7E00,
        0x7C00,
    ]


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]), P=st.integers(1, 8))
def test_dense_divide_and_count_nan_bits(data, dtype, P):
    x = nan_mix(data, dtype, data.draw(st.integers(0, 12)))
    want = np.empty_like(x)
    with np.errstate(all="ignore"):
        peak = naive.divide_max_abs(x, P, want)
    got = np.full_like(x, 7)
    assert host_arrays.divide_max_abs(x, P, out=got) == peak
    assert_same_bits(got, want)
    got = x.copy()  # in place
    assert host_arrays.divide_max_abs(got, P) == peak
    assert_same_bits(got, want)
    got, want = x.copy(), x.copy()
    count = naive.canonical_count_nonfinite(want)
    assert host_arrays.canonical_count_nonfinite(got) == count
    assert_same_bits(got, want)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_layer_cast_and_canonicalize_nan_bits(data, dtype):
    """``cast`` between float16 and float32 moves NaN sign and payload by bits (the kernels'
    widening, its exact inverse back); other float pairs write the canonical NaN;
    ``canonicalize`` rewrites every NaN in place."""
    x = nan_mix(data, dtype, data.draw(st.integers(0, 12)))
    got = host_arrays.canonicalize(x.copy())
    assert_same_bits(got, naive.canonicalize(x))
    assert_same_bits(host_arrays.cast(x, dtype), x)  # same dtype: a bit copy
    for target in (np.float16, np.float32, np.float64):
        if target == dtype:
            continue
        got = host_arrays.cast(x, target)
        nan = np.isnan(x)
        with np.errstate(over="ignore", invalid="ignore"):
            assert_same_bits(got[~nan], x[~nan].astype(target))
        src_bits = naive.bits(x[nan]).astype(np.uint64)
        if (np.dtype(dtype).name, np.dtype(target).name) == ("float16", "float32"):
            want = ((src_bits & 0x8000) << 16) | 0x7F800000 | ((src_bits & 0x3FF) << 13)
        elif (np.dtype(dtype).name, np.dtype(target).name) == ("float32", "float16"):
            top = (src_bits >> 13) & 0x3FF
            want = ((src_bits >> 16) & 0x8000) | 0x7C00 | np.where(top == 0, 0x200, top)
        else:
            want = np.full(len(src_bits), naive.CANONICAL_NAN_BITS[np.dtype(target)])
        np.testing.assert_array_equal(naive.bits(got[nan]).astype(np.uint64), want)


@SETTINGS
@given(
    data=st.data(),
    dtype=st.sampled_from([np.float32, np.float64]),
    n=st.integers(1, 300),
    ascending=st.booleans(),
    bitmap=st.booleans(),
)
def test_member_passes_match_numpy(data, dtype, n, ascending, bitmap):
    """``zero_members``, ``set_outside`` and ``sub_members`` (the layer's undo-log passes)
    against NumPy's set membership, for ascending and shuffled positions (the merge path and
    the restarting one, and the bitmap path that large member sets take), with NaN payloads
    written as the canonical NaN."""
    saved = host_arrays.BITMAP_MIN_MEMBERS
    host_arrays.BITMAP_MIN_MEMBERS = 0 if bitmap else 1 << 62
    try:
        _member_passes_match_numpy(data, dtype, n, ascending)
    finally:
        host_arrays.BITMAP_MIN_MEMBERS = saved


def _member_passes_match_numpy(data, dtype, n, ascending):
    pick = st.lists(st.integers(0, n - 1), unique=True, max_size=n)
    idx = np.array(sorted(data.draw(pick)), dtype=np.int64)
    if not ascending:
        idx = np.array(data.draw(st.permutations(idx.tolist())), dtype=np.int64)
    members = np.array(sorted(data.draw(pick)), dtype=np.int64)
    vals = nan_mix(data, dtype, len(idx))
    s = nan_mix(data, dtype, n)
    hit = np.isin(idx, members)

    want = s.copy()
    want[idx[hit]] = 0
    assert_same_bits(host_arrays.zero_members(s.copy(), idx, members), want)

    want = s.copy()
    want[idx[~hit]] = vals[~hit]
    assert_same_bits(host_arrays.set_outside(s.copy(), idx, vals, members), want)

    want = s.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        want[idx[hit]] = naive.canonicalize(s[idx[hit]] + (-vals[hit]))
    assert_same_bits(host_arrays.sub_members(s.copy(), idx, vals, members), want)


def test_member_passes_restart_on_a_descent():
    """A position below the previous one is searched for from the start of ``members``."""
    members = np.array([2, 5, 7], np.int64)
    got = host_arrays.zero_members(np.ones(9, np.float32), np.array([7, 5, 2, 8]), members)
    np.testing.assert_array_equal(np.flatnonzero(got == 0), [2, 5, 7])


def test_member_passes_reject_bad_arguments():
    s = np.zeros(5, np.float32)
    idx = np.array([0, 3], np.int64)
    members = np.array([1, 3], np.int64)
    vals = np.ones(2, np.float32)
    for call, exc, match in (
        (lambda: host_arrays.set_outside(s, [0, 5], vals, members), ValueError, "^idx: pos"),
        (lambda: host_arrays.set_outside(s, [-1, 2], vals, members), ValueError, "^idx: pos"),
        (lambda: host_arrays.zero_members(s, idx, [3, 1]), ValueError, "^members: must be asc"),
        (lambda: host_arrays.zero_members(s, idx.astype(float), members), TypeError, "^idx: d"),
        (lambda: host_arrays.sub_members(s, idx, vals[:1], members), ValueError, "^vals: exp"),
        (
            lambda: host_arrays.sub_members(s, idx, vals.astype(np.float64), members),
            ValueError,
            "^vals",
        ),
        (lambda: host_arrays.zero_members(s.astype(np.int32), idx, members), TypeError, "^s: d"),
        (lambda: host_arrays.zero_members(s.reshape(1, 5), idx, members), ValueError, "^s: exp"),
    ):
        with pytest.raises(exc, match=match):
            call()
    assert not s.any()  # nothing was written


def test_dense_passes_reject_bad_arguments():
    x = np.ones(3, np.float32)
    for bad, exc, match in (
        (np.ones(3, np.float16), TypeError, "^x: dtype"),
        (np.ones((2, 2), np.float32), ValueError, "^x: expected a 1-D"),
        (np.ones(3, np.int64), TypeError, "^x: dtype"),
    ):
        with pytest.raises(exc, match=match):
            host_arrays.divide_max_abs(bad, 2)
        with pytest.raises(exc, match=match):
            host_arrays.canonical_count_nonfinite(bad)
        with pytest.raises(exc, match="^out" + match[2:]):
            host_arrays.divide_max_abs(x, 2, out=bad)
    y = np.ones(3)
    for out, exc, match in (
        (np.ones(4, np.float32), ValueError, "^out: length 4 does not match x"),
        (np.ones(3), TypeError, "^out: dtype float64 does not match x"),
        (x, ValueError, "^out: overlaps x"),
    ):
        with pytest.raises(exc, match=match):
            host_arrays.divide_max_abs(x if out is not x else x[::-1], 2, out=out)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="^x: array is read-only"):
        host_arrays.canonical_count_nonfinite(x)
    with pytest.raises(ValueError, match="^x: array is read-only"):
        host_arrays.divide_max_abs(x, 2)  # in place
    got = np.empty(3, np.float32)
    assert host_arrays.divide_max_abs(x, 2, out=got) == 0.5  # a read-only x is only read
    for s, exc in ((0, ValueError), (np.inf, ValueError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(exc, match="^s: "):
            host_arrays.divide_max_abs(y, s)
    assert (y == 1).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["subnormal", "nan", "full"])
def test_window_pass_outside_the_float_compares(dtype, kind):
    """The window pass tests keys with float compares only where they equal the integer test
    (a normal, non-NaN threshold): a k-th largest magnitude that is subnormal, or NaN (more than
    k NaNs), takes the integer test; a window whose lists fill up (k above the sample's
    estimate) keeps counting without writing past them. Every path equals the NumPy order."""
    rng = np.random.default_rng(11)
    n = 3 * (1 << 15) + 5
    tiny = np.finfo(dtype).smallest_subnormal
    if kind == "subnormal":
        x = (rng.integers(-1000, 1000, n) * tiny).astype(dtype)
        x[::997] = 1.0
    elif kind == "nan":
        x = rng.standard_normal(n).astype(dtype)
        x[rng.random(n) < 0.2] = np.nan
    else:
        x = rng.standard_normal(n).astype(dtype)
    e = np.zeros(n, dtype)
    for k in (n // 100, n // 5, n // 3):
        for sigmas in (None, 0.0):
            with tuning(sigmas=sigmas):
                same_pair(sk.topk_abs(x, k), naive.topk_abs(x, k))
                got = sk.accumulate_topk(x, e, np.array([k]), np.array([0, n]))
            for a, b in zip(
                got, naive.accumulate_topk(x, e, np.array([k]), np.array([0, n])), strict=True
            ):
                same_bits(a, b)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]), n=st.integers(1, 300))
def test_set_outside_log_equals_the_replay_newest_first(data, dtype, n):
    """``set_outside_log`` (one members bitmap for the whole log) against NumPy's replay of the
    log newest first: positions repeating across entries end with the oldest entry's value
    outside ``members``; entries ascending or shuffled; and the bitmap scratch is left all zero
    (a second call with other members sees none of the first call's)."""
    pick = st.lists(st.integers(0, n - 1), unique=True, max_size=n)
    log = []
    for _ in range(data.draw(st.integers(0, 4))):
        idx = np.array(data.draw(st.permutations(data.draw(pick))), dtype=np.int64)
        log.append((idx, nan_mix(data, dtype, len(idx))))
    members = np.array(sorted(data.draw(pick)), dtype=np.int64)
    s = nan_mix(data, dtype, n)
    want = s.copy()
    for idx, vals in reversed(log):
        out = ~np.isin(idx, members)
        want[idx[out]] = vals[out]
    assert_same_bits(host_arrays.set_outside_log(s.copy(), log, members), want)
    want = s.copy()
    for idx, vals in reversed(log):
        want[idx] = vals
    empty = np.zeros(0, np.int64)
    assert_same_bits(host_arrays.set_outside_log(s.copy(), log, empty), want)


def test_set_outside_log_rejects_bad_arguments_naming_them():
    s = np.zeros(5, np.float32)
    vals = np.ones(2, np.float32)
    members = np.array([1, 3], np.int64)
    for log, mem, exc, match in (
        ([([0, 5], vals)], members, ValueError, "^idx: pos"),
        ([([0, 1], vals[:1])], members, ValueError, "^vals: exp"),
        ([([0.0, 1.0], vals)], members, TypeError, "^idx: d"),
        ([([0, 1], vals)], [3, 1], ValueError, "^members: must be asc"),
    ):
        with pytest.raises(exc, match=match):
            host_arrays.set_outside_log(s, log, mem)
    assert not np.any(s)  # nothing written by a call that raised


def test_member_passes_bitmap_ignores_members_outside_the_vector():
    """Members outside [0, n) match no position, in the bitmap path as in the merge path."""
    members = np.array([-3, 2, 9, 100], np.int64)
    idx = np.array([9, 0, 2, 5], np.int64)
    vals = np.arange(1, 5, dtype=np.float32)
    got = {}
    saved = host_arrays.BITMAP_MIN_MEMBERS
    try:
        for limit in (0, 1 << 62):
            host_arrays.BITMAP_MIN_MEMBERS = limit
            got[limit] = host_arrays.set_outside(np.zeros(10, np.float32), idx, vals, members)
    finally:
        host_arrays.BITMAP_MIN_MEMBERS = saved
    assert_same_bits(got[0], got[1 << 62])
    np.testing.assert_array_equal(np.flatnonzero(got[0]), [0, 5])


# ---------------------------------------------------------------------------------------------
# accumulate_above: X = g + E and select_above(X, threshold) in one pass
# ---------------------------------------------------------------------------------------------

THRESHOLDS = st.one_of(
    st.sampled_from([0.0, -1.0, 0.5, 1.0, 3.0, np.inf, np.nan, 1e-40, 1e-310]),
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False),
)


@SETTINGS
@given(x=vectors(), data=st.data(), threshold=THRESHOLDS)
def test_accumulate_above(x, data, threshold):
    """Against NumPy's sum then its select_above: every dtype, thresholds from 0 (all) to
    NaN (only NaN), subnormal ones (the integer test), and a room so small that the selection
    spills over and is redone from the finished X."""
    n = x.shape[0]
    work = np.float32 if x.dtype == np.float16 else x.dtype
    with np.errstate(all="ignore"):
        e = data.draw(st.sampled_from([0.0, 0.5, -1e-3])) * x[::-1].astype(work)
    out = np.empty(n, work) if data.draw(st.booleans()) else None
    saved = config.SELECT_INITIAL_FRACTION, config.SELECT_CHUNK
    if data.draw(st.booleans()):
        config.SELECT_INITIAL_FRACTION, config.SELECT_CHUNK = 0.0, 1
    try:
        got = sk.accumulate_above(x, e, threshold, out=out)
    finally:
        config.SELECT_INITIAL_FRACTION, config.SELECT_CHUNK = saved
    with np.errstate(all="ignore"):
        ref = naive.accumulate_above(x, e, threshold)
    for a, b in zip(got, ref, strict=True):
        same_bits(a, b)
    assert got[1].dtype == np.int64
    if out is not None:
        assert got[0] is out


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from(DTYPES), threshold=THRESHOLDS)
def test_accumulate_above_nan_bits(data, dtype, threshold):
    n = data.draw(st.integers(0, 140))
    work = np.float32 if dtype == np.float16 else dtype
    g, e = nan_mix(data, dtype, n), nan_mix(data, work, n)
    got = sk.accumulate_above(g, e, threshold)
    with np.errstate(all="ignore"):
        want = naive.accumulate_above(g, e, threshold)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b)


def test_accumulate_above_rejects_bad_arguments_naming_them():
    g = np.arange(6, dtype=np.float32)
    for args, kwargs, exc, match in (
        ((g, g.astype(np.float64), 1.0), {}, TypeError, "^e: dtype"),
        ((g, g[:5], 1.0), {}, ValueError, "^e: "),
        ((g, g, "1"), {}, TypeError, "^threshold"),
        ((g, g, 1.0), {"out": g}, ValueError, "^out"),
        ((g, g, 1.0), {"out": np.empty(6)}, ValueError, "^out"),
    ):
        with pytest.raises(exc, match=match):
            sk.accumulate_above(*args, **kwargs)


def test_layer_passes_reject_what_the_review_found():
    """Faults of one kind, each a clear error naming the argument: the passes that write values
    without ``vals``; a divisor that is zero or infinite in x's dtype though not in float64; a
    malformed log; and big-endian positions, which are taken as what they are."""
    s = np.zeros(8, np.float32)
    idx = np.arange(8)
    none = np.array([], np.int64)
    for call in (
        lambda: host_arrays.set_outside(s, idx, None, none),
        lambda: host_arrays.sub_members(s, idx, None, idx),
        lambda: host_arrays.set_outside_log(s, [(idx, None)], np.arange(4096, 9000)),
    ):
        with pytest.raises(TypeError, match="^vals: expected an array"):
            call()
    assert not np.any(s)
    x = np.ones(3, np.float32)
    for bad in (1e-46, 1e39, 10**400):
        with pytest.raises(ValueError, match="^s: must be finite and non-zero"):
            host_arrays.divide_max_abs(x, bad)
    assert np.all(x == 1)
    for log, match in ((None, "^log: expected a sequence"), ([idx], "^log: every entry")):
        with pytest.raises(TypeError, match=match):
            host_arrays.set_outside_log(s, log, none)
    vals = np.arange(1, 9, dtype=np.float32)
    big = host_arrays.set_outside(s.copy(), idx.astype(">i8"), vals, np.array([2], ">i8"))
    assert_same_bits(big, np.where(idx == 2, 0, vals).astype(np.float32))
    x, i, v = sk.accumulate_above(vals, np.zeros(8, np.float32), 10**400)
    assert i.shape == (0,) and v.shape == (0,)
    assert sk.select_above(vals, -(10**400))[0].tolist() == list(range(8))


def _finite_or_inf(dtype):
    width = np.dtype(dtype).itemsize * 8
    return st.one_of(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 3.0, np.inf, -np.inf]),
        st.floats(-1e3, 1e3, width=width),
        st.floats(width=width, allow_nan=False),  # overflows to inf, subnormal products
    )


def _equal_or_both_nan(got, want):
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert_same_bits(got[~nan], want[~nan])


@SETTINGS
@given(
    data=st.data(),
    dtype=st.sampled_from([np.float32, np.float64]),
    m=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
    with_x=st.booleans(),
)
def test_accumulate_velocity_and_factor_masking_equal_numpy(data, dtype, m, with_x):
    """Momentum correction's one pass has the bits of NumPy's separate ones (u·m, then + g,
    then + E: no fused multiply-add), and factor masking zeroes exactly the entries where the
    residual is zero and X is not."""
    n = data.draw(st.integers(0, 60))
    u, g, e, e_after = (
        data.draw(hnp.arrays(dtype, n, elements=_finite_or_inf(dtype))) for _ in range(4)
    )
    e_after[data.draw(hnp.arrays(np.bool_, n))] = 0
    with np.errstate(all="ignore"):
        want_u = u * dtype(m) + g
        want_x = want_u + e
    u0, g_in, out = u.copy(), g.copy(), np.full(n, 7, dtype)
    x = np.full(n, 7, dtype) if with_x else None
    assert host_arrays.accumulate_velocity(u, m, g_in, out, e if with_x else None, x) is out
    assert_same_bits(u, u0)  # the old velocity is only read
    _equal_or_both_nan(out, want_u)
    _equal_or_both_nan(g_in, want_u)
    if with_x:
        _equal_or_both_nan(x, want_x)
        masked = want_u.copy()
        masked[(e_after == 0) & (want_x != 0)] = 0
        assert host_arrays.mask_sent(out, e_after, x) is out
        _equal_or_both_nan(out, masked)


def test_momentum_passes_reject_bad_arguments():
    f4 = lambda: np.ones(3, np.float32)  # noqa: E731
    u, g, out, e, x = f4(), f4(), f4(), f4(), f4()
    acc = host_arrays.accumulate_velocity
    for call, exc, match in (
        (lambda: acc(np.ones(3, np.float16), 0.9, g, out), TypeError, "^u: dtype"),
        (lambda: acc(u, 0.9, np.ones(3), out), TypeError, "^g: dtype float64 does not match u"),
        (lambda: acc(u, 0.9, g, np.ones(4, np.float32)), ValueError, "^out: length 4"),
        (lambda: acc(u, 0.9, g, u), ValueError, "^out: overlaps u or g"),
        (lambda: acc(u, 0.9, g, g[::-1]), ValueError, "^out: overlaps u or g"),
        (lambda: acc(u, True, g, out), TypeError, "^m: must be a real number, got bool"),
        (lambda: acc(u, "0.9", g, out), TypeError, "^m: must be a real number, got str"),
        (lambda: acc(u, 0.9, g, out, None, x), ValueError, "^residual: is required with x"),
        (lambda: acc(u, 0.9, g, out, e), ValueError, "^residual: is read only with x"),
        (lambda: acc(u, 1e39, g, out), ValueError, "^m: must be finite in float32"),
        (lambda: acc(u, 10**400, g, out), ValueError, "^m: must be finite in float32"),
        (lambda: acc(u, 0.9, u, out), ValueError, "^g: overlaps u"),
        (lambda: acc(u, 0.9, g, out, g, x), ValueError, "^residual: overlaps g or out"),
        (lambda: acc(u, 0.9, g, out, out, x), ValueError, "^residual: overlaps g or out"),
        (lambda: host_arrays.mask_sent(u, u, x), ValueError, "^residual: overlaps u"),
        (lambda: host_arrays.mask_sent(u, e, u[::-1]), ValueError, "^x: overlaps u"),
        (lambda: acc(u, 0.9, g, out, e, e), ValueError, "^x: overlaps"),
        (lambda: acc(u, 0.9, g, out, e, g), ValueError, "^x: overlaps"),
        (lambda: acc(u, 0.9, g, out, e[:2], x), ValueError, "^residual: length 2"),
        (lambda: host_arrays.mask_sent(u, e, np.ones(2)), ValueError, "^x: length 2"),
        (lambda: host_arrays.mask_sent(np.ones(3, np.int64), e, x), TypeError, "^u: dtype"),
        (lambda: host_arrays.mask_sent([1.0, 2.0, 3.0], e, x), TypeError, "^u is written"),
    ):
        with pytest.raises(exc, match=match):
            call()
    assert (u == 1).all() and (g == 1).all() and (out == 1).all()  # nothing was written
    g.flags.writeable = False
    with pytest.raises(ValueError, match="^g: array is read-only"):
        acc(u, 0.9, g, out)
    u.flags.writeable = False
    assert acc(u, 0.5, f4(), out) is out and (out == 1.5).all()  # a read-only u is only read
    # a residual wider than x is rounded to x's dtype first, as torch's residual.to(x.dtype)
    wide = np.array([2.0**-24 + 2.0**-50], np.float64)
    one, x1 = np.ones(1, np.float32), np.empty(1, np.float32)
    acc(np.zeros(1, np.float32), 0.9, one.copy(), np.empty(1, np.float32), wide, x1)
    assert x1[0] == np.float32(1) + wide.astype(np.float32)[0] == np.float32(1)
    with pytest.raises(ValueError, match="^u: array is read-only"):
        host_arrays.mask_sent(u, e, x)


_HALF_SPECIALS = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF]
_HALF_SPECIALS += [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x5BFF, 0x1400, 0x3555]


def test_sum_half_is_the_float16_sum_rounded_once():
    """Every float16 a (all 65,536 bit patterns) plus each of 200 random and 18 special b: the
    exact sum (float64 holds every sum of two float16 exactly) rounded once to float16 by
    NumPy, bit for bit; NaN exactly where that is NaN. Float16 arrays and their uint16 bits
    are both taken; the sums are written into out, which is returned."""
    a_bits = np.arange(65536, dtype=np.uint16)
    a64 = a_bits.view(np.float16).astype(np.float64)
    rng = np.random.default_rng(20261206)
    for b in [*_HALF_SPECIALS, *rng.integers(0, 65536, 200).tolist()]:
        out = np.full(65536, b, np.uint16)
        with np.errstate(all="ignore"):
            want = (a64 + np.uint16(b).view(np.float16).astype(np.float64)).astype(np.float16)
        assert host_arrays.sum_half(a_bits, out) is out
        got = out.view(np.float16)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=hex(b))
        assert_same_bits(got[~nan], want[~nan])
        assert (out[nan] == 0x7E00).all(), hex(b)  # every NaN sum: the positive quiet NaN
        swapped = a_bits.copy()  # b + a: the same bits (MPI's commutative operation)
        host_arrays.sum_half(np.full(65536, b, np.uint16), swapped)
        np.testing.assert_array_equal(swapped, out, err_msg=hex(b))
    x, y = np.array([1.0, 65504.0, -0.0], np.float16), np.array([2**-11, 16.0, 0.0], np.float16)
    assert host_arrays.sum_half(x, y) is y
    assert y.tolist() == [1.0, np.inf, 0.0] and not np.signbit(y[2])  # ties to even, overflow
    # strided views (another compiled variant), an empty pair, and out as a itself
    a, out = rng.standard_normal(40).astype(np.float16), rng.standard_normal(40).astype(np.float16)
    want = (a[::2].astype(np.float64) + out[1::2].astype(np.float64)).astype(np.float16)
    host_arrays.sum_half(a[::2], out[1::2])
    assert_same_bits(out[1::2], want)
    empty = np.empty(0, np.float16)
    assert host_arrays.sum_half(empty, empty) is empty
    twice = a.astype(np.float64) * 2
    host_arrays.sum_half(a, a)
    assert_same_bits(a, twice.astype(np.float16))


def test_half_passes_read_overlapping_arguments_as_given():
    """``sum_half``, ``scale_to_half`` and ``scale_from_half`` on arguments that share memory
    other than entry for entry (shifted views, a float16 view of the float32 output): the
    results NumPy gives for the same overlap, which reads the arguments as they were."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal(9).astype(np.float16)
    for a_sl, out_sl in ((slice(0, -1), slice(1, None)), (slice(1, None), slice(0, -1))):
        o = base.copy()
        want = (o[a_sl].astype(np.float64) + o[out_sl].astype(np.float64)).astype(np.float16)
        host_arrays.sum_half(o[a_sl], o[out_sl])
        assert_same_bits(o[out_sl], want)
    buf = np.arange(1, 9, dtype=np.float32)  # h: the first 8 float16 in buf's 32 bytes
    buf.view(np.float16)[:8] = np.arange(1, 9)
    want = buf.view(np.float16)[:8].astype(np.float32) * 2
    host_arrays.scale_from_half(buf.view(np.float16)[:8], 2.0, buf)
    assert_same_bits(buf, want)
    x = rng.standard_normal(8).astype(np.float32)
    want = (x[1:] * np.float32(0.5)).astype(np.float16)
    host_arrays.scale_to_half(x[1:], 0.5, x.view(np.float16)[4:11])
    assert_same_bits(x.view(np.float16)[4:11], want)


def test_sum_half_rejects_bad_arguments():
    h = lambda n=3: np.ones(n, np.float16)  # noqa: E731
    for call, exc, match in (
        (lambda: host_arrays.sum_half(np.ones(3, np.float32), h()), TypeError, "^a: must be"),
        (lambda: host_arrays.sum_half(h(), np.ones(3, np.int16)), TypeError, "^out: must be"),
        (lambda: host_arrays.sum_half(h(), np.ones((1, 3), np.float16)), ValueError, "^out: must"),
        (lambda: host_arrays.sum_half(h(), h(4)), ValueError, "^out: length 4"),
        (lambda: host_arrays.sum_half(h(), [1.0, 1.0, 1.0]), TypeError, "^out is written"),
    ):
        with pytest.raises(exc, match=match):
            call()
    out = h()
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: array is read-only"):
        host_arrays.sum_half(h(), out)


def test_scale_to_and_from_half_have_numpys_bits():
    """The 16-bit allreduce's passes before and after MPI's sum: float16(x·f) and
    float32(h)·f with the bits of NumPy's multiplications and casts (NaN where NumPy's is
    NaN), for every float16 h, float32 x around every float16 rounding boundary (ties,
    subnormals, the overflow at 65520), ±inf and NaN, and factors that are powers of two or
    not."""
    h_bits = np.arange(65536, dtype=np.uint16)
    h = h_bits.view(np.float16)
    wide = h.astype(np.float32)
    # float32 values at, next to and halfway between consecutive float16 values
    with np.errstate(invalid="ignore"):  # inf − inf, NaN: NaN midpoints, kept as inputs
        mids = (wide[:-1] / 2 + wide[1:] / 2).astype(np.float32)
    x = np.concatenate(
        [
            wide,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            np.float32([65519.996, 65520.0, 1e30, -1e30, 2.0**-30]),
        ]
    )
    for f in (1.0, 2.0**-3, 2.0**5, 3.0, -0.75):
        with np.errstate(all="ignore"):
            want = np.multiply(x, np.float32(f), dtype=np.float32).astype(np.float16)
            back = np.multiply(h, np.float32(f), dtype=np.float32)
        out = np.empty(x.shape[0], np.float16)
        assert host_arrays.scale_to_half(x, f, out) is out
        _equal_or_both_nan(out, want)
        out32 = np.empty(65536, np.float32)
        assert host_arrays.scale_from_half(h_bits, f, out32) is out32
        _equal_or_both_nan(out32, back)
    for call, exc, match in (
        (lambda: host_arrays.scale_to_half(h, 1.0, h.copy()), TypeError, "^x: must be float32"),
        (lambda: host_arrays.scale_to_half(wide, 1.0, wide), TypeError, "^out: must be float16"),
        (lambda: host_arrays.scale_to_half(wide, 0.0, h.copy()), ValueError, "^f: must be"),
        (lambda: host_arrays.scale_to_half(wide, 1e39, h.copy()), ValueError, "^f: must be"),
        (lambda: host_arrays.scale_to_half(wide, True, h.copy()), TypeError, "^f: expected"),
        (lambda: host_arrays.scale_to_half(wide, 1.0, h[:3].copy()), ValueError, "^out: length"),
        (lambda: host_arrays.scale_from_half(wide, 1.0, wide), TypeError, "^h: must be float16"),
        (lambda: host_arrays.scale_from_half(h, 1.0, h.copy()), TypeError, "^out: must be float"),
        (lambda: host_arrays.scale_from_half(h, 1.0, wide[:2].copy()), ValueError, "^out: len"),
    ):
        with pytest.raises(exc, match=match):
            call()
    ro = np.empty(65536, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="^out: array is read-only"):
        host_arrays.scale_from_half(h, 1.0, ro)
