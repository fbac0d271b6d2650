"""Process-wide tuning the daemon applies once it has started."""

from __future__ import annotations

import gc

# Collect the youngest generation every 20,000 net allocations instead of CPython's
# 700: handling one message allocates a few hundred container objects (parsed trees'
# proxies, tuples of journal rows, futures) that almost all die young, so the default
# runs a collection every few messages. Memory held by cyclic garbage between
# collections stays a few MB at most. The measured gain: docs/operations.md,
# "Garbage collector".
GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Move everything alive now (modules, schemas, config, routing tables) out of the
    collector's sight with `gc.freeze()`, so full collections do not rescan it, and
    raise the youngest generation's threshold. Call once, after startup."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
