"""agentd's traces as Arize Phoenix receives them: the check that a real OTLP
receiver LLM developers use reads what agentd exports, run by hand where Phoenix is
installed (installing `arize-phoenix` takes longer than CI allows).

It starts `phoenix serve` on loopback (its own working folder, OTLP/HTTP on
/v1/traces), a real `agentd run` on the demo home with `telemetry:` pointing at it,
asks the tutor its question and sends a relay, then reads the spans back through
Phoenix's REST API. Checks: the tutor's conversation is one trace (its id is the
client's thread) with `invoke_agent`, `chat` and `execute_tool` spans, the GenAI
attribute names as the conventions spell them, and no prompt or answer text in any
span (capture_content is off).

Usage: python benchmarks/phoenix.py [--quick] [--phoenix PATH]. Without Phoenix
(`--phoenix`, $PHOENIX_BIN or `phoenix` on PATH) it prints {"skipped": ...}. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd.client import BusClient, frame_kind  # noqa: E402
from agentd.platform.demo import MathQuestion  # noqa: E402
from agentd.tools.relay import Relay  # noqa: E402
from tests.daemon_process import DaemonProcess, edit_config, make_home  # noqa: E402

QUESTION = "What is (2 + 3) * 7?"
GENAI_CHAT = ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
              "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
              "gen_ai.conversation.id")
GENAI_TOOL = ("gen_ai.operation.name", "gen_ai.tool.name", "gen_ai.tool.call.id",
              "gen_ai.conversation.id")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_phoenix(binary: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port, grpc = free_port(), free_port()
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(work), "PHOENIX_HOST": "127.0.0.1",
           "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc)}
    log = open(work / "phoenix.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([binary, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/v1/projects", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"phoenix did not start: see {work / 'phoenix.log'}")
        time.sleep(0.5)


def spans_of(url: str, want: int) -> list[dict[str, Any]]:
    """Every span Phoenix holds (all projects), once at least `want` have arrived."""
    deadline = time.monotonic() + 60
    while True:
        spans: list[dict[str, Any]] = []
        for project in httpx.get(url + "/v1/projects", timeout=10).json()["data"]:
            cursor = None
            while True:
                params: dict[str, Any] = {"limit": 1000}
                if cursor:
                    params["cursor"] = cursor
                page = httpx.get(f"{url}/v1/projects/{project['name']}/spans",
                                 params=params, timeout=10).json()
                spans += page["data"]
                cursor = page.get("next_cursor")
                if not cursor:
                    break
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


async def converse(d: DaemonProcess, n: int) -> list[str]:
    threads = []
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        for _ in range(n):
            asked = await bus.exchange(MathQuestion(text=QUESTION))
            threads.append(frame_kind(asked[0])[2])
            await bus.exchange(Relay(a=1, b=2))
    return threads


def check(spans: list[dict[str, Any]], threads: list[str]) -> dict[str, Any]:
    problems: list[str] = []
    trace_ids = {uuid.UUID(t).hex for t in threads}
    names: dict[str, int] = {}
    for s in spans:
        if s["context"]["trace_id"] in trace_ids:
            names[s["name"]] = names.get(s["name"], 0) + 1
    for prefix in ("invoke_agent tutor", "chat ", "execute_tool calculator."):
        if not any(n.startswith(prefix) for n in names):
            problems.append(f"no span named {prefix}… in the tutor's trace")
    agents = {s["context"]["span_id"] for s in spans if s["name"].startswith("invoke_agent ")}
    orphans = [s["name"] for s in spans if s["name"].startswith("chat ")
               and s.get("parent_id") not in agents]
    if orphans:
        problems.append(f"{len(orphans)} chat spans are not children of an invoke_agent span")
    for s in spans:
        attrs = s.get("attributes") or {}
        wanted = GENAI_CHAT if s["name"].startswith("chat ") else (
            GENAI_TOOL if s["name"].startswith("execute_tool ") else ())
        missing = [a for a in wanted if a not in attrs]
        if missing:
            problems.append(f"{s['name']} lacks {missing}")
    text = json.dumps(spans)
    if "(2 + 3) * 7" in text or "What is" in text:
        problems.append("the question's text is in a span (capture_content is off)")
    return {"spans": len(spans), "in_tutor_traces": sum(names.values()),
            "span_names": dict(sorted(names.items())), "problems": problems}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phoenix", default=os.environ.get("PHOENIX_BIN") or shutil.which("phoenix"))
    args = ap.parse_args()
    if not args.phoenix or not Path(args.phoenix).exists():
        print(json.dumps({"skipped": "Arize Phoenix is not installed (pip install "
                          "arize-phoenix; then --phoenix PATH/bin/phoenix)"}))
        return
    n = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="agentd-phoenix-") as tmp:
        work = Path(tmp)
        phoenix, url = start_phoenix(args.phoenix, work)
        try:
            home = work / "home"
            make_home(home)
            edit_config(home, lambda doc: doc.__setitem__(
                "telemetry", {"otlp_endpoint": url, "service_name": "agentd-phoenix-check"}))

            async def run() -> list[str]:
                d = await DaemonProcess(home).start()
                try:
                    return await converse(d, n)
                finally:
                    await d.stop()  # a clean stop flushes the batch processor

            threads = asyncio.run(run())
            # Per question: 3 invoke_agent, 3 chat, 2 execute_tool; per relay: 3 tools.
            result = check(spans_of(url, 11 * n), threads)
            result["phoenix"] = subprocess.run(
                [str(Path(args.phoenix).with_name("python")), "-c",
                 "import importlib.metadata as m; print(m.version('arize-phoenix'))"],
                capture_output=True, text=True, check=False,
            ).stdout.strip()
        finally:
            phoenix.terminate()
            phoenix.wait(30)
    result["ok"] = not result["problems"]
    print(json.dumps(result))
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
