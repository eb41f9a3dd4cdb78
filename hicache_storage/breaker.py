"""Health and the circuit breaker: a store the SDK knows is down costs no engine wait.

Every backend answers :meth:`~hicache_storage.protocol.HiCacheStorage.health` with a
:class:`Health` (``ok``, ``degraded`` or ``down``, and why), from a cheap probe of its
own (a ping, a stat, one existence check).

The protocol layer keeps a :class:`CircuitBreaker` per backend instance for its reads
and one for its writes (:class:`Breakers`: a full disk fails writes only). After
``breaker_failures`` consecutive engine-facing calls that failed as a whole (every item
failed because the store failed, or an engine-side deadline passed), it *opens*: every
call answers at once with its failure shape (a miss, ``False``), and no engine thread
touches the store. A thread of its own probes ``health()`` after ``breaker_backoff``
seconds, doubling up to ``breaker_max_backoff``; once the store answers, one engine call
goes through as a trial (*half-open*), and its success closes the breaker (its failure
opens it again). Each transition is logged once and counted (``breaker_opens``,
``breaker_rejections`` in the stats; ``hicache_circuit_open`` in the metrics).

Options (in the extra config, for every backend): ``breaker_failures`` (default 5; 0
turns the breaker off), ``breaker_backoff`` (seconds, default 1), ``breaker_max_backoff``
(seconds, default 30).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache_storage.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = [
    "BREAKER_KEYS",
    "CLOSED",
    "HALF_OPEN",
    "OPEN",
    "WRITE_OPS",
    "Breakers",
    "CircuitBreaker",
    "Health",
    "breaker_options",
    "report_timeout",
]

logger = logging.getLogger("hicache_storage.breaker")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

#: The longest wait between two probes a breaker takes, in seconds.
MAX_BACKOFF = 3600.0

#: The breaker's options in a backend's extra config (not the backend's own options).
BREAKER_KEYS = frozenset({"breaker_failures", "breaker_backoff", "breaker_max_backoff"})


@dataclass(frozen=True)
class Health:
    """A backend's state: ``ok``, ``degraded`` (working, with a problem) or ``down``."""

    status: str
    reason: str = ""

    def __post_init__(self) -> None:
        """Refuse a status other than the three."""
        if self.status not in ("ok", "degraded", "down"):
            raise ValueError(f"health status must be ok, degraded or down, not {self.status!r}")

    @property
    def usable(self) -> bool:
        """Whether calls may go to the store (``ok`` or ``degraded``)."""
        return self.status != "down"


def breaker_options(extra: Mapping[str, Any]) -> tuple[int, float, float]:
    """``(failures, backoff, max_backoff)`` from an extra config; :class:`ConfigError`."""
    try:
        failures = int(extra.get("breaker_failures", 5))
        backoff = float(extra.get("breaker_backoff", 1.0))
        most = float(extra.get("breaker_max_backoff", 30.0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"breaker options: {exc}") from None
    if isinstance(extra.get("breaker_failures"), bool) or failures < 0:
        raise ConfigError("breaker_failures must be an integer >= 0 (0: no breaker)")
    if not (0 < backoff <= most <= MAX_BACKOFF) or not math.isfinite(most):
        raise ConfigError(
            f"breaker_backoff must be > 0 and <= breaker_max_backoff <= {MAX_BACKOFF:g} s"
        )
    return failures, backoff, most


class CircuitBreaker:
    """One backend instance's breaker (see the module docs). Never blocks a caller."""

    def __init__(
        self,
        name: str,
        failures: int,
        backoff: float,
        max_backoff: float,
        probe: Callable[[], Health],
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.failures = failures
        self.backoff = backoff
        self.max_backoff = max_backoff
        # A bound method is held weakly: a backend dropped without close() is not kept
        # alive (and probed) by its breaker.
        self._probe: Callable[[], Callable[[], Health] | None] = (
            weakref.WeakMethod(probe) if hasattr(probe, "__self__") else (lambda: probe)
        )
        self._on_change = on_change
        self._lock = threading.Lock()
        self.state = CLOSED
        self._streak = 0
        self._delay = backoff
        self._trial = False  # a half-open trial call is out
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self.opens = 0
        self.rejections = 0
        self.last_reason = ""

    def allow(self) -> bool:
        """Whether a call may go to the store now (False: answer with the failure shape)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == HALF_OPEN and not self._trial:
                self._trial = True
                return True
            self.rejections += 1
            return False

    def record(self, failed: bool, reason: str = "") -> None:
        """The outcome of a call that :meth:`allow` let through."""
        changed = None
        with self._lock:
            if self.state == HALF_OPEN and self._trial:
                self._trial = False
                if failed:
                    self._delay = min(self._delay * 2, self.max_backoff)
                    self._open(reason or "the trial call failed")  # (still down: no news)
                else:
                    changed = self._set(CLOSED)
                    self._streak = 0
                    self._delay = self.backoff
            elif self.state == CLOSED:
                self._streak = self._streak + 1 if failed else 0
                if failed and self._streak >= self.failures:
                    changed = self._open(reason or f"{self._streak} calls failed in a row")
        if changed:
            self._announce(changed)

    def _set(self, state: str) -> str | None:
        if self.state == state:
            return None
        self.state = state
        return state

    def _open(self, reason: str) -> str | None:
        """Open (lock held); the new state to announce only when it was closed."""
        self.last_reason = reason
        was = self.state
        self._set(OPEN)
        changed = OPEN if was == CLOSED else None
        if changed:
            self.opens += 1
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(
                target=self._probe_loop, name=f"hicache-breaker-{self.name}", daemon=True
            )
            self._prober.start()
        return changed

    def _announce(self, state: str) -> None:
        if state == OPEN:
            logger.warning(
                "hicache-storage: the %s backend's circuit opened (%s): calls answer at once "
                "as failures until a health probe finds the store back (first in %.1f s)",
                self.name,
                self.last_reason,
                self._delay,
            )
        elif state == CLOSED:
            logger.warning(
                "hicache-storage: the %s backend's circuit closed: calls go through", self.name
            )
        if self._on_change is not None:
            try:
                self._on_change(state)
            except Exception:  # noqa: BLE001, S110 - a gauge, never a caller's failure
                pass

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._delay):
            probe = self._probe()
            if probe is None:  # (the backend is gone)
                break
            try:
                health = probe()
            except Exception as exc:  # noqa: BLE001 - a probe that raises: still down
                health = Health("down", type(exc).__name__)
            del probe
            with self._lock:
                if self.state != OPEN:
                    break
                if health.usable:
                    self.state = HALF_OPEN
                    self._trial = False
                    break
                self.last_reason = health.reason
                self._delay = min(self._delay * 2, self.max_backoff)
        with self._lock:
            # (Gone before it returns: a trial failing now starts a new prober.)
            if self._prober is threading.current_thread():
                self._prober = None

    def close(self) -> None:
        """Stop probing (the backend is closing); waits a moment for a probe under way."""
        self._stop.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(0.5)


#: Engine-facing operations that write (their breaker is apart from the reads').
WRITE_OPS = frozenset({"set", "batch_set", "batch_set_v1", "batch_set_pages"})


class Breakers:
    """A backend instance's two breakers: its reads' and its writes'.

    A store may fail one direction alone (a full disk fails writes, never reads): each
    opens on its own streak, and a full disk never stops the reads of what is stored.
    """

    def __init__(
        self,
        name: str,
        failures: int,
        backoff: float,
        max_backoff: float,
        probe: Callable[[], Health],
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        def tell(direction: str) -> Callable[[str], None] | None:
            if on_change is None:
                return None
            return lambda state: on_change(direction, state)

        self.read = CircuitBreaker(f"{name} (reads)", failures, backoff, max_backoff, probe,
                                   tell("read"))  # fmt: skip
        self.write = CircuitBreaker(f"{name} (writes)", failures, backoff, max_backoff, probe,
                                    tell("write"))  # fmt: skip

    def for_op(self, op: str) -> CircuitBreaker:
        """The breaker of engine-facing operation ``op``."""
        return self.write if op in WRITE_OPS else self.read

    @property
    def state(self) -> str:
        """The worse of the two: ``open``, ``half_open`` or ``closed``."""
        states = {self.read.state, self.write.state}
        return OPEN if OPEN in states else HALF_OPEN if HALF_OPEN in states else CLOSED

    def close(self) -> None:
        """Stop probing (the backend is closing)."""
        self.read.close()
        self.write.close()


def report_timeout(backend: Any, write: bool = False) -> None:
    """An engine-side deadline passed on a read (or ``write``) of ``backend``: a failure."""
    state = getattr(backend, "__dict__", {}).get("_hicache")
    breakers = getattr(state, "breaker", None)
    if isinstance(breakers, Breakers):
        target = breakers.write if write else breakers.read
        target.record(True, "a call passed the engine's deadline")
