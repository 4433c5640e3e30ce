"""Helpers shared by the sparse algorithms: error-feedback bookkeeping and the all-gather + sum.

Error feedback (docs/design.md §4). Each rank keeps a dense residual E of length n. With
X = g + E_old and ``sent`` the (indices, values) this rank contributed, the modes of
``residual=`` are

* ``"global"``: E_new[i] = X[i] − sent[i] where i is in the final output, X[i] elsewhere. A value
  this rank sent that did not reach the output (dropped downstream) comes back to it, so the
  conservation invariant Σ_r X_r = P·out + Σ_r E_r,new holds whenever the output is exactly the sum
  of what was sent at its coordinates.
* ``"local"``: E_new[i] = X[i] − sent[i] everywhere (plain error feedback: a rank forgets what it
  sent, even if it was dropped downstream; Karimireddy et al., arXiv 1901.09847; Stich et al.,
  arXiv 1809.07599).
* ``"none"``: no residual; the base class ignores what ``_reduce`` returns for it.

Since ``sent`` holds X's own values at the sent positions, X[i] − sent[i] is exactly 0: the helpers
zero those positions instead of subtracting, which is exact for every dtype (and for NaN).
"""

from __future__ import annotations

import numpy as np

from spardl_kernels import coalesce

from .. import _arrays as A
from ..comm import pack_blocks, unpack_blocks, wire_index_dtype

__all__ = ["error_feedback", "sent_reached", "allgather_sum"]


def sent_reached(sent_indices: np.ndarray, out_indices: np.ndarray) -> np.ndarray:
    """Which of this rank's sent coordinates are in the final output.

    Parameters
    ----------
    sent_indices : int64 array of shape (m,), strictly ascending
        The coordinates this rank contributed.
    out_indices : int64 array of shape (nnz,), strictly ascending
        The coordinates of the final output.

    Returns
    -------
    bool array of shape (m,)
        True where ``sent_indices[j]`` is in ``out_indices``.
    """
    if len(out_indices) == 0 or len(sent_indices) == 0:
        return np.zeros(len(sent_indices), dtype=bool)
    # Both are sorted: one vectorised binary search per sent coordinate.
    pos = np.searchsorted(out_indices, sent_indices)
    pos = np.minimum(pos, len(out_indices) - 1)
    return out_indices[pos] == sent_indices


def error_feedback(
    x: np.ndarray, sent_indices: np.ndarray, mode: str, out_indices: np.ndarray | None = None
) -> np.ndarray:
    """This rank's new residual E_new from X and the coordinates it sent.

    Parameters
    ----------
    x : ndarray of shape (n,), the work dtype (float32 or float64)
        X = g + E_old. **Consumed**: it is modified in place and returned as E_new (the base class
        hands ``_reduce`` a private copy, so no second length-n buffer is needed).
    sent_indices : int64 array of shape (m,), strictly ascending
        The coordinates this rank sent; their values were X's own values.
    mode : {"global", "local", "none"}
        The allreducer's ``residual`` mode (see the module docstring).
    out_indices : int64 array, strictly ascending, optional
        The final output's coordinates, for ``mode="global"`` when some sent values may have been
        dropped downstream (gTop-k). ``None`` means everything sent reached the output (TopkA,
        Gaussiank, TopkDSA), where "global" and "local" coincide.

    Returns
    -------
    ndarray of shape (n,)
        E_new (the same object as ``x``).

    Raises
    ------
    ValueError
        If ``mode`` is not one of the three modes.
    """
    if mode == "none":
        return x
    if mode == "local" or out_indices is None:
        A.zero_at(x, sent_indices)
    elif mode == "global":
        # A sent value that did not reach the output stays with this rank (E = X there);
        # the membership test is sent_reached's, on the host or on the device.
        A.zero_members(x, sent_indices, out_indices)
    else:
        raise ValueError(f"mode must be 'global', 'local' or 'none', got {mode!r}")
    return x


def allgather_sum(
    comm, indices: np.ndarray, values: np.ndarray, n: int, equal_counts: bool
) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every rank's sparse vector and sum them in rank order 0 … P−1.

    Parameters
    ----------
    comm : spardl.comm.Comm
        The communicator (P ranks).
    indices : int64 array of shape (m,), strictly ascending, each in [0, n)
        This rank's coordinates.
    values : ndarray of shape (m,), the work dtype
        Its values.
    n : int
        Vector length (decides the wire index dtype: int32 below 2^31).
    equal_counts : bool
        Every rank sends the same m (TopkA: m = k). Then the packed buffers have equal sizes and
        one ``allgather`` replaces the two collectives (sizes, data) of an ``allgatherv``.

    Returns
    -------
    indices : int64 array, strictly ascending
    values : ndarray of the work dtype
        The sum over ranks, bit-identical on every rank: duplicates are summed in rank order
        (``coalesce`` sums in position order, and the concatenation is in rank order).

    Notes
    -----
    Cost (α-β): equal counts, 1 message and m(P−1)·(isz + vsz) bytes received; otherwise 2
    messages (the size all-gather, then the data).
    """
    if comm.size == 1:
        return indices, values
    idt = wire_index_dtype(n)
    vdt = np.dtype(values.dtype)
    dev = A.is_device(values)
    buf = pack_blocks([(indices, values)], [0], idt, vdt)
    if equal_counts:
        everyone = comm.allgather_array(buf)
        rows = [everyone[q] for q in range(comm.size)]
    else:
        rows = comm.allgatherv_bytes(buf)
    parts = [unpack_blocks(row, 1, [0], idt, vdt)[0] for row in rows]
    cat_i = A.concat([p[0] for p in parts], np.int64, dev)
    cat_v = A.concat([p[1] for p in parts], vdt, dev)
    return coalesce(cat_i, cat_v)
