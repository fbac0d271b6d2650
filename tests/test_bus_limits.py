"""The bus's flow limits as plain objects: no socket, no clock but the one passed in."""

from __future__ import annotations

from agentd.bus._limits import InflightWindow, TokenBucket


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(10.0, 3, 0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.05)  # half a token back
    assert bucket.take(0.1)  # one token back
    assert bucket.take(10.0) and bucket.take(10.0) and bucket.take(10.0)
    assert not bucket.take(10.0)  # never more than the burst saved up


def test_inflight_window_is_full_at_the_limit_and_an_answer_frees_room() -> None:
    window = InflightWindow(2, ttl_s=30.0)
    window.submitted("t1", 0.0)
    window.submitted("t1", 0.0)  # a second envelope on the same thread counts too
    assert window.full and "t1" in window
    assert window.answered("t1")  # freed room below the limit: the reader may go on
    assert not window.full
    assert not window.answered("t1")  # not full before: nothing to wake
    assert "t1" not in window and window.total == 0
    assert not window.answered("never-submitted")


def test_inflight_window_expires_threads_by_their_last_submission() -> None:
    window = InflightWindow(10, ttl_s=5.0)
    window.submitted("a", 0.0)
    window.submitted("b", 1.0)
    window.submitted("a", 2.0)  # "a" moves behind "b"
    assert window.oldest_deadline() == 6.0  # b's
    assert window.expire(6.5) == 1 and "b" not in window and "a" in window
    assert window.total == 2  # a's two envelopes
    assert window.expire(7.0) == 2 and window.total == 0
    assert window.oldest_deadline() is None
