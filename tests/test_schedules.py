"""spardl.schedules: the SRS and Bruck schedules, checked by simulating the data flow symbolically
for every P from 1 to 64."""

from __future__ import annotations

import math
import pickle
import sys
import time

import numpy as np
import pytest

from spardl.schedules import CyclicRange, Round, bruck_schedule, num_rounds, srs_schedule

PS = list(range(1, 65))


def _matched(schedules, P, j):
    """Round j: what r sends to dest is what dest expects from r, item for item, in order."""
    for r in range(P):
        rnd = schedules[r][j]
        peer = schedules[rnd.dest][j]
        assert peer.source == r
        assert peer.recv == rnd.send
        assert rnd.dest != r or P == 1


@pytest.mark.parametrize("P", PS)
def test_srs_delivers_every_contribution_to_the_owner_once(P):
    sched = [srs_schedule(P, r) for r in range(P)]
    R = math.ceil(math.log2(P)) if P > 1 else 0
    assert num_rounds(P) == R
    assert all(len(s) == R for s in sched)
    # sizes s_0 = P - 2^(R-1), then 2^(R-1-j); they add to P - 1
    sizes = [len(rnd.send) for rnd in sched[0]]
    if P > 1:
        assert sizes == [P - 2 ** (R - 1)] + [2 ** (R - 1 - j) for j in range(1, R)]
        assert [rnd.dest for rnd in sched[0]] == [2 ** (R - 1 - j) % P for j in range(R)]
    assert sum(sizes) == P - 1
    # held[r][b]: the multiset (list) of ranks whose contribution to block b rank r holds
    held = [[[r] for _ in range(P)] for r in range(P)]
    sent = [set() for _ in range(P)]
    for j in range(R):
        _matched(sched, P, j)
        msgs = {}
        for r in range(P):
            rnd = sched[r][j]
            assert len(set(rnd.send)) == len(rnd.send)
            for b in rnd.send:
                assert b != r, "a rank never sends the block it owns"
                assert b not in sent[r], "a block is sent once"
                sent[r].add(b)
            msgs[rnd.dest] = [(b, held[r][b]) for b in rnd.send]
            for b in rnd.send:
                held[r][b] = []
        for dest, payload in msgs.items():
            for b, contrib in payload:
                # receiving a block already sent away would strand the contribution
                assert b not in sent[dest]
                held[dest][b] = held[dest][b] + contrib
    for r in range(P):
        assert sent[r] == set(range(P)) - {r}
        assert sorted(held[r][r]) == list(range(P)), "owner holds every rank exactly once"
        assert all(held[r][b] == [] for b in range(P) if b != r)


@pytest.mark.parametrize("P", PS)
def test_bruck_delivers_every_item_to_every_rank_once(P):
    sched = [bruck_schedule(P, r) for r in range(P)]
    R = num_rounds(P)
    assert all(len(s) == R for s in sched)
    held = [[r] for r in range(P)]
    total_sent = [0] * P
    for i in range(R):
        _matched(sched, P, i)
        msgs = {}
        for r in range(P):
            rnd = sched[r][i]
            assert len(rnd.send) == min(2**i, P - 2**i)
            assert rnd.dest == (r - 2**i) % P and rnd.source == (r + 2**i) % P
            assert set(rnd.send) <= set(held[r]), "a rank sends only what it holds"
            msgs[rnd.dest] = list(rnd.send)
            total_sent[r] += len(rnd.send)
        for dest, items in msgs.items():
            held[dest] = held[dest] + items
    for r in range(P):
        assert sorted(held[r]) == list(range(P))
        assert total_sent[r] == P - 1


def test_p1_is_empty_and_errors():
    assert srs_schedule(1, 0) == [] and bruck_schedule(1, 0) == []
    assert isinstance(srs_schedule(2, 1)[0], Round)
    with pytest.raises(ValueError, match="rank"):
        srs_schedule(4, 4)
    with pytest.raises(ValueError, match="P"):
        bruck_schedule(0, 0)
    with pytest.raises(TypeError, match="P"):
        srs_schedule(4.0, 0)
    with pytest.raises(ValueError, match="P"):
        num_rounds(0)


# -- the rounds' items as CyclicRange: O(log P) per schedule, equal to the tuples of the ids ------


def _srs_tuples(P, rank):
    """The SRS rounds with the items written out: (dest, send, source, recv) per round."""
    R = (P - 1).bit_length()
    out = []
    for j in range(R):
        g = 2 ** (R - 1 - j)
        s = P - g if j == 0 else g
        send = tuple((rank + g + i) % P for i in range(s))
        recv = tuple((rank + i) % P for i in range(s))
        out.append(((rank + g) % P, send, (rank - g) % P, recv))
    return out


def _bruck_tuples(P, rank):
    out = []
    for i in range((P - 1).bit_length()):
        c = min(2**i, P - 2**i)
        send = tuple((rank + q) % P for q in range(c))
        recv = tuple((rank + 2**i + q) % P for q in range(c))
        out.append(((rank - 2**i) % P, send, (rank + 2**i) % P, recv))
    return out


@pytest.mark.parametrize("P", range(1, 41))
def test_lazy_items_equal_the_tuples(P):
    for rank in range(P):
        for got, want in [
            (srs_schedule(P, rank), _srs_tuples(P, rank)),
            (bruck_schedule(P, rank), _bruck_tuples(P, rank)),
        ]:
            assert len(got) == len(want)
            for rnd, (dest, send, source, recv) in zip(got, want, strict=True):
                assert (rnd.dest, rnd.source) == (dest, source)
                for lazy, items in [(rnd.send, send), (rnd.recv, recv)]:
                    assert isinstance(lazy, CyclicRange)
                    assert lazy == items and items == lazy and not lazy != items
                    assert tuple(lazy) == items and list(lazy) == list(items)
                    assert len(lazy) == len(items) and hash(lazy) == hash(items)
                    assert [lazy[i] for i in range(-len(items), len(items))] == list(items * 2)
                    assert tuple(reversed(lazy)) == items[::-1]
                    assert lazy[1:-1] == items[1:-1] and lazy[::2] == items[::2]
                    assert [b in lazy for b in range(-1, P + 1)] == [
                        b in items for b in range(-1, P + 1)
                    ]
                    assert all(lazy.index(b) == items.index(b) for b in items)
                    assert np.array_equal(np.array(lazy, dtype=np.int64), np.array(items))
            assert got == [Round(*w) for w in want]  # Round to Round: the fields compare too


@pytest.mark.parametrize("P", [2**40, 2**40 + 3, 2**62])
def test_huge_p_answers_at_once(P):
    R = num_rounds(P)
    start = time.perf_counter()
    for rank in (0, 1, P // 3, P - 1):
        srs = srs_schedule(P, rank)
        bruck = bruck_schedule(P, rank)
        assert len(srs) == len(bruck) == R
        s0 = P - 2 ** (R - 1)  # the first SRS round's size
        first = srs[0]
        assert first.dest == (rank + 2 ** (R - 1)) % P and first.source == (rank - 2 ** (R - 1)) % P
        assert len(first.send) == len(first.recv) == s0
        assert first.send[0] == (rank + 2 ** (R - 1)) % P
        assert first.send[-1] == (rank + 2 ** (R - 1) + s0 - 1) % P
        assert (first.recv[0], first.recv[-1]) == (rank, (rank + s0 - 1) % P)
        assert [len(r.send) for r in srs[1:]] == [2 ** (R - 1 - j) for j in range(1, R)]
        assert sum(len(r.send) for r in srs) == P - 1
        last = bruck[-1]
        c = min(2 ** (R - 1), P - 2 ** (R - 1))
        assert len(last.send) == len(last.recv) == c
        assert (last.send[0], last.send[-1]) == (rank, (rank + c - 1) % P)
        assert (last.recv[0], last.recv[-1]) == (
            (rank + 2 ** (R - 1)) % P,
            (rank + 2 ** (R - 1) + c - 1) % P,
        )
        assert sum(len(r.send) for r in bruck) == P - 1
        assert rank not in first.send and (rank - 1) % P in first.send
        assert first.send[s0 // 2 : s0 // 2 + 2] == (
            (rank + 2 ** (R - 1) + s0 // 2) % P,
            (rank + 2 ** (R - 1) + s0 // 2 + 1) % P,
        )
    assert time.perf_counter() - start < 1.0


def test_p_above_sys_maxsize_is_refused():
    with pytest.raises(ValueError, match="^P must be <= sys.maxsize"):
        srs_schedule(sys.maxsize + 1, 0)
    with pytest.raises(ValueError, match="^P must be <= sys.maxsize"):
        bruck_schedule(2**100, 0)
    assert len(srs_schedule(sys.maxsize, 0)) == num_rounds(sys.maxsize)


def test_cyclic_range_reads_as_its_tuple():
    r = CyclicRange(12, 4, 7)  # start reduced to 5: the items 5, 6, 0, 1
    assert (r.start, r.modulus, len(r)) == (5, 7, 4)
    assert repr(r) == "CyclicRange(start=5, count=4, modulus=7)"
    assert r == (5, 6, 0, 1) and r != [5, 6, 0, 1] and r != (5, 6, 0)
    assert r == CyclicRange(5, 4, 7) and r != CyclicRange(5, 3, 7)
    assert CyclicRange(0, 3, 5) == CyclicRange(0, 3, 9)  # the same items, other moduli
    assert CyclicRange(3, 0, 5) == CyclicRange(1, 0, 8) == ()
    assert {r: 1}[(5, 6, 0, 1)] == 1
    assert r[1:3] == CyclicRange(6, 2, 7) and isinstance(r[1:3], CyclicRange)
    assert r[::-1] == (1, 0, 6, 5) and r[5:] == ()
    assert r + (9,) == (5, 6, 0, 1, 9) and (9,) + r == (9, 5, 6, 0, 1) and r + r == tuple(r) * 2
    assert 0 in r and 0.0 in r and np.int64(6) in r and 2 not in r and 7 not in r
    assert 0.5 not in r and "0" not in r and float("nan") not in r and float("inf") not in r
    assert (r.index(0), r.count(0), r.count(2)) == (2, 1, 0)
    with pytest.raises(ValueError):
        r.index(0, 3)
    with pytest.raises(ValueError):
        r.index(2)
    with pytest.raises(IndexError):
        r[4]
    with pytest.raises(IndexError):
        r[-5]
    with pytest.raises(TypeError, match="integers or slices"):
        r["0"]
    with pytest.raises(AttributeError):
        r._count = 9
    assert pickle.loads(pickle.dumps(r)) == r


@pytest.mark.parametrize(
    "args,err,match",
    [
        ((0, 1, 0), ValueError, "^modulus must be >= 1"),
        ((0, 4, 3), ValueError, "^count must be in"),
        ((0, -1, 3), ValueError, "^count must be in"),
        ((0, sys.maxsize + 1, 2**70), ValueError, "^count must be in"),
        ((0.0, 1, 3), TypeError, "^start must be an integer"),
        ((0, True, 3), TypeError, "^count must be an integer"),
        ((0, 1, "3"), TypeError, "^modulus must be an integer"),
    ],
)
def test_cyclic_range_checks_its_arguments(args, err, match):
    with pytest.raises(err, match=match):
        CyclicRange(*args)
