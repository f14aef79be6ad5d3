"""Logging that a flood of bad input cannot turn into a flood of lines: at most one per kind per interval."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def log(self, kind: str, level: int, message: str, *args: Any, exc_info: Any = None) -> bool:
        """Log unless a line of this kind was logged within the interval; True when it was logged."""
        now = self._clock()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return False
        dropped = self._dropped.pop(kind, 0)
        suffix = f" (and {dropped} more like it since the last line)" if dropped else ""
        self._last[kind] = now
        if len(self._last) > 1024:  # kinds are few; never let them grow without bound
            self._last.clear()
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)
        return True
