"""Semantic routing: core `intent` in, the right permitted tool out, the dispatch
table still the authority. End to end through the pump (`Harness`, durable), the
platform and fake OpenAI servers on loopback that record every request; plus the
pure parts (masking, selection, reading a filler's reply)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentd._envelope import build_envelope, parse_envelope
from agentd._routing import Routing
from agentd._schemas import NS_CORE
from agentd._threads import new_uuid
from agentd.client import frame_kind
from agentd.config import load_config_text
from agentd.embeddings import LexicalEmbedder
from agentd.platform import Platform, make_agent_handlers
from agentd.semantic import SemanticRouter, permitted, read_fill, select
from agentd.testing import Harness
from tests.llm_servers import FakeLLM, Reply, Seen

TESTS = Path(__file__).resolve().parent
NS = "https://example.org/ns/routing-test/"
FILLER_MARK = "You turn a request into exactly one XML payload"
ERASE_WORDS = ("files.erase", "Erases temporary", "wipe", "erase-files")


def organism_text(server: FakeLLM, ladder: str = "[cheap, strong]", extra: str = "") -> str:
    backend = f'provider: openai, base_url: "{server.base_url}"'
    return f"""
organism: {{name: routing}}
python_path: [{json.dumps(str(TESTS))}]
pump: {{max_hops: 20, handler_timeout_s: 20}}
routing: {{semantic: {{threshold: 0.2, top_k: 3, fill_models: {ladder}}}}}
profiles:
  users: {{listeners: [files.read, files.list, mail.send], allow_intents: true}}
  closed: {{listeners: [files.read, files.list]}}
  admin: {{listeners: all, allow_intents: true}}
prompts:
  worker_base: "You do tasks. {{tool_definitions}}"
llm:
  retries: 0
  backends:
    - {{name: cheap, {backend}, model: cheap-1}}
    - {{name: middle, {backend}, model: middle-1}}
    - {{name: strong, {backend}, model: strong-1}}
listeners:
  - name: files.read
    payload_class: routing_fixtures:ReadFile
    response_class: routing_fixtures:Done
    handler: routing_fixtures:read_file
    description: Reads the contents of a file.
  - name: files.list
    payload_class: routing_fixtures:ListFiles
    response_class: routing_fixtures:Done
    handler: routing_fixtures:list_files
    description: Lists the entries of a directory.
  - name: files.erase
    payload_class: routing_fixtures:EraseFiles
    response_class: routing_fixtures:Done
    handler: routing_fixtures:erase_files
    description: Erases temporary files from disk.
    semantic_description: delete remove wipe clean temp files
  - name: mail.send
    payload_class: routing_fixtures:SendMail
    response_class: routing_fixtures:Done
    handler: routing_fixtures:send_mail
    description: Sends an email message to a recipient.
  - name: worker
    payload_class: routing_fixtures:WorkerTask
    description: Does tasks.
    agent: {{prompt: worker_base, model: cheap, max_iterations: 4}}
    peers: [files.read, files.list, mail.send]
{extra}"""


PAYLOADS = {
    "files.read": f'<readfile xmlns="{NS}read-file"><path>main.rs</path></readfile>',
    "files.list": f'<listfiles xmlns="{NS}list-files"><directory>/tmp</directory></listfiles>',
    "files.erase": f'<erasefiles xmlns="{NS}erase-files"><pattern>*.tmp</pattern></erasefiles>',
    "mail.send": f'<sendmail xmlns="{NS}send-mail"><to>bob</to><body>hi</body></sendmail>',
}


def capability(seen: Seen) -> str:
    found = re.search(r"Capability: (\S+)", seen.conversation().system)
    return found.group(1) if found else ""


def good_filler(seen: Seen) -> str:
    """Fills whatever capability it is asked for, correctly."""
    return PAYLOADS[capability(seen)]


def intent(sender: str, text: str, thread: str | None = None) -> bytes:
    body = f'<intent xmlns="{NS_CORE}"><text>{text}</text></intent>'.encode()
    return build_envelope(sender, thread or new_uuid(), body)


def payload_of(frame: bytes) -> bytes:
    from lxml import etree

    return etree.tostring(parse_envelope(frame).payload, method="c14n")


@asynccontextmanager
async def organism(
    script: Callable[[Seen], Reply | str], ladder: str = "[cheap, strong]", extra: str = "",
    clients: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Harness, FakeLLM]]:
    async with FakeLLM("openai", script) as server:
        config = load_config_text(organism_text(server, ladder, extra), base_dir=TESTS)
        platform = Platform.from_config(config)
        handlers = make_agent_handlers(config, platform)
        clients = clients or {"alice": "users", "carol": "closed", "root": "admin"}
        async with Harness(config, clients, agent_handlers=handlers) as h:
            platform.bind_threads(h.pump.registry)
            yield h, server
        await platform.aclose()


def fill_requests(server: FakeLLM) -> list[Seen]:
    return [s for s in server.requests if FILLER_MARK in s.conversation().system]


async def journal_text(h: Harness) -> str:
    assert h.kernel is not None
    entries = await h.kernel.journal(limit=1000)
    return "\n".join(
        f"{e.kind} {e.handler} {e.sender} {e.tag} "
        + (e.payload or b"").decode("utf-8", "replace") for e in entries
    )


# ---------------------------------------------------------------- end to end


async def test_a_client_intent_is_filled_and_dispatched_as_its_own_request() -> None:
    async with organism(good_filler) as (h, server):
        frames = await h.send("alice", intent("alice", "read the contents of main.rs"))
        journal = await journal_text(h)
    assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"), ("files.read", "done")]
    assert b"<detail>main.rs</detail>" in frames[-1]
    [fill] = fill_requests(server)
    assert fill.json["model"] == "cheap-1" and capability(fill) == "files.read"
    route = next(line for line in journal.splitlines() if line.startswith("intent-route"))
    record = json.loads(route.split(" ", 4)[4])
    assert record["intent"] == "read the contents of main.rs"
    assert record["selected"] == "files.read" and record["outcome"] == "filled"
    assert record["ranking"][0]["listener"] == "files.read" and record["ranking"][0]["score"] > 0.2
    assert "request/1 files.read alice" in journal  # dispatched as alice's, one hop on


async def test_a_router_organism_of_tools_only_fills_an_intent() -> None:
    """No agent listener: the platform exists because `llm` does, and fills."""
    async with FakeLLM("openai", good_filler) as server:
        text = organism_text(server).split("  - name: worker")[0]
        config = load_config_text(text, base_dir=TESTS)
        assert not any(lst.agent for lst in config.listeners)
        async with Harness(config, {"alice": "users"}) as h:
            frames = await h.send("alice", intent("alice", "read the contents of main.rs"))
    assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"), ("files.read", "done")]
    [fill] = fill_requests(server)
    assert capability(fill) == "files.read"


async def test_delete_the_temp_files_never_reaches_erase_outside_the_profile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with organism(good_filler) as (h, server):
        frames = await h.send("alice", intent("alice", "delete the temp files"))
        masked = await h.send("alice", intent("alice", "wipe clean"))
        journal = await journal_text(h)
    assert frame_kind(masked[-1])[:2] == ("core", "huh")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "intent" in logged and not any(word in logged for word in ERASE_WORDS[:2])
    assert all(b"files.erase" not in f for f in frames)
    last = frame_kind(frames[-1])[:2]
    assert last in {("core", "huh"), ("files.read", "done"), ("files.list", "done"),
                    ("mail.send", "done")}
    for seen in server.requests:
        assert not any(word in seen.body.decode() for word in ERASE_WORDS)
    assert not any(word in journal for word in ERASE_WORDS[:2])


async def test_the_same_intent_reaches_erase_where_the_profile_allows_it() -> None:
    async with organism(good_filler) as (h, _):
        frames = await h.send("root", intent("root", "wipe clean the temp files"))
    assert frame_kind(frames[-1])[:2] == ("files.erase", "done")


async def test_all_masked_and_no_match_give_identical_replies() -> None:
    async with organism(good_filler) as (h, server):
        masked = await h.send("alice", intent("alice", "wipe clean"))  # only erase matches
        nothing = await h.send("alice", intent("alice", "zebra quokka"))
    assert frame_kind(masked[-1])[:2] == ("core", "huh")
    assert payload_of(masked[-1]) == payload_of(nothing[-1])
    assert b"no matching capability in your profile" in payload_of(masked[-1])
    assert fill_requests(server) == []  # nothing selected: no model was asked


async def test_a_profile_without_allow_intents_is_unroutable_and_asks_no_model() -> None:
    async with organism(good_filler) as (h, server):
        frames = await h.send("carol", intent("carol", "read the contents of main.rs"))
    assert [frame_kind(f)[:2] for f in frames] == [("core", "huh")]
    assert b"unroutable" in frames[0]
    assert server.requests == []


async def test_a_client_intent_for_a_gated_listener_waits_for_its_approval() -> None:
    """Filled from an intent or sent directly, a request to a gated listener is parked
    until someone decides: the intent is no way around the gate."""
    gated = "  gated: {listeners: [files.read], allow_intents: true, " \
            "approval: {approvers: [operator]}}\n"
    async with FakeLLM("openai", good_filler) as server:
        text = organism_text(server).replace("  closed: ", gated + "  closed: ")
        config = load_config_text(text, base_dir=TESTS)
        platform = Platform.from_config(config)
        async with Harness(config, {"dave": "gated"},
                           agent_handlers=make_agent_handlers(config, platform)) as h:
            platform.bind_threads(h.pump.registry)
            direct = await h.send("dave", build_envelope(
                "dave", new_uuid(), PAYLOADS["files.read"].encode(), to="files.read"))
            via = await h.send("dave", intent("dave", "read the contents of main.rs"))
            assert h.kernel is not None
            parked = await h.kernel.approvals()
        await platform.aclose()
    for frames in (direct, via):
        assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"),
                                                       ("core", "approval-required")]
    assert len(parked) == 2 and {a.listener for a in parked} == {"files.read"}
    assert len(fill_requests(server)) == 1  # the intent was filled, then parked


def ladder_script(replies: dict[str, str]) -> Callable[[Seen], str]:
    return lambda seen: replies[seen.json["model"]]


async def test_a_bad_filler_is_refused_then_the_next_model_then_huh() -> None:
    envelope = build_envelope("alice", new_uuid(), PAYLOADS["files.read"].encode(),
                              to="files.erase").decode()
    replies = {
        "cheap-1": PAYLOADS["mail.send"],  # a payload for another tool
        "middle-1": envelope,  # a payload addressed elsewhere
        "strong-1": f'<readfile xmlns="{NS}read-file"><file>x</file></readfile>',  # schema
    }
    async with organism(ladder_script(replies), "[cheap, middle, strong]") as (h, server):
        frames = await h.send("alice", intent("alice", "read the contents of main.rs"))
        journal = await journal_text(h)
    assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"), ("core", "huh")]
    assert b"no matching capability in your profile" in frames[-1]
    assert [s.json["model"] for s in fill_requests(server)] == ["cheap-1", "middle-1", "strong-1"]
    assert "mail.send alice" not in journal and "files.erase" not in journal
    record = json.loads(next(
        line for line in journal.splitlines() if line.startswith("intent-route")
    ).split(" ", 4)[4])
    assert [t["outcome"] for t in record["fill"]] == ["refused"] * 3


async def test_the_next_model_fills_when_the_first_fails_the_schema() -> None:
    replies = {"cheap-1": f'<readfile xmlns="{NS}read-file"/>',
               "strong-1": PAYLOADS["files.read"]}
    async with organism(ladder_script(replies)) as (h, server):
        frames = await h.send("alice", intent("alice", "read the contents of main.rs"))
    assert frame_kind(frames[-1])[:2] == ("files.read", "done")
    assert [s.json["model"] for s in fill_requests(server)] == ["cheap-1", "strong-1"]


async def test_only_the_ladders_models_see_the_intent_text() -> None:
    """`fill_models` says which models may read an intent's text: when the one on the
    ladder fails, the text is not failed over to another backend (it went to every
    backend of the router, and a ladder of N retried each rung on all N)."""
    def script(seen: Seen) -> Reply | str:
        if seen.json["model"] == "cheap-1":
            return Reply(status=503)
        return good_filler(seen)

    async with organism(script, "[cheap]") as (h, server):
        frames = await h.send("alice", intent("alice", "read the contents of main.rs"))
    assert b"no matching capability in your profile" in frames[-1]
    assert [s.json["model"] for s in fill_requests(server)] == ["cheap-1"]


def worker_script(intent_text: str) -> Callable[[Seen], str]:
    """The worker agent sends one intent, then answers with what came back; the
    filler fills correctly."""

    def script(seen: Seen) -> str:
        conversation = seen.conversation()
        if FILLER_MARK in conversation.system:
            return good_filler(seen)
        if not conversation.results:
            return f'<intent xmlns="{NS_CORE}"><text>{intent_text}</text></intent>'
        return "got: " + conversation.results[-1].content

    return script


async def test_an_agent_intent_is_routed_among_its_peers_and_answered() -> None:
    from tests.routing_fixtures import WorkerTask

    async with organism(worker_script("read the contents of main.rs")) as (h, _server):
        frames = await h.send("root", WorkerTask(text="look at main.rs"))
    assert frame_kind(frames[-1])[:2] == ("worker", "answer")
    assert b"files.read" in frames[-1] and b"main.rs" in frames[-1]


async def test_a_sub_thread_cannot_reach_by_intent_what_its_parent_could() -> None:
    """root's profile holds files.erase and root may reach it by intent; the worker
    it calls runs in a frame narrowed to its peers, so the same intent is refused."""
    from tests.routing_fixtures import WorkerTask

    async with organism(worker_script("wipe clean the temp files")) as (h, server):
        direct = await h.send("root", intent("root", "wipe clean the temp files"))
        frames = await h.send("root", WorkerTask(text="clean up"))
        journal = await journal_text(h)
    assert frame_kind(direct[-1])[:2] == ("files.erase", "done")
    assert frame_kind(frames[-1])[:2] == ("worker", "answer")
    assert b"no matching capability in your profile" in frames[-1]
    erased = [line for line in journal.splitlines() if "request/" in line and "files.erase" in line]
    assert len(erased) == 1  # root's own, never the worker's
    worker_calls = [s for s in server.requests if "You do tasks" in s.conversation().system]
    assert all("files.erase" not in s.body.decode() for s in worker_calls)


class StuckResolver:
    """A resolver that never finishes: the process "dies" while routing."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def resolve(self, *args: Any) -> Any:
        self.started.set()
        await asyncio.Event().wait()


async def test_an_accepted_intent_is_routed_after_a_restart(tmp_path: Path) -> None:
    """Accepted means durable: an intent journaled but never routed (the process
    stopped mid-way) is routed when the organism comes back."""
    async with FakeLLM("openai", good_filler) as server:
        config = load_config_text(organism_text(server), base_dir=TESTS)
        data = intent("alice", "read the contents of main.rs")
        thread = parse_envelope(data).thread
        stuck = StuckResolver()
        async with Harness(config, {"alice": "users"}, state_dir=tmp_path,
                           intents=stuck) as first:
            result = await first.pump.submit("alice", data)
            assert result.seq is not None
            await stuck.started.wait()
            assert first.kernel is not None
            await first.kernel.flush()
        platform = Platform.from_config(config)
        handlers = make_agent_handlers(config, platform)
        async with Harness(config, {"alice": "users"}, state_dir=tmp_path,
                           agent_handlers=handlers) as again:
            platform.bind_threads(again.pump.registry)
            await again.run_until_idle()
            frames = again.frames("alice", thread)
        await platform.aclose()
    assert frame_kind(frames[-1])[:2] == ("files.read", "done")
    assert len(fill_requests(server)) == 1


async def test_an_intent_is_bounded_in_time_and_in_slots() -> None:
    """A resolver that never answers (a blackholed embeddings endpoint): the intent
    is refused after handler_timeout_s, not held for ever; meanwhile at most a
    quarter of the pump's slots resolve intents (one more is `rate-limited` at once)
    and other traffic runs. One intent used to hold a slot for minutes, and two
    stalled a pump of two slots."""
    async with FakeLLM("openai", good_filler) as server:
        text = organism_text(server).replace(
            "pump: {max_hops: 20, handler_timeout_s: 20}",
            "pump: {max_hops: 20, handler_timeout_s: 0.5, max_concurrency: 4}")
        config = load_config_text(text, base_dir=TESTS)
        stuck = StuckResolver()
        async with Harness(config, {"alice": "users"}, intents=stuck) as h:
            first = intent("alice", "read the contents of main.rs")
            assert (await h.pump.submit("alice", first)).accepted
            await stuck.started.wait()
            second = await h.send("alice", intent("alice", "list the files in /tmp"))
            assert b"<code>rate-limited</code>" in second[-1]
            listed = await h.send("alice", build_envelope(
                "alice", new_uuid(), PAYLOADS["files.list"].encode()))
            assert frame_kind(listed[-1])[:2] == ("files.list", "done")
            await h.run_until_idle()  # the stuck intent ends at its timeout
            refused = h.frames("alice", parse_envelope(first).thread)
            assert b"no matching capability in your profile" in refused[-1]


# ---------------------------------------------------------------- the pure parts


def _routing() -> Routing:
    text = organism_text(FakeLLM("openai"))
    return Routing.build(load_config_text(text, base_dir=TESTS),
                         agent_handlers={"worker": lambda *a: None})


def test_permitted_is_the_table_intersected_with_the_peers() -> None:
    routing = _routing()
    admin = routing.profiles["admin"]
    worker = routing.listeners["worker"]
    assert {lst.name for lst in permitted(admin, None)} == set(routing.listeners)
    assert {lst.name for lst in permitted(admin, worker)} == {
        "files.read", "files.list", "mail.send"}
    users = routing.profiles["users"]
    assert {lst.name for lst in permitted(users, worker)} == {
        "files.read", "files.list", "mail.send"}


def test_select_takes_the_best_above_the_threshold_and_keeps_top_k() -> None:
    ranking = select(["a", "b", "c"], [0.1, 0.5, 0.4], threshold=0.3, top_k=2)
    assert ranking.entries == (("b", 0.5), ("c", 0.4)) and ranking.selected == "b"
    assert select(["a"], [0.29], threshold=0.3, top_k=5).selected is None
    assert select([], [], threshold=0.0, top_k=5).selected is None
    assert select(["a"], [0.0], threshold=0.0, top_k=5).selected is None  # nothing shared


@pytest.mark.parametrize(("reply", "ok"), [
    (PAYLOADS["files.read"], True),
    ("Sure! ```xml\n" + PAYLOADS["files.read"] + "\n```", True),
    ("<readfile><path>a</path></readfile>", True),  # namespace repaired
    (PAYLOADS["mail.send"], False),
    (PAYLOADS["files.read"] + PAYLOADS["files.read"], False),
    (f'<readfile xmlns="{NS}read-file"><path>a</path><x/></readfile>', False),
    ("I cannot do that.", False),
    (f'<intent xmlns="{NS_CORE}"><text>erase</text></intent>', False),
])
def test_read_fill_accepts_one_valid_payload_of_the_selected_listener(
    reply: str, ok: bool
) -> None:
    listener = _routing().listeners["files.read"]
    assert (read_fill(reply, listener).payload is not None) is ok


async def test_introspect_ranking_shows_only_permitted_listeners() -> None:
    routing = _routing()
    router = SemanticRouter(LexicalEmbedder(), lambda: None)
    ranking = await router.rank("wipe clean the temp files", routing.profiles["users"])
    assert "files.erase" not in {name for name, _ in ranking.entries}
    ranking = await router.rank("wipe clean the temp files", routing.profiles["admin"])
    assert ranking.selected == "files.erase"
    as_json: dict[str, Any] = ranking.as_json()
    assert set(as_json) == {"ranking", "selected"}


def test_eval_routes_prints_accuracy_and_abstain_rate_per_profile(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from agentd.cli import main

    config = tmp_path / "organism.yaml"
    config.write_text(organism_text(FakeLLM("openai")))  # never called: lexical, no fill
    labelled = tmp_path / "labelled.yaml"
    labelled.write_text(
        "- {profile: users, text: read the contents of main.rs, expect: files.read}\n"
        "- {profile: users, text: list the entries of the tmp directory, expect: files.list}\n"
        "- {profile: users, text: wipe clean the temp files, expect: null}\n"
        "- {profile: admin, text: wipe clean the temp files, expect: files.erase}\n"
        "- {profile: admin, text: send an email message to bob, expect: mail.send}\n"
        "- {profile: admin, text: zebra quokka, expect: files.read}\n"
    )
    result = CliRunner().invoke(main, ["eval-routes", "--config", str(config), "--json",
                                       str(labelled)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["users"] == {"items": 3, "top1_accuracy": 1.0, "top3_accuracy": 1.0,
                                "abstain_rate": 0.3333, "abstain_correct": 1.0}
    assert figures["admin"]["top1_accuracy"] == 0.6667
    assert figures["admin"]["abstain_rate"] == 0.3333
    text = CliRunner().invoke(main, ["eval-routes", "--config", str(config), "--misses",
                                     str(labelled)])
    assert "profile=users top1_accuracy=1.0" in text.output.replace("items=3 ", "")
    assert "miss: 'zebra quokka' expected=files.read got=-" in text.output
    labelled.write_text("- {profile: ghosts, text: x, expect: null}\n")
    refused = CliRunner().invoke(main, ["eval-routes", "--config", str(config), str(labelled)])
    assert refused.exit_code == 1 and "no profile named 'ghosts'" in refused.output


async def test_openai_embeddings_never_see_a_masked_description() -> None:
    from agentd.config import LlmBackendConfig
    from agentd.embeddings import OpenAIEmbedder

    def embed(text: str) -> list[float]:
        words = text.lower().split()
        return [1.0 + sum(w.startswith(p) for w in words) for p in ("read", "list", "mail")]

    routing = _routing()
    async with FakeLLM("openai", embed=embed) as server:
        backend = LlmBackendConfig(name="emb", provider="openai", base_url=server.base_url,
                                   model="chat")
        router = SemanticRouter(OpenAIEmbedder(backend, "embed-1"), lambda: None)
        try:
            ranking = await router.rank("wipe clean the temp files", routing.profiles["users"])
        finally:
            await router.aclose()
    assert server.requests and all(s.path == "/v1/embeddings" for s in server.requests)
    masked = ("Erases temporary files", "delete remove wipe clean temp files")
    for seen in server.requests:
        assert not any(text in seen.body.decode() for text in masked)
    assert "files.erase" not in {name for name, _ in ranking.entries}


async def test_concurrent_intents_embed_a_cold_candidate_set_once() -> None:
    """Twenty intents at once over a cold cache made twenty requests embedding the
    same descriptions; they wait for one now. A listener a reload retired leaves the
    candidates even of a warm ranker (its cache is per table, and a reload retires
    the removed listeners of the tables threads still hold)."""
    from agentd.config import LlmBackendConfig
    from agentd.embeddings import OpenAIEmbedder

    def embed(text: str) -> list[float]:
        words = text.lower().split()
        return [1.0 + sum(w.startswith(p) for w in words) for p in ("read", "list", "mail")]

    routing = _routing()
    users = routing.profiles["users"]
    async with FakeLLM("openai", embed=embed) as server:
        backend = LlmBackendConfig(name="emb", provider="openai", base_url=server.base_url,
                                   model="chat", max_concurrency=32)
        router = SemanticRouter(OpenAIEmbedder(backend, "embed-1"), lambda: None)
        try:
            await asyncio.gather(*(router.rank(f"read file {i}", users) for i in range(20)))
            documents = [s for s in server.requests if len(s.json["input"]) > 1]
            assert len(documents) == 1
            assert (await router.rank("send mail to bob", users)).selected == "mail.send"
            users.table.listeners["mail.send"].retired = True  # what a reload's swap does
            try:
                ranking = await router.rank("send mail to bob", users)
            finally:
                users.table.listeners["mail.send"].retired = False
        finally:
            await router.aclose()
    assert "mail.send" not in {name for name, _ in ranking.entries}
