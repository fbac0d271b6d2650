"""What a handler sees and what it may return.

A handler is untrusted code. It receives a typed payload and a `HandlerMetadata`
captured by the pump before the call; it returns a `HandlerResponse` (or `None`).
It can only *request* a destination: the pump sets `from` and `thread` itself and
checks every requested destination against the listener's declared peers.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from agentd._errors import HuhCode

if TYPE_CHECKING:
    from agentd.durable.state import StateView


@dataclass(frozen=True, slots=True)
class HandlerMetadata:
    thread_id: str  # opaque UUID of the frame the handler runs in
    from_id: str  # the previous hop only
    own_name: str
    redelivered: bool = False  # True when replayed after a crash (at-least-once)
    usage_instructions: str = ""  # peers' tool-prompt fragments, for LLM prompts
    # Behind `state`: the daemon's state book and the conversation this call serves
    # (never shown to the handler), and the view, made on first use.
    _book: Any = field(default=None, repr=False, compare=False)
    _conversation: str = field(default="", repr=False, compare=False)
    _view: Any = field(default=None, repr=False, compare=False)
    # Platform handlers only: the journal seq of the message (stable across a
    # redelivery), and a callable run once the handler's output has committed.
    _seq: int = field(default=0, repr=False, compare=False)
    _after_commit: Any = field(default=None, repr=False, compare=False)
    # The hops of the message's causal chain so far (a federation call carries them).
    _hops: int = field(default=0, repr=False, compare=False)
    # A reply about one of the handler's calls (its answer, an ack or huh for it): the
    # ref the handler gave that call (`HandlerResponse.addressed(..., refs=)`), set by
    # the pump from the call's frame, never from the reply ("": none).
    _ref: str = field(default="", repr=False, compare=False)
    # When the conversation's owner asked to see steps: report(progress, total,
    # message) turns a tool's progress into `step progress` frames (MCP tools).
    _progress: Any = field(default=None, repr=False, compare=False)

    @property
    def state(self) -> StateView:
        """This listener's storage for the conversation it serves: `get(key,
        default=None)`, `set(key, value)`, `delete(key)`, strings only. Writes commit
        with the handler's output, or not at all if the handler fails."""
        view = self._view
        if view is None:
            from agentd.durable.state import StateBook, StateView

            book = self._book if self._book is not None else StateBook()
            view = StateView(book, self.own_name, self._conversation or self.thread_id)
            object.__setattr__(self, "_view", view)
        return view


F = TypeVar("F", bound=Callable[..., Any])


def takes_element(handler: F) -> F:
    """Mark a handler that takes the payload element the pump validated instead of
    the object it would build from it (an isolation pool, which sends the element's
    C14N to its worker). The element stays the pump's: such a handler only reads it."""
    handler.takes_element = True  # type: ignore[attr-defined]
    return handler


# What a coroutine's code holds where it can suspend: `await`, `async for`, `async
# with` all compile to a YIELD_VALUE (the others are named for clarity).
_SUSPENDS = frozenset(("YIELD_VALUE", "GET_AWAITABLE", "SEND", "BEFORE_ASYNC_WITH",
                       "GET_AITER", "GET_ANEXT", "END_ASYNC_FOR"))


def never_suspends(handler: object) -> bool:
    """True for a handler that is a plain `async def` function with no `await`,
    `async for` or `async with` in its body: its coroutine runs to its end on the
    first step, so the pump may run it on the caller's stack, without a task (a
    callable object, a partial or a wrapper is never taken for one)."""
    if type(handler) is not types.FunctionType or not inspect.iscoroutinefunction(handler):
        return False
    return not any(ins.opname in _SUSPENDS for ins in dis.get_instructions(handler))


class ResponseKind(Enum):
    SEND = "send"
    RESPOND = "respond"
    BROADCAST = "broadcast"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class HandlerResponse:
    """A handler's answer. `payload` is an `@xmlify` object, a list of them, or raw
    XML bytes holding one or more payload elements (multi-payload fan-out)."""

    payload: Any = None
    to: str | None = None
    kind: ResponseKind = ResponseKind.SEND
    # BROADCAST: every payload goes to each of them; SEND: payload i goes to
    # targets[i] ("": routed by its key alone), see `addressed`.
    targets: tuple[str, ...] = field(default=())
    # SEND with `targets`: the handler's reference of each call (see `addressed`).
    refs: tuple[str, ...] = field(default=())
    error_code: HuhCode | None = None
    error_message: str = ""
    retry_allowed: bool | None = None  # None: what the code implies

    @classmethod
    def respond(cls, payload: Any) -> HandlerResponse:
        """Send `payload` back up the call chain to the caller."""
        return cls(payload, kind=ResponseKind.RESPOND)

    @classmethod
    def addressed(cls, payload: Any, to: Sequence[str], refs: Sequence[str] = ()
                  ) -> HandlerResponse:
        """Send the payloads of `payload` (several elements, or a list) each to the
        listener named at its position in `to` ("": routed by its key alone), so a
        payload class that several peers take reaches only the one meant. `refs`
        (platform handlers): a name for each call, up to 64 of `A-Za-z0-9._:-`; whatever
        comes back about a call (its answer, an ack or huh) carries it, so calls to
        one listener are told apart however their replies are ordered."""
        return cls(payload, kind=ResponseKind.SEND, targets=tuple(to), refs=tuple(refs))

    @classmethod
    def broadcast(cls, payload: Any, to: Sequence[str]) -> HandlerResponse:
        """Send `payload` to each named peer (one envelope each)."""
        return cls(payload, kind=ResponseKind.BROADCAST, targets=tuple(to))

    @classmethod
    def error(
        cls, code: HuhCode | str, message: str = "", *, retry_allowed: bool | None = None
    ) -> HandlerResponse:
        """Report failure to the caller as a `huh` with `code`. `retry_allowed=False`
        tells the caller that sending the same request again cannot succeed (by
        default the code decides)."""
        return cls(None, kind=ResponseKind.ERROR, error_code=HuhCode(code),
                   error_message=message, retry_allowed=retry_allowed)


@dataclass(frozen=True, slots=True)
class ChainStopped:
    """A gateway's answer when the peer organism refused the call at its hop limit:
    the chain has crossed organisms `max_hops` times, and the pump stops it as it
    stops one that stays home (the client is told `budget-exceeded`; the calling
    listener is not answered). Internal: the platform's, never a listener author's."""

    code: HuhCode
