"""The published JSON Schema of organism.yaml: the checked-in copy is the one the
code generates, and every organism we ship validates against it.

Checked with `jsonschema`, a validator independent of pydantic, because that is
what an editor's YAML language server does with the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from agentd.cli import main
from agentd.config import load_config, organism_schema, organism_schema_text
from agentd.demo import ORGANISM

ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = ROOT / "docs" / "organism.schema.json"
SHIPPED = [
    *sorted((ROOT / "agentd" / "demo").glob("*.yaml")),
    *sorted((ROOT / "config").glob("*.yaml")),
    *sorted((ROOT / "tests" / "organisms").glob("*.yaml")),
]


def validator() -> Draft202012Validator:
    schema = json.loads(CHECKED_IN.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def errors(document: Any) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator().iter_errors(document)
    ]


def test_the_checked_in_schema_is_the_generated_one() -> None:
    assert CHECKED_IN.read_text() == organism_schema_text(), (
        "docs/organism.schema.json is stale: agentd config-schema > docs/organism.schema.json"
    )


def test_agentd_config_schema_prints_it() -> None:
    result = CliRunner().invoke(main, ["config-schema"])
    assert result.exit_code == 0
    assert json.loads(result.output) == organism_schema()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_organism_validates_against_the_schema(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    if "organism" not in document:
        pytest.skip("not an organism file")
    assert errors(document) == []


def test_the_shipped_organisms_are_found() -> None:
    assert {p.name for p in SHIPPED} >= {"organism.yaml", "agent-demo.yaml"}


def test_the_demo_organism_also_loads() -> None:
    # the schema and the loader agree on the shipped demo
    assert load_config(ORGANISM).name


def test_the_schema_refuses_what_the_loader_refuses() -> None:
    base: dict[str, Any] = {"organism": {"name": "t"}}
    assert errors(base) == []
    assert errors({**base, "colour": "blue"})
    assert errors({**base, "bus": {"port": "8765"}})
    assert errors({**base, "bus": {"port": 70000}})
    assert errors({**base, "journal": {"retention": "retain_days"}})
    assert errors({**base, "journal": {"retention": {"retain_days": 0}}})
    assert errors({**base, "profiles": {"p": {"listeners": "some"}}})
    assert errors({"bus": {}})  # organism is required
    assert errors({**base, "journal": {"retention": {"retain_days": 7}}}) == []
    assert errors({**base, "profiles": {"p": {"listeners": "all"}}}) == []


def test_every_listener_key_is_in_the_configuration_reference() -> None:
    """Each key a listener may have (`tool:` among them) is a row of the reference."""
    schema = json.loads(CHECKED_IN.read_text())
    keys = schema["$defs"]["ListenerSection"]["properties"]
    reference = (CHECKED_IN.parent / "configuration.md").read_text()
    chapter = reference.split("## `listeners`", 1)[1].split("\n## ", 1)[0]
    assert "tool" in keys
    assert [k for k in keys if f"\n| `{k}` |" not in chapter] == []
