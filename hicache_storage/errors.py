"""Typed errors of hicache-storage.

The tree::

    HiCacheStorageError
    ├── InvalidArgumentError (ValueError)         the caller passed something wrong
    │   ├── InvalidKeyError                       key empty, too long, or unsafe characters
    │   ├── InvalidTypeError (TypeError)          wrong type (e.g. a non-contiguous tensor)
    │   ├── HostIndicesError                      host indices not page aligned / wrong count
    │   └── ConfigError                           bad backend option or namespace
    │       └── NamespaceMismatchError            host pool does not match the namespace
    ├── BackendLookupError (LookupError)
    │   ├── UnknownBackendError                   no backend of that name is installed
    │   └── AmbiguousBackendError                 two distributions claim one name
    ├── BackendLoadError (ImportError)            the backend's module or client won't load
    ├── NotSupportedError (NotImplementedError)   the backend does not offer this operation
    ├── BackendError                              the store failed (I/O)
    │   ├── BackendUnavailableError (ConnectionError)
    │   ├── BackendTimeoutError (TimeoutError)
    │   ├── CapacityError                         no room, even after eviction
    │   ├── CorruptObjectError                    header or checksum does not match
    │   │   └── UnsupportedFormatError            written by a newer format (keep it)
    │   └── BackendClosedError                    the backend was closed
    └── ContractViolationError                    a backend returned a result of the wrong shape

Engine-facing calls (``get``, ``set``, ``exists``, the batch forms and the v1 pair) never
raise :class:`BackendError` or any other failure of the store: they return the failure
shape (``None``, ``False``, ``0``, ``[False] * n``) and count the failure in the stats.
They do raise :class:`InvalidArgumentError` (and its subclasses): a wrong argument is a
bug in the caller and must be loud.

A backend turns its client library's exceptions into this tree in one place:
:func:`map_errors` is a context manager that re-raises each exception listed in a mapping
(``{redis.TimeoutError: BackendTimeoutError, redis.ConnectionError:
BackendUnavailableError}``) as the mapped :class:`BackendError` type, chained to the
original; :func:`from_os_error` does the same for ``OSError`` by errno.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping

__all__ = [
    "AmbiguousBackendError",
    "BackendClosedError",
    "BackendError",
    "BackendLoadError",
    "BackendLookupError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "CapacityError",
    "ConfigError",
    "ContractViolationError",
    "CorruptObjectError",
    "ErrorMap",
    "HiCacheStorageError",
    "HostIndicesError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidTypeError",
    "NamespaceMismatchError",
    "NotSupportedError",
    "UnknownBackendError",
    "UnsupportedFormatError",
    "from_os_error",
    "map_errors",
    "mapped_error",
]


class HiCacheStorageError(Exception):
    """Base class of every error raised by hicache-storage."""


class InvalidArgumentError(HiCacheStorageError, ValueError):
    """The caller passed an invalid argument; engine-facing calls raise it."""


class InvalidKeyError(InvalidArgumentError):
    """A key is empty, too long, or contains characters that are unsafe in object names."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (for example a non-contiguous or GPU tensor)."""


class HostIndicesError(InvalidArgumentError):
    """Host-pool indices are not page aligned, out of range, or of the wrong count."""


class ConfigError(InvalidArgumentError):
    """A backend option, a size string or a namespace field is invalid."""


class NamespaceMismatchError(ConfigError):
    """The registered host pool does not match the backend's namespace (dtype, page size...)."""


class BackendLookupError(HiCacheStorageError, LookupError):
    """Base class of registry lookup errors."""


class UnknownBackendError(BackendLookupError):
    """No installed backend has the requested name."""


class AmbiguousBackendError(BackendLookupError):
    """Several distributions register the same backend name."""


class BackendLoadError(HiCacheStorageError, ImportError):
    """A backend's module, class or client library cannot be loaded."""


class NotSupportedError(HiCacheStorageError, NotImplementedError):
    """The backend does not support this operation (see its capabilities)."""


class BackendError(HiCacheStorageError):
    """The store failed to perform an operation (I/O error, server down, disk full...)."""


class BackendUnavailableError(BackendError, ConnectionError):
    """The store cannot be reached."""


class BackendTimeoutError(BackendError, TimeoutError):
    """The store did not answer in time."""


class CapacityError(BackendError):
    """The store has no room for the object, even after eviction."""


class CorruptObjectError(BackendError):
    """A stored object failed its header or checksum verification."""


class UnsupportedFormatError(CorruptObjectError):
    """A stored object has a header version or checksum algorithm this SDK does not know.

    Most likely it was written by a newer release sharing the store: a miss for this
    reader, but not damage, so stores do not remove it.
    """


class BackendClosedError(BackendError):
    """The backend was closed; it accepts no more operations."""


class ContractViolationError(HiCacheStorageError):
    """A backend returned a result that breaks the protocol (wrong length or type).

    Raised only in strict mode (``HICACHE_STORAGE_STRICT=1`` or ``strict_contract=True``);
    otherwise the result is replaced by a safe failure shape and the violation is counted.
    """


def from_os_error(exc: OSError, what: str) -> BackendError:
    """Map an ``OSError`` from a store operation to the matching :class:`BackendError`."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"{what}: no space left ({exc})")
    if isinstance(exc, TimeoutError):
        return BackendTimeoutError(f"{what}: {exc}")
    if isinstance(exc, ConnectionError):
        return BackendUnavailableError(f"{what}: {exc}")
    return BackendError(f"{what}: {exc}")


#: How :func:`map_errors` translates: client exception class -> our error class.
ErrorMap = Mapping[type[BaseException], type[BackendError]]


def mapped_error(exc: BaseException, mapping: ErrorMap) -> BaseException:
    r"""The error ``exc`` becomes under ``mapping``, or ``exc`` itself when nothing maps it.

    The classes of ``exc``'s MRO are looked up in order, so the most specific entry wins
    (``{OSError: BackendError, TimeoutError: BackendTimeoutError}`` maps a
    ``TimeoutError`` to :class:`BackendTimeoutError` whatever the dict order). The new
    error carries ``exc``'s message (its class name when the message is empty) and has
    ``exc`` as its ``__cause__``. An exception that is already a
    :class:`HiCacheStorageError` is returned unchanged: our own errors (a
    :class:`CapacityError`, an :class:`InvalidArgumentError` that must reach the caller)
    keep their type even under a broad entry such as ``{Exception: BackendError}``, and
    exceptions that are not :class:`Exception`\ s (``KeyboardInterrupt``,
    ``SystemExit``) are never mapped.
    """
    if isinstance(exc, HiCacheStorageError) or not isinstance(exc, Exception):
        return exc  # our own errors keep their type; KeyboardInterrupt & co. are not mapped
    for cls in type(exc).__mro__:
        target = mapping.get(cls)
        if target is not None:
            new = target(str(exc) or type(exc).__name__)
            new.__cause__ = exc
            return new
    return exc


@contextlib.contextmanager
def map_errors(mapping: ErrorMap) -> Iterator[None]:
    """Re-raise exceptions of the block as the :class:`BackendError` types of ``mapping``.

    ::

        with map_errors({redis.TimeoutError: BackendTimeoutError,
                         redis.RedisError: BackendError}):
            client.mget(names)

    Matching and chaining are those of :func:`mapped_error` (most specific class first,
    message kept, ``raise new from original``); an exception that no entry maps, or that
    is already a :class:`HiCacheStorageError`, propagates unchanged. Also usable as a
    decorator.
    """
    try:
        yield
    except BaseException as exc:
        new = mapped_error(exc, mapping)
        if new is exc:
            raise
        raise new from exc
