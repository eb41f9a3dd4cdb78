"""One rate limiter for every warning on a hot path.

A store that fails the same way on every call (a full disk, a corrupt tier, a refused
write) must not write one log line per call: an engine doing thousands of operations a
second would drown its log. :class:`RateLimitedLog` logs a message at most once per
``interval`` seconds per *key* (a short name of the kind of event), counts the ones it
suppressed, and says how many with the next one it logs.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs a message at most once per ``interval`` seconds per key, counting the rest.

    Args:
        logger: where the messages go (default: this package's ``hicache_storage`` logger).
        interval: seconds between two messages of one key.
    """

    def __init__(self, logger: logging.Logger | None = None, interval: float = 5.0) -> None:
        self.logger = logger if logger is not None else logging.getLogger("hicache_storage")
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(
        self,
        key: str,
        msg: str,
        *args: object,
        exc_info: bool = False,
        level: int = logging.WARNING,
    ) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged within ``interval`` seconds.

        Returns True if the message was logged.
        """
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def suppressed(self, key: str) -> int:
        """Messages of ``key`` suppressed since the last one logged."""
        with self._lock:
            return self._suppressed.get(key, 0)
