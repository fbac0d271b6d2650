"""The published JSON Schema of `organism.yaml` (`agentd config-schema`).

Generated from `OrganismDocument`, so it cannot drift from what the loader
accepts; a copy is checked in at `docs/organism.schema.json` for editors.
"""

from __future__ import annotations

import json
from typing import Any

from agentd.config.organism import json_schema
from agentd.config.sections import OrganismDocument


def organism_schema() -> dict[str, Any]:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **json_schema(OrganismDocument),
    }
    schema["title"] = "agentd organism.yaml"
    return schema


def organism_schema_text() -> str:
    """The schema as the checked-in file holds it (stable key order, final newline)."""
    return json.dumps(organism_schema(), indent=2) + "\n"
