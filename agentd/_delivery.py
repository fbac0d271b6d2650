"""Acknowledged delivery on the main bus, as values: the `<d:seq>` a frame from a
client's outbox carries, the core `ack {seq}` a client answers with, and the seq a
resuming client names in its auth frame. Shared by the bus (which stamps and reads)
and `agentd.client` (which reads and acknowledges); pure.

A frame's delivery seq is its outbox id: the kernel allocates outbox ids in commit
order and never reuses one, so they increase per client, which is all a client
needs to drop a frame it already has. The stamp goes in right after `<thread>`,
where the envelope's meta takes its extensions, so the frame stays in C14N form.
"""

from __future__ import annotations

import re

from lxml import etree

from agentd._envelope import NIL_THREAD, Envelope, build_envelope
from agentd._schemas import NS_CORE, NS_DELIVERY, NS_STREAM

SEQ_TAG = "{" + NS_DELIVERY + "}seq"
_C = "{" + NS_CORE + "}"
ACK_TAG = _C + "ack"
RESUME_TAG = _C + "resume"
_STREAM_ID = re.compile(r"[0-9a-f]{16,32}")
_THREAD_END = b"</thread>"
_CORE_URI = NS_CORE.encode()
# Digits only, at most 18 of them: a seq is an outbox id, a 63-bit integer.
MAX_SEQ_DIGITS = 18


def seq_element(seq: int) -> bytes:
    return f'<d:seq xmlns:d="{NS_DELIVERY}">{seq}</d:seq>'.encode()


def stamp(data: bytes, seq: int) -> bytes:
    """`data` (an envelope agentd built: meta is from, to?, thread, extensions) with
    `<d:seq>seq</d:seq>` as meta's first extension. Names cannot hold `<`, so the
    first `</thread>` is meta's."""
    at = data.find(_THREAD_END)
    if at < 0:
        return data
    at += len(_THREAD_END)
    return data[:at] + seq_element(seq) + data[at:]


def ask_previews(data: bytes) -> bytes:
    """`data` (an envelope: meta is from, to?, thread, extensions) with `<s:stream/>`
    as meta's first extension: previews of the model's text on its thread."""
    at = data.find(_THREAD_END)
    if at < 0:
        return data
    at += len(_THREAD_END)
    return data[:at] + f'<s:stream xmlns:s="{NS_STREAM}"></s:stream>'.encode() + data[at:]


def parse_seq(text: str | None) -> int | None:
    """A seq as the wire writes it (decimal digits), or None."""
    text = (text or "").strip()
    if not text.isascii() or not text.isdigit() or len(text) > MAX_SEQ_DIGITS:
        return None
    return int(text)


def seq_of(env: Envelope) -> int | None:
    """The delivery seq a frame carries in its meta, or None (a frame that is not
    from the outbox: `accepted`, a refusal of a frame just received)."""
    root = env.payload.getparent()
    if root is None:
        return None
    for child in root[0]:
        if child.tag == SEQ_TAG:
            return parse_seq(child.text)
    return None


def might_be_control(data: bytes) -> bool:
    """A cheap first look: only a core payload can be an `ack` or a `resume`."""
    return _CORE_URI in data and (b"ack" in data or b"resume" in data)


def resume_frame(client: str, stream: str, from_seq: int) -> bytes:
    """A client's request for a stream's partials from `from_seq` on, again."""
    body = (f'<resume xmlns="{NS_CORE}"><stream>{stream}</stream>'
            f"<from-seq>{from_seq}</from-seq></resume>").encode()
    return build_envelope(client, NIL_THREAD, body)


def resume_of(env: Envelope) -> tuple[str, int] | None:
    """(stream, from-seq) of a client's core `resume`, else None."""
    payload: etree._Element = env.payload
    if payload.tag != RESUME_TAG or len(payload) != 2 or payload.attrib:
        return None
    stream, start = payload[0], payload[1]
    if stream.tag != _C + "stream" or start.tag != _C + "from-seq" or len(stream) or len(start):
        return None
    sid = (stream.text or "").strip()
    seq = parse_seq(start.text)
    if not _STREAM_ID.fullmatch(sid) or seq is None or seq < 1:
        return None
    return sid, seq


def ack_seq(env: Envelope) -> int | None:
    """The seq of a client's core `ack {seq}` (the payload must be exactly that:
    one `seq` child, digits), else None."""
    payload: etree._Element = env.payload
    if payload.tag != ACK_TAG or (payload.text and payload.text.strip()) or len(payload) != 1:
        return None
    child = payload[0]
    if child.tag != "{" + NS_CORE + "}seq" or len(child) or child.attrib or payload.attrib:
        return None
    if child.tail and child.tail.strip():
        return None
    return parse_seq(child.text)


def ack_frame(client: str, seq: int) -> bytes:
    """A client's acknowledgement of every frame up to `seq` (on the nil thread: it
    belongs to no conversation)."""
    body = f'<ack xmlns="{NS_CORE}"><seq>{seq}</seq></ack>'.encode()
    return build_envelope(client, NIL_THREAD, body)
