"""The demo agent's task payload (`agentd/demo/agent-demo.yaml`): a question in words.

An LLM agent needs a payload root of its own (blind self-iteration routes by it),
so every agent declares its own task class; this is the demo's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from agentd import MaxLen, xmlify


@xmlify(namespace="https://xml-pipeline.org/ns/agents/math-tutor/v1")
@dataclass
class MathQuestion:
    """A question about arithmetic, answered with the calculator's help."""

    text: Annotated[str, MaxLen(2000), "the question, in words"]
