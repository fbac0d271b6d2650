"""The `tool:` block of a listener: one of handler/agent/tool, the keys of each kind
checked with their locations, and a kind that cannot be built reported as a
configuration error at the block."""

from __future__ import annotations

import importlib
import json
import textwrap
from pathlib import Path

import pytest

from agentd._errors import ConfigError
from agentd.config import load_config_text
from agentd.tools import KINDS

TESTS_DIR = Path(__file__).resolve().parent
HEAD = f"organism: {{name: test}}\npython_path: [{json.dumps(str(TESTS_DIR))}]\nlisteners:\n"


def errors(text: str, base: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config_text(HEAD + textwrap.dedent(text), base_dir=base)
    return str(info.value)


def test_every_kind_in_the_contract_is_described_and_built() -> None:
    assert set(KINDS) == {"file-read", "file-write", "file-list", "exec", "http-fetch",
                          "wasm", "timer", "mcp"}
    for module in set(KINDS.values()):
        kind = importlib.import_module(module)
        assert callable(kind.describe) and callable(kind.handlers), module


def test_a_listener_with_a_tool_and_a_handler_is_refused(tmp_path: Path) -> None:
    text = errors("""\
      - name: files
        handler: fixtures_config:add
        description: x
        tool: {kind: file-read, root: .}
    """, tmp_path)
    assert "one of `handler`, `agent` or `tool`" in text


def test_a_tool_does_not_take_payload_classes_at_the_listener(tmp_path: Path) -> None:
    text = errors("""\
      - name: files
        payload_class: fixtures_config:Add
        tool: {kind: file-read, root: .}
    """, tmp_path)
    assert "payload_class" in text and "built in" in text


def test_an_unknown_tool_kind_is_an_error_with_its_line(tmp_path: Path) -> None:
    text = errors("""\
      - name: files
        tool: {kind: shell, root: .}
    """, tmp_path)
    assert ":5:" in text and "kind" in text


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ("{kind: file-read}", "root"),
        ("{kind: file-read, root: no-such-folder}", "not a folder"),
        ("{kind: file-read, root: ., max_bytes: 0}", "max_bytes"),
        ("{kind: exec, argv: []}", "argv"),
        ("{kind: exec, argv: [/bin/true], allow_args: {x: '('}}", "regular expression"),
        ("{kind: http-fetch, allow_hosts: ['*']}", "host name"),
        ("{kind: http-fetch, allow_hosts: ['*.::1']}", "host name"),
        ("{kind: http-fetch, allow_hosts: ['[::1']}", "host name"),
        ("{kind: http-fetch, allow_hosts: ['fe80::1%eth0']}", "zone"),
        ("{kind: http-fetch, allow_hosts: ['[10.0.0.1]']}", "host name"),
        ("{kind: http-fetch, allow_hosts: [a.example], allow_private: [nope]}", "CIDR"),
        ("{kind: http-fetch, allow_hosts: [a.example], allow_schemes: [ftp]}", "allow_schemes"),
        ("{kind: wasm, module: m.wasm, payload_class: fixtures_config:Add, sha256: zz}",
         "SHA-256"),
        ("{kind: file-read, root: ., shell: true}", "shell"),
    ],
)
def test_tool_keys_are_checked(tmp_path: Path, block: str, needle: str) -> None:
    text = errors(f"""\
      - name: t
        tool: {block}
    """, tmp_path)
    assert needle in text


TOOLS_AND_A_HANDLER = """\
  - name: files
    tool: {kind: file-read, root: .}
  - name: run
    tool: {kind: exec, argv: [/bin/true]}
  - name: add
    payload_class: fixtures_config:Add
    handler: fixtures_config:add
    description: adds
"""


def test_loading_yields_values_and_the_wiring_builds_the_handlers(tmp_path: Path) -> None:
    """A loaded configuration holds what a tool is (its classes, its description, its
    checked settings), never its handler: two loads of one file are equal values, and
    the routing binds a handler built from them."""
    from agentd._routing import Routing

    first, second = (load_config_text(HEAD + TOOLS_AND_A_HANDLER, base_dir=tmp_path)
                     for _ in range(2))
    for name in ("files", "run"):
        loaded = first.listener(name).loaded_tool
        assert first.listener(name).handler is None and loaded is not None
        assert loaded == second.listener(name).loaded_tool and loaded.name == name
    assert first.listener("add").loaded_tool is None
    routing = Routing.build(first)
    assert all(callable(routing.listeners[n].handler) for n in ("files", "run", "add"))


def test_a_reload_builds_each_tool_anew_and_keeps_what_did_not_change(tmp_path: Path) -> None:
    """A tool's handler is built on what its load found (an MCP server's pins): each
    routing a reload builds gives every tool listener a new one, the listeners of one
    block together; a handler listener whose declaration is unchanged is kept."""
    from agentd._routing import Routing

    before = Routing.build(load_config_text(HEAD + TOOLS_AND_A_HANDLER, base_dir=tmp_path))
    after = Routing.build(load_config_text(HEAD + TOOLS_AND_A_HANDLER, base_dir=tmp_path),
                          version=2, previous=before)
    assert after.listeners["add"] is before.listeners["add"]
    for name in ("files", "run"):
        assert after.listeners[name] is not before.listeners[name]
        assert after.listeners[name].handler is not before.listeners[name].handler
