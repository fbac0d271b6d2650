"""Previews as values: seqs, coalescing for a busy client, `final`, interruptions,
the resume buffer and its bound, and what of a model's text is shown. The same over
a real daemon and bus is in test_stream_daemon.py."""

from __future__ import annotations

from lxml import etree

from agentd._envelope import parse_envelope
from agentd._schemas import NS_CORE, schema
from agentd._streams import StreamHub, VisibleText


class Wire:
    """What the hub sent: (client, thread, payload tag, children)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.busy = False

    def send(self, client: str, thread: str, data: bytes) -> None:
        self.frames.append(data)

    def seen(self) -> list[tuple[str, dict[str, str]]]:
        out = []
        for data in self.frames:
            payload = parse_envelope(data).payload
            assert schema(NS_CORE).validate(payload), data
            out.append((etree.QName(payload).localname,
                        {etree.QName(c).localname: c.text or "" for c in payload}))
        return out


def hub(wire: Wire, **kw: int) -> StreamHub:
    return StreamHub(wire.send, lambda client: wire.busy, **kw)


T = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"


def test_pieces_go_out_in_order_then_final() -> None:
    wire = Wire()
    w = hub(wire).writer("alice", T)
    for piece in ("The ", "sum ", "is 4."):
        w.piece(piece)
    w.close()
    seen = wire.seen()
    assert [(k, d.get("seq"), d.get("text")) for k, d in seen[:3]] == [
        ("partial", "1", "The "), ("partial", "2", "sum "), ("partial", "3", "is 4.")]
    assert seen[3] == ("final", {"stream": seen[0][1]["stream"], "last-seq": "3"})


def test_a_busy_client_gets_the_pieces_coalesced_under_one_seq() -> None:
    wire = Wire()
    w = hub(wire).writer("alice", T)
    w.piece("a")
    wire.busy = True
    for piece in ("b", "c", "d"):
        w.piece(piece)
    assert len(wire.frames) == 1  # nothing queued behind a busy connection
    wire.busy = False
    w.piece("e")
    w.close()
    assert [(k, d.get("seq"), d.get("text")) for k, d in wire.seen()] == [
        ("partial", "1", "a"), ("partial", "2", "bcde"), ("final", None, None)]


def test_the_end_sends_what_waits_and_no_final_without_a_partial() -> None:
    wire = Wire()
    h = hub(wire)
    silent = h.writer("alice", T)
    silent.piece("<think>nothing to show</think>")
    silent.close()
    assert wire.frames == []
    wire.busy = True
    w = h.writer("alice", T)
    w.piece("held")
    w.close()
    assert [k for k, _ in wire.seen()] == ["partial", "final"]


def test_an_interrupted_attempt_ends_its_stream_and_the_retry_starts_a_new_one() -> None:
    wire = Wire()
    w = hub(wire).writer("alice", T)
    w.piece("one ")
    w.interrupted()
    w.piece("one two")
    w.close()
    seen = wire.seen()
    assert [(k, d.get("seq"), d.get("interrupted")) for k, d in seen] == [
        ("partial", "1", None), ("final", None, "true"), ("partial", "1", None),
        ("final", None, None)]
    assert seen[0][1]["stream"] != seen[2][1]["stream"]


def test_a_resume_resends_the_buffered_partials_once_to_their_owner_only() -> None:
    wire = Wire()
    h = hub(wire, buffer_bytes=6)
    w = h.writer("alice", T)
    for piece in ("aaa", "bbb", "ccc"):
        w.piece(piece)
    stream = wire.seen()[0][1]["stream"]
    wire.frames.clear()
    assert h.resume("mallory", stream, 1) == 0
    assert h.resume("alice", stream, 1) == 2  # "aaa" left the 6-byte buffer
    assert [(d["seq"], d["text"]) for _, d in wire.seen()] == [("2", "bbb"), ("3", "ccc")]
    assert h.resume("alice", "0" * 16, 1) == 0


def test_markup_and_thinking_are_not_shown_wherever_the_pieces_split() -> None:
    text = ('Let <think>I should add</think>me add: a < b.\n<add xmlns="urn:x"><a>2</a>'
            "<b>3</b></add> Done<br/>.")
    for size in (1, 2, 3, 7, len(text)):
        v = VisibleText()
        shown = "".join(v.feed(text[i:i + size]) for i in range(0, len(text), size))
        assert shown == "Let me add: a < b.\n Done.", size


def test_characters_xml_cannot_carry_are_replaced_in_a_preview() -> None:
    wire = Wire()
    w = hub(wire).writer("alice", T)
    w.piece("bell\x07 & <tag")
    w.piece(">x</tag> ok")
    w.close()
    assert wire.seen()[0][1]["text"] == "bell\ufffd & "


def test_steps_validate_against_the_core_schema_and_progress_waits_for_no_one() -> None:
    from agentd._core import Step
    from agentd._streams import StepFrames
    from agentd._threads import Frame

    wire = Wire()
    h = hub(wire)
    h.thread_opted_in("alice", T)
    steps = StepFrames(h, lambda frame: False)
    root = Frame(T, ("alice",), None, "alice", None)  # type: ignore[arg-type]
    assert steps.wanted(root)
    add = b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>2</a><b>3</b></add>'
    steps.send(root, Step("tool-call", "calculator.add", "c1", add).to_bytes())
    steps.send(root, Step("progress", "calc.count", progress=2, total=3,
                          message="at \x00 2" + "x" * 5000).to_bytes(), lossy=True)
    wire.busy = True
    steps.send(root, Step("progress", "calc.count", progress=3).to_bytes(), lossy=True)
    steps.send(root, Step("tool-result", "calculator.add", "c1").to_bytes())
    seen = wire.seen()
    assert [(k, v["kind"]) for k, v in seen] == [
        ("step", "tool-call"), ("step", "progress"), ("step", "tool-result")]
    assert steps.dropped == 1  # the progress that found the connection behind
    assert len(seen[1][1]["message"]) == 4096 and "\x00" not in seen[1][1]["message"]
    other = Frame("0f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f", ("bob",), None, "bob", None)  # type: ignore[arg-type]
    assert not steps.wanted(other)  # bob never asked
