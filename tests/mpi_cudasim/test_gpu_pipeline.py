"""GPU buffers through the whole collective pipeline, on the Numba CUDA simulator.

For every algorithm, device-array gradients must give results bit-identical to the same calls
on NumPy arrays (indices, values, residual), keep the result and the residual on the device,
and conserve (Σ_r X_r = P·out + Σ_r E_r) where the algorithm does. Plus unit tests of
``spardl._arrays`` (host and device twins) and of the device message path of ``spardl.comm``
(packing, staging through pinned buffers, and the CUDA-aware path, which the simulator can run
because its "device" memory is host memory).

Launch sizes are patched small (as in tests/test_cuda_kernels.py) so that n = 42 spans several
CUDA blocks.
"""

import os

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
cuda = pytest.importorskip("numba.cuda")
if not (SIM or cuda.is_available()):
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU", allow_module_level=True)

from cudasim_launch import use_small_launches  # noqa: E402
from mpiutil import conservation_error  # noqa: E402

import spardl  # noqa: E402
from spardl import _arrays as A  # noqa: E402
from spardl import comm as C  # noqa: E402

N = 42  # uneven blocks at P = 4 (tests/test_gpu_pipeline.py runs P = 1, 2, 4)
STEPS = 2


# The simulator's shared-array allocation is made atomic for every test here (conftest.py): its
# race gave a kernel garbage on one rank now and then (wrong positions, a residual entry zeroed)
# when the simulated ranks shared the cores with other tests. Not a race of the kernels.


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    use_small_launches(monkeypatch)


def bits(a):
    """Host bytes of a host or device array (bit-for-bit comparisons: NaN, -0.0 and all)."""
    return np.ascontiguousarray(A.to_host(a)).tobytes()


def grad(comm, step, dtype=np.float32):
    rng = np.random.default_rng(1000 * step + comm.rank)
    g = rng.standard_normal(N) * (rng.random(N) < 0.8)
    return g.astype(dtype)


CONFIGS = [
    ("dense", {}),
    ("dense", {"wire_dtype": "float16"}),  # the 16-bit dense allreduce
    ("spardl", {"teams": 1}),
    ("spardl", {"teams": 2}),
    ("spardl", {"teams": 4}),  # at P = 4: teams of one, the cross-team exchange is everything
    ("topka", {}),
    ("gaussiank", {}),
    ("topkdsa", {}),
    ("gtopk", {}),
    ("oktopk", {}),
    # the compact wire: packed bytes staged through the host, the roundings kept on the device
    ("spardl", {"teams": 1, "wire": "compact"}),
    ("spardl", {"teams": 2, "wire": "compact"}),
    ("topkdsa", {"wire": "compact"}),
    ("gtopk", {"wire": "compact"}),
    ("oktopk", {"wire": "compact"}),
]


@pytest.mark.parametrize("name,opts", CONFIGS, ids=[f"{n}{o}" for n, o in CONFIGS])
def test_device_matches_host(comm, name, opts):
    P = comm.size
    if opts.get("teams", 1) > 1 and P % opts["teams"]:
        pytest.skip("teams must divide P")
    host = spardl.make(name, comm, N, density=0.1, **opts)
    dev = spardl.make(name, comm, N, density=0.1, **opts)
    for step in range(STEPS):
        g = grad(comm, step)
        x = (g + host.residual).astype(np.float64)  # X = g + E_old, before the call
        out_h = host(g)
        out_d = dev(cuda.to_device(g))
        assert A.is_device(out_d.indices) and A.is_device(out_d.values)
        assert A.is_device(dev.residual)
        assert bits(out_d.indices) == bits(out_h.indices)
        assert bits(out_d.values) == bits(out_h.values)
        assert bits(dev.residual) == bits(host.residual)
        dense_d = out_d.to_dense()
        assert A.is_device(dense_d)
        assert bits(dense_d) == bits(out_h.to_dense())
        if dev.conserves:
            err = conservation_error(comm, x, A.to_host(dense_d), A.to_host(dev.residual), "mean")
            assert err < 1e-5
    # the same messages and bytes for both kinds of buffer
    for key in ("messages", "bytes_sent", "bytes_received"):
        assert dev.stats[key] == host.stats[key]


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_auto_flushing_into_dense_matches_host(comm, op):
    """``auto``'s first dense step after a sparse one reduces X = g + E. Device gradients once
    took a generic sum-then-divide there, where host ones take dense's own step (divide, then
    sum, with its bound entry): the mean differed by an ulp, and the bytes and the inner
    state for the rest of the run."""
    opts = dict(candidates=["topka", "dense"], trials=1, prune=0, alpha=1e-5, beta=1e-9)
    host = spardl.make("auto", comm, N, density=0.3, op=op, **opts)
    dev = spardl.make("auto", comm, N, density=0.3, op=op, **opts)
    flushed = False
    # step 0: topka's trial; step 1: dense's trial, the flush (what follows is chosen by the
    # measured times, which differ between host and simulated device)
    for step in range(2):
        g = grad(comm, step)
        flushed = flushed or host._flush
        out_h, out_d = host(g), dev(cuda.to_device(g))
        assert bits(out_d.to_dense()) == bits(out_h.to_dense())
        assert bits(dev.residual) == bits(host.residual)
        for key in ("messages", "bytes_sent", "bytes_received"):
            assert dev.stats[key] == host.stats[key]
        sh, sd = host.state_dict(), dev.state_dict()
        assert sd["extra"]["inner"] == sh["extra"]["inner"]
    assert flushed  # the run did flush into dense


def test_spardl_float16_and_checkpoint(comm):
    """float16 gradients accumulate in float32 on the device too; a checkpoint holds a host
    residual and the next device call continues bit for bit."""
    host = spardl.make("spardl", comm, N, density=0.2)
    dev = spardl.make("spardl", comm, N, density=0.2)
    g = grad(comm, 0, np.float16)
    host(g)
    dev(cuda.to_device(g))
    state = dev.state_dict()
    assert isinstance(state["residual"], np.ndarray) and state["residual"].dtype == np.float32
    again = spardl.make("spardl", comm, N, density=0.2)
    again.load_state_dict(state)
    g = grad(comm, 1, np.float16)
    out_h = host(g)
    out_d = again(cuda.to_device(g))
    assert out_d.values.dtype == np.float16
    assert bits(out_d.indices) == bits(out_h.indices)
    assert bits(out_d.values) == bits(out_h.values)
    assert A.is_device(again.residual)
    assert bits(again.residual) == bits(host.residual)


@pytest.mark.parametrize("name", ["topka", "gaussiank", "oktopk"])
def test_float16_rounding_remainders_match_host(comm, name):
    """float16 outputs that underflow (or round) keep their remainders in the owner's residual
    on the device too, bit for bit as on the host (the sums go through the host, O(nnz))."""
    host = spardl.make(name, comm, N, density=0.25)
    dev = spardl.make(name, comm, N, density=0.25)
    for step in range(STEPS):
        g = grad(comm, step, np.float16) * np.float16(1e-7) if step else np.zeros(N, np.float16)
        if comm.rank == 0:
            g[:10] = np.float16(1.19e-7)
        out_h = host(g)
        out_d = dev(cuda.to_device(g))
        assert A.is_device(out_d.values) and A.is_device(dev.residual)
        assert bits(out_d.indices) == bits(out_h.indices)
        assert bits(out_d.values) == bits(out_h.values)
        assert bits(dev.residual) == bits(host.residual)


# The simulator runs the float32 -> float16 cast with NumPy in its own threads, which warn on
# the overflow that the clamp then handles (a GPU does not warn).
@pytest.mark.filterwarnings("ignore:.*overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_dense_float16_matches_host(comm, op):
    """Dense with float16 gradients: float32 sums on the device, rounded once (and clamped past
    ±65504, reached by "sum" at P > 1), bit for bit as on the host; the result stays there."""
    host = spardl.make("dense", comm, N, op=op)
    dev = spardl.make("dense", comm, N, op=op)
    g = grad(comm, 0, np.float16)
    g[:3] = np.float16(60000.0)
    out_h = host(g)
    out_d = dev(cuda.to_device(g))
    assert out_d.is_dense and A.is_device(out_d.to_dense())
    assert bits(out_d.to_dense()) == bits(out_h.to_dense())
    assert bits(out_d.indices) == bits(out_h.indices)
    assert bits(out_d.values) == bits(out_h.values)
    assert np.all(np.isfinite(A.to_host(out_d.values)))
    assert A.is_device(dev.residual) and not np.any(A.to_host(dev.residual))


def test_cuda_aware_path_matches_staged(comm, monkeypatch):
    """Device buffers handed to MPI directly (the CUDA-aware path) give the same bytes as the
    pinned-buffer staging."""
    staged = spardl.make("spardl", comm, N, density=0.1)
    monkeypatch.setattr(C, "cuda_aware", lambda: True)
    direct = spardl.make("spardl", comm, N, density=0.1)
    dense = spardl.make("dense", comm, N)
    g = grad(comm, 3)
    out_d = direct(cuda.to_device(g))
    dense_out = dense(cuda.to_device(g))
    monkeypatch.setattr(C, "cuda_aware", lambda: False)
    out_s = staged(cuda.to_device(g))
    assert bits(out_d.indices) == bits(out_s.indices)
    assert bits(out_d.values) == bits(out_s.values)
    assert bits(direct.residual) == bits(staged.residual)
    assert A.is_device(dense_out.values)
    want = np.zeros(N, np.float64)
    comm.Allreduce(g.astype(np.float64), want)
    np.testing.assert_allclose(
        A.to_host(dense_out.to_dense()), want / comm.size, rtol=1e-5, atol=1e-6
    )


def test_comm_device_messages(comm):
    """Packing on the device gives the host's bytes; the collectives return device arrays."""
    c = C.Comm(comm)
    idx = np.array([3, 5, 9], np.int64)
    val = np.array([1.5, -2.0, 0.25], np.float32)
    blocks_h = [(idx, val), (idx[:0], val[:0])]
    blocks_d = [
        (cuda.to_device(idx), cuda.to_device(val)),
        (cuda.to_device(idx[:0]), cuda.to_device(val[:0])),
    ]
    packed_h = C.pack_blocks(blocks_h, [2, 0], np.int32, np.float32)
    packed_d = C.pack_blocks(blocks_d, [2, 0], np.int32, np.float32)
    assert A.is_device(packed_d) and bits(packed_d) == packed_h.tobytes()
    for (ih, vh), (i_d, v_d) in zip(
        C.unpack_blocks(packed_h, 2, [2, 0], np.int32, np.float32),
        C.unpack_blocks(packed_d, 2, [2, 0], np.int32, np.float32),
        strict=True,
    ):
        assert A.is_device(i_d) and bits(i_d) == ih.tobytes() and bits(v_d) == vh.tobytes()
    P, r = c.size, c.rank
    mine = np.arange(4, dtype=np.float64) + 10 * r
    rows = c.allgather_array(cuda.to_device(mine))
    assert A.is_device(rows)
    np.testing.assert_array_equal(
        A.to_host(rows), np.stack([np.arange(4) + 10 * q for q in range(P)])
    )
    var = c.allgatherv_bytes(cuda.to_device(np.full(r + 1, r, np.uint8)))
    assert all(A.is_device(v) for v in var)
    assert [A.to_host(v).tolist() for v in var] == [[q] * (q + 1) for q in range(P)]
    b = cuda.to_device(np.full(3, r, np.int64))
    c.bcast(b, 0)
    assert A.to_host(b).tolist() == [0, 0, 0]
    got = c.sendrecv_bytes(cuda.to_device(np.full(5, r, np.uint8)), (r + 1) % P, (r - 1) % P, 8)
    assert A.is_device(got) and A.to_host(got).tolist() == [(r - 1) % P] * 5
    x = cuda.to_device(mine)
    total = c.allreduce(x)
    assert (
        A.is_device(total)
        and A.to_host(total).tolist() == (P * np.arange(4) + 5 * P * (P - 1)).tolist()
    )
    assert A.to_host(x).tolist() == mine.tolist()  # the input is left as it was
    if P > 1:  # a one-way message around the ring: rank 0 sends first, the others pass it on
        if r == 0:
            c.send_bytes(cuda.to_device(np.full(3, 7, np.uint8)), 1)
            back = c.recv_bytes(P - 1, 8, device=True)
        else:
            back = c.recv_bytes(r - 1, 8, device=True)
            c.send_bytes(back, (r + 1) % P)
        assert A.is_device(back) and A.to_host(back).tolist() == [7, 7, 7]
    c.free()


# -- pack_blocks / unpack_blocks on the device: the host's checks and messages ----------------


def _blocks(host_blocks, on_device):
    """The blocks with those whose position is in ``on_device`` moved to the device."""
    return [
        tuple(cuda.to_device(a) for a in blk) if j in on_device else blk
        for j, blk in enumerate(host_blocks)
    ]


def _f32(n):
    return np.arange(n, dtype=np.float32) + 0.5


PACK_ERRORS = [
    # block 1's indices relative to its start 10 span 0 … 2**31: one past int32's range
    (
        [(np.array([2, 3]), _f32(2)), (np.array([10, 10 + 2**31]), _f32(2))],
        [0, 10],
        np.int32,
        r"^blocks\[1\]: indices relative to start 10 span 0 … 2147483648, outside the range",
    ),
    # below the range: relative -200 … -199 with int8
    (
        [(np.array([], np.int64), _f32(0)), (np.array([0, 1]), _f32(2))],
        [0, 200],
        np.int8,
        r"^blocks\[1\]: indices relative to start 200 span -200 … -199, outside the range "
        r"\[-128, 127\]",
    ),
    # 128 pairs, all relative indices 0 … 127 in int8's range, but the count is not
    (
        [(np.arange(128), _f32(128))],
        [0],
        np.int8,
        r"^blocks\[0\] holds 128 pairs, more than index_dtype int8 can count \(127\)$",
    ),
]


@pytest.mark.parametrize("host_blocks,starts,idt,match", PACK_ERRORS)
def test_device_pack_checks_like_the_host(host_blocks, starts, idt, match):
    """A count or block-relative index that would wrap on the wire: the device path raises the
    host's ValueError, word for word (every block on the device, or, with several blocks, only
    the first or only the last one)."""
    with pytest.raises(ValueError, match=match) as host:
        C.pack_blocks(host_blocks, starts, idt, np.float32)
    n = len(host_blocks)
    for on_device in [set(range(n))] + ([{0}, {n - 1}] if n > 1 else []):
        with pytest.raises(ValueError, match=match) as dev:
            C.pack_blocks(_blocks(host_blocks, on_device), starts, idt, np.float32)
        assert str(dev.value) == str(host.value)


@pytest.mark.parametrize(
    "counts,match",
    [
        # the total, 0, matches the 8-byte buffer: only the per-block check sees the -3
        ([3, -3], r"^received message's header announces a negative count \(-3\)$"),
        ([0, -2, 2, -1, 1], r"^received message's header announces a negative count \(-2\)$"),
        ([-1, 0], r"^received message's header announces negative counts \(total -1\)$"),
    ],
)
def test_device_unpack_refuses_negative_counts_like_the_host(counts, match):
    nb = len(counts)
    header = np.array(counts, np.int32).view(np.uint8)
    buf = np.zeros(-(-header.size // 8) * 8, np.uint8)  # the length a total of 0 announces
    buf[: header.size] = header
    with pytest.raises(ValueError, match=match) as host:
        C.unpack_blocks(buf, nb, [0] * nb, np.int32, np.float32)
    with pytest.raises(ValueError, match=match) as dev:
        C.unpack_blocks(cuda.to_device(buf), nb, [0] * nb, np.int32, np.float32)
    assert str(dev.value) == str(host.value)


@pytest.mark.parametrize(
    "idt,vdt,host_blocks,starts",
    [
        # relative indices at both ends of int32's range, an empty block, a repeated start
        (
            np.int32,
            np.float64,
            [
                (np.array([7, 7 + 2**31 - 1]), np.array([-0.0, np.nan])),
                (np.array([], np.int64), np.array([])),
                (np.array([2**31 + 7]), np.array([np.inf])),
                (np.array([0, 3, 5]), np.array([1.0, -2.5, 1e-300])),
            ],
            [7, 0, 2**32 + 6, 2**31],
        ),
        # 127 pairs: as many as int8 can count, relative indices -1 … 125
        (np.int8, np.float16, [(np.arange(127) + 9, np.linspace(-3, 3, 127))], [10]),
        (
            np.int64,
            np.float32,
            [(np.array([2**40, 2**41]), np.array([1.5, -0.0])), (np.array([5]), np.array([2.0]))],
            [0, 5],
        ),
    ],
)
def test_device_pack_unpack_round_trips_bit_for_bit(monkeypatch, idt, vdt, host_blocks, starts):
    """Valid messages: the device packs the host's bytes, with one device-to-host copy (the
    gathered first and last indices) whatever the number of blocks, and each side unpacks what
    either packed into the same bits."""
    host_blocks = [(i.astype(np.int64), v.astype(vdt)) for i, v in host_blocks]
    blocks_d = _blocks(host_blocks, set(range(len(host_blocks))))
    device_array = type(cuda.to_device(np.zeros(1)))
    copies = []
    to_host = device_array.copy_to_host

    def counted(self, *args, **kwargs):
        copies.append(self.shape)
        return to_host(self, *args, **kwargs)

    monkeypatch.setattr(device_array, "copy_to_host", counted)
    packed_d = C.pack_blocks(blocks_d, starts, idt, vdt)
    assert len(copies) == 1
    # the allreducers' form (index_dtype chosen to fit): no device work for the check
    unchecked = C.pack_blocks(blocks_d, starts, idt, vdt, device_range_check=False)
    assert len(copies) == 1
    monkeypatch.undo()
    packed_h = C.pack_blocks(host_blocks, starts, idt, vdt)
    assert A.is_device(packed_d) and bits(packed_d) == packed_h.tobytes() == bits(unchecked)
    nb = len(host_blocks)
    want = C.unpack_blocks(packed_h, nb, starts, idt, vdt)
    for got in (
        C.unpack_blocks(packed_d, nb, starts, idt, vdt),
        C.unpack_blocks(cuda.to_device(packed_h), nb, starts, idt, vdt),
        C.unpack_blocks(A.to_host(packed_d), nb, starts, idt, vdt),
    ):
        for (ih, vh), (i_g, v_g), (i0, v0) in zip(want, got, host_blocks, strict=True):
            assert bits(i_g) == ih.tobytes() == i0.tobytes()
            assert bits(v_g) == vh.tobytes() == v0.tobytes()


def test_cuda_aware_detection_is_documented_and_forced(monkeypatch):
    C._detect_cuda_aware.cache_clear()
    monkeypatch.setenv("SPARDL_CUDA_AWARE", "1")
    assert C.cuda_aware() is True and "SPARDL_CUDA_AWARE" in C.cuda_aware_reason()
    C._detect_cuda_aware.cache_clear()
    monkeypatch.setenv("SPARDL_CUDA_AWARE", "0")
    assert C.cuda_aware() is False
    C._detect_cuda_aware.cache_clear()
    monkeypatch.setenv("SPARDL_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="SPARDL_CUDA_AWARE"):
        C.cuda_aware()
    monkeypatch.delenv("SPARDL_CUDA_AWARE")
    C._detect_cuda_aware.cache_clear()
    assert isinstance(C.cuda_aware(), bool) and C.cuda_aware_reason()
    C._detect_cuda_aware.cache_clear()


# -- spardl._arrays: host and device twins ---------------------------------------------------


def both(fn, *args):
    """fn on host copies of the array arguments and on device copies: the same bits; the host
    result."""
    h = fn(*[a.copy() if isinstance(a, np.ndarray) else a for a in args])
    d = fn(*[cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args])
    assert A.is_device(d) and not A.is_device(h)
    assert bits(d) == bits(h), fn
    return h


def test_arrays_twins():
    rng = np.random.default_rng(7)
    x = rng.standard_normal(37).astype(np.float32)
    x[[3, 8]] = [-0.0, np.float32(2.5)]
    y = rng.standard_normal(37).astype(np.float32)
    idx = np.array([0, 4, 9, 30], np.int64)
    members = np.array([4, 5, 30], np.int64)
    vals = np.array([1.0, -2.0, 3.5, np.nan], np.float32)
    pos = np.array([2, 0, 36], np.int64)

    both(A.copy, x)
    both(lambda a: A.cast(a, np.float16), x)
    both(lambda a: A.cast(a, np.float64), x)
    both(A.add_into, x, y)
    both(A.set_at, x, idx, vals)
    both(A.zero_at, x, idx)
    both(A.zero_members, x, idx, members)
    both(A.sub_members, x, idx, vals, members)
    log_h = [(idx, vals), (pos, vals[:3] * 2)]  # position 0 in both: the oldest value stays
    log_d = [tuple(cuda.to_device(a) for a in entry) for entry in log_h]
    h = A.set_outside_log(x.copy(), log_h, members)
    d = A.set_outside_log(cuda.to_device(x), log_d, cuda.to_device(members))
    assert bits(d) == bits(h) and h[0] == vals[0]
    both(A.shift, idx, -4)
    both(A.take, x, pos)
    both(A.take, idx, np.array([3, 1], np.int64))
    both(A.absolute, x)
    both(A.divide, x, 3)
    assert bits(
        A.concat(
            [cuda.to_device(x), idx[:0].astype(np.float32), cuda.to_device(y)], np.float32, True
        )
    ) == bits(A.concat([x, y], np.float32, False))
    assert bits(A.zeros(5, np.float64, True)) == bits(A.zeros(5, np.float64, False))
    assert bits(A.arange(6, True)) == bits(A.arange(6, False))
    assert A.all_finite(cuda.to_device(x)) and A.all_finite(x)
    for bad in (np.nan, np.inf, -np.inf):
        z = x.copy()
        z[11] = bad
        assert not A.all_finite(cuda.to_device(z)) and not A.all_finite(z)
    # a device byte row at an odd offset is realigned before typed views are taken of it
    raw = cuda.to_device(np.arange(24, dtype=np.uint8))
    row = A.aligned(raw[3:19])
    assert bits(row) == bytes(range(3, 19))
    assert bits(row.view(np.int64)) == np.arange(3, 19, dtype=np.uint8).view(np.int64).tobytes()


def _nan(dtype, payload):
    """A NaN of ``dtype`` built from bits: a non-canonical payload, sign set when odd."""
    dt = np.dtype(dtype)
    width = dt.itemsize * 8
    mant = {16: 10, 32: 23, 64: 52}[width]
    sign = (payload & 1) << (width - 1)
    b = sign | (((1 << (width - 1 - mant)) - 1) << mant) | (payload % (1 << mant) or 1)
    return np.array([b], f"u{dt.itemsize}").view(dt)[0]


def test_arrays_twins_write_the_canonical_nan():
    """NaNs with payloads through the layer's arithmetic: every computed NaN is the canonical
    one on both sides (so a GPU's own default NaN cannot reach the output), and the float16 <->
    float32 casts keep a NaN's sign and payload by bits, signalling ones included."""
    canon = {np.float16: 0x7E00, np.float32: 0x7FC00000, np.float64: 0x7FF8000000000000}
    for dt in (np.float32, np.float64):
        x = np.arange(1, 9, dtype=dt)
        x[[1, 4]] = [_nan(dt, 5), _nan(dt, 2)]
        y = np.ones(8, dt)
        y[[2, 4]] = [_nan(dt, 3), np.inf]
        x[6], y[6] = np.inf, -np.inf  # inf + (-inf)
        u = f"u{np.dtype(dt).itemsize}"
        with np.errstate(invalid="ignore"):
            summed = both(A.add_into, x, y)
            assert (summed.view(u)[np.isnan(summed)] == canon[dt]).all()
            quotient = both(A.divide, x, 3)
            assert (quotient.view(u)[np.isnan(quotient)] == canon[dt]).all()
            idx, members = np.array([1, 2, 6], np.int64), np.array([1, 6], np.int64)
            vals = np.array([1.0, 2.0, np.inf], dt)
            diff = both(A.sub_members, x, idx, vals, members)
            assert diff.view(u)[1] == canon[dt] and diff.view(u)[6] == canon[dt]
            acc = both(A.accumulate, x, y)
            assert (acc.view(u)[np.isnan(acc)] == canon[dt]).all() and np.isnan(acc).sum() == 4
    h = np.array([0x7D00, 0xFD01, 0x7E01, 0x3C00, 0x7C01], np.uint16).view(np.float16)
    w = both(lambda a: A.cast(a, np.float32), h)
    assert w.view(np.uint32).tolist() == [
        0x7FA00000,
        0xFFA02000,
        0x7FC02000,
        0x3F800000,
        0x7F802000,
    ]
    assert (
        both(lambda a: A.cast(a, np.float16), w).view(np.uint16).tolist()
        == h.view(np.uint16).tolist()
    )
    w64 = both(lambda a: A.cast(a, np.float64), w)
    assert (w64.view(np.uint64)[np.isnan(w64)] == canon[np.float64]).all()


def test_device_grad_errors_name_the_argument(comm):
    ar = spardl.make("spardl", comm, N, density=0.1)
    with pytest.raises(ValueError, match="length"):
        ar(cuda.to_device(np.zeros(N + 1, np.float32)))
    with pytest.raises(TypeError, match="dtype"):
        ar(cuda.to_device(np.zeros(N, np.int32)))


def test_device_mismatch_across_ranks_raises_everywhere(comm):
    """One rank passes a GPU gradient, the others CPU ones: ValueError on every rank, no hang."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n = 40
    ar = spardl.make("spardl", comm, n, density=0.1)
    g = np.ones(n, np.float32)
    mine = cuda.to_device(g) if comm.rank == 0 else g
    with pytest.raises(ValueError, match="device"):
        ar(mine)
    comm.Barrier()
