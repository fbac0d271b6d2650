"""`ReplyWindow`: which replies a link sends and which outbox rows an
acknowledgement frees, without sockets. The property that matters: no id is ever
freed while a smaller id that this link did not get acknowledged is still owed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentd.federation._replies import ReplyWindow


def test_rows_and_live_replies_met_during_a_load_are_sent_once_in_order() -> None:
    w = ReplyWindow(limit=100)
    w.start_load()
    assert not w.offer(12)  # live, while loading: held
    assert w.end_load([10, 11, 12]) == [10, 11, 12]
    assert not w.offer(11) and w.offer(13)


def test_only_an_unbroken_run_of_acknowledgements_frees_rows() -> None:
    w = ReplyWindow(limit=100)
    for i in (1, 2, 3):
        assert w.offer(i)
    assert w.acknowledge(2) is None  # 1 is still owed
    assert w.acknowledge(1) == 2
    assert w.acknowledge(99) is None  # never sent: ignored
    assert w.acknowledge(3) == 3


def test_past_the_limit_nothing_more_is_sent_until_a_reload() -> None:
    w = ReplyWindow(limit=2)
    assert w.offer(1) and w.offer(2)
    assert not w.offer(3) and w.overflowed
    assert not w.offer(4)  # skipped too, though there is room after an ack
    w.acknowledge(1)
    assert not w.offer(5) and not w.needs_reload
    assert w.acknowledge(2) == 2  # never 3 or 4: they were not sent
    assert w.needs_reload


@given(st.lists(st.tuples(st.sampled_from(["offer", "ack", "load"]),
                          st.integers(1, 40)), max_size=80),
       st.integers(1, 6))
def test_no_unsent_reply_is_ever_freed(ops: list[tuple[str, int]], limit: int) -> None:
    """Live replies come in increasing id order (the kernel allocates outbox ids in
    commit order and the pump delivers after each commit); loads return what the
    outbox holds above what was freed, in any interleaving."""
    w = ReplyWindow(limit)
    available: set[int] = set()  # rows in the outbox
    sent: set[int] = set()
    freed_up_to = 0
    newest = 0
    for op, n in ops:
        if op == "offer":
            newest += n % 3 + 1
            available.add(newest)
            if w.offer(newest):
                sent.add(newest)
        elif op == "load":
            w.start_load()
            sent.update(w.end_load(sorted(i for i in available if i > freed_up_to)))
        else:
            candidates = sorted(sent)
            up_to = w.acknowledge(candidates[n % len(candidates)]) if candidates else None
            if up_to is not None:
                assert all(i in sent for i in available if freed_up_to < i <= up_to)
                freed_up_to = max(freed_up_to, up_to)
