"""Which agent's task each thread is: a thread belongs to the one agent that began a
task on it, and leaves the table when the agent ends the task or its frame ends
(then the agent's hooks hear of it). Bookkeeping only: what a task holds is
`Task`'s, what it means the platform's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from agentd.context import Segment
from agentd.platform._context import Fragment
from agentd.platform._scope import IsolationError
from agentd.platform._working import TaskContext

TaskEndHook = Callable[[str], None]  # called with the thread of a task that ended


@dataclass
class Task:
    """One agent's task on one thread: its protected facts, its task layer and its
    working memory."""

    agent: str
    protected: dict[str, str]  # facts of layers 1-4: nothing below may redefine them
    task: Fragment
    query: str  # what long-term memory is searched with
    context: TaskContext
    reported: set[tuple[str, str, str]] = field(default_factory=set)
    # Segments grown by results since the model's last call, written before its next.
    unsaved: dict[int, Segment] = field(default_factory=dict)
    # The journal seqs of the results a restored task's history holds: the message of
    # one of them, redelivered after the crash, is not recorded again.
    restored: frozenset[int] = frozenset()


class TaskTable:
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._owners: dict[str, str] = {}
        self._end_hooks: dict[str, list[TaskEndHook]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __contains__(self, thread: object) -> bool:
        return thread in self._tasks

    def __getitem__(self, thread: str) -> Task:
        return self._tasks[thread]

    def get(self, thread: str) -> Task | None:
        return self._tasks.get(thread)

    def own(self, agent: str, thread: str) -> Task:
        """`agent`'s task on `thread`; `IsolationError` if it has none there."""
        task = self._tasks.get(thread)
        if task is None or self._owners.get(thread) != agent:
            raise IsolationError(f"thread {thread} is not a task of {agent}")
        return task

    def claim(self, agent: str, thread: str) -> None:
        """Refuse `agent` a thread another agent's task holds."""
        owner = self._owners.get(thread)
        if owner is not None and owner != agent:
            raise IsolationError(f"thread {thread} belongs to another agent")

    def add(self, thread: str, task: Task) -> None:
        self._owners[thread] = task.agent
        self._tasks[thread] = task

    def remove(self, thread: str) -> str | None:
        """Drop the task on `thread`; its agent, or None if there was none."""
        agent = self._owners.pop(thread, None)
        if agent is not None:
            del self._tasks[thread]
        return agent

    def on_end(self, agent: str, hook: TaskEndHook) -> None:
        self._end_hooks.setdefault(agent, []).append(hook)

    def ended(self, agent: str, thread: str) -> None:
        """Tell `agent`'s hooks its task on `thread` was ended for it."""
        for hook in self._end_hooks.get(agent, ()):
            hook(thread)
