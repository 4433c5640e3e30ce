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

Quantisation under error feedback (``wire="compact"``, docs/design.md §2.1). A value v that a rank
sends arrives as q = decoded(v), which may differ from v by the 16-bit rounding. The rank then
keeps v − q (exact in the work dtype) where it would have kept 0: :func:`keep_remainder`, called
by each algorithm where it sends, once for every value it encodes. With "coo" q is v itself
(the same array object) and the helper does nothing, so results are bit for bit those of before.
"""

from __future__ import annotations

import numpy as np

from spardl_kernels import coalesce, scatter_add
from spardl_kernels.cpu.wire import add_remainders

from .. import _arrays as A
from ..comm import pack_wire, unpack_wire, wire_index_dtype

__all__ = ["error_feedback", "sent_reached", "allgather_sum", "keep_remainder"]


def keep_remainder(target, indices, sent, delivered, mode="global", members=None):
    """Keep in ``target`` what the wire did not deliver: ``target[i] += sent − delivered``.

    Parameters
    ----------
    target : ndarray of shape (n,), the work dtype
        The sender's residual (or partial sums that become it), modified in place.
    indices : int64 array of shape (m,), strictly ascending
        The absolute coordinates of the values sent.
    sent : ndarray of shape (m,)
        The values as they were encoded.
    delivered : ndarray of shape (m,)
        The values as every receiver decodes them (:func:`spardl.comm.pack_wire`). When it is
        ``sent`` itself ("coo": nothing rounded) nothing is done.
    mode : {"global", "local", "none"}, default "global"
        The residual mode; "none" keeps nothing.
    members : int64 array, strictly ascending, optional
        Keep only at the coordinates in ``members`` (gtopk: the final output's).

    Returns
    -------
    ndarray
        ``target``.

    Notes
    -----
    The difference is computed in the work dtype, where it is exact (a 16-bit value of the
    compact format is v rounded within its binade, so v − q needs no rounding; docs/design.md
    §2.1), and added with ``scatter_add``: at a coordinate the sender zeroed, the remainder
    itself. On the host for device arrays (O(m) copies both ways; compact messages are staged
    through the host anyway).
    """
    if delivered is sent or mode == "none" or len(indices) == 0:
        return target
    idx, sent, delivered = A.to_host(indices), A.to_host(sent), A.to_host(delivered)
    if members is not None:
        hit = sent_reached(idx, A.to_host(members))
        idx, sent, delivered = idx[hit], sent[hit], delivered[hit]
    if not A.is_device(target):
        return add_remainders(target, idx, sent, delivered)  # one pass, zeros skipped
    rem = sent - delivered
    nz = (rem != 0) & np.isfinite(rem)  # a non-finite value travels raw: nothing to keep
    if np.any(nz):
        scatter_add(target, A.to_device(idx[nz]), A.to_device(rem[nz]))
    return target


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
    comm,
    indices: np.ndarray,
    values: np.ndarray,
    n: int,
    equal_counts: bool,
    wire: str = "coo",
    sent: list | None = None,
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
        one ``allgather`` replaces the two collectives (sizes, data) of an ``allgatherv``
        ("coo" only: compact messages differ in size).
    wire : {"coo", "compact"}, default "coo"
        The wire format (:func:`spardl.comm.pack_wire`).
    sent : list, optional
        Appended with this rank's values as every rank decodes them (``values`` itself for
        "coo", and at P = 1, where nothing is sent).

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
        if sent is not None:
            sent.append(values)
        return indices, values
    idt = wire_index_dtype(n)
    vdt = np.dtype(values.dtype)
    dev = A.is_device(values)
    buf, delivered = pack_wire([(indices, values)], [0], idt, vdt, wire, quantise=comm.quantise)
    if sent is not None:
        sent.extend(delivered)
    if equal_counts and wire == "coo":
        everyone = comm.allgather_array(buf)
        rows = [everyone[q] for q in range(comm.size)]
    else:
        rows = comm.allgatherv_bytes(buf, pad=wire != "coo")
    parts = [unpack_wire(row, 1, [0], idt, vdt, wire, dev)[0] for row in rows]
    cat_i = A.concat([p[0] for p in parts], np.int64, dev)
    cat_v = A.concat([p[1] for p in parts], vdt, dev)
    return coalesce(cat_i, cat_v)
