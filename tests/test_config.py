"""organism.yaml: parsed once into frozen dataclasses; every problem is reported, all
of them at once, each with its file:line:column and key path."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentd._errors import ConfigError
from agentd.config import (
    AgentConfig,
    ClientEntry,
    ListenerConfig,
    LlmBackendConfig,
    OrganismConfig,
    Retention,
    TlsConfig,
    check_config_main,
    load_config,
    load_config_text,
    read_clients_text,
)
from agentd.llm.tools import TOOL_NAME, ToolNameError, tool_name, tool_names

TESTS_DIR = Path(__file__).resolve().parent
SOURCE = "organism.yaml"
# Every small test config starts with these lines: a name, and tests/ on the import
# path so that `fixtures_config:Add` resolves.
HEAD = f"organism: {{name: test}}\npython_path: [{json.dumps(str(TESTS_DIR))}]\n"


def fixtures() -> Any:
    """The fixture module, as the loader imported it (call after a load)."""
    return importlib.import_module("fixtures_config")


def body(text: str) -> str:
    return HEAD + textwrap.dedent(text)


def listener(name: str, **fields: str) -> str:
    """One block-style entry of `listeners:`."""
    lines = [f"  - name: {name}"] + [f"    {key}: {value}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def handler_listener(name: str, **fields: str) -> str:
    base = {
        "payload_class": "fixtures_config:Add",
        "handler": "fixtures_config:add",
        "description": "Adds.",
    }
    return listener(name, **(base | fields))


def load(text: str, base_dir: Path) -> OrganismConfig:
    return load_config_text(text, base_dir=base_dir, source_name=SOURCE)


def issues_of(text: str, base_dir: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, base_dir)
    return info.value.issues


def at(text: str, needle: str, path: str, message: str, nth: int = 1) -> str:
    """The issue expected where the nth line holding `needle` has it (a line naming
    this checkout's tests folder, whose path may hold the needle, is never counted)."""
    here = json.dumps(str(TESTS_DIR))
    hits = [i for i, line in enumerate(text.splitlines(), 1)
            if needle in line and here not in line]
    line = hits[nth - 1]
    col = text.splitlines()[line - 1].index(needle) + 1
    return f"{SOURCE}:{line}:{col}: {path}: {message}"


FULL = """\
organism: {name: hello-world}
state_dir: var/state
python_path: [TESTS]
bus:
  host: 0.0.0.0
  port: 8443
  tls: {cert: tls/cert.pem, key: tls/key.pem}
  compression: yes
auth: {clients_file: clients.yaml, max_failures: 3}
oob: {authorized_keys: authorized_keys, allowed_uids: [1000, 1001]}
metrics: {listen: 127.0.0.1:9464}
pump: {max_concurrency: 128, handler_timeout_s: 12.5, max_hops: 32}
journal: {retention: {retain_days: 30}, synchronous: FULL}
profiles:
  public: {listeners: [calculator.add, greeter]}
  admin: {listeners: all, retention: prune_on_delivery, token_budget: 100000}
prompts:
  no_paperclippers: file:prompts/no_paperclippers.md
  greeter_base: "You are a friendly greeter. {tool_definitions}"
llm:
  strategy: failover
  backends:
    - name: local
      provider: openai
      base_url: http://127.0.0.1:11434/v1
      model: llama3
      api_key_env: OPENAI_API_KEY
    - {name: tape, provider: replay, cassette: cassettes/greeter.jsonl}
listeners:
  - name: calculator.add
    payload_class: fixtures_config:Add
    response_class: fixtures_config:Sum
    handler: fixtures_config:add
    description: Adds two integers.
  - name: greeter
    payload_class: fixtures_config:Greeting
    agent:
      prompt: "no_paperclippers & greeter_base"
      model: local
      max_iterations: 8
      max_tokens: 2048
    peers: [calculator.add]
  - name: relay
    payload_class: [fixtures_config:Relay, "fixtures_config:Box.Inner"]
    response_class: fixtures_config:Sum
    handler: fixtures_config:relay
    description: Asks the calculator and passes the answer back.
    peers: [calculator.add]
    timeout_s: 5
meta: {allow_list_capabilities: true}
""".replace("TESTS", json.dumps(str(TESTS_DIR)))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "no_paperclippers.md").write_text("Never make paperclips.\n")
    (tmp_path / "organism.yaml").write_text(FULL)
    return tmp_path


# ------------------------------------------------------------------------ valid files


def test_full_configuration_loads_into_dataclasses(home: Path) -> None:
    config = load_config(home / "organism.yaml")
    fx = fixtures()  # importable now: the config's python_path put tests/ on sys.path

    assert config.name == "hello-world"
    assert config.source == home / "organism.yaml"
    assert config.base_dir == home
    assert config.digest == hashlib.sha256((home / "organism.yaml").read_bytes()).hexdigest()
    assert config.state_dir == home / "var" / "state"
    assert config.bus.host == "0.0.0.0"
    assert config.bus.port == 8443
    assert config.bus.tls == TlsConfig(home / "tls/cert.pem", home / "tls/key.pem")
    assert config.bus.compression is True
    assert config.bus.max_envelope_bytes == 262144
    assert config.auth.clients_file == home / "clients.yaml"
    assert config.auth.max_failures == 3
    assert config.auth.session_ttl_s == 28800
    assert config.oob.authorized_keys == home / "authorized_keys"
    assert config.oob.socket == home / "var" / "state" / "oob.sock"
    assert config.oob.allowed_uids == (1000, 1001)
    assert config.metrics.listen == "127.0.0.1:9464"
    assert config.metrics.host_port == ("127.0.0.1", 9464)
    assert (config.pump.max_concurrency, config.pump.handler_timeout_s) == (128, 12.5)
    assert config.pump.max_hops == 32
    assert config.pump.per_listener_concurrency == 64
    assert config.journal.retention == Retention("retain_days", 30)
    assert config.journal.synchronous == "FULL"
    assert list(config.profiles) == ["public", "admin"]
    assert config.profiles["public"].listeners == ("calculator.add", "greeter")
    assert config.profiles["admin"].listeners == "all"
    assert config.profiles["admin"].retention == Retention("prune_on_delivery")
    assert config.profiles["admin"].token_budget == 100000
    assert [p.name for p in config.profiles.values()] == ["public", "admin"]
    assert config.prompts["no_paperclippers"] == "Never make paperclips.\n"
    assert config.prompts["greeter_base"] == "You are a friendly greeter. {tool_definitions}"
    assert config.llm is not None
    assert config.llm.strategy == "failover"
    assert config.llm.backends[0] == LlmBackendConfig(
        name="local",
        provider="openai",
        base_url="http://127.0.0.1:11434/v1",
        model="llama3",
        api_key_env="OPENAI_API_KEY",
    )
    assert config.llm.backend("tape").cassette == home / "cassettes/greeter.jsonl"
    assert config.meta.allow_list_capabilities is True
    assert config.meta.allow_schema_requests is False

    add, greeter, relay = config.listeners
    assert isinstance(add, ListenerConfig)
    assert add.payload_classes == (fx.Add,)
    assert add.response_classes == (fx.Sum,)
    assert add.handler is fx.add
    assert add.agent is None
    assert add.description == "Adds two integers."
    assert add.handler_ref == "fixtures_config:add"
    assert add.payload_refs == ("fixtures_config:Add",)
    line = FULL.splitlines().index("  - name: calculator.add") + 1
    assert add.location == f"{home / 'organism.yaml'}:{line}:5"
    assert greeter.handler is None
    assert greeter.agent == AgentConfig(
        prompt="no_paperclippers & greeter_base", model="local", max_iterations=8, max_tokens=2048
    )
    assert greeter.agent.prompt_names == ("no_paperclippers", "greeter_base")
    assert greeter.peers == ("calculator.add",)
    assert greeter.description == "Greets someone by name."  # from the payload's docstring
    assert relay.payload_classes == (fx.Relay, fx.Box.Inner)
    assert relay.timeout_s == 5.0
    assert relay.max_concurrency is None
    assert config.listener("relay") is relay
    with pytest.raises(KeyError):
        config.listener("nobody")


def test_defaults_apply_when_sections_are_absent(tmp_path: Path) -> None:
    config = load("organism: {name: tiny}\n", tmp_path)
    assert config.state_dir == tmp_path / "state"
    assert config.oob.socket == tmp_path / "state" / "oob.sock"
    assert config.bus.port == 8765 and config.bus.tls is None
    assert config.auth.clients_file is None
    assert config.metrics.listen is None
    assert config.journal.retention == Retention("retain_forever")
    assert config.llm is None
    assert config.listeners == ()
    assert dict(config.profiles) == {}
    assert config.source is None


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
def test_a_configuration_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Whoever can write organism.yaml chooses the code the daemon runs (python_path,
    handlers): refused like an authorized_keys file of the same mode (it loaded, and
    an added handler module was imported as root)."""
    path = tmp_path / "organism.yaml"
    path.write_text("organism: {name: tiny}\n")
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "writable by group or others" in info.value.issues[0]
    path.chmod(0o644)
    assert load_config(path).name == "tiny"


def test_state_dir_override_wins(home: Path) -> None:
    config = load_config(home / "organism.yaml", state_dir_override=home / "elsewhere")
    assert config.state_dir == home / "elsewhere"
    assert config.oob.socket == home / "elsewhere" / "oob.sock"


def test_file_prompt_is_read_relative_to_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "base.md").write_text("Be kind.")
    config = load("organism: {name: t}\nprompts: {base: file:p/base.md}\n", tmp_path)
    assert config.prompts["base"] == "Be kind."


def test_the_dataclasses_are_frozen(home: Path) -> None:
    config = load_config(home / "organism.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bus.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.listeners[0].handler = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.profiles["x"] = config.profiles["public"]  # type: ignore[index]
    with pytest.raises(TypeError):
        config.prompts["x"] = "y"  # type: ignore[index]
    assert isinstance(config.listeners, tuple)
    hash(config)  # immutable all the way down


def test_the_same_text_loads_to_equal_configs(home: Path) -> None:
    assert load_config(home / "organism.yaml") == load_config(home / "organism.yaml")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("retain_forever", Retention("retain_forever")),
        ("prune_on_delivery", Retention("prune_on_delivery")),
        ("{retain_days: 7}", Retention("retain_days", 7)),
    ],
)
def test_retention_forms(tmp_path: Path, value: str, expected: Retention) -> None:
    config = load(f"organism: {{name: t}}\njournal: {{retention: {value}}}\n", tmp_path)
    assert config.journal.retention == expected


def test_handler_may_be_an_instance_with_async_call(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("a", handler="fixtures_config:async_instance"))
    assert load(text, tmp_path).listeners[0].handler is fixtures().async_instance


def test_agent_description_defaults_to_the_payload_docstring(tmp_path: Path) -> None:
    text = body(
        "llm: {backends: [{name: local, provider: openai, model: m}]}\n"
        "prompts: {base: hi}\n"
        "listeners:\n"
        + listener(
            "g", payload_class="fixtures_config:Greeting", agent="{prompt: base, model: local}"
        )
    )
    assert load(text, tmp_path).listeners[0].description == "Greets someone by name."


# ------------------------------------------------------------------- structural errors


def test_unknown_key_is_reported_with_its_location(tmp_path: Path) -> None:
    text = body("colour: blue\n")
    [issue] = issues_of(text, tmp_path)
    assert issue.startswith(at(text, "colour", "colour", "unknown key; expected one of: organism,"))


def test_unknown_nested_key_is_reported_with_its_key_path(tmp_path: Path) -> None:
    text = body(
        "bus: {port: 1, tls: {cert: c, key: k, pasword: x}}\n"
        "listeners:\n"
        + handler_listener("a")
        + listener(
            "b", payload_class="fixtures_config:Add", handlr="fixtures_config:add", description="d"
        )
    )
    issues = issues_of(text, tmp_path)
    assert issues[0].startswith(at(text, "pasword", "bus.tls.pasword", "unknown key"))
    # in file order: having lost its handler, listener b has neither handler nor agent
    assert issues[1] == at(
        text, "name: b", "listeners[1]", "a listener needs a `handler`, an `agent` or a `tool`"
    )
    assert issues[2].startswith(at(text, "handlr", "listeners[1].handlr", "unknown key"))


def test_duplicate_key_in_a_mapping_is_an_error(tmp_path: Path) -> None:
    text = body("pump:\n  max_hops: 3\n  max_hops: 4\n")
    assert issues_of(text, tmp_path) == [
        at(text, "max_hops: 4", "pump.max_hops", "duplicate key (first given on line 4)")
    ]


def test_invalid_yaml_is_reported_with_its_location(tmp_path: Path) -> None:
    [issue] = issues_of("organism: {name: t}\nbus:\n  port: [1\n", tmp_path)
    assert issue.startswith(f"{SOURCE}:4:1: (root): invalid YAML: ")


def test_yaml_anchors_and_aliases_are_refused(tmp_path: Path) -> None:
    text = "organism: &o {name: t}\nbus: *o\n"
    assert issues_of(text, tmp_path) == [
        f"{SOURCE}:1:11: (root): anchors (&o) are not allowed",
        f"{SOURCE}:2:6: (root): aliases (*o) are not allowed",
    ]


def test_yaml_tags_beyond_plain_data_are_refused(tmp_path: Path) -> None:
    text = "organism: {name: !!python/name:os.system x}\nbus: !custom {}\n"
    assert issues_of(text, tmp_path) == [
        f"{SOURCE}:1:18: (root): YAML tag 'tag:yaml.org,2002:python/name:os.system' is not "
        "allowed (plain data only)",
        f"{SOURCE}:2:6: (root): YAML tag '!custom' is not allowed (plain data only)",
    ]


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    assert issues_of("# nothing\n", tmp_path) == [
        f"{SOURCE}:1:1: (root): the configuration is empty"
    ]


def test_organism_name_is_required(tmp_path: Path) -> None:
    assert issues_of("bus: {port: 1}\n", tmp_path) == [
        f"{SOURCE}:1:1: organism.name: required key is missing"
    ]


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    [issue] = info.value.issues
    assert issue.startswith(f"{tmp_path / 'absent.yaml'}:1:1: (file): cannot read")


# ------------------------------------------------------------------------ type checks


def test_string_where_a_number_is_required_is_rejected(tmp_path: Path) -> None:
    text = body(
        """\
        bus:
          port: "8765"
          compression: "yes"
          rate_per_s: fast
        pump: {max_hops: 2.5}
        """
    )
    assert issues_of(text, tmp_path) == [
        at(text, '"8765"', "bus.port", "expected an integer, got a string"),
        at(text, '"yes"', "bus.compression", "expected true or false, got a string"),
        at(text, "fast", "bus.rate_per_s", "expected a number, got a string"),
        at(text, "2.5", "pump.max_hops", "expected an integer, got a number"),
    ]


def test_number_where_a_string_is_required_is_rejected(tmp_path: Path) -> None:
    text = "organism: {name: 42}\n"
    assert issues_of(text, tmp_path) == [
        f"{SOURCE}:1:18: organism.name: expected a string, got an integer "
        "(quote it to make it a string)"
    ]


def test_values_out_of_range_are_rejected(tmp_path: Path) -> None:
    text = body(
        """\
        bus: {port: 70000}
        pump: {max_concurrency: 0, handler_timeout_s: -1}
        oob: {allowed_uids: [-3]}
        """
    )
    assert issues_of(text, tmp_path) == [
        at(text, "70000", "bus.port", "must be between 0 and 65535"),
        at(text, "0,", "pump.max_concurrency", "must be at least 1"),
        at(text, "-1", "pump.handler_timeout_s", "must be greater than 0"),
        at(text, "-3", "oob.allowed_uids[0]", "must be at least 0"),
    ]


def test_durations_are_at_most_ten_years(tmp_path: Path) -> None:
    """"Never" written as a huge number put deadlines past the year 9999: admission
    of a gated message raised, `introspect timers` and `approvals` failed."""
    text = body(
        """        pump: {thread_idle_s: 1.0e+12}
        listeners:
          - {name: wait, description: Waits., tool: {kind: timer, max_delay_s: 1.0e+12}}
        """
    )
    assert issues_of(text, tmp_path) == [
        at(text, "1.0e+12}", "pump.thread_idle_s", "must be at most 315576000.0"),
        at(text, "{kind: timer", "listeners[0].tool.timer.max_delay_s",
           "must be at most 315576000.0"),
    ]


def test_metrics_listen_must_be_host_and_port(tmp_path: Path) -> None:
    text = body("metrics: {listen: localhost}\n")
    [issue] = issues_of(text, tmp_path)
    assert issue.startswith(at(text, "localhost", "metrics.listen", "expected host:port"))
    ok = load(body("metrics: {listen: '[::1]:9464'}\n"), tmp_path)
    assert ok.metrics.host_port == ("::1", 9464)


def test_bad_retention_is_rejected(tmp_path: Path) -> None:
    text = body(
        """\
        journal: {retention: retain_days}
        profiles:
          p: {listeners: all, retention: {retain_days: 0}}
        """
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "retain_days}",
            "journal.retention",
            "expected retain_forever, prune_on_delivery or {retain_days: N}; got 'retain_days'",
        ),
        at(text, "0}", "profiles.p.retention.retain_days", "must be at least 1"),
    ]


# --------------------------------------------------------------------------- listeners


def test_duplicate_listener_names_are_reported(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("calculator.add") * 2)
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "calculator.add",
            "listeners[1].name",
            "duplicate listener name 'calculator.add' (also listeners[0], line 4)",
            nth=2,
        )
    ]


def test_invalid_and_reserved_listener_names_are_rejected(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener('"-x"') + handler_listener("core"))
    issues = issues_of(text, tmp_path)
    assert issues[0].startswith(at(text, '"-x"', "listeners[0].name", "invalid name '-x'"))
    assert issues[1] == at(text, "core", "listeners[1].name", "'core' is reserved for the platform")


def test_sync_handler_is_rejected(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("a", handler="fixtures_config:sync_handler"))
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "fixtures_config:sync",
            "listeners[0].handler",
            "fixtures_config:sync_handler must be an `async def` function (it is synchronous)",
        )
    ]


def test_missing_module_is_reported(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("a", payload_class="no_such_mod.sub:Add"))
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "no_such_mod",
            "listeners[0].payload_class",
            "no module named 'no_such_mod' "
            "(is the folder that holds it listed in `python_path`?)",
        )
    ]


def test_bad_attribute_is_reported(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("a", handler="fixtures_config:nope"))
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "fixtures_config:nope",
            "listeners[0].handler",
            "'fixtures_config' has no attribute 'nope'",
        )
    ]


def test_malformed_reference_and_non_callable_handler_are_reported(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + handler_listener(
            "a", payload_class="fixtures_config.Add", handler="fixtures_config:NOT_CALLABLE"
        )
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "fixtures_config.Add",
            "listeners[0].payload_class",
            "expected module:attribute, got 'fixtures_config.Add'",
        ),
        at(
            text,
            "fixtures_config:NOT",
            "listeners[0].handler",
            "fixtures_config:NOT_CALLABLE is not callable",
        ),
    ]


def test_module_that_fails_to_import_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "broken_listener_mod.py").write_text("raise RuntimeError('boom')\n")
    text = (
        "organism: {name: t}\n"
        f'python_path: [".", {json.dumps(str(TESTS_DIR))}]\n'
        "listeners:\n" + handler_listener("a", payload_class="broken_listener_mod:X")
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "broken_listener_mod",
            "listeners[0].payload_class",
            "importing 'broken_listener_mod' failed: RuntimeError: boom",
        )
    ]


def test_payload_class_must_be_an_xmlify_dataclass(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + handler_listener("a", payload_class="[fixtures_config:Add, fixtures_config:NotXml]")
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "fixtures_config:NotXml",
            "listeners[0].payload_class[1]",
            "fixtures_config:NotXml is not an @xmlify dataclass",
        )
    ]


def test_listener_has_exactly_one_of_handler_or_agent(tmp_path: Path) -> None:
    text = body(
        """\
        llm: {backends: [{name: local, provider: openai, model: m}]}
        prompts: {p: hi}
        listeners:
          - name: both
            payload_class: fixtures_config:Add
            handler: fixtures_config:add
            agent: {prompt: p, model: local}
          - name: neither
            payload_class: fixtures_config:Relay
            description: d
        """
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "{prompt: p",
            "listeners[0].agent",
            "a listener has one of `handler`, `agent` or `tool`, not several",
        ),
        at(text, "name: neither", "listeners[1]",
           "a listener needs a `handler`, an `agent` or a `tool`"),
    ]


def test_handler_listener_needs_a_description(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + listener("a", payload_class="fixtures_config:Add", handler="fixtures_config:add")
    )
    assert issues_of(text, tmp_path) == [
        at(text, "name: a", "listeners[0].description", "required key is missing")
    ]


def test_peers_naming_an_unknown_listener_are_reported(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + handler_listener("calculator.add")
        + handler_listener("b", peers="[calculator.add, calculator.mul]")
    )
    assert issues_of(text, tmp_path) == [
        at(text, "calculator.mul", "listeners[1].peers[1]", "no listener is named 'calculator.mul'")
    ]


def test_profile_naming_an_unknown_listener_is_reported(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + handler_listener("calculator.add")
        + "profiles:\n  public: {listeners: [calculator.add, ghost]}\n"
    )
    assert issues_of(text, tmp_path) == [
        at(text, "ghost", "profiles.public.listeners[1]", "no listener is named 'ghost'")
    ]


def test_two_classes_with_one_root_are_refused(tmp_path: Path) -> None:
    text = body(
        "listeners:\n"
        + handler_listener("a", payload_class="fixtures_config:Greeting")
        + handler_listener("b", payload_class="fixtures_config:OtherGreeting")
    )
    [issue] = issues_of(text, tmp_path)
    assert issue.startswith(
        at(
            text,
            "fixtures_config:OtherGreeting",
            "listeners[1].payload_class",
            "fixtures_config:OtherGreeting has the same root",
        )
    )


# ------------------------------------------------------------------------------ agents

AGENT_HEAD = """\
llm: {backends: [{name: local, provider: openai, model: llama3}]}
prompts: {base: "You are kind.", rules: "No paperclips."}
listeners:
"""


def agent_listener(name: str, agent: str, payload: str = "fixtures_config:Greeting") -> str:
    return listener(name, payload_class=payload, agent=agent)


def test_agent_sharing_a_payload_key_is_rejected(tmp_path: Path) -> None:
    text = body(
        AGENT_HEAD
        + handler_listener("calculator.add")
        + agent_listener("adder", "{prompt: base, model: local}", payload="fixtures_config:Add")
    )
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "fixtures_config:Add",
            "listeners[1].payload_class",
            "an LLM agent needs a payload root of its own; "
            "{https://example.org/ns/config-tests/calculator/add/v1}add is also the payload "
            "of 'calculator.add'",
            nth=2,
        )
    ]


def test_handlers_may_share_a_payload_key(tmp_path: Path) -> None:
    text = body("listeners:\n" + handler_listener("calculator.add") + handler_listener("audit"))
    assert [lst.name for lst in load(text, tmp_path).listeners] == ["calculator.add", "audit"]


def test_agent_model_must_name_a_backend(tmp_path: Path) -> None:
    text = body(AGENT_HEAD + agent_listener("g", "{prompt: base, model: gpt9}"))
    assert issues_of(text, tmp_path) == [
        at(text, "gpt9", "listeners[0].agent.model", "no backend named 'gpt9' in llm.backends")
    ]


def test_agent_without_llm_section_is_an_error(tmp_path: Path) -> None:
    text = body(
        "prompts: {base: hi}\nlisteners:\n" + agent_listener("g", "{prompt: base, model: local}")
    )
    assert issues_of(text, tmp_path) == [
        at(text, "local}", "listeners[0].agent.model", "an agent needs an `llm` section")
    ]


def test_agent_prompt_names_must_exist(tmp_path: Path) -> None:
    text = body(AGENT_HEAD + agent_listener("g", '{prompt: "base & rulez", model: local}'))
    assert issues_of(text, tmp_path) == [
        at(
            text,
            '"base & rulez"',
            "listeners[0].agent.prompt",
            "no prompt named 'rulez' in prompts",
        )
    ]


def test_agent_may_not_declare_a_response_class(tmp_path: Path) -> None:
    text = body(
        AGENT_HEAD
        + agent_listener("g", "{prompt: base, model: local}")
        + "    response_class: fixtures_config:Sum\n"
    )
    [issue] = issues_of(text, tmp_path)
    assert issue.startswith(
        at(text, "fixtures_config:Sum", "listeners[0].response_class", "an agent")
    )


def test_prompt_file_missing_is_reported(tmp_path: Path) -> None:
    text = body(
        "llm: {backends: [{name: local, provider: openai, model: m}]}\n"
        "prompts: {base: file:prompts/absent.md}\n"
        "listeners:\n" + agent_listener("g", "{prompt: base, model: local}")
    )
    # reported once, at the prompt; the agent that uses it is not blamed again
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "file:prompts",
            "prompts.base",
            f"prompt file not found: {tmp_path / 'prompts/absent.md'}",
        )
    ]


def test_an_issue_echoing_a_newline_stays_one_line(tmp_path: Path) -> None:
    # Found by the mutation test below: a path with a newline in a prompt's value
    # made an issue of two lines (the second one forged by the file's author).
    text = body(
        "llm: {backends: [{name: local, provider: openai, model: m}]}\n"
        'prompts: {base: "file:absent.md\\nx.yaml:1:1: bus: forged"}\n'
        "listeners:\n" + agent_listener("g", "{prompt: base, model: local}")
    )
    (issue,) = issues_of(text, tmp_path)
    assert "\n" not in issue and ISSUE_LINE.fullmatch(issue)
    assert issue.endswith(f"prompt file not found: {tmp_path}/absent.md\\nx.yaml:1:1: bus: forged")


def test_llm_backend_checks(tmp_path: Path) -> None:
    text = body(
        """\
        llm:
          strategy: random
          backends:
            - {name: a, provider: openai}
            - {name: a, provider: replay, cassette: c.jsonl}
            - {name: b, provider: replay}
            - {name: c, provider: magic, model: m}
        """
    )
    assert issues_of(text, tmp_path) == [
        at(text, "random", "llm.strategy", "expected one of failover, round-robin; got 'random'"),
        at(
            text,
            "{name: a, provider: openai",
            "llm.backends[0].model",
            "required for provider openai",
        ),
        at(
            text, "{name: a, provider: replay", "llm.backends[1].name", "duplicate backend name 'a'"
        ),
        at(text, "{name: b", "llm.backends[2].cassette", "required for provider replay"),
        at(
            text,
            "magic",
            "llm.backends[3].provider",
            "expected one of openai, anthropic, replay; got 'magic'",
        ),
    ]


# ----------------------------------------------------------------------- many at once


def test_several_errors_are_all_reported_in_file_order(tmp_path: Path) -> None:
    text = body(
        "bus: {port: eighty}\n"
        "wobble: 1\n"
        "listeners:\n"
        + handler_listener("a", handler="fixtures_config:sync_handler")
        + handler_listener("b", payload_class="nowhere:X", peers="[zed]")
        + "profiles: {p: {listeners: [a, q]}}\n"
    )
    issues = issues_of(text, tmp_path)
    assert [issue.split(": ")[1] for issue in issues] == [
        "bus.port",
        "wobble",
        "listeners[0].handler",
        "listeners[1].payload_class",
        "listeners[1].peers[0]",
        "profiles.p.listeners[1]",
    ]
    assert [int(issue.split(":")[1]) for issue in issues] == [3, 4, 8, 11, 14, 15]


# -------------------------------------------------------------------------------- CLI


def test_check_config_main_prints_a_summary(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_config_main(home / "organism.yaml") == 0
    assert capsys.readouterr().out == "ok: hello-world, 3 listeners, 2 profiles\n"


def test_check_config_main_prints_every_issue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "organism.yaml"
    config.write_text("organism: {name: t}\nbus: {port: x}\npump: {nope: 1}\n")
    assert check_config_main(config) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in err] == ["bus.port", "pump.nope"]
    assert err[0].startswith(f"{config}:2:13: ")


# ---------------------------------------------------------------------------- property

ISSUE_LINE = re.compile(r"[^\n]+:\d+:\d+: [^\n]+: [^\n]+")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, len(FULL) - 1),
            st.sampled_from(["", ":", "-", "{", "x", "\n  ", "&a ", "*a", '"', "0"]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_mutated_file_loads_or_fails_with_located_issues(
    edits: list[tuple[int, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    text = FULL
    for position, replacement in edits:
        position = min(position, len(text) - 1)
        text = text[:position] + replacement + text[position + 1 :]
    base_dir = tmp_path_factory.getbasetemp() / "fuzz-home"
    if not base_dir.exists():
        (base_dir / "prompts").mkdir(parents=True)
        (base_dir / "prompts" / "no_paperclippers.md").write_text("Never.")
    try:
        load(text, base_dir)
    except ConfigError as exc:
        assert exc.issues
        for issue in exc.issues:
            assert ISSUE_LINE.fullmatch(issue), issue


def test_deep_nesting_is_refused_before_it_is_composed(tmp_path: Path) -> None:
    text = "organism: {name: t}\nbus: " + "[" * 50_000 + "]" * 50_000 + "\n"
    assert issues_of(text, tmp_path) == [f"{SOURCE}:2:37: (root): nested more than 32 levels deep"]


def test_python_path_folders_come_first_on_sys_path_in_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = load("organism: {name: t}\npython_path: [a, b]\n", tmp_path)
    assert config.python_path == (tmp_path / "a", tmp_path / "b")
    assert sys.path[:2] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_null_sections_and_lists_read_as_empty(tmp_path: Path) -> None:
    config = load("organism: {name: t}\nbus:\npump:\nlisteners:\nprofiles:\n", tmp_path)
    assert config.bus.port == 8765 and config.pump.max_hops == 64
    assert config.listeners == () and dict(config.profiles) == {}
    text = "organism: {name: t}\nbus: {port: null}\n"
    assert issues_of(text, tmp_path) == [
        at(text, "null", "bus.port", "expected an integer, got null")
    ]


def test_a_python_path_folder_that_does_not_exist_is_reported(tmp_path: Path) -> None:
    text = "organism: {name: t}\npython_path: [nowhere]\n"
    assert issues_of(text, tmp_path) == [
        at(text, "nowhere", "python_path[0]", f"not a folder: {tmp_path / 'nowhere'}")
    ]


# ------------------------------------------------------------------- the clients file


def test_clients_file_reads_into_entries_with_normalised_secrets() -> None:
    text = "clients:\n  alice: {totp_secret: 'jbsw y3dp ehpk 3pxp', profile: public}\n"
    assert read_clients_text(text, "clients.yaml") == {
        "alice": ClientEntry("alice", "JBSWY3DPEHPK3PXP", "public")
    }


def test_clients_file_problems_are_all_reported_with_locations() -> None:
    text = textwrap.dedent(
        """\
        clients:
          alice: {totp_secret: JBSWY3DP, profile: public}
          core: {totp_secret: JBSWY3DPEHPK3PXP, profile: admin}
          bob: {totp_secret: JBSWY3DPEHPK3PXP, colour: red}
        """
    )
    with pytest.raises(ConfigError) as info:
        read_clients_text(text, SOURCE)
    assert info.value.issues == [
        at(text, "JBSWY3DP,", "clients.alice.totp_secret",
           "shorter than 80 bits (16 base32 characters)"),
        at(text, "core", "clients.core", "`core` is reserved for agentd itself"),
        at(text, "{totp_secret: JBSWY3DPEHPK3PXP, colour", "clients.bob.profile",
           "required key is missing"),
        at(text, "colour", "clients.bob.colour",
           "unknown key; expected one of: totp_secret, profile"),
    ]


def test_a_profile_is_named_by_its_key_only(tmp_path: Path) -> None:
    text = "organism: {name: t}\nprofiles:\n  public: {listeners: all, name: admin}\n"
    [issue] = issues_of(text, tmp_path)
    assert issue == at(
        text,
        "name: admin",
        "profiles.public.name",
        "unknown key; expected one of: listeners, retention, synchronous, token_budget, "
        "isolation, allow_intents, stream, routing, approval",
    )


def test_an_invalid_profile_name_is_reported_at_the_key(tmp_path: Path) -> None:
    text = "organism: {name: t}\nprofiles:\n  'bad name': {listeners: all}\n"
    assert issues_of(text, tmp_path) == [
        at(
            text,
            "'bad name'",
            "profiles['bad name']",
            "invalid profile name 'bad name': use letters, digits, '_', '.', '-'",
        )
    ]


# ------------------------------------------------------- native tool calling: tool names


def test_tool_names_map_dots_and_colons_reversibly_within_an_agent() -> None:
    table = tool_names(["calculator.add", "hub:search", "echo", "a-b_c"])
    assert table == {"calculator__add": "calculator.add", "hub--search": "hub:search",
                     "echo": "echo", "a-b_c": "a-b_c"}
    assert all(TOOL_NAME.fullmatch(name) for name in table)


def test_a_name_with_another_character_has_no_tool_name() -> None:
    with pytest.raises(ToolNameError, match=r"'a/b'.*letters, digits"):
        tool_name("a/b")


def two_peer_agent(peers: str, tool_calling: str = "") -> str:
    calling = f", tool_calling: {tool_calling}" if tool_calling else ""
    return (AGENT_HEAD + handler_listener("a.b") + handler_listener("a__b")
            + handler_listener("x" * 65)
            + agent_listener("g", f"{{prompt: base, model: local{calling}}}")
            + f"    peers: {peers}\n")


def test_two_peers_mapping_to_one_tool_name_are_refused_at_load(tmp_path: Path) -> None:
    text = body(two_peer_agent("[a.b, a__b]"))
    [issue] = issues_of(text, tmp_path)
    assert "listeners[3].peers" in issue
    assert "'a.b' and 'a__b' both map to the provider tool name 'a__b'" in issue


def test_a_peer_longer_than_64_characters_once_mapped_is_refused(tmp_path: Path) -> None:
    text = body(two_peer_agent(f"[{'x' * 65}]", "native"))
    [issue] = issues_of(text, tmp_path)
    assert f"listener {'x' * 65!r} cannot be a provider tool" in issue
    assert "at most 64" in issue


def test_xml_tool_calling_lifts_the_tool_name_rules(tmp_path: Path) -> None:
    text = body(two_peer_agent(f"[a.b, a__b, {'x' * 65}]", "xml"))
    agent = load(text, tmp_path).listeners[3].agent
    assert agent is not None and agent.tool_calling == "xml"


def test_tool_calling_defaults_to_auto_and_refuses_other_values(tmp_path: Path) -> None:
    text = body(AGENT_HEAD + agent_listener("g", "{prompt: base, model: local}"))
    agent = load(text, tmp_path).listeners[0].agent
    assert agent is not None and agent.tool_calling == "auto"
    bad = body(AGENT_HEAD + agent_listener("g", "{prompt: base, model: local, tool_calling: "
                                                "json}"))
    [issue] = issues_of(bad, tmp_path)
    assert "listeners[0].agent.tool_calling" in issue


def test_stream_is_for_agent_listeners(tmp_path: Path) -> None:
    text = body("profiles:\n  public: {listeners: [calc], stream: true}\nlisteners:\n"
                ) + handler_listener("calc", stream="true")
    assert issues_of(text, tmp_path) == [
        at(text, "true", "listeners[0].stream",
           "stream is for agent listeners: their model's text as it is written", 2)]
