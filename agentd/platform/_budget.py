"""Token budgets, enforced before each call and settled with actual usage after.

A scope is a (name, limit) pair: the agent's budget within one conversation
(`agent.token_budget`) and the conversation's budget (the profile's `token_budget`).
Before a call, the ledger reserves the estimated input tokens plus the output it
grants (`max_tokens`, lowered to what is left, never below `MIN_OUTPUT_TOKENS`);
if that does not fit every scope, the call is refused with `BudgetExceeded`. After
the call, the reservation is replaced by the provider's reported usage. Concurrent
calls in one conversation therefore cannot overspend together.

Spent figures are kept per scope in a bounded LRU (old conversations are forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentd._errors import AgentdError

MIN_OUTPUT_TOKENS = 16


class BudgetExceeded(AgentdError):
    def __init__(self, scope: str, limit: int, spent: int, needed: int) -> None:
        super().__init__(
            f"token budget {scope} exhausted: {spent} of {limit} spent, the call needs "
            f"about {needed} more"
        )
        self.scope = scope
        self.limit = limit
        self.spent = spent


@dataclass(frozen=True)
class Scope:
    name: str
    limit: int | None


@dataclass
class Reservation:
    scopes: tuple[Scope, ...]
    amount: int
    max_output: int
    settled: bool = field(default=False)


class BudgetLedger:
    def __init__(self, max_scopes: int = 100_000) -> None:
        self.max_scopes = max_scopes
        self._spent: OrderedDict[str, int] = OrderedDict()
        self._held: dict[str, int] = {}

    def spent(self, scope: str) -> int:
        return self._spent.get(scope, 0)

    @property
    def reserved(self) -> int:
        """Tokens held by reservations not settled yet: 0 once no call is in flight."""
        return sum(self._held.values())

    def remaining(self, scope: Scope) -> int | None:
        if scope.limit is None:
            return None
        return scope.limit - self.spent(scope.name) - self._held.get(scope.name, 0)

    def reserve(self, scopes: Sequence[Scope], input_tokens: int, max_output: int) -> Reservation:
        """Reserve for one call, or raise `BudgetExceeded` naming the tightest scope."""
        grant = max_output
        for scope in scopes:
            left = self.remaining(scope)
            if left is None:
                continue
            room = left - input_tokens
            if room < min(MIN_OUTPUT_TOKENS, max_output):
                assert scope.limit is not None
                raise BudgetExceeded(
                    scope.name, scope.limit, self.spent(scope.name),
                    input_tokens + min(MIN_OUTPUT_TOKENS, max_output),
                )
            grant = min(grant, room)
        amount = input_tokens + grant
        active = tuple(s for s in scopes if s.limit is not None)
        for scope in active:
            self._held[scope.name] = self._held.get(scope.name, 0) + amount
        return Reservation(active, amount, grant)

    def settle(self, reservation: Reservation, used: int | None) -> None:
        """Release the reservation and charge `used` tokens (None: charge nothing,
        the call failed)."""
        if reservation.settled:
            return
        reservation.settled = True
        for scope in reservation.scopes:
            held = self._held.get(scope.name, 0) - reservation.amount
            if held > 0:
                self._held[scope.name] = held
            else:
                self._held.pop(scope.name, None)
            if used:
                self._spent[scope.name] = self._spent.get(scope.name, 0) + used
                self._spent.move_to_end(scope.name)
        while len(self._spent) > self.max_scopes:
            self._spent.popitem(last=False)
