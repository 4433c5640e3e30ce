"""spardl.schedules: the SRS and Bruck schedules, checked by simulating the data flow symbolically
for every P from 1 to 64."""

from __future__ import annotations

import math

import pytest

from spardl.schedules import Round, bruck_schedule, num_rounds, srs_schedule

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
