"""The guard: the runtime that makes every backend keep the contract of :mod:`hicache_storage.protocol`.

:func:`guard_class` wraps each engine-facing method of a class (``get``, ``set``,
``exists``, the ``batch_*`` forms and ``close``). :class:`~hicache_storage.protocol.HiCacheStorage`
calls it once for itself and, from ``__init_subclass__``, for every subclass, so a vendor's
override is wrapped the moment its class is defined. A method already wrapped (inherited
unchanged) is left alone; the marker is the attribute ``__hicache_guarded__``.

How one call goes:

* **Outermost or nested.** A thread-local dict maps ``id(instance)`` to the number of item
  errors counted so far in the call in progress. A call that finds its instance in the
  dict is *nested* (a default ``batch_get`` calling ``get``, an override calling
  ``super()``): it runs the implementation directly, turns an exception into the failure
  shape and adds one item error, but neither validates arguments again nor records stats.
  The *outermost* call does all of the following.
* **Validation.** The first argument (the key, or the keys of a batch) is validated with
  :func:`~hicache_storage.keys.validate_key` / :func:`~hicache_storage.keys.validate_keys`,
  and a batch's per-key argument (``targets``, ``values``, ``pages``) must have one entry
  per key, so no implementation checks lengths itself; a ``TypeError`` raised by the call itself is re-raised as
  :class:`~hicache_storage.errors.InvalidTypeError` when the arguments do not bind to the
  signature (checked only after the error, so the happy path pays nothing).
* **Failure shapes.** :class:`~hicache_storage.errors.InvalidArgumentError`,
  :class:`~hicache_storage.errors.NotSupportedError` and
  :class:`~hicache_storage.errors.ContractViolationError` reach the caller. Any other
  exception is logged (rate limited, secrets scrubbed by ``_log_failure``) and the call
  returns its failure shape: ``None``, ``False``, ``0``, ``[False] * n`` or ``[None] * n``.
  A closed instance returns the failure shape without running the implementation.
* **Result shapes.** Each operation has a checker (:data:`_OPS`) that accepts a correct
  result unchanged and replaces a wrong one (a list of the wrong length, a bool where a
  list is due, a per-key list from ``batch_exists``) by the nearest safe result, counting a
  contract violation. In strict mode (``HICACHE_STORAGE_STRICT=1`` or
  ``backend.strict_contract = True``) the violation raises instead.
* **Stats.** The outermost call records the operation, the number of items, how many
  succeeded (from the checked result), how many failed (the whole batch when the call
  raised, else the item errors that nested calls and
  :meth:`~hicache_storage.protocol.HiCacheStorage._add_item_errors` reported, capped at
  ``n``) and the elapsed time.

``close`` is wrapped differently: it becomes idempotent (the body runs once, even when
it raises) and marks the instance closed. ``delete`` and ``clear`` keep raising typed
errors (they are maintenance calls, not the engine's hot path), and raise
:class:`~hicache_storage.errors.BackendClosedError` once the instance is closed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
import os
import threading
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache_storage.answers import as_bool
from hicache_storage.errors import (
    BackendClosedError,
    ContractViolationError,
    InvalidArgumentError,
    InvalidTypeError,
    NotSupportedError,
)
from hicache_storage.keys import validate_key, validate_keys
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.stats import StatsRecorder

if TYPE_CHECKING:
    from hicache_storage.breaker import Breakers
    from hicache_storage.protocol import HiCacheStorage

__all__ = [
    "ENGINE_OPS",
    "InstanceState",
    "active_calls",
    "guard_class",
    "is_guarded",
    "overrides",
]

# The failures and violations the guard logs go to the protocol's logger (named after
# the contract, hicache_storage.protocol), under the package logger users configure.
logger = logging.getLogger("hicache_storage.protocol")


@dataclass(frozen=True)
class _Op:
    """How to guard one engine-facing method."""

    kind: str  # "single" (key first) or "batch" (keys first)
    failure: Callable[[int], Any]
    check: Callable[[Any, int], tuple[Any, str | None]]
    count_ok: Callable[[Any], int]
    #: The answer is a leading run (``batch_exists``): a failure that leaves it at 0
    #: failed the whole call, however many keys it never got to.
    leading: bool = False


def _check_any(result: Any, n: int) -> tuple[Any, str | None]:
    return result, None


def _check_bool(result: Any, n: int) -> tuple[Any, str | None]:
    if isinstance(result, bool):
        return result, None
    answer = as_bool(result)  # 0/1 and numpy booleans keep their meaning
    return bool(answer), f"returned {type(result).__name__}, expected bool"


def _check_count(result: Any, n: int) -> tuple[Any, str | None]:
    plain = type(result) is int  # (before the isinstance narrowing below)
    if isinstance(result, bool) or not isinstance(result, numbers.Integral):
        if isinstance(result, list) and len(result) == n:
            # A per-key list: the engine needs the leading run.
            lead = 0
            while lead < n and as_bool(result[lead]) is True:
                lead += 1
            return lead, "returned a list, expected the int count of leading hits"
        return 0, f"returned {type(result).__name__}, expected int"
    count = int(result)  # numpy integers too
    if not 0 <= count <= n:
        return 0, f"returned {count} for {n} keys (must be in [0, {n}])"
    if not plain:  # a numpy integer: the right count, but not the promised type
        return count, f"returned {type(result).__name__}, expected int"
    return count, None


def _check_bools(result: Any, n: int) -> tuple[Any, str | None]:
    if isinstance(result, list) and len(result) == n:
        if all(isinstance(x, bool) for x in result):
            return result, None
        return [as_bool(x) is True for x in result], "returned non-bool entries"
    if isinstance(result, bool):
        return [result] * n, f"returned a bool, expected a list of {n} bools"
    if isinstance(result, list):
        return [False] * n, f"returned {len(result)} results for {n} keys"
    return [False] * n, f"returned {type(result).__name__}, expected a list of {n} bools"


def _check_gets(result: Any, n: int) -> tuple[Any, str | None]:
    if isinstance(result, list) and len(result) == n:
        return result, None
    if isinstance(result, list):
        return [None] * n, f"returned {len(result)} results for {n} keys"
    return [None] * n, f"returned {type(result).__name__}, expected a list of {n} results"


def _ok_truthy(result: Any) -> int:
    return 1 if result is True else 0


def _ok_not_none(result: Any) -> int:
    return 0 if result is None else 1


_OPS: dict[str, _Op] = {
    "get": _Op("single", lambda n: None, _check_any, _ok_not_none),
    "set": _Op("single", lambda n: False, _check_bool, _ok_truthy),
    "exists": _Op("single", lambda n: False, _check_bool, _ok_truthy),
    "batch_get": _Op(
        "batch", lambda n: [None] * n, _check_gets, lambda r: sum(x is not None for x in r)
    ),
    "batch_set": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
    "batch_exists": _Op("batch", lambda n: 0, _check_count, lambda r: int(r), leading=True),
    "batch_exists_each": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
    "batch_get_v1": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
    "batch_set_v1": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
    "batch_get_pages": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
    "batch_set_pages": _Op("batch", lambda n: [False] * n, _check_bools, lambda r: sum(r)),
}

#: Exceptions that reach the caller: bad arguments and unsupported operations.
_PASS_THROUGH = (InvalidArgumentError, NotSupportedError, ContractViolationError)

_local = threading.local()


def active_calls() -> dict[int, int]:
    """This thread's guarded calls in progress: instance id -> item errors so far."""
    active: dict[int, int] | None = getattr(_local, "active", None)
    if active is None:
        active = _local.active = {}
    return active


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an engine-facing method with validation, failure shapes and stats."""
    spec = _OPS[name]
    batch = spec.kind == "batch"

    @functools.wraps(fn)
    def wrapper(self: HiCacheStorage, *args: Any, **kwargs: Any) -> Any:
        active = active_calls()
        me = id(self)
        if me in active:
            # Nested call on this instance (a default batch loop calling get, or super()):
            # the outermost call validated the arguments and records the stats.
            before = active[me]
            try:
                return fn(self, *args, **kwargs)
            except _PASS_THROUGH:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine must never see a store failure
                keys = args[0] if args else kwargs.get("keys" if batch else "key")
                n = len(keys) if batch and isinstance(keys, Sized) else 1
                # Every item of the failed call failed: once each, whatever it had reported.
                active[me] = before + n
                self._log_failure(name, exc)
                return spec.failure(n)

        # Outermost call: validate keys (first argument), run, check the result's shape.
        if args:
            first = args[0]
        elif batch and "keys" in kwargs:
            first = kwargs.pop("keys")
        elif not batch and "key" in kwargs:
            first = kwargs.pop("key")
        else:
            raise InvalidTypeError(f"{name}() needs {'keys' if batch else 'a key'}")
        if batch:
            first = validate_keys(first)
            n = len(first)
        else:
            validate_key(first)
            n = 1
        args = (first, *args[1:])
        _check_companion(name, args, kwargs, n)
        state = self._hicache_state()
        if state.closed:
            self._log_failure(name, BackendClosedError(f"{type(self).__name__} is closed"))
            state.stats.record(name, n, 0, n, 0.0, timed=False)
            return spec.failure(n)
        # (An empty call asks the store nothing: no breaker.)
        breaker = state.breaker.for_op(name) if state.breaker is not None and n > 0 else None
        if breaker is not None and not breaker.allow():
            # The store is known to be down: the engine gets its answer at once.
            state.stats.add(breaker_rejections=1)
            state.stats.record(name, n, 0, n, 0.0, timed=False)
            return spec.failure(n)
        # Every call the breaker let through tells it how it went, whatever happens (a
        # half-open trial that never reported would leave it half-open for good).
        failed: bool | None = True
        try:
            active[me] = 0
            t0 = time.perf_counter()
            errors = 0
            try:
                result = fn(self, *args, **kwargs)
            except _PASS_THROUGH:
                failed = False  # (the caller's error, not the store's)
                raise
            except Exception as exc:  # noqa: BLE001 - the engine must never see a store failure
                if isinstance(exc, TypeError):
                    failed = False
                    _raise_if_bad_call(name, fn, self, args, kwargs, exc)
                    failed = True
                self._log_failure(name, exc)
                result = spec.failure(n)
                errors = n
            finally:
                inner_errors = active.pop(me, 0)
            elapsed = time.perf_counter() - t0
            errors = min(n, max(errors, inner_errors))
            result, problem = spec.check(result, n)
            failed = errors >= n or (spec.leading and errors > 0 and spec.count_ok(result) == 0)
            if problem is not None:
                state.stats.add(contract_violations=1)
                message = f"{type(self).__name__}.{name} {problem}"
                if state.strict:
                    raise ContractViolationError(message)
                state.log(
                    "violation:" + name,
                    "contract violation: %s; replaced by a safe result",
                    message,
                )
            state.stats.record(name, n, spec.count_ok(result), errors, elapsed)
            return result
        finally:
            if breaker is not None:
                breaker.record(bool(failed), f"{name} failed for every item")

    wrapper.__hicache_guarded__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = fn
    return wrapper


#: Batch operations whose second argument must hold one entry per key: its parameter
#: name, and whether it may be omitted (``None``).
_COMPANIONS: dict[str, tuple[str, bool]] = {
    "batch_get": ("targets", True),
    "batch_set": ("values", False),
    "batch_get_pages": ("pages", False),
    "batch_set_pages": ("pages", False),
}


def _check_companion(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> None:
    """Raise InvalidArgumentError unless the batch's per-key argument has ``n`` entries.

    Checked once here, for every backend, before the implementation runs.
    """
    spec = _COMPANIONS.get(name)
    if spec is None:
        return
    param, optional = spec
    if len(args) < 2 and param not in kwargs:
        return  # not passed: the call itself fails (InvalidTypeError) or takes the default
    value = args[1] if len(args) > 1 else kwargs[param]
    if value is None:
        if optional:
            return
        raise InvalidArgumentError(f"{name}(): {n} keys but no {param}")
    try:
        count = len(value)
    except TypeError:
        raise InvalidTypeError(
            f"{name}(): {param} must be a sequence, got {type(value).__name__}"
        ) from None
    if count != n:
        raise InvalidArgumentError(f"{name}(): {n} keys but {count} {param}")


def _raise_if_bad_call(
    name: str,
    fn: Callable[..., Any],
    obj: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: TypeError,
) -> None:
    """Raise InvalidTypeError if ``exc`` came from calling ``fn`` with the wrong arguments.

    Checked only after a TypeError, so the happy path pays nothing for it.
    """
    try:
        inspect.signature(fn).bind(obj, *args, **kwargs)
    except TypeError as bad:
        raise InvalidTypeError(f"{name}(): {bad}") from exc


def _guard_close(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``close`` idempotent: the body runs once, later calls return at once."""

    @functools.wraps(fn)
    def wrapper(self: HiCacheStorage) -> None:
        state = self._hicache_state()
        if state.closed:
            return
        if state.closing:
            # A subclass's close calling super().close() reaches the parent's guarded close
            # while closing: run it (once). Anything else (close() from inside the same
            # body, or from another thread meanwhile) returns at once.
            if state.closer == threading.get_ident() and fn not in state.closing_bodies:
                state.closing_bodies.add(fn)
                fn(self)
            return
        state.closing = True
        state.closer = threading.get_ident()
        state.closing_bodies = {fn}
        try:
            fn(self)
        finally:
            state.closed = True
            if state.breaker is not None:
                state.breaker.close()
            state.stats.unbind()  # (its circuit gauges to 0; no more capacity refreshes)

    wrapper.__hicache_guarded__ = True  # type: ignore[attr-defined]
    return wrapper


def _guard_maintenance(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``delete``/``clear`` refuse to run on a closed instance.

    They are not engine-facing calls (they raise typed errors instead of returning a
    failure shape), so after :meth:`close` they raise :class:`BackendClosedError`: an
    instance that was closed must not go on removing pages of a store other instances
    still use.
    """

    @functools.wraps(fn)
    def wrapper(self: HiCacheStorage, *args: Any, **kwargs: Any) -> Any:
        if self._hicache_state().closed:
            raise BackendClosedError(f"{type(self).__name__} is closed")
        return fn(self, *args, **kwargs)

    wrapper.__hicache_guarded__ = True  # type: ignore[attr-defined]
    return wrapper


class InstanceState:
    """Per-instance bookkeeping of the protocol layer."""

    def __init__(self) -> None:
        self.stats = StatsRecorder()
        self.closed = False
        self.closing = False
        self.closer: int | None = None  # the thread running close()
        self.closing_bodies: set[Callable[..., Any]] = set()  # close bodies run so far
        self.strict = os.environ.get("HICACHE_STORAGE_STRICT", "") not in ("", "0", "false")
        self.log = RateLimitedLog(logger)
        self.secrets: list[str] | None = None  # values of secret options, once known
        self.breaker: Breakers | None = None  # set up by HiCacheStorage.__init__


#: The engine-facing operations the guard wraps (``close`` aside).
ENGINE_OPS: tuple[str, ...] = tuple(_OPS)


def is_guarded(fn: object) -> bool:
    """True if ``fn`` is a method the guard has already wrapped."""
    return bool(getattr(fn, "__hicache_guarded__", False))


def guard_class(cls: type) -> None:
    """Wrap every engine-facing method ``cls`` defines or inherits unwrapped.

    Methods are looked up through the whole MRO: an implementation may come from a mixin
    that does not derive from ``HiCacheStorage``.
    """
    for op in _OPS:
        fn = getattr(cls, op, None)
        if callable(fn) and not is_guarded(fn):
            setattr(cls, op, _guard(op, fn))
    fn = getattr(cls, "close", None)
    if callable(fn) and not is_guarded(fn):
        cls.close = _guard_close(fn)  # type: ignore[attr-defined]
    for op in ("delete", "clear"):
        fn = getattr(cls, op, None)
        if callable(fn) and not is_guarded(fn):
            setattr(cls, op, _guard_maintenance(fn))


def overrides(cls: type, op: str, base: type) -> bool:
    """True if ``cls`` implements ``op`` itself rather than inheriting ``base``'s version.

    Compares the implementations under the guard's wrappers, so a guarded override is told
    apart from the guarded default.
    """
    mine = getattr(cls, op, None)
    default = getattr(base, op, None)
    return _unwrap(mine) is not _unwrap(default)


def _unwrap(fn: Any) -> Any:
    while is_guarded(fn) and getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn
