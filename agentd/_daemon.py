"""The daemon: one process that ties the kernel, the pump, the main bus, the
out-of-band channel and the metrics listener together. Beside it: the operator
commands it answers (`agentd._operator`), its `status` answers (`agentd._status`),
its own kernel writes (`agentd._daemon_journal`) and the outbox views it hands the
bus and the federation (`agentd._kernel_outbox`).

Start order: preflight (every check on the configuration and the files it names,
the same as `check-config`) -> kernel (lock, recover) -> routing -> pump (recover,
workers) -> bind the bus, OOB and metrics sockets, last -> READY=1. Stop order is
the reverse, with a bounded drain of the pump while connections are still open so
answers in flight can reach clients.

Invariants kept here:
- Only the kernel writes the database; audit and security events are journal
  entries of their own kinds (`audit`, `security`), written by `DaemonJournal`.
- A reload (`agentd._reload`) validates the whole new configuration before changing
  anything, and threads that exist keep the dispatch table they were created with.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Coroutine, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentd import _metrics as metrics
from agentd import telemetry
from agentd._daemon_journal import DaemonJournal
from agentd._errors import ConfigError
from agentd._kernel_outbox import FederationHost, KernelOutbox
from agentd._observability import sd_notify, watchdog_interval, watchdog_pinger
from agentd._operator import DaemonCommands
from agentd._preflight import CheckedConfig, preflight
from agentd._reload import AgentPlatforms, build_agent_handlers, live_table_versions, reload_daemon
from agentd._routing import Routing
from agentd._runtime import tune_gc
from agentd._status import kernel_status, organism_status
from agentd._streams import StepFrames, StreamHub, StreamWriter
from agentd._wiring import kernel_options, pump_options
from agentd.config import OrganismConfig, load_config
from agentd.isolation import IsolationPools
from agentd.kernel import Kernel, StateDirLock
from agentd.pump import Pump
from agentd.semantic import SemanticRouter

if TYPE_CHECKING:
    from agentd.platform import AgentHandlers

log = logging.getLogger("agentd.daemon")

LEASE_LOST_STATUS = 3  # `agentd run` after its kernel lost the postgres lease


class Daemon:
    def __init__(self, config: OrganismConfig, config_path: Path | None = None, *,
                 standby: bool = False) -> None:
        self.config = config
        # `agentd run --standby` (postgres backend): waits for the lease before it
        # opens the kernel; "primary" once it holds it.
        self.role = "standby" if standby else "primary"
        self.waited_s = 0.0  # how long a standby waited for the lease
        self.checked = CheckedConfig(config)  # replaced by preflight at start
        # What the settings read only at start (_reload.READ_AT_START) were read from.
        self.started_with: CheckedConfig | None = None
        self.config_path = config_path or config.source
        self.started = time.time()
        self.kernel: Kernel | None = None
        self.routing: Routing | None = None
        self.pump: Pump | None = None
        self.router: SemanticRouter | None = None  # core `intent` (semantic routing)
        self.bus: Any = None
        self.journal = DaemonJournal(lambda: self.kernel)
        # Previews of agents' model calls, straight to the bus (no outbox row).
        self.streams = StreamHub(lambda c, t, d: self._deliver(c, t, d, None),
                                 lambda c: self.bus is not None and self.bus.busy(c),
                                 record=self.journal.record_stream)
        self._streaming: tuple[OrganismConfig, frozenset[str]] | None = None
        self.oob: Any = None
        self.metrics_server: Any = None
        self.federation: Any = None
        self.auth: Any = None
        self.platforms = AgentPlatforms()
        self.isolation = IsolationPools()
        self._stop = asyncio.Event()
        self._stop_mode = "graceful"
        self.exit_status = 0  # what `agentd run` exits with
        self._watchdog: asyncio.Task[None] | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self._reloading = asyncio.Lock()  # one reload at a time (operator's or automatic)
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle ----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return (
            self.kernel is not None
            and self.kernel.healthy
            and (self.bus is None or bool(self.bus.listening))
        )

    @property
    def agents(self) -> AgentHandlers | None:
        """The handlers of the live routing's agents (None: no agents)."""
        return self.platforms.current

    def _agent_platform(self) -> Any:
        """The live LLM platform (semantic routing fills payloads through it)."""
        handlers = self.platforms.current
        return handlers.platform if handlers is not None else None

    async def start(self) -> None:
        """Check everything, open the kernel, build and recover, and bind the
        listening sockets last: a configuration that cannot run never listens."""
        self.checked = self.started_with = preflight(self.config)
        config = self.config = self.checked.config  # with the listeners gateways import
        telemetry.configure(config.telemetry, config.name, config.base_dir,
                            telemetry.secret_values(config) if config.telemetry else ())
        options = kernel_options(config)
        if self.role == "standby":
            if options.lease is None:
                raise ConfigError(["--standby: kernel.backend is sqlite, which has no lease "
                                   "to wait for; a standby needs kernel: {backend: postgres}"])
            options = replace(options, standby=True)
            if not await self._wait_for_lease(options):
                return  # stopped while waiting: serve() stops at once
        else:
            self.kernel = await Kernel.open(
                config.state_dir, options,
                on_commit=lambda seconds, _n: metrics.journal_commit_seconds.observe(seconds),
            )
        assert self.kernel is not None
        self.kernel.on_lease_lost = self._lease_lost
        try:
            await self._start_rest()
        except BaseException:
            await self._close_components()
            raise

    async def _wait_for_lease(self, options: Any) -> bool:
        """A standby: the OOB channel answers `status` while the kernel waits for the
        lease (the bus stays closed); a stop request ends the wait. On taking it the
        kernel recovers as after `kill -9`. False if stopped first."""
        config = self.config
        self.install_signal_handlers()
        # The state directory first (its OOB socket is this daemon's from now on).
        lock = await asyncio.to_thread(StateDirLock.acquire, config.state_dir)
        try:
            await self._listen_oob()
            log.info("standby: waiting for the lease of organism %s", config.name)
            # Started, for systemd (a waiting standby is a running service), and alive:
            # the watchdog's pings come from this event loop while it waits.
            self._notify("READY=1\nSTATUS=standby: waiting for the lease")
            self._start_watchdog()
            started = time.monotonic()
            opening = asyncio.ensure_future(Kernel.open(
                config.state_dir, options, lock=lock,
                on_commit=lambda seconds, _n: metrics.journal_commit_seconds.observe(seconds),
            ))
            stopping = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not opening.done():
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await opening
                log.info("standby: stopped while waiting for the lease")
                lock.release()
                return False
            self.kernel = opening.result()
        except BaseException:
            lock.release()  # idempotent: a failed Kernel.open released it already
            await self._close_components()
            raise
        self.waited_s = time.monotonic() - started
        self.role = "primary"
        log.warning("standby: took the lease (epoch %d) after waiting %.2f s at journal "
                    "seq %d; recovering", self.kernel.lease_epoch, self.waited_s,
                    self.kernel.journal_seq)
        if self.oob is not None:
            await self._restore_nonces()
        return True

    async def _start_rest(self) -> None:
        config = self.config
        assert self.kernel is not None
        clients: dict[str, str] = {}
        if self.checked.clients is not None:
            from agentd.bus import ClientAuth

            # The entries the preflight read and checked: the file is read once. On
            # PostgreSQL the sessions and used codes live in the kernel too, so a
            # standby that takes over knows them.
            shared = config.kernel.backend == "postgres"
            self.auth = ClientAuth.restore(
                self.checked.clients, config.state_dir, config.auth,
                saved=await self.kernel.bus_auth() if shared else None,
                save=self.journal.save_auth if shared else None)
            self.auth.on_lockout = lambda client: self.audit("lockout", {"client": client})
        clients = self.client_profiles()
        handlers = build_agent_handlers(config, self.kernel, self.audit)
        self.platforms.adopt(handlers, 1)  # adopted first, so a failed start closes it
        isolated = await self.isolation.apply(config, agents=handlers)
        self.routing = Routing.build(config, agent_handlers=handlers, isolated_handlers=isolated)
        self.router = SemanticRouter.from_config(config, self._agent_platform)
        self.pump = Pump(self.routing, clients, self._deliver, pump_options(config),
                         self.kernel, on_security=self.audit, intents=self.router,
                         steps=StepFrames(self.streams, self._streams_configured))
        if self.agents is not None:
            self.agents.platform.bind_threads(self.pump.registry)
            self.agents.platform.bind_previews(self.preview)
        await self.journal.interrupted_streams({g.name for g in config.gateways},
                                               self.streams.thread_opted_in)
        resumed = await self.pump.recover()
        if resumed:
            log.info("recovered messages=%d", resumed)
        await self.pump.start()
        await self._listen()
        for warning in unserved(config):
            log.warning("%s", warning)
        kernel = self.kernel
        metrics.kernel_healthy.set_function(lambda: 1 if kernel.healthy else 0)
        metrics.kernel_writer_restarts.set_function(lambda: kernel.writer_restarts)
        metrics.kernel_in_flight.set_function(lambda: kernel.in_flight)
        tune_gc()
        self._notify(f"READY=1\nSTATUS={self.role}")
        self._start_watchdog()
        self._maintenance = asyncio.create_task(self._maintain(), name="daemon-maintenance")

    def _start_watchdog(self) -> None:
        if watchdog_interval() is not None and self._watchdog is None:
            self._watchdog = asyncio.create_task(watchdog_pinger(), name="sd-watchdog")

    async def _listen(self) -> None:
        """Bind the bus, the OOB socket and the metrics port: the last step of start,
        after every check passed. A port in use is one line naming the setting."""
        config = self.config
        assert self.kernel is not None and self.pump is not None
        if config.bus.tls is not None and self.auth is not None:
            from agentd.bus import BusServer

            self.bus = BusServer(config.bus, self.auth, self.pump.submit, KernelOutbox(self.kernel),
                                 ssl_context=self.checked.tls,
                                 submit_nowait=self.pump.submit_nowait)
            self.bus.streams = self.streams
            await _bind("bus.port", f"{config.bus.host}:{config.bus.port}", self.bus.start())
        if config.federation is not None and self.checked.identity is not None:
            from agentd.federation import Federation

            self.federation = Federation(self.checked.identity, config.federation,
                                         config.gateways, self.audit,
                                         server_ssl=self.checked.federation_tls,
                                         host=FederationHost(self.kernel, self.pump,
                                                             lambda: self.config),
                                         allow_meta=config.meta.allow_remote,
                                         max_envelope_bytes=config.bus.max_envelope_bytes,
                                         shape=self.pump.shape,
                                         state_dir=config.state_dir,
                                         on_pinned=self._pinned)
            await _bind("federation.listen", config.federation.listen, self.federation.start())
        if self.oob is None:
            await self._listen_oob()
        if config.metrics.listen:
            from agentd._observability import MetricsServer

            self.metrics_server = MetricsServer(config.metrics.listen, ready=lambda: self.ready)
            await _bind("metrics.listen", config.metrics.listen, self.metrics_server.start())

    async def _listen_oob(self) -> None:
        """The operator's socket (a standby opens it before its kernel)."""
        config = self.config
        if config.oob.authorized_keys is None:
            return
        from agentd.oob import OobServer

        socket = config.oob.socket or (config.state_dir / "oob.sock")
        self.oob = OobServer(
            socket,
            config.oob.authorized_keys,
            DaemonCommands(self),
            allowed_uids=config.oob.allowed_uids,
            max_frame_bytes=config.oob.max_frame_bytes,
            clock_skew_s=config.oob.clock_skew_s,
            audit=self.audit,
        )
        await self.oob.start()
        if self.kernel is not None:  # the server logs where it listens
            await self._restore_nonces()

    async def _maintain(self) -> None:
        """Gauges, and the end of idle conversations, every few seconds."""
        interval = min(10.0, max(0.05, self.config.pump.thread_idle_s / 10))
        while True:
            await asyncio.sleep(interval)
            assert self.pump is not None and self.kernel is not None
            ended = self.pump.collect_idle(self.config.pump.thread_idle_s)
            if ended:
                log.info("idle conversations ended count=%d", ended)
            metrics.queue_depth.set(self.pump.queue_depth)
            metrics.threads_active.set(len(self.pump.registry))
            metrics.db_size_bytes.set(self.kernel.db_size_bytes())
            await self.platforms.close_unused(lambda: live_table_versions(self))
            await self.isolation.close_unused(lambda: live_table_versions(self))
            if self.bus is not None:
                metrics.bus_connections.set(self.bus.connections)

    async def _restore_nonces(self) -> None:
        """The OOB replay cache lives in memory; the journal has every command's nonce,
        so a command captured before a restart is still refused after it."""
        assert self.kernel is not None and self.oob is not None
        seen = []
        for entry in await self.kernel.journal(limit=10_000, kinds=["oob-command"]):
            try:
                nonce = json.loads(entry.payload or b"{}").get("nonce")
            except ValueError:
                continue
            if isinstance(nonce, str):
                seen.append((nonce, entry.ts))
        kept = self.oob.remember_nonces(seen)
        if kept:
            log.info("oob nonces restored from the journal count=%d", kept)

    def client_profiles(self) -> dict[str, str]:
        """Who may start conversations, and under which profile: the bus's clients,
        and each gateway that exports listeners (under the gateway's name)."""
        clients = self.auth.profiles() if self.auth is not None else {}
        for gateway in self.config.gateways:
            if gateway.name in clients:
                raise ConfigError([f"gateways: {gateway.name!r} is also a bus client's id"])
            if gateway.export and gateway.profile is not None:
                clients[gateway.name] = gateway.profile
        return clients

    def preview(self, owner: str, conversation: str, agent: str,
                configured: bool = False) -> StreamWriter | None:
        """A writer for an agent's model call when the conversation's owner asked for
        previews or the configuration streams it (platforms bind it:
        `Platform.bind_previews`)."""
        if self.bus is None or not (configured or self.streams.wanted(owner, conversation)):
            return None
        return self.streams.writer(owner, conversation)

    def _streams_configured(self, frame: Any) -> bool:
        """Whether the configuration streams `frame`'s conversation without being
        asked: its profile, or an agent on its path, has `stream: true`."""
        if self.bus is None:
            return False
        config = self.config
        cached = self._streaming
        if cached is None or cached[0] is not config:
            cached = self._streaming = (config, frozenset(
                lst.name for lst in config.listeners if lst.agent is not None and lst.stream))
        profile = config.profiles.get(frame.root.profile.name)
        if profile is not None and profile.stream:
            return True
        return bool(cached[1]) and not cached[1].isdisjoint(frame.path)

    def _deliver(self, client: str, thread: str, data: bytes, outbox_id: int | None) -> None:
        if self.federation is not None and self.federation.deliver(client, thread, data,
                                                                   outbox_id):
            return
        if self.bus is not None:
            self.bus.deliver(client, thread, data, outbox_id)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, "graceful")

    def _lease_lost(self, why: str) -> None:
        """Another daemon may be the writer now (postgres backend): stop serving at
        once, and exit non-zero (`LEASE_LOST_STATUS`) so systemd shows it failed."""
        log.error("kernel %s: stopping; this daemon serves nothing more", why)
        self.exit_status = LEASE_LOST_STATUS
        self.request_stop("immediate")

    def request_stop(self, mode: str = "graceful") -> None:
        self._stop_mode = mode
        self._stop.set()

    async def serve(self) -> None:
        """Run until a signal or `shutdown` asks to stop, then stop."""
        await self._stop.wait()
        await self.stop(self._stop_mode)

    async def stop(self, mode: str = "graceful", drain_s: float = 10.0) -> None:
        self._notify("STOPPING=1")
        log.info("stopping mode=%s", mode)
        if self.oob is not None:
            await self.oob.close()
            self.oob = None
        if mode == "graceful" and self.pump is not None:
            # Answers in flight can still reach connected clients; what does not
            # finish in time stays pending in the journal and resumes at next start.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pump.join(), drain_s)
        await self._close_components()

    async def _close_components(self) -> None:
        for task in (self._watchdog, self._maintenance):
            if task is not None:
                task.cancel()
        if self.oob is not None:
            await self.oob.close()
        if self.bus is not None:
            await self.bus.close(1001)
        if self.federation is not None:
            await self.federation.close()
            self.federation = None
        if self.pump is not None:
            await self.pump.stop()
        await self.isolation.stop()
        mcp = sys.modules.get("agentd.mcp")  # loaded only by organisms with MCP tools
        if mcp is not None:
            await mcp.close_servers()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        await self.platforms.aclose()
        if self.router is not None:
            await self.router.aclose()
        if self.kernel is not None:
            await self.kernel.close()
            self.kernel = None
        await asyncio.to_thread(telemetry.shutdown)  # exports the spans still queued

    @staticmethod
    def _notify(state: str) -> None:
        sd_notify(state)

    # ---- audit -------------------------------------------------------------------

    def audit(self, kind: str, fields: Mapping[str, str]) -> None:
        """An audit or security event, journaled as an entry of its own kind."""
        self.journal.audit(kind, fields)

    # ---- operator commands -------------------------------------------------------------

    async def kernel_status(self) -> dict[str, Any]:
        return await kernel_status(self)

    def status(self) -> dict[str, Any]:
        return organism_status(self)

    async def reload(self, dry_run: bool) -> dict[str, Any]:
        """Check the configuration file fully, then apply the difference (see
        `agentd._reload`); a dry run only reports it. A reload also accepts the
        schemas peers changed since their pins."""
        async with self._reloading:
            accepted = [] if dry_run or self.federation is None else (
                self.federation.accept_offers())
            result = await reload_daemon(self, dry_run)
            if accepted:
                result["accepted_schemas"] = accepted
            return result

    def _pinned(self) -> None:
        """A peer's listener was pinned for the first time: reload to route to it."""
        async def reload() -> None:
            try:
                result = await self.reload(False)
                log.info("reloaded for newly pinned peer schemas: version=%s",
                         result.get("version"))
            except Exception:
                log.exception("reload for newly pinned peer schemas failed")

        task = asyncio.get_running_loop().create_task(reload(), name="federation-pinned")
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def unserved(config: OrganismConfig) -> list[str]:
    """What a configuration leaves unreachable, one warning each: a daemon without a
    bus has nobody to talk to, one without an OOB channel cannot be operated."""
    warnings = []
    if config.bus.tls is None or config.auth.clients_file is None:
        missing = " and ".join(
            key for key, value in (("bus.tls", config.bus.tls),
                                   ("auth.clients_file", config.auth.clients_file))
            if value is None
        )
        warnings.append(
            f"NOT SERVING THE BUS: {missing} not set, so no client can connect "
            "(`agentd init` writes a configuration that sets them)"
        )
    if config.oob.authorized_keys is None:
        warnings.append(
            "NO OPERATOR CHANNEL: oob.authorized_keys is not set, so agentctl cannot "
            "reach this daemon"
        )
    return warnings


async def _bind(setting: str, address: str, start: Coroutine[Any, Any, None]) -> None:
    """Await a server's `start`; an address that cannot be bound is a `ConfigError`
    of one line naming the setting, not a traceback."""
    try:
        await start
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError([f"{setting}: {address} is already in use"]) from None
        if isinstance(exc, socket.gaierror) and setting.endswith(".port"):
            # The host does not resolve: the host is the setting to fix, not the port.
            raise ConfigError([f"{setting.removesuffix('.port')}.host: cannot resolve "
                               f"{address.rpartition(':')[0]}: {exc.strerror or exc}"]
                              ) from None
        raise ConfigError([f"{setting}: cannot listen on {address}: "
                           f"{exc.strerror or exc}"]) from None


async def run_daemon(config_path: Path, state_dir: Path | None = None, *,
                     standby: bool = False) -> int:
    config = load_config(config_path, state_dir_override=state_dir)
    daemon = Daemon(config, config_path, standby=standby)
    await daemon.start()
    daemon.install_signal_handlers()
    await daemon.serve()
    return daemon.exit_status
