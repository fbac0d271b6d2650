"""Token estimates, calibrated per backend from the usage the provider reports.

Uncalibrated, a token is ceil(UTF-8 bytes / 4). After each call the ratio of the
reported input tokens to the estimate of the same request moves the backend's
factor (an exponential average, bounded to [0.25, 4]), so a backend whose tokenizer
counts more than 4 bytes a token (code, JSON, non-Latin text) is not under-counted
for long.
"""

from __future__ import annotations

import math

SMOOTHING = 0.3
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


class TokenCalibration:
    def __init__(self) -> None:
        self._factor: dict[str, float] = {}

    def factor(self, backend: str) -> float:
        return self._factor.get(backend, 1.0)

    def estimate(self, nbytes: int, backend: str) -> int:
        return math.ceil(nbytes / 4 * self.factor(backend))

    def observe(self, backend: str, estimated_raw: int, reported: int) -> None:
        """`estimated_raw`: ceil(bytes / 4) of the request; `reported`: the provider's
        input tokens for it."""
        if estimated_raw <= 0 or reported <= 0:
            return
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, reported / estimated_raw))
        old = self._factor.get(backend)
        self._factor[backend] = ratio if old is None else old + SMOOTHING * (ratio - old)
