"""The built-in demo, shipped as package data so that an installed agentd (a wheel, a
container image) runs it exactly as a checkout does.

- `organism.yaml`: calculator, echo and relay tools, and `files`, a file-read tool
  over `samples/` (what `agentd demo` runs first);
- `agent-demo.yaml`: those tools plus `tutor`, an LLM agent whose model is a replay
  of `cassettes/agent-demo.jsonl`, its prompts in `prompts/`;
- `prompts/no_paperclippers.md`: the manifesto, which is also what the LLM platform
  puts first in any agent's prompt when the organism does not define its own.

`agentd init` copies these files into the home it writes (`home_files`), so the home
is self-contained: every path in it is relative to its own folder.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
ORGANISM = DEMO_DIR / "organism.yaml"
AGENT_ORGANISM = DEMO_DIR / "agent-demo.yaml"
MANIFESTO_FILE = DEMO_DIR / "prompts" / "no_paperclippers.md"

# The files an agent organism refers to, relative to DEMO_DIR; `agentd init` copies
# them into the home under the same relative paths.
AGENT_FILES = ("prompts/no_paperclippers.md", "cassettes/agent-demo.jsonl")
# The folder the `files` tool reads, copied likewise.
SAMPLE_FILES = ("samples/welcome.txt", "samples/haiku.txt")

__all__ = ["AGENT_FILES", "AGENT_ORGANISM", "DEMO_DIR", "MANIFESTO_FILE", "ORGANISM",
           "SAMPLE_FILES"]
