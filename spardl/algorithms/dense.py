"""`dense`: MPI Allreduce of the whole vector, the baseline every speedup is quoted against."""

from __future__ import annotations

import math

import numpy as np

from spardl_kernels.cpu import arrays as host_arrays

from .. import _arrays as A
from ..result import SparseResult
from .base import Allreducer, _work_dtype

#: Result buffers a dense allreducer keeps (per dtype in use).
_POOL = 2

#: Sums whose bound Σ_r max_i |g_ri / s| is below this are finite: every partial sum is at most
#: the bound times (1 + ε)^P, far below the largest finite value, half of which this is.
_BOUND = {name: float(np.finfo(name).max) / 2 for name in ("float32", "float64")}

#: The values of ``wire_dtype``: None (the work dtype) or "float16".
WIRE_DTYPES = (None, "float16")

#: ``wire_dtype="float16"``: the most ranks for which the float16 sums of values scaled to
#: P·M < 2^15 are known to stay below 65504 (every partial sum is at most P·M·2^e·(1 + 2^-11)^P,
#: and (1 + 2^-11)^1024 < 1.7); beyond it, the sums are counted for NaN and ±inf.
_HALF_SAFE_P = 1024


def _pow2_steps(e, dtype) -> list[int]:
    """Exponents that add up to e, each k with 2^k and 2^-k normal numbers of ``dtype``: the
    remainder first, then steps of the largest such size (none for e = 0).

    Multiplying by 2^k for each k in turn is multiplying by 2^e, exactly but for products
    below the normal range (towards zero the small step comes first, so a value that ends
    subnormal is rounded at the last step, once). One step covers every float32 e in ±126 and
    every float64 e in ±1022, so the common case is the single multiplication it was."""
    top = np.finfo(dtype).maxexp - 2
    full, rest = divmod(abs(e), top)
    sign = 1 if e > 0 else -1
    return ([sign * rest] if rest else []) + [sign * top] * full


class Dense(Allreducer):
    """Dense allreduce: every rank sends all n values; nothing is dropped (E_new = 0).

    Cost: one collective; 2n(P−1)/P words each way under a bandwidth-optimal allreduce
    (Rabenseifner's reduce-scatter + all-gather; Thakur, Rabenseifner & Gropp, IJHPCA 2005).
    ``density`` and ``residual`` are accepted for a uniform interface and have no effect: the
    residual is always zero.

    A step is the checks every allreducer makes, one ``MPI_Allreduce`` and nothing else of
    size n but what the result needs, so that it is a fair baseline for the sparse ones:

    * one pass over g before the sum writes g / s into the buffer MPI then reduces in place
      (``MPI_IN_PLACE``; s = P for ``op="mean"``, 1 for "sum"), and finds max_i |g_i / s|
      (inf if any entry is NaN or ±inf). That number travels as one more entry of the buffer,
      so the sum also yields B = Σ_r max_i |g_ri / s|, which bounds every partial sum of every
      index: below half the dtype's largest value (every step with finite gradients of sane
      size) the sums are finite and no pass runs after the reduction; otherwise one pass counts
      NaN and ±inf and writes NaNs as the canonical NaN (docs/design.md §3.4). The pass
      replaces the copy of g into the result buffer that MPI's own ``Allreduce(g, out)`` makes,
      so the step costs what that call costs, plus the cross-rank check;
    * the buffer (float32 and float64 gradients) is reused from step to step once nothing
      refers to the previous result any more (a pool of two, so a caller that keeps the last
      result still gets reuse): a fresh 100 MB buffer costs tens of ms in page faults on every
      step, which ``Allreduce`` into a caller's warm buffer does not pay;
    * float16 gradients are widened to float32 (exact) into a buffer kept from step to step,
      divided there, reduced in float32 and rounded once to float16. Sums of float16 overflow
      at 65504 long before their mean does, and MPI's own float16 sum rounds after every
      addition; the float32 sum is what the sparse allreducers compute too. A mean (or sum)
      beyond float16's range is clamped to ±65504 rather than becoming inf, as in the other
      allreducers; with no residual, the rounding remainder is dropped. This costs the float32
      Allreduce's bytes (twice the float16 ones; ``stats`` counts them as sent);
    * no residual buffer, no index array. The allreducer holds up to two buffers of n + 1
      values (one more array for float16: its float32 work buffer).

    With ``wire_dtype="float16"`` it is instead the 16-bit dense allreduce users run where links
    are slow (DDP's ``fp16_compress_hook``, Horovod's fp16 compression), at half the bytes:
    one MAX allreduce of one number first gives M = max_r max_i |g_ri / s|; the pass's g / s
    is scaled by the power of two 2^e that puts P·M in [2^14, 2^15) and rounded to float16 (to
    nearest, ties to even); MPI's float16 ``Allreduce`` sums it (each addition rounds to
    float16, in the order MPI chooses; on the host :func:`spardl.comm.float16_allreduce`: a
    reduce-scatter with the same sum vectorised, where MPICH's wheels convert in software, and
    an all-gather), and the sums are widened to the gradient's dtype and scaled back by 2^-e.
    The scaling is exact; it keeps every sum below 65504, and every value of at least
    2^-28·P·M out of float16's subnormal range, where software float16 arithmetic runs
    several times slower. What it drops: the rounding of every
    scaled g / s and of every partial sum to float16's 11 significant bits (fewer below
    2^-28·P·M), and values below about 2^-39·P·M, which round to zero; nothing of it is kept
    (no residual), so ``conserves`` is False. e follows M over the whole range of the
    gradient's dtype (float64 gradients of 1e300 or 1e-300 included): the scalings are made in
    the work dtype, in steps whose factors are normal numbers of it.
    A NaN or ±inf (M = inf) is summed unscaled and counted, as for the float32 sum; so are sums
    that, scaled back, could pass the work dtype's largest value (P·M ≥ 2^126 in float32,
    2^1022 in float64, or P > 1024), so that an overflow to ±inf is never returned as finite.

    ``wire`` (the sparse message format of the other allreducers) is accepted, so that ``auto``
    can hand every candidate the same options, and changes nothing: dense sends no sparse
    messages.

    The result is the dense form of :class:`~spardl.result.SparseResult`: the reduced vector
    itself; ``to_dense()`` copies it, ``indices``/``values`` are made on first read. The values
    are bit for bit MPI's sum of the ranks' g / s in the work dtype (the mean is the sum of
    g / P, as PyTorch's DistributedDataParallel computes it; for P a power of two that is the
    sum divided by P, bit for bit), the same on every rank and on the GPU path
    (``tests/mpi/test_dense.py``).

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        See :class:`spardl.algorithms.base.Allreducer`; ``density``, ``residual`` and ``wire``
        are checked and have no effect.
    wire_dtype : {None, "float16"}, default None
        None: the sum in the work dtype (float32 for float16 and float32 gradients, float64
        for float64). "float16": the scaled 16-bit allreduce described above.

    Raises
    ------
    TypeError
        On every rank, if ``wire_dtype`` is neither None nor a string, or a common argument is
        of the wrong type.
    ValueError
        On every rank, if ``wire_dtype`` is a string other than "float16", a common argument
        is out of range, or the ranks disagree.
    """

    name = "dense"
    #: No residual, so no float16 rounding feedback either (base class attribute).
    rounding_feedback = False
    #: ``wire_dtype``: None sums in the work dtype (float32 for float16 and float32 gradients,
    #: float64 for float64), "float16" sends and sums float16 (see above).
    options = {"wire_dtype": None}

    def _setup(self) -> None:
        wire_dtype = self.opts["wire_dtype"]
        if wire_dtype is not None and not isinstance(wire_dtype, str):
            raise TypeError(
                f"wire_dtype must be None or a str, one of {WIRE_DTYPES[1:]}, "
                f"got {type(wire_dtype).__name__}"
            )
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype must be None or one of {WIRE_DTYPES[1:]}, got {wire_dtype!r}"
            )
        #: The float16 wire drops its roundings: Σ_r X_r = P·out + Σ_r E_r holds only within them.
        self.conserves = wire_dtype is None
        self._pool = A.BufferPool(_POOL)  # host result buffers, reused once nothing holds them
        self._work = None  # float16 gradients: the float32 buffer they are reduced in
        self._half = None  # wire_dtype="float16": the host float16 buffer MPI sums
        self._device = False

    def _step_accepted(self, g) -> tuple[SparseResult, bool]:
        """The step after the checks: the result for the accepted gradient ``g`` and whether
        the step was applied (``auto`` also runs it on X = g + E when it flushes into dense)."""
        device = A.is_device(g)
        if self._dtype is None:
            self._dtype = np.dtype(g.dtype)
        self._device = device
        work = _work_dtype(self._dtype)
        n = self.n
        many = self.P > 1
        ops = host_arrays
        if device:
            from spardl_kernels.cuda import arrays as ops
        # One pass before the sum: g / s (s = P for the mean) into the buffer MPI reduces in
        # place, with this rank's largest |g_i / s| (inf for NaN or ±inf) in one more entry.
        # Summed over the ranks, that entry bounds every partial sum of every index, so the
        # sums are finite, and need no second pass, whenever it is well inside the range.
        s = self.P if self.op == "mean" else 1
        half = self.opts["wire_dtype"] is not None
        buf = self._send_buffer(work, n if half else n + many, device)
        x = buf[:n]
        if g.dtype == work:
            peak = ops.divide_max_abs(g, s, out=x)
        else:  # float16: widened exactly, then divided in place
            if device:
                ops.copy_into(x, A.cast(g, work))
            else:
                np.copyto(x, g)
            peak = ops.divide_max_abs(x, s)
        if half:
            peak, bounded = self._sum_in_float16(x, peak, device, ops)
        elif many:
            buf[n] = peak
            with self.comm.phase("allreduce"):
                buf = self.comm.allreduce(buf, "sum", out=buf)
            x = buf[:n]
            peak = float(buf[n])
        stats = self.comm.stats
        self.comm.next_step()
        if bounded if half else peak < _BOUND[work.name]:
            finite = True
        else:  # a NaN or ±inf somewhere, or sums near the top of the range: count them
            finite = ops.canonical_count_nonfinite(x) == 0
        if self.nonfinite != "propagate" and not finite:
            return self._not_applied(device), False
        self.step += 1
        stats["steps"] += 1
        return SparseResult.from_dense(self._in_grad_dtype(x, finite)), True

    def _sum_in_float16(self, x, peak, device, ops) -> tuple[float, bool]:
        """``wire_dtype="float16"``: x (g / s in the work dtype) summed in float16, the sums
        widened exactly back into x. Returns M, the largest |g / s| over every rank (inf if any
        is NaN or ±inf), and whether every sum is known to be finite without a pass over x.

        M comes first (one MAX allreduce of one number); with M finite and non-zero, x is scaled
        by 2^e, the power of two that puts P·M in [2^14, 2^15), before it is rounded to float16
        and MPI sums it, and the sums are scaled back by 2^-e: no sum can pass ±65504, and
        values down to 2^-28·P·M stay normal floats (MPI libraries that sum float16 in software
        slow down on subnormal ones). e is not bounded by the work dtype's range (a float64
        gradient of 1e300 or 1e-300 needs e near ∓1000, and a float32 one of 1e-40 needs
        e > 126): both scalings are made in the work dtype, in steps whose factors are normal
        numbers of it (:func:`_pow2_steps`; one step for every float32 e in ±126 and float64 e
        in ±1022). The sums are known to be finite when M is, P is at most 1024 and the scaled
        back float16 range, 65504·2^-e, is inside the work dtype's; otherwise the caller counts
        them, so that an overflow to ±inf (a sum of values near the dtype's largest) is caught."""
        n, wire = self.n, np.dtype(np.float16)
        dtype = x.dtype
        if self.P > 1:
            with self.comm.phase("allreduce"):
                peak = float(self.comm.allreduce(np.array([peak]), "max")[0])
        e = 0
        if 0 < peak < math.inf:
            f, x_exp = math.frexp(peak)  # P·M = P·f·2^x_exp, which may overflow a float
            e = 15 - x_exp - math.frexp(self.P * f)[1]
        steps = _pow2_steps(e, dtype)
        if device:
            for k in steps:
                ops.divide_max_abs(x, dtype.type(2.0**-k))  # x·2^k in place, exact
            buf = A.cast(x, wire)
        else:
            if self._half is None or self._half.shape[0] != n:
                self._half = np.empty(n, wire)
            buf = self._half
            *first, last = steps or [0]
            for k in first:
                np.multiply(x, dtype.type(2.0**k), out=x)
            if dtype == np.float32:  # NumPy's bits in one vectorised pass (NumPy's is not)
                ops.scale_to_half(x, 2.0**last, buf)  # past ±65504 (M not finite): ±inf
            else:
                with np.errstate(over="ignore"):  # past ±65504 (M not finite): ±inf, counted
                    np.multiply(x, dtype.type(2.0**last), out=buf, casting="same_kind")
        if self.P > 1:
            with self.comm.phase("allreduce"):
                buf = self.comm.allreduce(buf, "sum", out=None if device else buf)
        back = _pow2_steps(-e, dtype)
        if device:
            ops.copy_into(x, A.cast(buf, dtype))
            for k in back:
                ops.divide_max_abs(x, dtype.type(2.0**-k))
        else:
            f = 2.0 ** (back[0] if back else 0)
            with np.errstate(over="ignore"):  # past the dtype's range: ±inf, then counted
                if dtype == np.float32:
                    ops.scale_from_half(buf, f, x)
                else:
                    np.multiply(buf, dtype.type(f), out=x)
                for k in back[1:]:
                    np.multiply(x, dtype.type(2.0**k), out=x)
        bounded = 0 <= peak < math.inf and self.P <= _HALF_SAFE_P
        bounded = bounded and 16 - e <= np.finfo(dtype).maxexp - 1  # 65504·2^-e < 2^(16-e)
        return peak, bounded

    def _send_buffer(self, work, m, device):
        """The buffer of m work-dtype entries this step reduces in place: new on the device;
        on the host pooled (float32/float64 gradients) or the float16 path's own."""
        if device:
            return A.empty(m, work, True)
        if work == self._dtype:
            return self._buffer(work, m)
        if self._work is None or self._work.shape[0] != m:
            self._work = np.empty(m, work)
        return self._work

    def _buffer(self, dtype, m=None):
        """A host array of m (default n) ``dtype`` for this step's result: a pooled one that
        nothing outside the pool refers to any more (no result, view or tensor of it is alive),
        else a new one, kept in place of the oldest. Reusing memory spares the page faults of a
        fresh 4n-byte buffer on every step (tens of ms for 100 MB); two buffers cover a caller
        that keeps the previous result while it makes the next one."""
        m = self.n if m is None else m
        buf = self._pool.take(m, dtype)
        if buf is None:
            buf = np.empty(m, dtype)
            self._pool.keep(buf)
        return buf

    def _in_grad_dtype(self, total, finite):
        """The reduced vector in the gradient's dtype: float32 work values rounded to float16,
        finite values past ±65504 clamped to it (the common case costs one cast and one count).
        ``finite``: whether ``total`` is all finite, None if not known yet."""
        if total.dtype == self._dtype:
            return total
        device = A.is_device(total)
        with np.errstate(over="ignore"):  # past ±65504: inf, clamped below
            if device:
                out = A.cast(total, self._dtype)
            else:
                out = self._buffer(self._dtype)
                np.copyto(out, total, casting="same_kind")  # round to nearest, as astype
        if A.all_finite(out):
            return out
        top = float(np.finfo(self._dtype).max)
        host = A.to_host(total)
        clamped = np.clip(host, -top, top)
        if not finite:  # False, or None (not known yet)
            # NaN or Inf sums (nonfinite="propagate") stay as they are; only the finite values
            # past the range are clamped.
            keep = np.isfinite(host)
            if not keep.all():
                clamped = np.where(keep, clamped, host)
        clamped = clamped.astype(self._dtype)
        if device:
            return A.to_device(clamped)
        np.copyto(out, clamped)
        return out

    @property
    def residual(self):
        """Always zero: shape (n,), the work dtype (float32 for float16 gradients), on the
        device after GPU gradients. A new array on every read (nothing is kept per step)."""
        dtype = np.float32 if self._dtype is None else _work_dtype(self._dtype)
        return A.zeros(self.n, dtype, getattr(self, "_device", False))
