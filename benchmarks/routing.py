"""Semantic routing benchmark: ranking an intent over 500 listeners, and how often
the ranking is right on a labelled set.

    python benchmarks/routing.py [--quick]

The listeners are the 50 hand-written capabilities of
`benchmarks/data/routing_capabilities.yaml` plus generated distractors up to 500
(administrative services whose descriptions share generic words with the real
ones). The labelled set is every intent written there (over 200) plus intents that
should be refused. Each intent is ranked with `SemanticRouter.rank` over one
profile holding all 500 listeners, with `lexical` embeddings (BM25 fit once per
candidate set, then cached, as in the daemon): `route_p50_ms` / `route_p95_ms` time
one warm ranking; `top1_accuracy` (selected = expected, above the threshold),
`top3_accuracy` (expected among the first three), `abstain_rate` (share of all
intents with nothing selected). `fit_ms` is the one-off BM25 fit over the 500
descriptions. With `local` embeddings the same ranking runs over a small model
generated here (a synthetic vocabulary, so only its latency is meaningful):
`local_route_p50_ms`, `local_route_p95_ms`. Filling (an LLM call) is not measured.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd._routing import Listener, Profile, build_table  # noqa: E402
from agentd.config import SemanticRoutingConfig  # noqa: E402
from agentd.embeddings import Embedder, LexicalEmbedder, LocalEmbedder  # noqa: E402
from agentd.semantic import SemanticRouter  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "routing_capabilities.yaml"
LISTENERS = 500
THRESHOLD = 0.2

_ENTITIES = ("vendor", "asset", "shipment", "warehouse", "payroll", "compliance", "audit",
             "inventory", "lease", "contract", "badge", "license", "fleet", "procurement",
             "survey", "grant", "pension", "insurance", "claim", "training", "onboarding",
             "facility", "parking", "catering", "donation", "subscription", "warranty",
             "patent", "tender", "quota")
_VERBS = ("tracks", "approves", "archives", "reconciles", "validates", "audits", "exports",
          "imports", "allocates", "forecasts", "renews", "escalates")
_SYSTEMS = ("ledger", "registry", "portal", "backoffice", "erp", "crm", "hr", "legal",
            "records", "finance")
_GENERIC = ("records", "reports", "entries", "requests", "documents", "status", "data")


def listener(name: str, description: str, semantic: str = "") -> Listener:
    return Listener(
        name=name, handler=None, payload_specs=(), response_specs={}, peers=frozenset(),
        is_agent=False, description=description, timeout_s=1.0, max_concurrency=1,
        config=SimpleNamespace(semantic_description=semantic),
    )


def build_profile(capabilities: list[dict[str, Any]]) -> Profile:
    rng = random.Random(18)
    listeners = [listener(c["name"], c["description"], c.get("semantic", ""))
                 for c in capabilities]
    seen = {lst.name for lst in listeners}
    while len(listeners) < LISTENERS:
        entity, verb = rng.choice(_ENTITIES), rng.choice(_VERBS)
        system, generic = rng.choice(_SYSTEMS), rng.choice(_GENERIC)
        name = f"{system}.{entity}.{verb}"
        if name in seen:
            continue
        seen.add(name)
        text = (f"{verb.capitalize()} {entity} {generic} in the {system} service "
                f"and keeps their history.")
        listeners.append(listener(name, text))
    rng.shuffle(listeners)
    semantic = SemanticRoutingConfig(threshold=THRESHOLD, top_k=5)
    return Profile("bench", build_table(1, listeners), semantic=semantic)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(embedder: Embedder, profile: Profile, items: list[tuple[str, str | None]],
                  rounds: int) -> dict[str, float]:
    router = SemanticRouter(embedder, lambda: None)
    started = time.perf_counter()
    await router.rank("warm up", profile)  # fits BM25 / embeds the 500 descriptions
    fit_ms = (time.perf_counter() - started) * 1000
    times: list[float] = []
    top1 = top3 = abstained = expecting = 0
    for round_ in range(rounds):
        for text, expect in items:
            t0 = time.perf_counter()
            ranking = await router.rank(text, profile)
            times.append((time.perf_counter() - t0) * 1000)
            if round_:
                continue
            names = [n for n, _ in ranking.entries]
            abstained += ranking.selected is None
            if expect is not None:
                expecting += 1
                top1 += ranking.selected == expect
                top3 += expect in names[:3]
    return {
        "fit_ms": round(fit_ms, 3),
        "route_p50_ms": round(statistics.median(times), 3),
        "route_p95_ms": round(percentile(times, 0.95), 3),
        "top1_accuracy": round(top1 / expecting, 4),
        "top3_accuracy": round(top3 / expecting, 4),
        "abstain_rate": round(abstained / len(items), 4),
    }


async def main(quick: bool) -> dict[str, Any]:
    data = yaml.safe_load(DATA.read_text(encoding="utf-8"))
    capabilities = data["capabilities"]
    items = [(text, c["name"]) for c in capabilities for text in c["intents"]]
    items += [(text, None) for text in data["abstain"]]
    profile = build_profile(capabilities)
    rounds = 1 if quick else 5
    print(f"listeners={len(profile.table.listeners)} intents={len(items)} "
          f"(expecting a listener: {sum(1 for _, e in items if e)}) threshold={THRESHOLD}")
    lexical = await measure(LexicalEmbedder(), profile, items, rounds)
    print("lexical: " + " ".join(f"{k}={v}" for k, v in lexical.items()))
    result: dict[str, Any] = {**lexical}
    sys.path.insert(0, str(ROOT))
    from tests.embedding_models import write_static_model

    with tempfile.TemporaryDirectory() as tmp:
        model = LocalEmbedder(write_static_model(Path(tmp) / "model", dims=64))
        local = await measure(model, profile, items, rounds)
    print("local (synthetic model, latency only): "
          f"route_p50_ms={local['route_p50_ms']} route_p95_ms={local['route_p95_ms']} "
          f"fit_ms={local['fit_ms']}")
    result["local_route_p50_ms"] = local["route_p50_ms"]
    result["local_route_p95_ms"] = local["route_p95_ms"]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round (CI)")
    args = parser.parse_args()
    figures = asyncio.run(main(args.quick))
    print(json.dumps(figures))
