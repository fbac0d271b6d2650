"""The bus session's decisions without a socket: events in, actions out. Time is a
number the test passes; frames are bytes. The same paths over real TLS sockets are
in test_bus.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from agentd._delivery import ack_frame, ask_previews, resume_frame, seq_of, stamp
from agentd._envelope import build_envelope, parse_envelope, thread_hint
from agentd._xmlify import spec_of
from agentd.bus import (
    BusSession,
    ConnEvent,
    ConnState,
    SessionLimits,
    parse_auth_ok,
)
from agentd.bus._limits import TokenBucket
from agentd.bus._session import (
    ACK_WINDOW,
    BATCH_BYTES,
    TRANSITIONS,
    Acknowledge,
    Authenticate,
    Close,
    LoadOutbox,
    PauseReading,
    ResumeReading,
    ResumeStream,
    SetTimer,
    Submit,
    choose_session,
    transition,
)
from agentd.client import frame_kind
from agentd.tools.calculator import Add, Sum
from tests.state_tables import walk_table

LIMITS = SessionLimits(max_inflight=2, inflight_ttl_s=10.0, send_queue_limit=64 * 1024,
                       read_pause_bytes=16 * 1024)


def request(thread: str | None = None) -> bytes:
    return build_envelope("alice", thread or str(uuid.uuid4()),
                          spec_of(Add).to_bytes(Add(a=1, b=2)))


def answer(thread: str, pad: int = 0) -> bytes:
    frame = build_envelope("calculator.add", thread, spec_of(Sum).to_bytes(Sum(value=3)),
                           to="alice")
    return frame + b" " * pad


def accepted(thread: str) -> bytes:
    body = (f'<accepted xmlns="https://xml-pipeline.org/ns/core/v1"><thread>{thread}'
            f"</thread><seq>1</seq></accepted>").encode()
    return build_envelope("core", thread, body, to="alice")


def opened(limits: SessionLimits = LIMITS, bucket: TokenBucket | None = None) -> BusSession:
    """A session past authentication and an empty outbox, with its frames taken."""
    s = BusSession(limits)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "token"), bucket)
    s.outbox_loaded([])
    s.frames_to_send()
    s.sent()
    return s


# ---- the state machine ----------------------------------------------------------------


def test_every_state_and_event_is_either_in_the_table_or_illegal() -> None:
    walk_table(TRANSITIONS, transition, ConnState, ConnEvent)


def test_closed_is_terminal() -> None:
    assert set(TRANSITIONS[ConnState.CLOSED].values()) == {ConnState.CLOSED}


def test_a_session_walks_authenticating_replaying_open_draining_closed() -> None:
    s = BusSession(LIMITS)
    seen = [s.state]
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "token"))
    seen.append(s.state)
    s.outbox_loaded([])
    seen.append(s.state)
    s.shutdown()
    seen.append(s.state)
    assert s.go_away() == (Close(1001, "going away"),)
    seen.append(s.state)
    assert seen == [ConnState.AUTHENTICATING, ConnState.REPLAYING, ConnState.OPEN,
                    ConnState.DRAINING, ConnState.CLOSED]


# ---- authentication ----------------------------------------------------------------------


def test_the_first_frame_is_authenticated_and_reading_stops() -> None:
    s = BusSession(LIMITS)
    assert s.reading
    assert s.frame_received(b"<auth>...</auth>", 0.0) == (Authenticate(b"<auth>...</auth>"),)
    assert not s.reading


def test_refused_authentication_closes_with_4401() -> None:
    s = BusSession(LIMITS)
    s.frame_received(b"junk", 0.0)
    assert s.auth_result(None) == (Close(4401, "authentication failed"),)
    assert s.state is ConnState.CLOSED and s.close_code == 4401


def test_no_first_frame_in_time_closes_with_4408() -> None:
    s = BusSession(LIMITS)
    assert s.auth_timed_out() == (Close(4408, "authentication timeout"),)
    assert s.state is ConnState.CLOSED


def test_accepted_authentication_sends_auth_ok_then_loads_the_outbox() -> None:
    s = BusSession(LIMITS)
    s.frame_received(b"<auth/>", 0.0)
    token = "t" * 43
    assert s.auth_result(("alice", token)) == (PauseReading(), LoadOutbox())
    assert s.state is ConnState.REPLAYING and not s.reading
    [(frame, outbox_id)] = s.frames_to_send()
    assert parse_auth_ok(frame) == ("alice", token) and outbox_id is None


# ---- replay ----------------------------------------------------------------------------------


def test_outbox_goes_first_then_what_arrived_meanwhile_without_duplicates() -> None:
    s = BusSession(LIMITS)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "tok"))
    s.frames_to_send()
    t = [str(uuid.uuid4()) for _ in range(4)]
    assert s.deliver(t[2], answer(t[2]), 7) == ()  # held: also in the outbox read below
    assert s.deliver(t[3], answer(t[3]), 8) == ()  # held: newer than the outbox read
    assert s.deliver(t[3], accepted(t[3]), None) == ()
    actions = s.outbox_loaded([(5, t[0], answer(t[0])), (6, t[1], answer(t[1])),
                               (7, t[2], answer(t[2]))])
    assert actions == (ResumeReading(),) and s.state is ConnState.OPEN and s.reading
    sent = s.frames_to_send()
    assert [i for _, i in sent] == [5, 6, 7, 8, None]
    assert [frame_kind(f)[2] for f, _ in sent] == [t[0], t[1], t[2], t[3], t[3]]


def test_shutdown_during_replay_drains_after_it() -> None:
    s = BusSession(LIMITS)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "tok"))
    assert s.shutdown() == ()
    assert s.state is ConnState.REPLAYING
    assert s.outbox_loaded([]) == ()
    assert s.state is ConnState.DRAINING and not s.reading


def test_an_outbox_larger_than_the_queue_closes_and_keeps_the_rest_durable() -> None:
    small = SessionLimits(2, 10.0, send_queue_limit=4096, read_pause_bytes=2048)
    s = BusSession(small)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "tok"))
    t = str(uuid.uuid4())
    pending = [(i, t, answer(t, pad=1500)) for i in range(5)]
    assert s.outbox_loaded(pending) == (Close(1008, "send queue overflow"),)
    assert s.state is ConnState.CLOSED and s.frames_to_send() == []


# ---- envelopes in: in-flight window, rate limit --------------------------------------------


def test_envelopes_are_submitted_until_the_window_is_full_then_reading_pauses() -> None:
    s = opened()
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    assert s.frame_received(request(a), 1.0) == (Submit(a, request(a)),)
    actions = s.frame_received(request(b), 2.0)
    assert actions == (Submit(b, request(b)), PauseReading(), SetTimer(1.0 + 10.0))
    assert not s.reading


def test_accepted_does_not_free_a_slot_an_answer_does() -> None:
    s = opened()
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    s.frame_received(request(a), 1.0)
    s.frame_received(request(b), 1.0)
    assert s.deliver(a, accepted(a), None) == ()
    assert not s.reading
    assert s.deliver(a, answer(a), None) == (ResumeReading(),)
    assert s.reading


def test_unanswered_slots_expire_after_their_ttl() -> None:
    s = opened()
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    s.frame_received(request(a), 1.0)
    s.frame_received(request(b), 5.0)
    assert s.next_deadline() == 11.0
    assert s.tick(10.9) == (0, ())
    assert s.tick(11.0) == (1, (ResumeReading(),))
    assert s.next_deadline() is None


def test_a_wrong_thread_hint_releases_its_slot_and_counts_the_real_thread() -> None:
    @dataclass
    class Result:
        thread: str
        accepted: bool

    s = opened()
    hint, real = str(uuid.uuid4()), str(uuid.uuid4())
    s.frame_received(request(hint), 1.0)
    s.submitted(hint, Result(real, accepted=True), 1.0)
    assert hint not in s.inflight and real in s.inflight
    s.submitted(real, Result(str(uuid.uuid4()), accepted=False), 1.0)
    assert s.inflight.total == 0


def test_a_failed_submit_frees_its_slot() -> None:
    s = opened()
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    s.frame_received(request(a), 1.0)
    s.frame_received(request(b), 1.0)
    assert s.submit_failed(b) == (ResumeReading(),)


def test_rate_limited_envelopes_get_huh_rate_limited_and_are_not_submitted() -> None:
    s = opened(bucket=TokenBucket(rate=0.0, burst=1, now=0.0))
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    assert s.frame_received(request(a), 1.0) == (Submit(a, request(a)),)
    assert s.frame_received(request(b), 1.0) == ()
    [(frame, outbox_id)] = s.frames_to_send()
    assert frame_kind(frame) == ("core", "huh", b) and outbox_id is None
    assert b"rate-limited" in frame


def test_frames_after_shutdown_are_not_submitted() -> None:
    s = opened()
    s.shutdown()
    assert s.frame_received(request(), 1.0) == ()


# ---- frames out: batching, send queue, overflow --------------------------------------------


def test_frames_queued_together_leave_in_one_batch_in_order() -> None:
    s = opened(SessionLimits(64, 10.0, 4 * 1024 * 1024, 1024 * 1024))
    t = str(uuid.uuid4())
    frames = [answer(t) for _ in range(50)]
    for f in frames:
        s.deliver(t, f, None)
    assert s.sending
    assert [f for f, _ in s.frames_to_send()] == frames
    assert not s.sending and s.sendq is None  # an idle session keeps no queue


def test_a_batch_stops_near_batch_bytes() -> None:
    s = opened(SessionLimits(64, 10.0, 4 * 1024 * 1024, 2 * 1024 * 1024))
    t = str(uuid.uuid4())
    for _ in range(40):
        s.deliver(t, answer(t, pad=16 * 1024), None)
    first = s.frames_to_send()
    assert BATCH_BYTES <= sum(len(f) for f, _ in first) < BATCH_BYTES + 17 * 1024
    rest = []
    while batch := s.frames_to_send():
        rest.append(len(batch))
    assert len(first) + sum(rest) == 40 and len(rest) == 2


def test_a_full_socket_holds_frames_back_until_it_drains() -> None:
    s = opened()
    t = str(uuid.uuid4())
    s.deliver(t, answer(t), None)
    s.write_paused()
    assert not s.sending and s.frames_to_send() == []
    s.write_resumed()
    assert len(s.frames_to_send()) == 1


def test_a_long_send_queue_pauses_reading_until_it_is_written() -> None:
    s = opened()
    t = str(uuid.uuid4())
    s.write_paused()
    actions: list[object] = []
    while s.queued_bytes < LIMITS.read_pause_bytes:
        actions.extend(s.deliver(t, answer(t, pad=2000), None))
    assert actions == [PauseReading()]
    assert s.write_resumed() == ()  # still queued
    s.frames_to_send()
    assert s.sent() == (ResumeReading(),)


def test_a_client_that_does_not_read_is_closed_with_1008_and_keeps_its_outbox() -> None:
    s = opened()
    t = str(uuid.uuid4())
    s.write_paused()
    actions: list[object] = []
    oid = 0
    while not actions or actions[-1] != Close(1008, "send queue overflow"):
        oid += 1
        actions.extend(s.deliver(t, answer(t, pad=4000), oid))
    assert s.state is ConnState.CLOSED and s.close_code == 1008
    assert s.peak_queued_bytes <= LIMITS.send_queue_limit < s.peak_queued_bytes + 4500
    assert s.frames_to_send() == [] and s.queued_bytes == 0
    assert s.deliver(t, answer(t), oid + 1) == ()  # nothing after the close


# ---- endings and affinity ------------------------------------------------------------------


def test_withdrawn_access_closes_with_4401() -> None:
    s = opened()
    assert s.withdraw() == (Close(4401, "authentication failed"),)
    assert s.go_away() == ()  # already closed


def test_a_lost_peer_hands_back_only_its_durable_frames() -> None:
    s = opened()
    t = str(uuid.uuid4())
    s.write_paused()
    s.deliver(t, accepted(t), None)
    s.deliver(t, answer(t), 42)
    assert s.peer_gone() == [(answer(t), 42)]
    assert s.state is ConnState.CLOSED
    assert s.peer_gone() == []  # the socket closing after the close frame


def test_answers_go_to_the_session_that_sent_on_the_thread_else_the_newest() -> None:
    older, newer = opened(), opened()
    t = str(uuid.uuid4())
    older.frame_received(request(t), 1.0)
    assert choose_session([older, newer], t) == 0
    assert choose_session([older, newer], str(uuid.uuid4())) == 1
    older.withdraw()
    assert choose_session([older, newer], t) == 1


def test_a_row_the_replay_sent_is_not_sent_again_when_its_delivery_comes_after_it() -> None:
    """The replay reads a row once the writer has committed it; the pump delivers it
    once the daemon has heard of that commit, which may be after the replay ended:
    sent once. A delivery of a later row means none below it is still to come."""
    s = BusSession(LIMITS)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "tok"))
    s.frames_to_send()
    t = [str(uuid.uuid4()) for _ in range(4)]
    s.outbox_loaded([(5, t[0], answer(t[0])), (6, t[1], answer(t[1])),
                     (7, t[2], answer(t[2]))])
    assert [i for _, i in s.frames_to_send()] == [5, 6, 7]
    s.sent()
    assert s.deliver(t[1], answer(t[1]), 6) == ()  # row 5 was committed long before
    assert s.deliver(t[3], answer(t[3]), 8) == ()
    assert [i for _, i in s.frames_to_send()] == [8]
    s.sent()
    assert s.deliver(t[2], answer(t[2]), 7) == ()  # out of order: sent again, at least once
    assert [i for _, i in s.frames_to_send()] == [7]


def test_an_idle_connection_keeps_only_the_newest_replayed_ids() -> None:
    """Rows replayed long after they were committed get no live delivery: only the
    newest REPLAY_WINDOW ids are kept for the one that may still come."""
    from agentd.bus._session import REPLAY_WINDOW

    big = SessionLimits(2, 10.0, send_queue_limit=4 << 20, read_pause_bytes=1 << 20)
    s = BusSession(big)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "tok"))
    t = str(uuid.uuid4())
    s.outbox_loaded([(i, t, answer(t)) for i in range(1, 1001)])
    assert [i for _, i in s.frames_to_send() if i is not None] == list(range(1, 1001))
    s.sent()
    # The newest REPLAY_WINDOW are known sent; a live delivery of an older one (not
    # kept) is sent again, at least once.
    edge = 1001 - REPLAY_WINDOW
    assert s.deliver(t, answer(t), edge - 1) == ()
    assert [i for _, i in s.frames_to_send()] == [edge - 1]
    s.sent()
    assert s.deliver(t, answer(t), edge) == () and s.frames_to_send() == []


# ---- acknowledged delivery -------------------------------------------------------------


def acking(delivered: int = 0, outbox: list[tuple[int, str, bytes]] | None = None
           ) -> tuple[BusSession, tuple, list[bytes]]:
    """A session whose client logged in with `<d:seq>delivered</d:seq>`: it, the
    replay's actions, and the frames written after `auth-ok`."""
    s = BusSession(LIMITS)
    s.frame_received(b"<auth/>", 0.0)
    s.auth_result(("alice", "token"), None, delivered)
    actions = s.outbox_loaded(outbox or [])
    ok, *frames = [f for f, _ in s.frames_to_send()]
    assert ok.startswith(b"<auth-ok ")
    return s, tuple(actions), frames


def ack(seq: int, sender: str = "alice") -> bytes:
    return ack_frame(sender, seq)


def test_outbox_frames_leave_stamped_with_their_seq_and_others_do_not() -> None:
    s = opened()
    t = str(uuid.uuid4())
    s.deliver(t, accepted(t), None)
    s.deliver(t, answer(t), 41)
    (first, mark_a), (second, mark_b) = s.frames_to_send()
    assert first == accepted(t) and mark_a is None
    assert seq_of(parse_envelope(second)) == 41 and mark_b == 41  # removed once written
    assert second == stamp(answer(t), 41) and parse_envelope(second).thread == t


def test_for_an_acknowledging_client_a_written_frame_waits_for_its_ack() -> None:
    s, _, _ = acking()
    t = str(uuid.uuid4())
    for oid in (5, 6, 9):
        s.deliver(t, answer(t), oid)
    assert [mark for _, mark in s.frames_to_send()] == [None, None, None]
    assert s.frame_received(ack(6), 0.0) == (Acknowledge((5, 6)),)  # not submitted
    assert s.frame_received(ack(6), 0.0) == ()
    assert s.frame_received(ack(100), 0.0) == (Acknowledge((9,)),)


def test_a_resume_skips_and_removes_what_the_client_has() -> None:
    t = str(uuid.uuid4())
    rows = [(i, t, answer(t)) for i in (3, 4, 8)]
    _, actions, frames = acking(4, rows)
    assert Acknowledge((3, 4)) in actions
    assert [seq_of(parse_envelope(f)) for f in frames] == [8]


def test_an_ack_that_is_not_the_clients_own_goes_to_the_pump() -> None:
    s, _, _ = acking()
    forged = ack(3, sender="bob")
    assert [type(a) for a in s.frame_received(forged, 0.0)] == [Submit]
    padded = ack(3).replace(b"<seq>", b"<seq> ").replace(b"</ack>", b"<x/></ack>")
    assert type(s.frame_received(padded, 0.0)[0]) is Submit


def test_a_client_that_never_acknowledges_costs_at_most_the_ack_window() -> None:
    s, _, _ = acking()
    t = str(uuid.uuid4())
    for oid in range(1, ACK_WINDOW + 50):
        s.deliver(t, answer(t), oid)
        s.frames_to_send()
    assert s.frame_received(ack(10**6), 0.0) == (Acknowledge(tuple(range(50, ACK_WINDOW + 50))),)


# ---- previews ------------------------------------------------------------------------------


def test_an_envelope_that_asks_for_previews_says_so_when_submitted() -> None:
    s = opened()
    asked = ask_previews(request())
    assert s.frame_received(asked, 0.0)[0] == Submit(thread_hint(asked), asked, True)
    plain = request()
    assert s.frame_received(plain, 0.0)[0] == Submit(thread_hint(plain), plain, False)


def test_a_clients_resume_is_handled_here_and_anothers_goes_to_the_pump() -> None:
    s = opened()
    assert s.frame_received(resume_frame("alice", "ab" * 8, 3), 0.0) == (
        ResumeStream("ab" * 8, 3),)
    assert type(s.frame_received(resume_frame("bob", "ab" * 8, 3), 0.0)[0]) is Submit
    assert type(s.frame_received(resume_frame("alice", "not-hex!" * 2, 3), 0.0)[0]) is Submit
