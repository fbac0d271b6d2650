"""Context benchmark: the librarian's pass over a long task, memory recall, the
extract's fidelity, unfold integrity.

    python benchmarks/context.py [--quick]

- assemble: one agent task holding SEGMENTS segments (tool results and notices);
  each timed call is `Platform.arrange` (relevance of every segment to the task,
  the librarian's plan, summaries of newly folded segments, layer assembly,
  `validate_no_override`), with one new segment added between calls, as in a live
  task. Target: p50 <= 5 ms for 10,000 segments.
- recall: `LongTermMemory.recall` (k = 5) over MEMORIES memories of one agent, hashed
  lexical vectors. Target: p50 <= 20 ms for 100,000.
- extract_keeps_facts: share of the numbers, paths, identifiers and URLs planted in a
  generated corpus that the extractive fold keeps verbatim. Target 1.0.
- unfold_mismatches: random fold/evict/unfold/restart sequences over kernel rows; an
  unfold whose bytes differ from the original counts. Target 0.

Baseline: the same arrange on a task of 10 segments, in the same run
(`assemble_ratio` = p50 at SEGMENTS / p50 at 10). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# One BLAS thread, as the daemon's event loop wants: a matrix-vector product of this
# size gains nothing from a thread pool, and on a loaded machine its threads contend.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentd.config import load_config_text
from agentd.context import (
    HashedTerms,
    LongTermMemory,
    Part,
    Segment,
    Tier,
    decode_parts,
    extract,
)
from agentd.context._segments import add_turn
from agentd.platform import InMemoryHistoryStore, Platform

THREAD = "0b7c1d52-3b9e-4c1e-9a57-2b1f0c3d4e5f"
TASK = ('<mathquestion xmlns="https://xml-pipeline.org/ns/agents/math-tutor/v1">'
        "<text>Which deployment wrote the log under /var/log/agentd?</text></mathquestion>")
CONFIG = """
organism: {name: bench}
prompts:
  base: "You are a careful operator's assistant. {tool_definitions}"
llm:
  backends:
    - {name: none, provider: openai, base_url: "http://127.0.0.1:9/v1", model: x}
listeners:
  - name: assistant
    payload_class: agentd.platform.demo:MathQuestion
    description: Answers questions.
    agent: {prompt: base, model: none}
"""
_WORD_TEXT = ("deploy build service host region latency error retry queue worker cache "
              "shard replica backup restore token budget prompt segment memory vector index")
WORDS = _WORD_TEXT.split(" ")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def result_text(rng: random.Random, i: int) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
    return f"step {i}: {words} /srv/app/{i}.log status {rng.randint(100, 599)}"


async def arrange_latency(segments: int, calls: int) -> list[float]:
    platform = Platform.from_config(load_config_text(CONFIG, base_dir=Path.cwd()),
                                    history=InMemoryHistoryStore(max_turns=segments + calls + 1))
    session = platform.session("assistant")
    session.begin(THREAD, TASK)
    rng = random.Random(1)
    for i in range(segments):
        session.record(THREAD, result_text(rng, i), source="tool", notice=i % 7 == 0)
    await platform.arrange("assistant", THREAD)  # the first pass embeds everything
    samples: list[float] = []
    for i in range(calls):
        session.record(THREAD, result_text(rng, segments + i), source="tool")
        start = time.perf_counter()
        await platform.arrange("assistant", THREAD)
        samples.append((time.perf_counter() - start) * 1e3)
    await platform.aclose()
    return samples


async def recall_latency(memories: int, calls: int) -> list[float]:
    store = LongTermMemory(HashedTerms())
    rng = random.Random(2)
    for i in range(memories):
        await store.add("assistant", f"memory {i}: " + " ".join(
            rng.choice(WORDS) for _ in range(12)))
    samples: list[float] = []
    for _ in range(calls):
        query = " ".join(rng.choice(WORDS) for _ in range(8))
        start = time.perf_counter()
        found = await store.recall("assistant", query, 5)
        samples.append((time.perf_counter() - start) * 1e3)
        assert len(found) <= 5
    return samples


def extract_fidelity(texts: int) -> float:
    rng = random.Random(3)
    kept = total = 0
    for i in range(texts):
        planted = [
            str(rng.randint(0, 10**6)),
            f"{rng.randint(0, 999)}.{rng.randint(0, 99)}",
            f"/var/lib/{rng.choice(WORDS)}/{rng.choice(WORDS)}-{i}.db",
            f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{i}.py",
            f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{i}",
            f"{rng.choice(WORDS)}.{rng.choice(WORDS)}.{rng.choice(WORDS)}",
            f"https://{rng.choice(WORDS)}.example.com/{i}?q={rng.randint(1, 99)}",
            f"v{rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}",
        ]
        prose = []
        for fact in planted:
            prose.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
            prose.append(fact)
        text = " ".join(prose) + "."
        out = extract(text)
        total += len(planted)
        kept += sum(1 for fact in planted if fact in out)
    return kept / total


def unfold_mismatches(sequences: int) -> int:
    rng = random.Random(4)
    bad = 0
    for _ in range(sequences):
        segs: list[Segment] = []
        truth: dict[int, list[Part]] = {}
        for _ in range(rng.randint(1, 8)):
            part = Part(rng.choice(["assistant", "result", "notice"]),
                        "".join(rng.choice("ab \n<>\"é☃0") for _ in range(rng.randint(0, 60))))
            seg = add_turn(segs, part)
            truth.setdefault(seg.id, []).append(part)
        rows = {s.id: s.row("t", "c", "a", 0.0) for s in segs}
        for _ in range(rng.randint(1, 10)):
            seg = rng.choice(segs)
            op = rng.choice(["fold", "evict", "unfold", "restart"])
            if op == "fold":
                seg.tier, seg.summary = Tier.FOLDED, extract(seg.text)
            elif op == "evict":
                seg.tier = Tier.EVICTED
            elif op == "unfold":
                seg.tier = Tier.EXPANDED
                bad += list(decode_parts(seg.original)) != truth[seg.id]
            else:
                rows.update({s.id: s.row("t", "c", "a", 0.0) for s in segs})
                segs = [Segment.from_row(rows[k]) for k in sorted(rows)]
        bad += sum(list(decode_parts(s.original)) != truth[s.id] for s in segs)
    return bad


async def run(quick: bool) -> dict[str, float]:
    segments, calls = 10_000, (30 if quick else 200)
    memories = 100_000
    small = await arrange_latency(10, calls)
    large = await arrange_latency(segments, calls)
    recall = await recall_latency(memories, 50 if quick else 300)
    fidelity = extract_fidelity(300 if quick else 3000)
    mismatches = unfold_mismatches(2000 if quick else 10_000)
    p50_small, p50, p99 = statistics.median(small), statistics.median(large), percentile(large, 99)
    print(f"arrange   10 segments:     p50 {p50_small:.2f} ms")
    print(f"arrange   {segments:,} segments: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
          f"(target p50 <= 5 ms)")
    print(f"recall    {memories:,} memories: p50 {statistics.median(recall):.2f} ms "
          "(target <= 20 ms)")
    print(f"extract   keeps {fidelity:.3f} of planted facts (target 1.0)")
    print(f"unfold    {mismatches} mismatches (target 0)")
    return {
        "assemble_p50_ms": round(p50, 3),
        "assemble_p99_ms": round(p99, 3),
        "assemble_baseline_p50_ms": round(p50_small, 3),
        "assemble_ratio": round(p50 / p50_small, 2),
        "recall_p50_ms": round(statistics.median(recall), 3),
        "extract_keeps_facts": round(fidelity, 4),
        "unfold_mismatches": mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes (under a minute)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.quick))))


if __name__ == "__main__":
    main()
