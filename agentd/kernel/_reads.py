"""The kernel's read side: committed state through the read-only connection.

`Kernel` inherits these. They only read, through `self._reader` (aiosqlite on a
second, read-only connection, so a read never waits for the writer process) and see
committed state only: a caller that must read its own writes awaits
`Kernel.flush()` first. Filtering the journal by thread scans it (no thread index:
it would halve append throughput).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentd.kernel._records import ApprovalRow, JournalEntry, ThreadRow, TimerRow
from agentd.kernel._store import (
    JOURNAL_COLUMNS,
    MEMORY_COLUMNS,
    SEGMENT_COLUMNS,
    THREAD_COLUMNS,
    entry_from_row,
    thread_from_row,
    verify_file,
    verify_postgres,
)


class KernelReads:
    """Queries over committed state (mixed into `Kernel`)."""

    _reader: Any  # aiosqlite.Connection, or _postgres.PgReader (same calls)
    db_path: Path
    dsn: str | None

    # -- reading (committed state only: `await flush()` first to read your writes) ----

    async def pending_messages(self) -> list[JournalEntry]:
        """Pending journal entries not yet delivered, by seq (what to redeliver)."""
        cols = ", ".join(f"j.{c.strip()}" for c in JOURNAL_COLUMNS.split(","))
        rows = await self._reader.execute_fetchall(
            f"SELECT {cols} FROM inflight i JOIN journal j ON j.pos = i.pos ORDER BY i.seq")
        return [entry_from_row(tuple(r)) for r in rows]

    async def threads(self, state: str | None = "active") -> list[ThreadRow]:
        if state is None:
            rows = await self._reader.execute_fetchall(
                f"SELECT {THREAD_COLUMNS} FROM threads ORDER BY created, uuid")
        else:
            rows = await self._reader.execute_fetchall(
                f"SELECT {THREAD_COLUMNS} FROM threads WHERE state = ? ORDER BY created, uuid",
                (state,))
        return [thread_from_row(tuple(r)) for r in rows]

    async def thread(self, uuid: str) -> ThreadRow | None:
        rows = list(await self._reader.execute_fetchall(
            f"SELECT {THREAD_COLUMNS} FROM threads WHERE uuid = ?", (uuid,)))
        return thread_from_row(tuple(rows[0])) if rows else None

    async def outbox(self, client: str, limit: int = 1000) -> list[tuple[int, str, bytes]]:
        """Undelivered envelopes for `client`: (id, thread, data), in id order."""
        rows = await self._reader.execute_fetchall(
            "SELECT id, thread, data FROM outbox WHERE client = ? ORDER BY id LIMIT ?",
            (client, limit))
        return [(r[0], r[1], r[2]) for r in rows]

    async def journal(self, *, thread: str | None = None, limit: int = 100,
                      kinds: Iterable[str] | None = None) -> list[JournalEntry]:
        """The newest `limit` entries (optionally of one thread / some kinds), oldest
        first. Filtering by thread scans the journal (no thread index: it would halve
        append throughput)."""
        where: list[str] = []
        args: list[Any] = []
        if thread is not None:
            where.append("thread = ?")
            args.append(thread)
        if kinds is not None:
            kinds = list(kinds)
            where.append(f"kind IN ({', '.join('?' * len(kinds))})")
            args.extend(kinds)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._reader.execute_fetchall(
            f"SELECT {JOURNAL_COLUMNS} FROM journal {clause} ORDER BY pos DESC LIMIT ?",
            (*args, limit))
        return [entry_from_row(tuple(r)) for r in reversed(list(rows))]

    async def conversation_journal(self, root: str, limit: int = 2000) -> list[JournalEntry]:
        """The first `limit` entries of the client's thread `root` and of every frame
        under it (by the threads' parent links), in commit order: what the
        conversation view is built from. Scans the journal, as `journal` does."""
        rows = await self._reader.execute_fetchall(
            "WITH RECURSIVE tree(uuid) AS (SELECT ? UNION "
            "SELECT t.uuid FROM threads t JOIN tree ON t.parent = tree.uuid) "
            f"SELECT {JOURNAL_COLUMNS} FROM journal WHERE thread IN (SELECT uuid FROM tree) "
            "ORDER BY pos LIMIT ?", (root, limit))
        return [entry_from_row(tuple(r)) for r in rows]

    async def context(self, thread: str) -> list[tuple[int, str, bytes]]:
        """`thread`'s context buffer: (index, role, content), oldest first."""
        rows = await self._reader.execute_fetchall(
            "SELECT role, content FROM context WHERE thread = ? ORDER BY id", (thread,))
        return [(i, r[0], r[1]) for i, r in enumerate(rows)]

    async def segments(self, *, thread: str | None = None, conversation: str | None = None
                       ) -> list[tuple[Any, ...]]:
        """Context segments of a task's frame (`thread`) or of every task serving a
        client's thread (`conversation`), as rows of `SEGMENT_COLUMNS`, in order."""
        column, value = ("thread", thread) if thread is not None else ("conversation",
                                                                        conversation)
        rows = await self._reader.execute_fetchall(
            f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE {column} = ? ORDER BY thread, id",
            (value,))
        return [tuple(r) for r in rows]

    async def memories(self, agent: str | None = None) -> list[tuple[Any, ...]]:
        """Long-term memories (of one agent, or all), oldest first, as rows of
        `MEMORY_COLUMNS`."""
        if agent is None:
            rows = await self._reader.execute_fetchall(
                f"SELECT {MEMORY_COLUMNS} FROM memories ORDER BY created, id")
        else:
            rows = await self._reader.execute_fetchall(
                f"SELECT {MEMORY_COLUMNS} FROM memories WHERE agent = ? ORDER BY created, id",
                (agent,))
        return [tuple(r) for r in rows]

    async def timers(self) -> list[TimerRow]:
        """Pending timers, soonest first."""
        rows = await self._reader.execute_fetchall(
            "SELECT id, conversation, frame, listener, due, note, hops, created FROM timers "
            "ORDER BY due, id")
        return [TimerRow(*r) for r in rows]

    async def approvals(self, state: str | None = "pending", payloads: bool = True
                        ) -> list[ApprovalRow]:
        """Parked messages (pending ones by default), oldest first. `payloads=False`:
        each row's `payload` is empty (recovery holds only the envelopes)."""
        clause = "" if state is None else "WHERE state = ?"
        payload = "payload" if payloads else "X''"
        rows = await self._reader.execute_fetchall(
            f"SELECT id, conversation, frame, owner, listener, sender, hops, envelope, {payload}, "
            "payload_sha256, approvers, created, deadline, state, decided_by, reason, "
            f"decided_at, call_ref FROM approvals {clause} ORDER BY created, id",
            () if state is None else (state,))
        out = []
        for r in rows:
            values = list(r)
            values[10] = tuple(a for a in str(values[10]).split(",") if a)
            out.append(ApprovalRow(*values))
        return out

    async def bus_auth(self) -> dict[str, str]:
        """The bus's authentication state per client (`Transaction.auth_put`)."""
        rows = await self._reader.execute_fetchall("SELECT client, state FROM bus_auth")
        return {str(client): str(state) for client, state in rows}

    async def open_streams(self) -> list[tuple[str, str, str, int]]:
        """Streams not ended (`Transaction.stream_put`): (id, client, thread, last_seq)."""
        rows = await self._reader.execute_fetchall(
            "SELECT id, client, thread, last_seq FROM streams ORDER BY id")
        return [(str(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    async def handler_state(self) -> list[tuple[str, str, str, str]]:
        """Every handler-state entry: (listener, conversation, key, value)."""
        rows = await self._reader.execute_fetchall(
            "SELECT listener, conversation, key, value FROM handler_state "
            "ORDER BY conversation, listener, key")
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def verify(self) -> tuple[bool, int | None, str]:
        """Walk the hash chain: (ok, first bad seq or None, message)."""
        if self.dsn:
            verdict = await asyncio.to_thread(verify_postgres, self.dsn)
        else:
            verdict = await asyncio.to_thread(verify_file, self.db_path)
        return verdict.as_tuple()
