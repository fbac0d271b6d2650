"""What the daemon itself writes to the kernel, beside the pump's entries: audit
and security events (journal entries of their own kinds), the bus's
authentication state (postgres), and the record of streams in flight, with the
clients told `final … interrupted` for the streams the last run left open.

Each write is one transaction handed to the kernel, its failure logged: none of
them may stop the daemon, and none waits for the commit but the start-up's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from agentd._core import Final
from agentd._envelope import build_envelope
from agentd.kernel import Kernel, KernelUnavailable

log = logging.getLogger("agentd.daemon")

# Pump and bus security events; the OOB channel's and the federation's own kinds
# are added where an event is judged.
_PUMP_SECURITY_KINDS = frozenset(
    {"forged-from", "priv-on-bus", "priv-from-handler", "peer-violation", "lockout",
     "tool-denied", "approval-refused", "approval-limit"}
)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("kernel write failed: %s", fut.exception())


class DaemonJournal:
    """The daemon's own kernel writes, against the kernel open at the time (none
    before a standby took the lease, nor after the stop closed it)."""

    def __init__(self, kernel: Callable[[], Kernel | None]) -> None:
        self._kernel = kernel

    def audit(self, kind: str, fields: Mapping[str, str]) -> None:
        """An audit or security event, journaled as an entry of its own kind."""
        from agentd.federation import SECURITY_KINDS as FEDERATION_SECURITY_KINDS
        from agentd.oob import SECURITY_KINDS as OOB_SECURITY_KINDS

        security = (kind in _PUMP_SECURITY_KINDS or kind in OOB_SECURITY_KINDS
                    or kind in FEDERATION_SECURITY_KINDS)
        direction = "security" if security else "audit"
        if fields.get("channel") != "oob":  # the OOB server logs its own events
            log.log(
                logging.WARNING if direction == "security" else logging.INFO,
                "%s kind=%s %s",
                direction,
                kind,
                " ".join(f"{k}={v}" for k, v in fields.items()),
            )
        kernel = self._kernel()
        if kernel is None:
            return
        tx = kernel.transaction()
        tx.journal(
            thread=fields.get("thread", ""),
            direction=direction,
            kind=kind,
            handler=fields.get("command", ""),
            sender=fields.get("key_id", fields.get("client", fields.get("listener", ""))),
            tag=fields.get("cause", ""),  # a tool's refusal: why, readable in the listing
            payload=json.dumps(dict(fields), sort_keys=True).encode(),
        )
        kernel.commit(tx).add_done_callback(_log_failure)

    def save_auth(self, clients: dict[str, str]) -> asyncio.Future[Any] | None:
        """The bus's authentication state, written to the kernel (postgres). Returns
        the commit: a login's `auth-ok` waits for it (a failed one closes the login)."""
        kernel = self._kernel()
        if kernel is None:
            return None
        tx = kernel.transaction()
        for client, state in clients.items():
            tx.auth_put(client, state)
        try:
            fut = kernel.commit(tx)
        except KernelUnavailable as exc:
            log.warning("bus authentication state not written to the kernel: %s", exc)
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            failed.add_done_callback(_log_failure)  # retrieved, whoever waits or not
            return failed
        fut.add_done_callback(_log_failure)
        return fut

    def record_stream(self, stream: str, client: str, thread: str, last_seq: int) -> None:
        """The kernel's record of a stream in flight (`last_seq` 0: it ended)."""
        kernel = self._kernel()
        if kernel is None:
            return
        tx = kernel.transaction()
        if last_seq:
            tx.stream_put(stream, client, thread, last_seq)
        else:
            tx.stream_delete(stream)
        try:
            kernel.commit(tx).add_done_callback(_log_failure)
        except KernelUnavailable as exc:
            log.warning("stream record not written: %s", exc)

    async def interrupted_streams(self, gateways: Collection[str],
                                  opted_in: Callable[[str, str], None]) -> None:
        """Streams the last run left in flight (`kill -9`): each client is told
        `final … interrupted` through its outbox, which it gets at login before any
        live frame, so before the resumed task's new stream; `opted_in(client,
        thread)` opts its conversation in again, so that task streams. A peer
        organism (one of `gateways`) is told nothing (its call's answer is what it
        takes from the outbox)."""
        kernel = self._kernel()
        assert kernel is not None
        rows = await kernel.open_streams()
        if not rows:
            return
        tx = kernel.transaction()
        for stream, client, thread, last_seq in rows:
            if client not in gateways:
                body = Final(stream, last_seq, interrupted=True).to_bytes()
                tx.outbox_put(client, thread, build_envelope("core", thread, body, to=client))
                # The opt-in died with the last run: the resumed task streams again.
                opted_in(client, thread)
            tx.stream_delete(stream)
        await kernel.commit(tx)
        log.warning("streams interrupted by the last stop, told to their clients count=%d",
                    len(rows))
