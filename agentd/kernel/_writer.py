"""The kernel's writer process: the `Store` runs in a child process of its own.

Why a process and not a thread: the stdlib sqlite3 module releases the GIL around
every `sqlite3_step`, once per row of an `executemany`, and lxml releases it around
every parse. With the writer on a thread of the daemon, the event loop and the writer
hand the GIL back and forth thousands of times a second and each hand-over can wait
out the 5 ms switch interval (the convoy effect). Measured on the 2-core dev box
(benchmarks/journal.py workload): the same batches that take 0.16 s to write in a
process of their own took 1.07 s on a writer thread beside a busy event loop
(`DELETE FROM inflight` went from 0.5 us to 116 us a row). In a process of its own
the writer runs on the other core and never waits for the event loop.

Protocol, over a private `socketpair` (never a path on disk): each request is
`(method, args)` in `marshal` (plain tuples, lists, str, bytes, numbers: about twice
as fast as pickle, whose memo table costs more than the rows themselves), each
response `(True, result)` or `(False, exception, errorcode)` in pickle (exceptions);
both length-prefixed (4 bytes, big endian). Only the two ends of one socketpair, the
daemon and the child it started, ever speak on it; pickle and marshal are safe here
for that reason only. Requests are answered in order, so callers pipeline.

Batches: `write_batch(txs, first[, more])`; `first` numbers the batch's transactions
(`first`, `first + 1`, ...: the kernel numbers them in sending order) and each COMMIT
records the last number it made durable, each rejection its number, so the outcome of
a batch whose writer died before answering can be read back (`outcomes`).

Folds: `write_batch(txs, first, more)` sends a batch in parts. The child applies each part
in one open SQLite transaction as it arrives and commits after the part sent with
`more=False`, then answers every part: the daemon sends what is queued at once and
the rest a few event-loop turns later, and the child's statements for the first part
overlap the daemon building the second. A part that cannot join (a bad transaction,
one asking for synchronous=FULL) rolls the fold back and each part is written alone;
a fold left open when the daemon goes away is undone.

The child holds a duplicate of the state-directory lock descriptor: while it lives
(finishing a batch after its parent was SIGKILLed, say) no other agentd can open the
database, so nobody reads a chain head that is about to move. It exits on EOF (its
parent closed the socket or died), ignores SIGINT and SIGTERM (the parent decides
when to stop; systemd signals the whole control group), and writes nothing but its
database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentd._runtime import tune_gc
from agentd._spin import LoopSpin, wait_readable
from agentd.kernel._errors import WriterExited
from agentd.kernel._store import Store, is_storage_error
from agentd.kernel._transaction import plan_batch

log = logging.getLogger("agentd.kernel")

_LEN = struct.Struct(">I")
_MAX_FRAME = 1 << 31  # a batch is at most commit_max_entries transactions
_SOCKET_BUFFER = 4 << 20
_STOP_TIMEOUT_S = 30.0  # time for the child's final checkpoint and close
_FOLD_WAIT_MS = 500  # postgres: how long an open fold waits for its next part
# The child imports this very copy of agentd, installed or not (sys.argv[1]: the
# directory that holds the agentd package).
_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "from agentd.kernel._writer import main; sys.exit(main(sys.argv[2:]))")
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


class WriterProcess:
    """The parent's end: `await call(method, *args)` runs `Store.method(*args)` in the
    child (`write_batch` plans and writes a batch)."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self._proc = proc
        self._reader = reader
        self._writer = writer
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._dead: str | None = None
        self.on_exit: Callable[[str], None] | None = None  # told when the child dies
        self._loop = asyncio.get_running_loop()
        self._spin = LoopSpin()  # the reply to a lone commit is due in ~50 us
        self._pump = self._loop.create_task(
            self._responses(), name="agentd-kernel-writer-responses")

    @classmethod
    async def start(cls, lock_fd: int) -> WriterProcess:
        """Start the child; `call("open", db, options)` opens the store in it."""
        parent_sock, child_sock = socket.socketpair()
        for sock in (parent_sock, child_sock):  # a whole batch in one send, no copies
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CHILD, _PACKAGE_ROOT, str(child_sock.fileno()),
                str(lock_fd),
                pass_fds=(child_sock.fileno(), lock_fd),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                start_new_session=True,  # no terminal signals; the parent stops it
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        reader, writer = await asyncio.open_connection(sock=parent_sock, limit=1 << 20)
        return cls(proc, reader, writer)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._dead is None

    def call(self, method: str, *args: Any, spin: bool = True) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self._dead is not None:
            fut.set_exception(WriterExited(self._dead))
            return fut
        data = marshal.dumps((method, args))
        # One write, header and body together: each write is a send() that wakes the
        # child, and a child woken for the 4-byte header alone goes back to sleep
        # waiting for the body (two wake-ups a batch; on a busy 2-core box each can
        # cost the event loop a preemption inside send()). Copying the body once is
        # far cheaper than the second system call and wake-up.
        self._writer.write(_LEN.pack(len(data)) + data)
        self._waiting.append(fut)
        if spin:
            self._spin.until(fut)
        return fut

    async def stop(self) -> None:
        """Close the store in the child (checkpoint) and wait for it to exit."""
        if self._dead is None:
            with contextlib.suppress(Exception):
                await self.call("close")
        self._die("kernel writer stopped")
        with contextlib.suppress(Exception):
            self._writer.close()
        try:
            await asyncio.wait_for(self._proc.wait(), _STOP_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
            raise
        finally:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def kill(self) -> None:
        """SIGKILL the child and wait until it is gone (a writer dying under load)."""
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        await self._proc.wait()

    async def _responses(self) -> None:
        reader = self._reader
        try:
            while True:
                header = await reader.readexactly(_LEN.size)
                ok, *rest = pickle.loads(await reader.readexactly(_LEN.unpack(header)[0]))
                fut = self._waiting.popleft()
                if fut.done():
                    continue
                if ok:
                    fut.set_result(rest[0])
                else:
                    exc, code = rest
                    if code is not None:
                        exc.sqlite_errorcode = code
                    fut.set_exception(exc)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            returncode = await self._proc.wait()
            message = f"kernel writer process {self._proc.pid} exited (status {returncode})"
            first = self._dead is None
            self._die(message)
            if first:
                log.error("%s: %s", message, exc)
                if self.on_exit is not None:
                    self.on_exit(message)

    def _die(self, message: str) -> None:
        if self._dead is None:
            self._dead = message
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(WriterExited(self._dead))
                fut.exception()


# -- the child ----------------------------------------------------------------------


class _Served:
    """The methods the parent may call, over one `Store`."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.store: Any = None
        self._sock = sock
        # Batches applied in the open SQLite transaction of a fold (see `fold`), with
        # the number of their first transaction, the seconds each took to plan and
        # apply, its operations and whether it must be written once (`_write`), not
        # yet committed or answered.
        self._folded: list[tuple[list[tuple], int | None, float, int, bool]] = []

    def open(self, db: str, options: dict[str, Any]
             ) -> tuple[int, int, int, int, dict, tuple[int, float]]:
        options = dict(options)
        dsn = options.pop("dsn", None)
        lease = {k: options.pop(k) for k in ("lease", "holder", "standby", "epoch",
                                             "lease_timeout_s") if k in options}
        if dsn:  # the postgres backend: the same Store over a PgConnection
            self.store = Store.open_postgres(dsn, **lease, abandoned=self._abandoned)
        else:
            self.store = Store.open(Path(db), **options)
        head = self.store.head
        return (head.seq, head.outbox_id, head.txn, self.store.migrated_from,
                self.store.context_counts(), self.store.lease)

    def _abandoned(self) -> bool:
        """While `open` waits (a standby waiting for the lease), the parent says
        nothing until it answers: anything readable is its end (EOF: it died) or a
        `close` (it stops)."""
        if self._sock is None:
            return False
        return bool(select.select([self._sock], [], [], 0)[0])

    def outcomes(self, first: int) -> tuple[int, list[int]]:
        return self.store.outcomes(first)

    def write_batch(self, txs: list[tuple], first: int | None = None
                    ) -> tuple[float, int, list, tuple | None]:
        """Plan and write a batch as one SQLite transaction. If that fails for a reason
        other than the storage, retry each transaction alone, so one bad transaction
        cannot take the others down with it (here, so the order of commits stays the
        order of submission even with the next batch already queued behind this one).

        Returns (seconds, operations written, [(index, message) of rejected
        transactions], None or (index, message): a storage error stopped the retries
        at that transaction, it and the rest were not written). A storage error on the
        whole batch raises. `first`: the number of its first transaction (see the
        module docstring)."""
        t0 = time.perf_counter()
        try:
            ops = self._write(txs, _last(first, txs))
            return time.perf_counter() - t0, ops, [], None
        except Exception as exc:
            if is_storage_error(exc):
                raise
            log.warning("kernel: batch of %d failed (%s); retrying each transaction alone",
                        len(txs), exc)
        ops = 0
        rejected: list[tuple[int, str]] = []
        for i, tx in enumerate(txs):
            txn = None if first is None else first + i
            try:
                ops += self._write([tx], txn)
            except Exception as exc:
                if is_storage_error(exc):
                    return time.perf_counter() - t0, ops, rejected, (i, str(exc))
                rejected.append((i, str(exc)))
                if txn is not None:
                    try:
                        self.store.record_rejected(txn)
                    except Exception as error:  # the rest is not written: say so
                        return time.perf_counter() - t0, ops, rejected, (i + 1, str(error))
        return time.perf_counter() - t0, ops, rejected, None

    def _write(self, txs: list[tuple], txn: int | None) -> int:
        plan = plan_batch(txs)
        if plan.ops:  # empty transactions (flush barriers) need no SQLite transaction
            # Recorded only where writing it again would not do (see BatchPlan.once):
            # the others leave the head untouched, as before numbering.
            self.store.write(plan, txn if plan.once else None)
        return plan.ops

    @property
    def folding(self) -> bool:
        return bool(self._folded)

    @property
    def postgres(self) -> bool:
        return self.store is not None and self.store.postgres

    def fold(self, txs: list[tuple], more: bool, first: int | None = None
             ) -> list[tuple] | None:
        """Apply a batch in the fold's open SQLite transaction (opening it); with
        `more`, the next request is another batch that commits with this one. Returns
        None while the fold stays open, else one reply per batch folded, in order:
        after the one COMMIT (see `_commit_fold`), or, if a batch cannot be folded (a bad
        transaction, one that wants synchronous=FULL), after rolling back and writing
        each batch alone (`write_batch`, with its retries). A storage error fails them
        all."""
        t0 = time.perf_counter()
        try:
            plan = plan_batch(txs)
            if plan.full_sync:
                raise _Unfoldable
            if not self._folded:
                self.store.begin()
            self._folded.append((txs, first, 0.0, plan.ops, plan.once))
            if plan.ops:
                self.store.apply(plan)
            self._folded[-1] = (txs, first, time.perf_counter() - t0, plan.ops, plan.once)
            if more:
                return None
            return self._commit_fold()
        except Exception as exc:
            return self._unfold(txs, first, exc)

    def end_fold(self) -> list[tuple]:
        """Commit an open fold now (a request other than its next batch came)."""
        try:
            return self._commit_fold()
        except Exception as exc:
            return self._unfold(None, None, exc)

    def _commit_fold(self) -> list[tuple]:
        """COMMIT; one commit, so the last part's reply carries the fold's seconds and
        operations and the others none (the daemon counts commits, not parts)."""
        t0 = time.perf_counter()
        once = any(part[4] for part in self._folded)  # else nothing to record (`_write`)
        lasts = [last for txs, first, _, _, _ in self._folded
                 if (last := _last(first, txs)) is not None]
        self.store.commit(max(lasts, default=None) if once else None)
        folded, self._folded = self._folded, []
        seconds = sum(part[2] for part in folded) + time.perf_counter() - t0
        ops = sum(part[3] for part in folded)
        replies: list[tuple] = [(True, (0.0, 0, [], None))] * (len(folded) - 1)
        replies.append((True, (seconds, ops, [], None)))
        return replies

    def _unfold(self, txs: list[tuple] | None, first: int | None, exc: Exception
                ) -> list[tuple]:
        batches = [(t, f) for t, f, _, _, _ in self._folded]
        if txs is not None and (not batches or batches[-1][0] is not txs):
            batches.append((txs, first))
        self._folded = []
        if self.store.conn.in_transaction:
            self.store.rollback()
        if is_storage_error(exc):
            return [(False, exc, getattr(exc, "sqlite_errorcode", None))] * len(batches)
        replies: list[tuple] = []
        for batch, start in batches:
            try:
                replies.append((True, self.write_batch(batch, start)))
            except Exception as error:
                replies.append((False, error, getattr(error, "sqlite_errorcode", None)))
        return replies

    def pragma(self, name: str) -> Any:
        if not name.isidentifier():
            raise ValueError(name)
        return self.store.conn.execute(f"PRAGMA {name}").fetchone()[0]

    def close(self) -> None:
        if self.store is not None:
            if self._folded:  # never committed, never answered: undone
                self._folded = []
                self.store.rollback()
            self.store.close()
            self.store = None

    def __getattr__(self, name: str) -> Any:
        if name in ("sweep_retention", "gc", "cap_outboxes", "checkpoint", "probe",
                    "set_max_bytes", "size_bytes", "renew"):
            return getattr(self.store, name)
        raise AttributeError(name)


def _last(first: int | None, txs: list[tuple]) -> int | None:
    """The number of the last of `txs` numbered from `first` (None: not numbered; an
    empty part numbers nothing)."""
    return None if first is None or not txs else first + len(txs) - 1


class _Unfoldable(Exception):
    """A batch that must commit alone (it asks for synchronous=FULL)."""


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _serve(sock: socket.socket) -> None:
    served = _Served(sock)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    try:
        while True:
            # A lone client's next envelope, or the next batch under load, is read
            # without the writer first going to sleep (two wake-ups per commit).
            wait_readable(poller)
            if served.folding and served.postgres and not poller.poll(_FOLD_WAIT_MS):
                # A fold's next part is late (the daemon paused?): commit what came.
                # On PostgreSQL a fold waiting un-synced keeps its session "active",
                # which no server timeout ends, and so would keep the lease.
                _answer(sock, served.end_fold())
                continue
            header = _recv_exactly(sock, _LEN.size)
            if header is None:
                return
            size = _LEN.unpack(header)[0]
            if size > _MAX_FRAME:
                return
            body = _recv_exactly(sock, size)
            if body is None:
                return
            method, args = marshal.loads(body)
            if method == "write_batch" and (len(args) > 2 or served.folding):
                # A fold: batches sent one after the other commit together.
                replies = served.fold(args[0], bool(args[2]) if len(args) > 2 else False,
                                      args[1])
                if replies is not None:
                    _answer(sock, replies)
                continue
            if served.folding:  # not the batch the fold waited for: commit it first
                _answer(sock, served.end_fold())
            reply: tuple[Any, ...]
            try:
                reply = (True, getattr(served, method)(*args))
            except Exception as exc:
                reply = (False, exc, getattr(exc, "sqlite_errorcode", None))
            _answer(sock, [reply])
            if method == "close":
                return
    finally:
        served.close()


def _answer(sock: socket.socket, replies: list[tuple]) -> None:
    """The replies to requests, in order, in one send."""
    out = []
    for reply in replies:
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an exception that does not pickle
            data = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {reply}"),
                                 None))
        out.append(_LEN.pack(len(data)) + data)
    sock.sendall(b"".join(out))


def main(argv: list[str]) -> int:
    tune_gc()  # the rows of a batch die young: the daemon's collector settings
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    lock_fd = int(argv[1])  # held, never used: see the module docstring
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
        os.close(lock_fd)
    return 0

