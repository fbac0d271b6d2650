"""Instructions per message of benchmarks/pump.py's workload (the real pump, a
request to a tool that replies, each on its own thread, no kernel), made
deterministic so a count under callgrind is comparable across commits.

Run twice with different message counts and take the difference, so start-up
(imports, schema compilation) cancels out:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/pump_instructions.py N

instructions per message = (Ir(3000) - Ir(1000)) / 2000, less the same
difference with --build-only (building the envelopes). The envelopes' thread
ids are derived from their index; the loop is asyncio (uvloop is C, counted too,
but its scheduling varies with timing).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pump import real_pump  # noqa: E402

from agentd._envelope import build_envelope  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402


def envelopes(n: int) -> list[bytes]:
    spec = spec_of(Add)
    return [
        build_envelope("alice", str(uuid.UUID(int=i + 1, version=4)), spec.to_bytes(Add(a=i, b=2)))
        for i in range(n)
    ]


def main() -> None:
    n = int(sys.argv[1])
    tune_gc()
    data = envelopes(n)
    if "--build-only" not in sys.argv:
        asyncio.run(real_pump(data))
    print(n)


if __name__ == "__main__":
    main()
