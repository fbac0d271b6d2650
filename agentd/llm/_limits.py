"""Rate limits: a clock abstraction and token buckets.

A `TokenBucket` holds at most `capacity` tokens and refills at `rate` per second.
`take(n)` waits (FIFO: a large request is not starved by small ones) until `n`
tokens are there; a request for more than `capacity` can never be served and fails
at once with `RequestTooLarge` instead of waiting forever. The level may go
negative when actual usage turns out larger than the estimate taken (`adjust`):
that debt is paid back by refill before the next request goes.

Time comes from a `Clock`, so tests can run the buckets on virtual time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from agentd.llm._types import RequestTooLarge


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class TokenBucket:
    def __init__(self, capacity: float, per_second: float, clock: Clock, what: str = "") -> None:
        if capacity <= 0 or per_second <= 0:
            raise ValueError("a token bucket needs a positive capacity and rate")
        self.capacity = float(capacity)
        self.rate = float(per_second)
        self.what = what
        self._clock = clock
        self._level = float(capacity)
        self._stamp = clock.now()
        self._lock = asyncio.Lock()

    @classmethod
    def per_minute(cls, per_minute: int, clock: Clock, what: str = "") -> TokenBucket:
        """A bucket for a provider-style "N per minute" limit: bursts up to N."""
        return cls(per_minute, per_minute / 60.0, clock, what)

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def _refill(self) -> None:
        now = self._clock.now()
        if now > self._stamp:
            self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
        self._stamp = now

    def wait_time(self, n: float) -> float:
        """Seconds until `n` tokens are there (0 if now). Pure but for the refill."""
        self._refill()
        return 0.0 if self._level >= n else (n - self._level) / self.rate

    async def take(self, n: float) -> float:
        """Take `n` tokens, waiting as needed; returns the seconds waited."""
        if n > self.capacity:
            raise RequestTooLarge(
                f"the request needs {n:.0f} {self.what or 'tokens'} but the bucket holds at "
                f"most {self.capacity:.0f}; it can never be sent"
            )
        waited = 0.0
        async with self._lock:
            while True:
                wait = self.wait_time(n)
                if wait <= 0:
                    self._level -= n
                    return waited
                await self._clock.sleep(wait)
                waited += wait

    def adjust(self, delta: float) -> None:
        """Charge (`delta` > 0) or refund (< 0) tokens after the fact."""
        self._refill()
        # Never more than one full bucket in debt: a wrong figure cannot lock it for long.
        self._level = max(-self.capacity, min(self.capacity, self._level - delta))
