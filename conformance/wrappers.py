"""Wrappers that make any backend slow or unreliable, for testing the code that calls it.

``FaultyBackend(inner, failure_rate=0.2)`` fails calls (or single pages of a batch) at
random with a realistic exception; ``LatencyBackend(inner, latency=0.005)`` delays every
call. Both forward everything else to ``inner`` and keep its namespace, shard and
capabilities, so a tier, a prefetch policy or an engine adapter can be tested against
slow and failing storage without a broken server. They are
:class:`~hicache_storage.wrapper.WrapperBackend` subclasses, so the protocol layer's guarantees
(failure shapes, no exception reaching the engine, stats) hold for them too.
"""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

from typing_extensions import override

from hicache_storage.errors import BackendUnavailableError, InvalidArgumentError
from hicache_storage.wrapper import WrapperBackend

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.buffers import PageBuffer
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["FaultyBackend", "LatencyBackend"]


class LatencyBackend(WrapperBackend):
    """Delays every operation by ``latency`` seconds plus up to ``jitter`` more.

    Args:
        inner: the backend to wrap.
        latency: fixed delay per call, seconds.
        jitter: random extra delay per call, uniform in ``[0, jitter]`` seconds.
        seed: seed of the jitter.
    """

    def __init__(
        self,
        inner: HiCacheStorage,
        latency: float = 0.001,
        jitter: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(inner)
        if latency < 0 or jitter < 0:
            raise InvalidArgumentError("latency and jitter must be >= 0")
        self.latency = latency
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @override
    def _before(self, op: str) -> None:
        with self._lock:
            extra = self._rng.uniform(0, self.jitter) if self.jitter else 0.0
        time.sleep(self.latency + extra)


class FaultyBackend(WrapperBackend):
    """Fails operations at random, like a store that drops connections.

    A failed single operation raises ``exception`` (the protocol layer turns it into the
    failure shape). In batch page operations, with ``partial=True`` each page fails on
    its own: failed pages are not passed to ``inner`` and report False, so a True result
    still means the page's bytes landed.

    Args:
        inner: the backend to wrap.
        failure_rate: probability that a call (or a page) fails, in ``[0, 1]``.
        seed: seed of the failure draws (reproducible runs).
        ops: operation names that may fail (default: all).
        partial: fail single pages of batch page operations instead of whole calls.
        exception: exception type raised for an injected failure.
    """

    def __init__(
        self,
        inner: HiCacheStorage,
        failure_rate: float = 0.1,
        seed: int | None = None,
        ops: Sequence[str] | None = None,
        partial: bool = True,
        exception: type[Exception] = BackendUnavailableError,
    ) -> None:
        super().__init__(inner)
        if not 0.0 <= failure_rate <= 1.0:
            raise InvalidArgumentError("failure_rate must be in [0, 1]")
        self.failure_rate = failure_rate
        self.ops = frozenset(ops) if ops is not None else None
        self.partial = partial
        self.exception = exception
        self.injected = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _draw(self) -> bool:
        with self._lock:
            hit = self._rng.random() < self.failure_rate
            if hit:
                self.injected += 1
            return hit

    def _applies(self, op: str) -> bool:
        return self.ops is None or op in self.ops

    @override
    def _before(self, op: str) -> None:
        if (
            self._applies(op)
            and not (self.partial and op in ("batch_get_pages", "batch_set_pages"))
            and self._draw()
        ):
            raise self.exception(f"injected failure in {op}")

    def _pages(self, op: str, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        if not (self.partial and self._applies(op)):
            self._before(op)
            inner_op = getattr(self.inner, op)
            out: list[bool] = inner_op(keys, pages)
            return out
        keep = [i for i in range(len(keys)) if not self._draw()]
        if len(keep) < len(keys):  # the injected page failures count as item errors
            self._log_failure(
                op, self.exception(f"injected failure of {len(keys) - len(keep)} pages")
            )
            self._add_item_errors(len(keys) - len(keep))
        results = [False] * len(keys)
        if keep:
            inner_results = getattr(self.inner, op)(
                [keys[i] for i in keep], [pages[i] for i in keep]
            )
            for i, ok in zip(keep, inner_results, strict=True):
                results[i] = ok
        return results

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._pages("batch_get_pages", keys, pages)

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._pages("batch_set_pages", keys, pages)
