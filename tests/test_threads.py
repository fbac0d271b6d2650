"""The thread registry: opaque, unique UUIDs over private call-chain frames."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd._routing import Profile, build_table
from agentd._states import IllegalTransition
from agentd._threads import (
    TRANSITIONS,
    Frame,
    ThreadEvent,
    ThreadRegistry,
    ThreadState,
    new_uuid,
    transition,
)


def profile(name: str = "p") -> Profile:
    return Profile(name, build_table(1, []))


def start(reg: ThreadRegistry, owner: str, p: Profile) -> Frame:
    frame = Frame(new_uuid(), (owner,), None, owner, p)
    reg.add(frame)
    return frame


def test_new_uuids_are_canonical_version_4() -> None:
    seen = set()
    for _ in range(5000):
        u = new_uuid()
        parsed = uuid.UUID(u)
        assert parsed.version == 4 and str(parsed) == u
        seen.add(u)
    assert len(seen) == 5000


def test_many_conversations_on_one_path_keep_their_own_uuids() -> None:
    reg = ThreadRegistry()
    p = profile()
    roots = [start(reg, "alice", p) for _ in range(100)]
    children = [reg.extend(r, "relay") for r in roots]
    grandchildren = [reg.extend(c, "calculator.add") for c in children]
    assert len({g.uuid for g in grandchildren}) == 100
    assert {g.path for g in grandchildren} == {("alice", "relay", "calculator.add")}
    for g, c, r in zip(grandchildren, children, roots, strict=True):
        assert g.parent is c and c.parent is r and g.root is r


def test_repr_never_shows_the_path() -> None:
    reg = ThreadRegistry()
    child = reg.extend(start(reg, "alice", profile()), "secret-listener")
    assert "secret-listener" not in repr(child) and "alice" not in repr(child)


def test_logs_name_a_frame_by_its_clients_thread_and_a_child_by_its_own_uuid_too() -> None:
    reg = ThreadRegistry()
    root = start(reg, "alice", profile())
    child = reg.extend(root, "tutor")
    grandchild = reg.extend(child, "calculator.add")
    assert root.log_ids == f"thread={root.uuid}"
    assert child.log_ids == f"thread={root.uuid} frame={child.uuid}"
    assert grandchild.log_ids == f"thread={root.uuid} frame={grandchild.uuid}"


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["start", "extend", "complete"]), st.integers(0, 50)),
        max_size=120,
    )
)
def test_registry_invariants_hold_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    reg = ThreadRegistry()
    p = profile()
    live = []
    for op, n in ops:
        if op == "start" or not live:
            live.append(start(reg, f"client{n % 3}", p))
        elif op == "extend":
            parent = live[n % len(live)]
            child = reg.extend(parent, f"l{n}")
            assert child.path == (*parent.path, f"l{n}")
            assert child.profile is parent.profile and child.owner == parent.owner
            live.append(child)
        else:
            frame = live.pop(n % len(live))
            children_before = frame.parent.children if frame.parent is not None else 0
            assert reg.end(frame, ThreadEvent.ANSWERED) is ThreadState.COMPLETED
            assert reg.get(frame.uuid) is None and frame.state is ThreadState.COMPLETED
            if frame.parent is not None:
                assert frame.parent.children == children_before - 1
    uuids = [f.uuid for f in live]
    assert len(set(uuids)) == len(uuids)
    for f in live:
        assert reg.get(f.uuid) is f
        assert f.path[0] == f.owner


EXPECTED_TRANSITIONS = {
    (ThreadState.ACTIVE, ThreadEvent.ANSWERED): ThreadState.COMPLETED,
    (ThreadState.ACTIVE, ThreadEvent.FAILED): ThreadState.FAILED,
    (ThreadState.ACTIVE, ThreadEvent.ABANDONED): ThreadState.COMPLETED,
}


@pytest.mark.parametrize("state", list(ThreadState))
@pytest.mark.parametrize("event", list(ThreadEvent))
def test_every_state_and_event_is_legal_or_raises(state: ThreadState, event: ThreadEvent) -> None:
    expected = EXPECTED_TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(IllegalTransition):
            transition(state, event)
    else:
        assert transition(state, event) is expected


def test_the_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(ThreadState)
    assert all(not TRANSITIONS[s] for s in (ThreadState.COMPLETED, ThreadState.FAILED))


def test_an_ended_frame_cannot_end_again() -> None:
    reg = ThreadRegistry()
    root = start(reg, "alice", profile())
    child = reg.extend(root, "calculator.add")
    assert reg.end(child, ThreadEvent.FAILED) is ThreadState.FAILED
    assert root.children == 0
    with pytest.raises(IllegalTransition):
        reg.end(child, ThreadEvent.ANSWERED)
    assert child.state is ThreadState.FAILED and root.children == 0


def test_an_abandoned_conversation_leaves_the_registry() -> None:
    reg = ThreadRegistry()
    root = start(reg, "alice", profile())
    assert reg.end(root, ThreadEvent.ABANDONED) is ThreadState.COMPLETED
    assert reg.get(root.uuid) is None and len(reg) == 0


async def test_idle_conversations_are_ended_in_pump_and_kernel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from agentd.testing import Harness
    from agentd.tools.calculator import Add

    organism = Path(__file__).parent / "organisms" / "basic.yaml"
    async with Harness.from_config(organism, {"alice": "public"}, state_dir=tmp_path) as h:
        frames = await h.send("alice", Add(a=1, b=2))
        thread = frames[0].split(b"<thread>")[1].split(b"</thread>")[0].decode()
        frame = h.pump.registry.get(thread)
        assert frame is not None
        assert h.pump.collect_idle(60, now=frame.touched + 30) == 0
        assert h.pump.collect_idle(60, now=frame.touched + 61) == 1
        assert h.pump.registry.get(thread) is None
        await h.run_until_idle()
        assert h.kernel is not None
        row = await h.kernel.thread(thread)
        assert row is not None and row.state == "completed"


async def test_abandoned_calls_do_not_keep_their_conversation_alive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from agentd.testing import Harness
    from tests.organisms import listeners as L

    organism = Path(__file__).parent / "organisms" / "basic.yaml"
    async with Harness.from_config(organism, {"alice": "public"}, state_dir=tmp_path) as h:
        # ping and pong call each other until the hop limit stops the chain: every
        # frame along the way is a call that will never be answered.
        await h.send("alice", L.Ping(n=0))
        frames = list(h.pump.registry)
        assert len(frames) > 5
        later = max(f.touched for f in frames) + 3600
        assert h.pump.collect_idle(60, now=later) == len(frames)
        assert len(h.pump.registry) == 0


# ---- conversations at rest: memory bounded by the work in progress ---------------------


def test_a_conversation_at_rest_is_still_found_and_wakes_when_continued() -> None:
    reg = ThreadRegistry(max_resting=4)
    root = start(reg, "alice", profile())
    assert reg.rest(root) == []
    assert (reg.in_progress, reg.resting, len(reg)) == (0, 1, 1)
    assert reg.get(root.uuid) is root and root.state is ThreadState.ACTIVE
    reg.wake(root)
    assert (reg.in_progress, reg.resting) == (1, 0)
    assert reg.get(root.uuid) is root


def test_the_rest_set_is_bounded_and_pushes_out_the_least_recently_rested() -> None:
    reg = ThreadRegistry(max_resting=3)
    p = profile()
    roots = [start(reg, "alice", p) for _ in range(5)]
    pushed = [f for r in roots[:3] for f in reg.rest(r)]
    assert pushed == []
    reg.rest(roots[0])  # rested again: now the most recent
    assert reg.rest(roots[3]) == [roots[1]]
    assert reg.rest(roots[4]) == [roots[2]]
    assert reg.resting == 3 and {f.uuid for f in reg} == {roots[i].uuid for i in (0, 3, 4)}
    # The caller ends what was pushed out; it is no longer held anywhere.
    assert reg.end(roots[1], ThreadEvent.ABANDONED) is ThreadState.COMPLETED
    assert reg.get(roots[1].uuid) is None and len(reg) == 3


def test_a_client_opening_conversations_by_the_thousand_pushes_out_its_own() -> None:
    """The rest set is shared: when it is full, the owner holding the most at rest
    loses its oldest. A client's burst of one-message conversations used to push out
    every other client's conversations (ending them, their handler state with them)."""
    reg = ThreadRegistry(max_resting=4)
    p = profile()
    alice = [start(reg, "alice", p) for _ in range(2)]
    for root in alice:
        reg.rest(root)
    pushed = []
    for _ in range(50):
        pushed += reg.rest(start(reg, "mallory", p))
    assert len(pushed) == 48 and {f.owner for f in pushed} == {"mallory"}
    assert all(reg.get(r.uuid) is r for r in alice) and reg.resting == 4
    reg.wake(alice[0])
    reg.end(alice[1], ThreadEvent.ABANDONED)
    assert reg.resting == 2  # mallory's last two


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["rest", "wake", "end"]), st.integers(0, 5),
                          st.integers(0, 40)), max_size=120))
def test_the_rest_set_always_takes_from_a_client_holding_the_most(
        ops: list[tuple[str, int, int]]) -> None:
    """Random rests, wakes and ends across six clients: who gives one up when the set
    is full is the resting client itself or a client holding the most, and the counts
    kept to find that client (no scan of the clients) always match the set."""
    reg = ThreadRegistry(max_resting=7)
    p = profile()
    frames: list[Frame] = []
    for op, who, pick in ops:
        if op == "rest":
            if pick % 3 or not frames:
                root = start(reg, f"c{who}", p)
                frames.append(root)
            else:
                root = frames[pick % len(frames)]
            held = {o: len(m) for o, m in reg._resting_of.items()}
            if reg.get(root.uuid) is not None and root.uuid not in reg._resting:
                held[root.owner] = held.get(root.owner, 0) + 1
            for frame in reg.rest(root):
                assert frame.owner == root.owner or held[frame.owner] == max(held.values())
                reg.end(frame, ThreadEvent.ABANDONED)
                frames.remove(frame)
        elif frames:
            frame = frames[pick % len(frames)]
            if op == "wake":
                reg.wake(frame)
            else:
                reg.end(frame, ThreadEvent.ABANDONED)
                frames.remove(frame)
        counts = {o: len(m) for o, m in reg._resting_of.items()}
        assert all(counts.values()) and sum(counts.values()) == reg.resting <= 7
        assert {n: set(owners) for n, owners in reg._owners_with.items()} == {
            n: {o for o, c in counts.items() if c == n} for n in set(counts.values())}
        assert reg._most == max(counts.values(), default=0)


def test_a_resting_conversation_can_be_ended_or_forgotten() -> None:
    reg = ThreadRegistry()
    a, b = start(reg, "alice", profile()), start(reg, "bob", profile())
    reg.rest(a)
    reg.rest(b)
    assert reg.end(a, ThreadEvent.ABANDONED) is ThreadState.COMPLETED
    reg.forget(b)
    assert len(reg) == 0 and reg.get(a.uuid) is None and reg.get(b.uuid) is None
    assert reg.rest(a) == []  # an ended conversation is never put back


def test_end_hooks_hear_of_every_frame_that_ends() -> None:
    reg = ThreadRegistry()
    ended: list[str] = []
    reg.on_end(ended.append)
    root = start(reg, "alice", profile())
    child = reg.extend(root, "relay")
    reg.end(child, ThreadEvent.FAILED)
    reg.rest(root)
    reg.end(root, ThreadEvent.ABANDONED)
    assert ended == [child.uuid, root.uuid]


async def test_completed_conversations_hold_no_memory_beyond_the_rest_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from agentd.testing import Harness
    from agentd.tools.calculator import Add
    from agentd.tools.relay import Relay

    organism = Path(__file__).parent / "organisms" / "basic.yaml"
    async with Harness.from_config(organism, {"alice": "public"}, state_dir=tmp_path) as h:
        h.pump.registry.max_resting = 10
        threads = []
        for i in range(60):
            payload = Relay(a=i, b=1) if i % 2 else Add(a=i, b=1)
            frames = await h.send("alice", payload)
            threads.append(frames[0].split(b"<thread>")[1].split(b"</thread>")[0].decode())
            assert frames[-1].count(b"<value>") == 1
        reg = h.pump.registry
        assert reg.in_progress == 0  # no call, no conversation left in progress
        assert len(reg) == reg.resting == 10
        assert {f.uuid for f in reg} == set(threads[-10:])
        await h.run_until_idle()
        assert h.kernel is not None
        # What outlives a conversation pushed out of memory is its thread row, ended
        # as idle collection would end it; one at rest is still active.
        old = await h.kernel.thread(threads[0])
        recent = await h.kernel.thread(threads[-1])
        assert old is not None and old.state == "completed"
        assert recent is not None and recent.state == "active"


async def test_a_conversation_continues_after_rest_and_after_being_pushed_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from agentd.testing import Harness
    from agentd.tools.calculator import Add

    organism = Path(__file__).parent / "organisms" / "basic.yaml"
    clients = {"alice": "public", "bob": "public"}
    async with Harness.from_config(organism, clients, state_dir=tmp_path) as h:
        h.pump.registry.max_resting = 2
        first = await h.send("alice", Add(a=1, b=2))
        thread = first[0].split(b"<thread>")[1].split(b"</thread>")[0].decode()
        # At rest: continued by its owner, refused to anyone else, as before.
        again = await h.send("alice", Add(a=3, b=4), thread=thread)
        assert [b"<accepted" in again[0], b"<value>7</value>" in again[-1]] == [True, True]
        refused = await h.send("bob", Add(a=1, b=1), thread=thread)
        assert len(refused) == 1 and b"unroutable" in refused[0]
        for _ in range(3):
            await h.send("alice", Add(a=0, b=0))
        assert h.pump.registry.get(thread) is None  # pushed out and ended
        # Pushed out: the client's next envelope on it starts it again, as after
        # idle collection.
        later = await h.send("alice", Add(a=5, b=5), thread=thread)
        assert b"<accepted" in later[0] and b"<value>10</value>" in later[-1]
