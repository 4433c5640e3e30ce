"""`dense`: MPI Allreduce of the whole vector, the baseline every speedup is quoted against."""

from __future__ import annotations

import numpy as np

from spardl_kernels.cpu import arrays as host_arrays

from .. import _arrays as A
from ..result import SparseResult
from .base import Allreducer, _work_dtype

#: Result buffers a dense allreducer keeps (per dtype in use).
_POOL = 2


class Dense(Allreducer):
    """Dense allreduce: every rank sends all n values; nothing is dropped (E_new = 0).

    Cost: one collective; 2n(P−1)/P words each way under a bandwidth-optimal allreduce
    (Rabenseifner's reduce-scatter + all-gather; Thakur, Rabenseifner & Gropp, IJHPCA 2005).
    ``density`` and ``residual`` are accepted for a uniform interface and have no effect: the
    residual is always zero.

    A step is the checks every allreducer makes, one ``MPI_Allreduce`` and nothing else of
    size n but what the result needs, so that it is a fair baseline for the sparse ones:

    * float32 and float64 gradients: ``Allreduce(g, out)`` from the caller's buffer into the
      result buffer, then for ``op="mean"`` ``out /= P`` in place, fused with the non-finite
      count (one pass; for "sum" the count alone). The result buffer is reused from step to
      step once nothing refers to the previous result any more (a pool of two, so a caller
      that keeps the last result still gets reuse): a fresh 100 MB buffer costs tens of ms in
      page faults on every step, which ``Allreduce`` into a caller's warm buffer does not pay;
    * float16 gradients: one float32 copy of g (into a buffer kept from step to step), reduced
      in place (``MPI_IN_PLACE``) in float32, divided in place, then rounded once to float16.
      Sums of float16 overflow at 65504 long before their mean does, and MPI's own float16 sum
      rounds after every addition; the float32 sum is what the sparse allreducers compute too.
      A mean (or sum) beyond float16's range is clamped to ±65504 rather than becoming inf, as
      in the other allreducers; with no residual, the rounding remainder is dropped. This costs
      the float32 Allreduce's bytes (twice the float16 ones; ``stats`` counts them as sent);
    * the non-finite check and the cross-rank check (one small allreduce) as in every
      allreducer; no residual buffer, no index array, no copy of g. The allreducer holds up to
      two result buffers of n values (three arrays for float16: its float32 work buffer).

    The result is the dense form of :class:`~spardl.result.SparseResult`: the reduced vector
    itself; ``to_dense()`` copies it, ``indices``/``values`` are made on first read. The values
    are bit for bit the MPI library's sum (divided by P in the work dtype for the mean), so they
    equal ``comm.Allreduce`` of the same buffers (see ``tests/mpi/test_dense.py``).
    """

    name = "dense"
    #: No residual, so no float16 rounding feedback either (base class attribute).
    rounding_feedback = False

    def _setup(self) -> None:
        self._pool = A.BufferPool(_POOL)  # host result buffers, reused once nothing holds them
        self._work = None  # float16 gradients: the float32 buffer they are reduced in
        self._device = False

    def _step(self, grad) -> tuple[SparseResult, bool]:
        g = self._accept(grad)
        device = A.is_device(g)
        if self._dtype is None:
            self._dtype = np.dtype(g.dtype)
        self._device = device
        work = _work_dtype(self._dtype)
        with self.comm.phase("allreduce"):
            if device:
                x = A.cast(g, work, copy=self.P == 1)
                total = x if self.P == 1 else self.comm.allreduce(x, "sum")
            elif g.dtype == work:
                total = self._buffer(work)
                if self.P == 1:
                    np.copyto(total, g)
                else:
                    self.comm.allreduce(g, "sum", out=total)
            else:
                if self._work is None:
                    self._work = np.empty(self.n, work)
                total = self._work
                np.copyto(total, g)  # float16 -> float32, exact
                if self.P > 1:
                    self.comm.allreduce(total, "sum", out=total)
        stats = self.comm.stats
        self.comm.next_step()
        # The mean's division and the non-finite count in one pass over the sums (a finite sum
        # stays finite divided by P, Inf and NaN stay what they are, so the count is the same);
        # the pass writes every NaN as the canonical NaN (docs/design.md §3.4), whatever NaN the
        # MPI library's sum made.
        scale = self.P if self.op == "mean" and self.P > 1 else 1
        ops = host_arrays
        if device:
            from spardl_kernels.cuda import arrays as ops
        if scale > 1:
            finite = ops.divide_count_nonfinite(total, scale) == 0
        elif self.nonfinite == "propagate":
            finite = None
        else:
            finite = ops.canonical_count_nonfinite(total) == 0
        if self.nonfinite != "propagate" and not finite:
            return self._not_applied(device), False
        self.step += 1
        stats["steps"] += 1
        return SparseResult.from_dense(self._in_grad_dtype(total, finite)), True

    def _buffer(self, dtype):
        """A host array of n ``dtype`` for this step's result: a pooled one that nothing outside
        the pool refers to any more (no result, view or tensor of it is alive), else a new one,
        kept in place of the oldest. Reusing memory spares the page faults of a fresh 4n-byte
        buffer on every step (tens of ms for 100 MB); two buffers cover a caller that keeps
        the previous result while it makes the next one."""
        buf = self._pool.take(self.n, dtype)
        if buf is None:
            buf = np.empty(self.n, dtype)
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
        if finite is None:
            finite = A.all_finite(total)
        if not finite:  # NaN or Inf in the sums: no clamping (nonfinite="propagate")
            return out
        top = float(np.finfo(self._dtype).max)
        clamped = np.clip(A.to_host(total), -top, top).astype(self._dtype)
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
