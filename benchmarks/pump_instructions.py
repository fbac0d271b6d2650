"""Instructions per message of benchmarks/pump.py's workload (the real pump, a
request to a tool that replies, each on its own thread, no kernel), made
deterministic so a count under callgrind is comparable across commits.

Run twice with different message counts and take the difference, so start-up
(imports, schema compilation) cancels out:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/pump_instructions.py N

instructions per message = (Ir(3000) - Ir(1000)) / 2000, less the same
difference with --build-only (building the envelopes). Without N the script does
that itself and prints the figure as JSON (`--quick`: N = 200 and 600, the
building included). The envelopes' thread
ids are derived from their index; the loop is asyncio (uvloop is C, counted too,
but its scheduling varies with timing).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
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


def drive(n: int, build_only: bool) -> None:
    tune_gc()
    data = envelopes(n)
    if not build_only:
        asyncio.run(real_pump(data))
    print(n)


def instructions(*args: str) -> int:
    """Ir of one run of this script under callgrind."""
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, __file__, *args],
        capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONHASHSEED="0"))
    return int(re.search(r"Collected : (\d+)", proc.stderr).group(1))  # type: ignore[union-attr]


def measure(quick: bool) -> dict[str, object]:
    """Per message, as the docstring says; --quick: two runs (about a minute each,
    mostly start-up), the envelopes' building included (about 39,000 of it)."""
    if shutil.which("valgrind") is None:
        return {"instructions_per_message": None, "why": "valgrind is not installed"}
    low, high = (200, 600) if quick else (1000, 3000)
    per = (instructions(str(high)) - instructions(str(low))) / (high - low)
    result: dict[str, object] = {"messages": [low, high], "build_included": quick}
    if not quick:
        build = (instructions(str(high), "--build-only")
                 - instructions(str(low), "--build-only")) / (high - low)
        per -= build
    result["instructions_per_message"] = round(per)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].isdigit():
        drive(int(sys.argv[1]), "--build-only" in sys.argv)
        return
    print(json.dumps(measure("--quick" in sys.argv)))


if __name__ == "__main__":
    main()
