"""The context package without a model: segments and their originals, the
librarian's rules, the extract, token calibration, long-term memory recall and
re-embedding (on a real kernel), and 10,000 random fold/evict/unfold/restart
sequences whose every unfold is byte-equal to the original."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.context import (
    Costs,
    HashedTerms,
    IntegrityError,
    LibrarianRules,
    LongTermMemory,
    Part,
    Segment,
    Tier,
    TokenCalibration,
    complete_with_facts,
    decode_parts,
    encode_parts,
    estimate_tokens,
    extract,
    facts,
    plan_tiers,
)
from agentd.context._memory import REEMBED_RETRY_S
from agentd.context._segments import add_turn
from agentd.kernel import Kernel

E, F, V = Tier.EXPANDED, Tier.FOLDED, Tier.EVICTED


def costs(n: int, *, expanded: int = 100, folded: int = 20, stub: int = 5,
          relevance: list[float] | None = None, pinned: list[bool] | None = None) -> Costs:
    return Costs.of([expanded] * n, [folded] * n, [stub] * n,
                    relevance if relevance is not None else [1.0] * n, pinned)


# ---- segments -------------------------------------------------------------------------


def test_a_call_and_its_results_are_one_segment_and_a_notice_is_its_own() -> None:
    segs: list[Segment] = []
    add_turn(segs, Part("assistant", "<add><a>1</a><b>2</b></add>"))
    add_turn(segs, Part("notice", "huh invalid-payload: ...", "platform"))
    add_turn(segs, Part("result", "<sum><value>3</value></sum>", "calculator.add", True))
    add_turn(segs, Part("assistant", "It is 3."))
    assert [(s.id, s.kind, len(s.parts)) for s in segs] == [
        (1, "tool", 2), (2, "notice", 1), (3, "reply", 1)]


def test_the_original_round_trips_and_a_damaged_row_is_refused() -> None:
    parts = [Part("assistant", "héllo \n\u2028 \"quoted\" <x/>"),
             Part("result", "{\"a\": [1, 2]}\n", "tool.x", False)]
    assert decode_parts(encode_parts(parts)) == tuple(parts)
    seg = Segment(1, "tool", list(parts))
    row = seg.row("t", "c", "agent", 0.0)
    assert Segment.from_row(row).original == seg.original
    damaged = list(row)
    damaged[11] = seg.original.replace(b"2", b"3")
    with pytest.raises(IntegrityError):
        Segment.from_row(damaged)


def test_a_stub_names_id_kind_and_size_never_content() -> None:
    seg = Segment(7, "tool", [Part("assistant", "SECRET-CONTENT /etc/passwd 42")])
    stub = seg.stub()
    assert "7" in stub and "tool" in stub and str(seg.nbytes) in stub
    assert "SECRET" not in stub and "passwd" not in stub and "42" not in stub


def test_token_estimate_is_bytes_over_four_rounded_up_until_calibrated() -> None:
    assert [estimate_tokens(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    cal = TokenCalibration()
    assert cal.estimate(400, "a") == 100
    cal.observe("a", 100, 130)  # the provider counted 30 % more
    assert cal.estimate(400, "a") == 130 and cal.estimate(400, "b") == 100
    cal.observe("a", 100, 10_000)  # absurd reports are bounded
    assert cal.factor("a") <= 4.0


# ---- the librarian (pure) ---------------------------------------------------------------


def test_segments_below_fold_below_are_folded_and_recent_ones_kept() -> None:
    rules = LibrarianRules(budget_tokens=10_000, fold_below=0.5, keep_recent=2)
    plan = plan_tiers(costs(5, relevance=[0.9, 0.1, 0.49, 0.0, 0.0]), rules, 100)
    assert plan.tiers == (E, F, F, E, E)
    assert plan.fits and plan.total_tokens == 100 + 3 * 100 + 2 * 20


def test_a_folded_segment_that_became_relevant_is_unfolded() -> None:
    rules = LibrarianRules(10_000, 0.5, 0)
    assert plan_tiers(costs(2, relevance=[0.1, 0.9]), rules, 0).tiers == (F, E)
    assert plan_tiers(costs(2, relevance=[0.8, 0.9]), rules, 0).tiers == (E, E)


def test_over_budget_the_least_relevant_are_evicted_first() -> None:
    rules = LibrarianRules(budget_tokens=300, fold_below=0.0, keep_recent=1)
    plan = plan_tiers(costs(5, relevance=[0.9, 0.2, 0.5, 0.1, 0.0]), rules, 0)
    # 500 tokens expanded; evict 0.1 then 0.2 (saving 95 each) to reach 310 > 300,
    # then 0.5: 215.
    assert plan.tiers == (E, V, V, V, E)
    assert plan.fits and plan.total_tokens <= 300


def test_an_unfolded_segment_is_expanded_even_when_irrelevant() -> None:
    rules = LibrarianRules(10_000, 0.5, 0)
    plan = plan_tiers(costs(3, relevance=[0.0, 0.0, 0.0], pinned=[False, True, False]),
                      rules, 0)
    assert plan.tiers == (F, E, F)


def test_protected_segments_are_evicted_last_and_stubs_collapse_rather_than_overflow() -> None:
    rules = LibrarianRules(budget_tokens=60, fold_below=0.0, keep_recent=3)
    plan = plan_tiers(costs(3), rules, 30)
    assert plan.fits and plan.tiers.count(V) >= 2
    many = plan_tiers(costs(200, stub=5), LibrarianRules(100, 0.0, 0), 50, 24)
    assert many.collapsed_stubs and many.fits and many.total_tokens == 74
    hopeless = plan_tiers(costs(1), LibrarianRules(10, 0.0, 0), 50)
    assert not hopeless.fits
    # Segments no larger than their stubs are not evicted one by one, but they still
    # go into the collapsed line when that is what makes the prompt fit.
    tiny = Costs.of([1] * 30, [1] * 30, [1] * 30, [0.0] * 30, [False] * 30)
    squeezed = plan_tiers(tiny, LibrarianRules(50, 0.0, 5), 26, 24)
    assert squeezed.fits and squeezed.collapsed_stubs and squeezed.total_tokens == 50
    assert set(squeezed.tiers) == {V}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 500), st.integers(1, 80), st.integers(1, 12),
                       st.floats(0, 1), st.booleans()), max_size=40),
    st.integers(50, 5000), st.floats(0, 1), st.integers(0, 6), st.integers(0, 400),
)
def test_the_plan_never_exceeds_the_budget_when_it_says_it_fits(
    rows: list[tuple[int, int, int, float, bool]], budget: int, fold_below: float,
    keep_recent: int, fixed: int,
) -> None:
    c = Costs.of([r[0] for r in rows], [min(r[1], r[0]) for r in rows],
                 [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows])
    plan = plan_tiers(c, LibrarianRules(budget, fold_below, keep_recent), fixed, 24)
    by_tier = {E: c.expanded, F: c.folded, V: c.stub}
    shown = sum(int(by_tier[t][i]) for i, t in enumerate(plan.tiers)
                if not (plan.collapsed_stubs and t is V))
    total = fixed + shown + (24 if plan.collapsed_stubs else 0)
    assert plan.total_tokens == total
    assert plan.fits == (total <= budget)
    if fixed + 24 <= budget:
        assert plan.fits  # evicting everything always makes room when room exists
    n = len(rows)
    for i, t in enumerate(plan.tiers):  # nothing recent or pinned is folded
        if i >= n - keep_recent or rows[i][4]:
            assert t is not F


# ---- the extract ---------------------------------------------------------------------------


def test_the_extract_keeps_every_number_path_identifier_and_url() -> None:
    text = ("Deployed build 4.2.1 of agentd.platform to /srv/agentd/releases/v42 at "
            "14:05; see https://ci.example.org/job/771?tab=log. The retry_limit stays 3, "
            "latency p99 was 12.5 ms (-3%), owner is svcAccount7 in eu-west-1, "
            "hash 9f2c4e1d8b7a6f5e4d3c2b1a. Everything else went fine and nobody noticed.")
    out = extract(text)
    for fact in ["4.2.1", "agentd.platform", "/srv/agentd/releases/v42", "14", "05",
                 "https://ci.example.org/job/771?tab=log", "retry_limit", "3", "12.5",
                 "-3%", "svcAccount7", "eu-west-1", "9f2c4e1d8b7a6f5e4d3c2b1a"]:
        assert fact in out, fact
    assert len(out) < len(text) + 200
    assert extract(text) == out  # deterministic


def test_the_extract_of_hostile_text_stops_in_linear_time() -> None:
    """A tool result or a model reply is untrusted, and the extract reads all of it.
    "a--a--a--" has a word boundary every three characters and no path: a pattern
    tried from each boundary to the end of the run costs the square of the length
    (20 KB took 3.4 s; 512 KiB would take some 40 minutes). Run in a child so a
    regression fails the test instead of hanging it; linear, it takes well under a
    second."""
    code = ("import sys; from agentd.context import extract; "
            "[extract((p * 200_000)[:512 * 1024]) for p in ('a--', '-_-', 'a-/')]")
    done = subprocess.run([sys.executable, "-c", code], timeout=120, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0


def test_a_relative_path_is_found_from_its_first_word_character() -> None:
    assert facts("see --out/report.txt and a--b/c then x") == ["out/report.txt", "a--b/c"]
    assert facts("run_7/logs/a.log") == ["run_7/logs/a.log"]


def test_hashed_terms_keep_words_not_runs_of_untrusted_text() -> None:
    """The lexical vectors' term cache lives as long as the daemon: a 100 KB run
    without spaces (a tool result) is hashed, never kept, and gives the same vector
    as before."""
    vectors = HashedTerms()
    run = "x" * 100_000
    first = vectors.vectors_now([f"alpha {run} beta"])
    assert all(len(term) <= 64 for term in vectors._buckets)
    assert "alpha" in vectors._buckets
    assert np.array_equal(first, vectors.vectors_now([f"alpha {run} beta"]))


def test_a_models_summary_is_completed_with_the_facts_it_dropped() -> None:
    original = "Moved /var/lib/x to /data/x; 1532 files, checksum ab12cd34ef56ab78cd90."
    done = complete_with_facts("Files were moved.", original)
    assert all(f in done for f in facts(original))
    assert complete_with_facts(original, original) == original


# ---- 10,000 sequences: fold / evict / unfold / restart ----------------------------------------


_ALPHABET = "ab c\n\"\\<>/{}[]0123456789é☃\u2028\x7f\t"


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 40)))


def test_ten_thousand_random_sequences_every_unfold_is_byte_equal() -> None:
    rng = random.Random(21)
    mismatches = 0
    for _ in range(10_000):
        segs: list[Segment] = []
        truth: dict[int, list[Part]] = {}
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(["assistant", "result", "notice"])
            part = Part(kind, _random_text(rng), rng.choice(["", "calc.add", "platform"]),
                        rng.random() < 0.3)
            seg = add_turn(segs, part)
            truth.setdefault(seg.id, []).append(part)
        rows = {s.id: s.row("t", "c", "a", 0.0) for s in segs}
        for _ in range(rng.randint(1, 8)):
            op = rng.choice(["fold", "evict", "unfold", "restart"])
            seg = rng.choice(segs)
            if op == "fold":
                seg.tier, seg.summary = F, extract(seg.text)
            elif op == "evict":
                seg.tier = V
            elif op == "unfold":
                seg.tier = E
                if list(decode_parts(seg.original)) != truth[seg.id]:
                    mismatches += 1
            else:  # restart: everything read back from the rows the kernel holds
                rows.update({s.id: s.row("t", "c", "a", 0.0) for s in segs})
                segs = [Segment.from_row(rows[i]) for i in sorted(rows)]
        for s in segs:  # a final unfold of each
            if s.parts != truth[s.id] or list(decode_parts(s.original)) != truth[s.id]:
                mismatches += 1
    assert mismatches == 0


# ---- long-term memory ------------------------------------------------------------------------


async def test_recall_is_by_similarity_at_most_k_and_above_zero() -> None:
    memory = LongTermMemory(HashedTerms())
    await memory.add("tutor", "The student prefers worked examples of fractions.")
    await memory.add("tutor", "Invoices are due within 30 days.")
    await memory.add("tutor", "Fractions: always reduce them.", key="fractions")
    await memory.add("other", "Fractions are forbidden.")
    found = await memory.recall("tutor", "How do I add fractions?", 5)
    assert [m.text for m in found] == ["Fractions: always reduce them.",
                                       "The student prefers worked examples of fractions."]
    assert len(await memory.recall("tutor", "fractions", 1)) == 1
    assert await memory.recall("tutor", "zebra", 5) == ()


async def test_memories_are_durable_and_re_embedded_when_the_embedder_changes(
    tmp_path: Path,
) -> None:
    async with await Kernel.open(tmp_path / "state") as kernel:
        first = LongTermMemory(HashedTerms(64), kernel=kernel)
        await first.ready()
        record = await first.add("tutor", "Deadlines are on Fridays.", key="deadline")
        second = LongTermMemory(HashedTerms(128), kernel=kernel)  # another embedder
        await second.ready()
        assert [m.id for m in second.list("tutor")] == [record.id]
        rows = await kernel.memories("tutor")
        assert rows[0][5] == "hashed-terms:128"
        assert len(np.frombuffer(rows[0][6], dtype=np.float32)) == 128
        assert [m.text for m in await second.recall("tutor", "when are deadlines", 3)] == [
            "Deadlines are on Fridays."]
        assert await second.forget("tutor", record.id)
        assert not await second.forget("tutor", record.id)
        assert await kernel.memories("tutor") == []


async def test_a_failing_provider_recalls_nothing_and_says_so() -> None:
    class Broken:
        identity = "broken:1"

        async def vectors(self, texts: list[str]) -> np.ndarray:
            raise OSError("down")

    memory = LongTermMemory(HashedTerms())
    await memory.add("tutor", "something about fractions")
    memory.embedder = Broken()
    assert await memory.recall("tutor", "fractions", 3) == ()
    assert memory.degraded.startswith("broken:1")


class _Widths:
    """An embeddings provider (external, so a stand-in is fair) whose width the test
    sets, or that fails."""

    identity = "widths:1"

    def __init__(self, width: int) -> None:
        self.width = width
        self.down = False

    async def vectors(self, texts: list[str]) -> np.ndarray:
        if self.down:
            raise OSError("provider down")
        out = np.zeros((len(texts), self.width), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i, sum(map(ord, text)) % self.width] = 1.0
        return out


async def test_a_memory_of_another_width_is_refused_before_it_is_stored(
    tmp_path: Path,
) -> None:
    """Was: committed, then the index refused it, so the operator was told it failed
    while it was stored, and every later memory's vector answered for the record
    before it (another memory's text recalled), after a restart too."""
    provider = _Widths(8)
    async with await Kernel.open(tmp_path / "state") as kernel:
        memory = LongTermMemory(provider, kernel=kernel)
        await memory.ready()
        await memory.add("tutor", "apples are red")
        provider.width = 16
        with pytest.raises(ValueError, match="16 dimensions"):
            await memory.add("tutor", "the vault code is 7741")
        provider.width = 8
        await memory.add("tutor", "zebras have stripes")
        assert [m.text for m in memory.list("tutor")] == ["apples are red",
                                                          "zebras have stripes"]
        assert [r[3] for r in await kernel.memories("tutor")] == ["apples are red",
                                                                  "zebras have stripes"]
        found = await memory.recall("tutor", "zebras have stripes", 1)
        assert [m.text for m in found] == ["zebras have stripes"]


async def test_stored_vectors_of_another_width_are_left_out_in_step(tmp_path: Path) -> None:
    """A database holding vectors of two widths under one identity (written before
    the check above): the odd one is left out of the index and of the records
    together, so each vector still answers for its own memory."""
    async with await Kernel.open(tmp_path / "state") as kernel:
        tx = kernel.transaction()
        for i, (text, width) in enumerate([("apples are red", 8), ("vault 7741", 16),
                                           ("zebras have stripes", 8)]):
            vector = (await _Widths(width).vectors([text]))[0]
            tx.memory_put((f"m-{i}", "tutor", None, text, float(i), "widths:1",
                           vector.tobytes()))
        await kernel.commit(tx)
        memory = LongTermMemory(_Widths(8), kernel=kernel)
        await memory.ready()
        assert [m.text for m in memory.list("tutor")] == ["apples are red",
                                                          "zebras have stripes"]
        found = await memory.recall("tutor", "zebras have stripes", 1)
        assert [m.text for m in found] == ["zebras have stripes"]


async def test_a_provider_down_at_re_embedding_leaves_the_other_memories_recalled(
    tmp_path: Path,
) -> None:
    """Memories another embedder made are re-embedded at load. With the provider down
    that load raised, and every agent task failed on it; now the current memories
    are recalled, the stale ones wait, and a later load (after REEMBED_RETRY_S)
    re-embeds them."""
    now = [1000.0]
    async with await Kernel.open(tmp_path / "state") as kernel:
        provider = _Widths(8)
        current = LongTermMemory(provider, kernel=kernel, clock=lambda: now[0])
        await current.ready()
        await current.add("tutor", "zebras have stripes")
        tx = kernel.transaction()  # one an earlier embedder made
        tx.memory_put(("m-old", "tutor", None, "deadlines are on fridays", 1.0,
                       "hashed-terms:64", np.ones(64, dtype=np.float32).tobytes()))
        await kernel.commit(tx)
        provider.down = True
        fresh = LongTermMemory(provider, kernel=kernel, clock=lambda: now[0])
        await fresh.ready()  # does not raise
        assert [m.text for m in fresh.list("tutor")] == ["zebras have stripes"]
        assert fresh.degraded.startswith("widths:1")
        provider.down = False
        await fresh.ready()  # too soon: not tried again
        assert len(fresh.list("tutor")) == 1
        now[0] += REEMBED_RETRY_S
        await fresh.ready()
        assert sorted(m.text for m in fresh.list("tutor")) == [
            "deadlines are on fridays", "zebras have stripes"]
        assert {r[5] for r in await kernel.memories("tutor")} == {"widths:1"}


def test_a_growing_segment_encodes_each_part_once_and_stays_canonical() -> None:
    seg = Segment(1, "reply", [Part("assistant", "calls", "", False)])
    assert seg.nbytes == len(encode_parts(seg.parts))
    for i in range(5):
        seg.append(Part("result", f"result {i}\n\"quoted\" é\u2028", "echo", True))
        assert seg.original == encode_parts(seg.parts)
    assert decode_parts(seg.original) == tuple(seg.parts)
