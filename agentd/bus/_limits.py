"""The bus's flow limits as plain objects (no sockets): a token bucket per client,
the in-flight window per connection, and the slots of connections that have not
authenticated yet. The session asks them questions; they never do
I/O, so the policies are tested without a network.

"In flight" (`bus.max_inflight`) means: an envelope the pump
accepted whose thread has not yet received its answer. The answer is the first
frame on that thread that is not `accepted` (a response, an `ack` or a `huh`).
An envelope refused at ingress is answered by its `huh` at once and never counts.
Each further envelope on the same thread adds one; each answer frame removes one.
A thread that never gets an answer (a handler that stays silent toward the client
without the pump's `ack`) is released after `ttl_s`, so a connection cannot stall
forever on a lost answer.

A connection holds an unauthenticated slot from the moment its socket is accepted
(before TLS) until it authenticates or goes; slots are capped in all and per source
address, so idle sockets from a few addresses cannot hold the room clients need.
"""

from __future__ import annotations


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; one token per envelope."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        tokens = self.tokens + (now - self.stamp) * self.rate
        self.stamp = now
        if tokens > self.burst:
            tokens = self.burst
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return True
        self.tokens = tokens
        return False

    def charge(self, tokens: float, now: float) -> None:
        """Take `tokens` more for work already done (a costly refusal), down to at
        most a burst in debt: the client waits that long before its next envelope."""
        saved = min(self.tokens + (now - self.stamp) * self.rate, self.burst)
        self.stamp = now
        self.tokens = max(saved - tokens, -self.burst)


    def ready_at(self) -> float:
        """When the bucket holds a whole token again."""
        return self.stamp + max(0.0, 1.0 - self.tokens) / self.rate


class UnauthenticatedSlots:
    """Connections not yet authenticated: at most `total`, at most `per_address`
    from one source address. `take` answers whether one more may stay."""

    __slots__ = ("_by_address", "count", "per_address", "total")

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        self.count = 0
        self._by_address: dict[str, int] = {}

    def take(self, address: str) -> bool:
        held = self._by_address.get(address, 0)
        if self.count >= self.total or held >= self.per_address:
            return False
        self._by_address[address] = held + 1
        self.count += 1
        return True

    def release(self, address: str) -> None:
        held = self._by_address.get(address, 0)
        if held <= 0:
            return
        if held == 1:
            del self._by_address[address]
        else:
            self._by_address[address] = held - 1
        self.count -= 1

    def held_by(self, address: str) -> int:
        return self._by_address.get(address, 0)


class InflightWindow:
    """Unanswered envelopes of one connection, by thread, oldest first."""

    __slots__ = ("_threads", "limit", "total", "ttl_s")

    def __init__(self, limit: int, ttl_s: float) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self.total = 0
        # thread -> [unanswered count, time of the last submit]; insertion order is
        # the order of last submission, so expiry scans from the front.
        # A plain dict (insertion-ordered, half an OrderedDict's size: one per connection).
        self._threads: dict[str, list[float]] = {}

    @property
    def full(self) -> bool:
        return self.total >= self.limit

    def __contains__(self, thread: str) -> bool:
        return thread in self._threads

    def submitted(self, thread: str, now: float) -> None:
        entry = self._threads.get(thread)
        if entry is None:
            self._threads[thread] = [1, now]
        else:
            entry[0] += 1
            entry[1] = now
            del self._threads[thread]  # to the end: the order is that of last submission
            self._threads[thread] = entry
        self.total += 1

    def answered(self, thread: str) -> bool:
        """One answer on `thread`; True if that freed room below the limit."""
        entry = self._threads.get(thread)
        if entry is None:
            return False
        was_full = self.total >= self.limit
        entry[0] -= 1
        self.total -= 1
        if entry[0] <= 0:
            del self._threads[thread]
        return was_full and self.total < self.limit

    def expire(self, now: float) -> int:
        """Release threads unanswered for longer than `ttl_s`; the count released."""
        released = 0
        cutoff = now - self.ttl_s
        while self._threads:
            thread, entry = next(iter(self._threads.items()))
            if entry[1] > cutoff:
                break
            del self._threads[thread]
            released += int(entry[0])
            self.total -= int(entry[0])
        return released

    def oldest_deadline(self) -> float | None:
        if not self._threads:
            return None
        return next(iter(self._threads.values()))[1] + self.ttl_s
