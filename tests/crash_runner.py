"""A child process for the crash-recovery test: runs the demo organism over a state
directory and prints, one line each, every frame the client receives.

    python -m tests.crash_runner STATE_DIR load N    # submit N relay requests, forever busy
    python -m tests.crash_runner STATE_DIR drain     # recover, deliver, run until idle

Lines: `A <thread> <expected>` once a request is accepted (durable), `R <thread>
<value>` for each reply, `DONE` when a drain finished. The parent kills `load` runs
with SIGKILL at random moments.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agentd._envelope import build_envelope, parse_envelope
from agentd._threads import new_uuid
from agentd._xmlify import spec_of
from agentd.config import load_config
from agentd.demo import ORGANISM
from agentd.testing import Harness
from agentd.tools.relay import Relay

CONFIG = ORGANISM


class Printer(Harness):
    expected: dict[str, int]

    def _deliver(self, client: str, thread: str, data: bytes, outbox_id: int | None) -> None:
        env = parse_envelope(data)
        local = env.payload.tag.split("}")[1]
        if local == "accepted":
            print(f"A {thread} {self.expected[thread]}", flush=True)
        elif local == "sum":
            print(f"R {thread} {env.payload[0].text}", flush=True)
        super()._deliver(client, thread, data, outbox_id)


async def main(state_dir: Path, mode: str, n: int) -> None:
    h = Printer(load_config(CONFIG), {"alice": "public"}, state_dir=state_dir)
    h.expected = {}
    async with h:
        if mode == "load":
            spec = spec_of(Relay)

            async def client(k: int) -> None:
                for i in range(k, n, 16):
                    thread = new_uuid()
                    h.expected[thread] = i + 7
                    data = build_envelope("alice", thread, spec.to_bytes(Relay(a=i, b=7)))
                    await h.pump.submit("alice", data)

            await asyncio.gather(*(client(k) for k in range(16)))
        await h.run_until_idle()
        print("DONE", flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0))
