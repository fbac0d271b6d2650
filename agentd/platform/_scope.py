"""What an agent's task may touch, shared by the platform and the agent loop (which
an isolated agent's worker runs without the rest of the platform): only its own
threads, and answers of a bounded size."""

from __future__ import annotations

MAX_ANSWER_CHARS = 60_000  # core:text allows 65536


class IsolationError(Exception):
    """An agent asked about a thread that is not one of its own tasks."""
