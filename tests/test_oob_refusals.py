"""Which OOB refusals are journaled one by one and which only counted (pure)."""

from __future__ import annotations

from agentd.oob._refusals import OTHER_PEERS, RefusalLimiter, Summary


def test_a_peer_gets_its_burst_whole_then_one_count_per_window() -> None:
    limiter = RefusalLimiter(interval_s=10, burst=3)
    admitted = [limiter.admit("a", "invalid", 100 + i * 0.01) for i in range(50)]
    assert admitted == [True] * 3 + [False] * 47
    assert limiter.pending() and limiter.due(109.9) == []
    assert limiter.due(110.0) == [Summary("a", 47, {"invalid": 47})]
    assert not limiter.pending() and limiter.due(1e9) == []  # reported once
    assert limiter.admit("a", "invalid", 110.0)  # a new window: whole again


def test_the_count_says_how_many_of_each_kind() -> None:
    limiter = RefusalLimiter(interval_s=1, burst=1)
    for kind in ("invalid", "stale", "invalid", "replay", "invalid"):
        limiter.admit("a", kind, 0.0)
    assert limiter.due(1.0) == [Summary("a", 4, {"invalid": 2, "replay": 1, "stale": 1})]


def test_peers_are_counted_apart_and_past_the_cap_together() -> None:
    limiter = RefusalLimiter(interval_s=10, burst=1, max_peers=2)
    assert limiter.admit("a", "invalid", 0) and limiter.admit("b", "invalid", 0)
    assert limiter.admit("c", "invalid", 0)  # the first of the shared window
    assert not limiter.admit("d", "invalid", 0) and not limiter.admit("a", "invalid", 0)
    assert sorted(limiter.due(10), key=lambda s: s.peer) == [
        Summary("a", 1, {"invalid": 1}), Summary(OTHER_PEERS, 1, {"invalid": 1})]


def test_rows_are_bounded_under_any_flood() -> None:
    limiter = RefusalLimiter(interval_s=10, burst=10, max_peers=64)
    rows = 0
    for i in range(100_000):  # 1,000 pids, a refusal every 0.1 ms: 10 s of flood
        rows += limiter.admit(f"pid={i % 1000}", "invalid", i / 10_000)
    rows += len(limiter.due(10.0))
    assert rows <= (10 + 1) * (64 + 1)
