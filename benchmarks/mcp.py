"""An MCP tool call through agentd against the same call made directly, in one run.

  agentd  a bus client (real TLS WebSocket on 127.0.0.1) -> BusServer -> Pump ->
          the MCP tool `calc.add` -> a FastMCP stdio server spawned confined ->
          back: one sequential round trip per call;
  direct  the SDK's own `ClientSession` over `stdio_client` to the same server
          program, unconfined, calling the same tool.

Also measured: the time from SIGKILL of the server's process group to the next
call served through agentd (the restart, with its first backoff).

Usage: python benchmarks/mcp.py [--quick]. The last line is one JSON object with
mcp_call_p50_ms, direct_call_p50_ms, mcp_overhead_ratio and mcp_restart_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is named like the SDK's package: its own directory must not shadow it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))
SERVER = ROOT / "tests" / "mcp" / "fastmcp_server.py"
NS = "https://xml-pipeline.org/ns/mcp/calc/add/v1"


def organism(home: Path) -> str:
    read = [sys.prefix, str(ROOT / "tests"), sys.base_prefix]
    return textwrap.dedent(f"""\
        organism: {{name: mcp-bench}}
        state_dir: {json.dumps(str(home / "state"))}
        profiles:
          public: {{listeners: all}}
        listeners:
          - name: calc
            tool:
              kind: mcp
              command: {json.dumps([sys.executable, str(SERVER), "good"])}
              tools: [add]
              read: {json.dumps(read)}
              root: {json.dumps(str(home))}
        """)


async def through_agentd(home: Path, calls: int) -> tuple[list[float], float]:
    import pyotp
    import yaml

    from agentd._routing import Routing
    from agentd.bus import BusServer, ClientAuth, make_self_signed
    from agentd.client import BusClient, frame_kind
    from agentd.config import AuthConfig, BusConfig, TlsConfig, load_config_text
    from agentd.mcp import SERVERS
    from agentd.mcp._stdio import _LIVE_GROUPS
    from agentd.pump import Pump, PumpOptions

    make_self_signed(home / "cert.pem", home / "key.pem")
    secret = pyotp.random_base32()
    (home / "clients.yaml").write_text(yaml.safe_dump(
        {"clients": {"alice": {"totp_secret": secret, "profile": "public"}}}))
    os.chmod(home / "clients.yaml", 0o600)
    config = load_config_text(organism(home), base_dir=home)
    auth = ClientAuth.load(home / "clients.yaml", config.state_dir,
                           AuthConfig(clients_file=home / "clients.yaml"))
    holder: dict[str, Any] = {}
    pump = Pump(Routing.build(config), auth.profiles(),
                lambda c, t, d, o=None: holder["bus"].deliver(c, t, d, o), PumpOptions(config.pump))
    await pump.start()
    bus = holder["bus"] = BusServer(
        BusConfig(host="127.0.0.1", port=0, tls=TlsConfig(home / "cert.pem", home / "key.pem")),
        auth, pump.submit, None, submit_nowait=pump.submit_nowait)
    await bus.start()
    payload = f'<add xmlns="{NS}"><a>2</a><b>40</b></add>'.encode()
    times: list[float] = []
    try:
        async with BusClient(f"wss://127.0.0.1:{bus.port}/bus", "alice", secret=secret,
                             cafile=home / "cert.pem") as client:
            from agentd._envelope import build_envelope
            from agentd._threads import new_uuid

            async def one() -> bytes:
                frames = await client.exchange(
                    build_envelope("alice", new_uuid(), payload, to="calc.add"), timeout=30)
                return frames[-1]

            await one()  # the session starts on the first call
            for _ in range(calls):
                start = time.perf_counter()
                last = await one()
                times.append((time.perf_counter() - start) * 1000)
                assert frame_kind(last)[1] == "mcp-result", last
            for pgid in list(_LIVE_GROUPS):
                os.killpg(pgid, signal.SIGKILL)
            killed = time.perf_counter()
            while frame_kind(await one())[1] != "mcp-result":
                await asyncio.sleep(0.01)  # the backoff is the server's; poll for the answer
            restart_ms = (time.perf_counter() - killed) * 1000
    finally:
        await bus.close()
        await pump.stop()
        for server in SERVERS.values():
            await server.aclose()
    return times, restart_ms


async def direct(calls: int) -> list[float]:
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=[str(SERVER), "good"])
    with open(os.devnull, "w") as quiet:
        return await _direct_calls(stdio_client(params, errlog=quiet), calls)


async def _direct_calls(transport: Any, calls: int) -> list[float]:
    from mcp import ClientSession

    times: list[float] = []
    async with transport as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.call_tool("add", {"a": 2, "b": 40})
        for _ in range(calls):
            start = time.perf_counter()
            await session.call_tool("add", {"a": 2, "b": 40})
            times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls = 50 if args.quick else 500
    import logging

    logging.basicConfig(level=logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="agentd-mcp-bench-") as tmp:
        ours, restart_ms = asyncio.run(through_agentd(Path(tmp), calls))
    theirs = asyncio.run(direct(calls))
    p50, d50 = statistics.median(ours), statistics.median(theirs)
    print(f"through agentd (bus + pump + confined server): p50 {p50:.2f} ms over {calls} calls")
    print(f"direct (SDK ClientSession, same server):       p50 {d50:.2f} ms")
    print(f"overhead ratio {p50 / d50:.2f} (target <= 2.0)")
    print(f"killed server replaced and next call served in {restart_ms:.0f} ms")
    print(json.dumps({"mcp_call_p50_ms": round(p50, 3), "direct_call_p50_ms": round(d50, 3),
                      "mcp_overhead_ratio": round(p50 / d50, 3),
                      "mcp_restart_ms": round(restart_ms, 1)}))


if __name__ == "__main__":
    main()
