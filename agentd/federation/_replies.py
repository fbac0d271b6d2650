"""Which replies to send on a link and which outbox rows an acknowledgement frees:
pure bookkeeping, one `ReplyWindow` per established link.

The kernel removes a client's outbox rows *up to* an id. So a row may be freed only
when every row before it that this link could have sent was acknowledged; a row
that was never sent must never lie below a freed id. The window keeps that:

- while the outbox is being loaded, live replies are held and merged after the
  rows (a live reply may be newer or older than what the load returns);
- ids are sent in increasing order, each once (`last_sent`): live replies come in
  increasing id order (the kernel allocates outbox ids in commit order and the
  pump delivers after each commit), and an id at or below `last_sent` is one
  already sent (or acknowledged and being removed);
- past `limit` unacknowledged replies nothing more is sent on this link, and the
  window asks for a reload once they are all acknowledged (`needs_reload`): ids
  skipped meanwhile are all above every id sent, so no acknowledgement frees them.
"""

from __future__ import annotations

from collections import deque


class ReplyWindow:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.loading = False
        self.held: list[int] = []  # live reply ids that arrived during a load
        self.unacked: deque[int] = deque()  # sent, in order
        self.acked: set[int] = set()  # acknowledged, behind an unacknowledged one
        self.last_sent = 0
        self.overflowed = False

    def offer(self, outbox_id: int) -> bool:
        """A reply is available: True if it is to be sent now."""
        if self.loading:
            self.held.append(outbox_id)
            return False
        if self.overflowed or outbox_id <= self.last_sent:
            return False
        if len(self.unacked) >= self.limit:
            self.overflowed = True
            return False
        self.unacked.append(outbox_id)
        self.last_sent = outbox_id
        return True

    def start_load(self) -> None:
        self.loading, self.held = True, []

    def end_load(self, loaded: list[int]) -> list[int]:
        """The ids to send, in order, from the rows loaded and the replies held."""
        self.loading = False
        held, self.held = self.held, []
        return [i for i in sorted(set(loaded) | set(held)) if self.offer(i)]

    def acknowledge(self, outbox_id: int) -> int | None:
        """The id up to which outbox rows may now be removed, if any."""
        if outbox_id not in self.acked and outbox_id in self.unacked:
            self.acked.add(outbox_id)
        up_to = None
        while self.unacked and self.unacked[0] in self.acked:
            up_to = self.unacked.popleft()
            self.acked.discard(up_to)
        return up_to

    @property
    def needs_reload(self) -> bool:
        """Replies were skipped and everything sent is acknowledged: load again."""
        return self.overflowed and not self.unacked and not self.loading
