"""The journal's hash chain: canonical encoding, linking and verification. Pure.

Every journal entry stores `prev_hash` and `hash = sha256(prev_hash || encode(entry))`,
where `prev_hash` is the `hash` of the entry before it in commit order (`pos`), and the
first entry's `prev_hash` is 32 zero bytes. Hashes are raw 32-byte digests on disk and
hex in `JournalEntry`.

`encode` joins, with U+001F (unit separator) and as UTF-8, the fields
`seq` (decimal), `ts` (decimal integer microseconds, `round(ts * 10**6)`; the kernel
stamps entries on whole microseconds), `thread`, `direction`, `kind`, `handler`,
`sender`, `tag`, `payload_hash` (hex), `profile`, `expires` (integer microseconds
like `ts`, empty for "retained forever") and `pending` (`1`/`0`). No field may
contain U+001F (refused when the entry is built), which makes the encoding
unambiguous and easy to reproduce in any language. `profile`, `expires` and
`pending` are covered (beyond the fields first agreed) because each decides whether
retention may delete the entry or whether recovery redelivers it, so each is worth
tampering with. (A separator join costs
~0.6 us an entry against ~2.5 us for compact JSON; at 100k entries/s that matters.)

Retention deletes entries but keeps the chain checkable: a run of deleted positions
is replaced by one *gap* record `(start_pos, end_pos, prev_hash of the first deleted
entry, hash of the last)`, merged with neighbouring gaps. Verification walks entries
and gaps in position order and demands that each one's `prev_hash` is its
predecessor's `hash`, that every position is covered, and that the last one is the
chain head recorded with every commit. What it cannot detect: someone with write
access who rewrites the whole chain from the tampered entry on (and the head);
record the head hash elsewhere (`agentd verify-journal` prints it) to close that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

GENESIS = bytes(32)

SEP = "\x1f"
N_SEPARATORS = 11
_sha256 = hashlib.sha256


def encode(
    seq: int,
    ts: float,
    thread: str,
    direction: str,
    kind: str,
    handler: str,
    sender: str,
    tag: str,
    payload_hash: str,
    profile: str,
    expires: float | None,
    pending: bool | int,
) -> bytes:
    """The canonical bytes of an entry's hashed fields (ValueError if a field holds
    the separator)."""
    text = SEP.join((str(seq), str(round(ts * 1_000_000)), thread, direction, kind, handler,
                     sender, tag, payload_hash, profile,
                     "" if expires is None else str(round(expires * 1_000_000)),
                     "1" if pending else "0"))
    if text.count(SEP) != N_SEPARATORS:
        raise ValueError("journal fields must not contain U+001F")
    return text.encode()


def link(prev_hash: bytes, encoded: bytes) -> bytes:
    return _sha256(prev_hash + encoded).digest()


def chain_rows(journal: Iterable[tuple], pos: int, prev: bytes
               ) -> tuple[list[tuple], int, bytes]:
    """The writer's rows for `journal` (base rows: seq, ts, thread, direction, kind,
    handler, sender, tag, payload, profile, expires, pending), chained on from
    position `pos` and hash `prev`: each row with its payload_hash, pos, prev_hash
    and hash added (the column order of `_store.INSERT_JOURNAL`), and the new
    position and hash. The bytes hashed are `encode`'s, built in one f-string here:
    the call, the tuple and the join of `encode` were a tenth of the writer's time
    per entry (test_kernel_properties checks the two agree)."""
    rows: list[tuple] = []
    append = rows.append
    for (seq, ts, thread, direction, kind, handler, sender, tag, payload, profile,
         expires, pending) in journal:
        pos += 1
        payload_hash = _sha256(payload).hexdigest()
        text = (f"{seq}\x1f{round(ts * 1_000_000)}\x1f{thread}\x1f{direction}\x1f{kind}"
                f"\x1f{handler}\x1f{sender}\x1f{tag}\x1f{payload_hash}\x1f{profile}\x1f"
                f"{'' if expires is None else round(expires * 1_000_000)}\x1f"
                f"{'1' if pending else '0'}")
        if text.count(SEP) != N_SEPARATORS:
            raise ValueError("journal fields must not contain U+001F")
        h = _sha256(prev + text.encode()).digest()
        append((seq, ts, thread, direction, kind, handler, sender, tag, payload_hash,
                payload, profile, expires, pending, pos, prev, h))
        prev = h
    return rows, pos, prev


@dataclass(frozen=True)
class Gap:
    """Positions `start..end` (inclusive) were deleted by retention."""

    start: int
    end: int
    prev_hash: bytes
    hash: bytes


# Row layout read by the verifier, in this order (see _store.VERIFY_ROWS):
# pos, seq, ts, thread, direction, kind, handler, sender, tag, payload_hash, payload,
# profile, expires, pending, prev_hash, hash
VerifyRow = tuple[
    int, int, float, str, str, str, str, str, str, str, "bytes | None", str,
    "float | None", int, bytes, bytes,
]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    bad_seq: int | None
    message: str
    entries: int = 0
    gaps: int = 0

    def as_tuple(self) -> tuple[bool, int | None, str]:
        return self.ok, self.bad_seq, self.message


def verify_chain(
    rows: Iterable[VerifyRow],
    gaps: Iterable[Gap],
    head_pos: int,
    head_hash: bytes,
) -> Verdict:
    """Walk entries (ascending pos) and gaps (ascending start) as one chain."""
    expected_pos = 1
    expected_prev = GENESIS
    n_rows = n_gaps = 0
    gap_iter: Iterator[Gap] = iter(gaps)
    gap = next(gap_iter, None)

    def fail(seq: int | None, message: str) -> Verdict:
        return Verdict(False, seq, message, n_rows, n_gaps)

    for row in rows:
        pos, seq = row[0], row[1]
        while gap is not None and gap.start <= pos:
            if gap.start != expected_pos:
                return fail(seq, _coverage_message(expected_pos, gap.start, "retention gap"))
            if gap.end < gap.start or gap.end >= pos:
                return fail(seq, f"retention gap {gap.start}..{gap.end} overlaps entry at "
                                 f"position {pos}")
            if gap.prev_hash != expected_prev:
                return fail(seq, f"retention gap {gap.start}..{gap.end} does not continue "
                                 f"the chain (prev_hash mismatch)")
            expected_pos, expected_prev = gap.end + 1, gap.hash
            n_gaps += 1
            gap = next(gap_iter, None)
        if pos != expected_pos:
            return fail(seq, _coverage_message(expected_pos, pos, f"entry seq {seq}"))
        (_, _, ts, thread, direction, kind, handler, sender, tag, payload_hash, payload,
         profile, expires, pending, prev_hash, stored_hash) = row
        if prev_hash != expected_prev:
            return fail(seq, f"entry seq {seq} (position {pos}): prev_hash does not match "
                             f"the previous entry's hash")
        # The writer always stores bytes: an erased payload is tampering, not a prune.
        if payload is None or _sha256(payload).hexdigest() != payload_hash:
            return fail(seq, f"entry seq {seq} (position {pos}): payload does not match "
                             f"payload_hash")
        encoded = encode(seq, ts, thread, direction, kind, handler, sender, tag,
                         payload_hash, profile, expires, bool(pending))
        if link(prev_hash, encoded) != stored_hash:
            return fail(seq, f"entry seq {seq} (position {pos}): hash does not match its "
                             f"fields (entry modified)")
        expected_pos, expected_prev = pos + 1, stored_hash
        n_rows += 1
    while gap is not None:
        if gap.start != expected_pos or gap.end < gap.start:
            return fail(None, _coverage_message(expected_pos, gap.start, "retention gap"))
        if gap.prev_hash != expected_prev:
            return fail(None, f"retention gap {gap.start}..{gap.end} does not continue the "
                              f"chain (prev_hash mismatch)")
        expected_pos, expected_prev = gap.end + 1, gap.hash
        n_gaps += 1
        gap = next(gap_iter, None)
    if expected_pos - 1 != head_pos or expected_prev != head_hash:
        return fail(None, f"chain ends at position {expected_pos - 1} but the recorded head "
                          f"is position {head_pos}: entries at the end are missing or the "
                          f"head was altered")
    return Verdict(True, None, f"journal OK: {n_rows} entries, {n_gaps} retention gaps, "
                               f"head position {head_pos} hash {head_hash.hex()}",
                   n_rows, n_gaps)


def _coverage_message(expected: int, found: int, what: str) -> str:
    if found > expected:
        return (f"positions {expected}..{found - 1} are missing before {what} and no "
                f"retention record covers them (entries deleted)")
    return f"{what} at position {found} is out of order (expected {expected})"
