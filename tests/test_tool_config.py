"""The `tool:` block of a listener: one of handler/agent/tool, the keys of each kind
checked with their locations, and a kind that cannot be built reported as a
configuration error at the block."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from agentd._errors import ConfigError
from agentd.config import load_config_text
from agentd.tools import BUILDERS

TESTS_DIR = Path(__file__).resolve().parent
HEAD = f"organism: {{name: test}}\npython_path: [{json.dumps(str(TESTS_DIR))}]\nlisteners:\n"


def errors(text: str, base: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config_text(HEAD + textwrap.dedent(text), base_dir=base)
    return str(info.value)


def test_every_kind_in_the_contract_has_a_builder() -> None:
    assert set(BUILDERS) == {"file-read", "file-write", "file-list", "exec", "http-fetch",
                             "wasm", "timer", "mcp"}


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
