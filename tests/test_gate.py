"""The speculation gate's choice between alternative drafts (SpeculationGate.pick)."""

from __future__ import annotations

from selfdraft.gate import WARMUP, SpeculationGate


def test_pick_runs_the_faster_alternative_and_falls_back_to_the_other():
    """Guards SpeculationGate.pick: each alternative warms up, then the one with the best optimistic rate
    drafts while it beats plain decoding; the alternative not run ages (so it is probed again), and when
    the running one starts losing the other takes over rather than plain decoding."""
    gate = SpeculationGate(probe_every=1000)
    kinds = ("whole tree", "free part alone")
    for _ in range(WARMUP):  # each alternative drafts first: 3 tokens in 30 ms and in 15 ms
        assert gate.pick(1, kinds) == 0
        gate.record(1, True, 3, 0.030, kinds[0], kinds[1:])
    for _ in range(WARMUP):
        assert gate.pick(1, kinds) == 1
        gate.record(1, True, 3, 0.015, kinds[1], kinds[:1])
    for _ in range(WARMUP):  # then plain steps: 1 token in 10 ms
        assert gate.pick(1, kinds) is None
        gate.record(1, False, 1, 0.010, kinds[0], kinds[1:])
    whole = gate.stats[(1, kinds[0])]
    weight = whole.weight
    for _ in range(10):  # 200 tok/s against 100 for the whole tree and for plain steps
        assert gate.pick(1, kinds) == 1
        gate.record(1, True, 3, 0.015, kinds[1], kinds[:1])
    assert whole.weight < weight  # the whole tree's estimate aged while it sat idle
    picks = []
    for _ in range(40):  # the free part stops paying: 1 token in 15 ms
        picks.append(gate.pick(1, kinds))
        if picks[-1] == 1:
            gate.record(1, True, 1, 0.015, kinds[1], kinds[:1])
        else:
            gate.record(1, True, 3, 0.030, kinds[0], kinds[1:])
    assert None not in picks and picks[-5:] == [0] * 5, picks  # the whole tree (100+ tok/s) takes over
    assert SpeculationGate().pick(1, (None,)) == 0 and SpeculationGate().speculate(1) is True
