"""A base for stores that hold whole values: :class:`BlobStore`.

Key/value services (Redis, S3, Mooncake used as a KV store, a database, process memory)
store and return one value per name. For them the engine-facing protocol reduces to three
batched calls, which is all an implementer writes::

    class AcmeBackend(BlobStore[AcmeOptions]):
        name = "acme"
        capabilities = Capabilities(delete=True, shared=True)
        options_class = AcmeOptions
        error_map = {acme.Timeout: BackendTimeoutError, acme.Error: BackendError}

        def _get_blobs(self, names):              # one value (or None) per name
            return self.client.mget([n.path for n in names])

        def _put_blobs_if_absent(self, names, blobs):
            return self.client.msetnx_each([n.path for n in names], blobs)

        def _exists_blobs(self, names):
            return self.client.exists_each([n.path for n in names])

The base does the rest, the same way for every such store: the object header of
:mod:`hicache_storage.storekit.header` in front of every value (length, payload checksum,
name digest) and its verification on every read, so a truncated, foreign, renamed or
corrupt value is a miss (counted in ``corrupt_objects``), never wrong bytes (a
damaged payload is caught by its checksum, so only with ``checksum="xxh3"``, the default
here; ``"none"`` checks lengths and names only); filling the
caller's target with :func:`~hicache_storage.buffers.copy_into` (all or nothing) or a new
uint8 tensor; the leading-run count of ``batch_exists``; per-item failures; and the
translation of the client's exceptions through :attr:`BlobStore.error_map`.
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeAlias, TypeVar, cast

from typing_extensions import override

from hicache_storage.answers import as_bool
from hicache_storage.breaker import Health
from hicache_storage.buffers import (
    PageBuffer,
    copy_into,
    new_target,
    source_views,
    target_views,
    total_nbytes,
)
from hicache_storage.config import StorageConfig, parse_options, scrub
from hicache_storage.errors import (
    BackendError,
    CapacityError,
    ContractViolationError,
    CorruptObjectError,
    ErrorMap,
    HiCacheStorageError,
    NotSupportedError,
    UnsupportedFormatError,
    map_errors,
    mapped_error,
)
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    algorithm_id,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from hicache_storage.keys import ObjectName

__all__ = [
    "FOREIGN",
    "PRESENT",
    "Blob",
    "BlobOptions",
    "BlobStore",
    "Foreign",
    "Present",
    "Segments",
]

logger = logging.getLogger(__name__)

#: What follows ``<digest>/`` in an object name: the fan-out (two hex digits), then a leaf
#: without a ``/``.
_NAME_TAIL = re.compile(r"[0-9a-f]{2}/[^/]+")

#: A stored value as ``_get_blobs`` returns it: header and payload in one buffer.
Blob: TypeAlias = bytes | bytearray | memoryview
#: A value to store as ``_put_blobs_if_absent`` receives it: the 48-byte header, then the
#: payload's segments (views of the caller's memory), in order. Their concatenation is
#: the value.
Segments: TypeAlias = list[bytes | memoryview]


class Present:
    """The type of :data:`PRESENT` (one instance; compare with ``is``)."""

    @override
    def __repr__(self) -> str:
        return "PRESENT"


#: What :meth:`BlobStore._put_blobs_if_absent` may return for a name that already held a
#: value (nothing written by this call): a success, not counted in ``bytes_written``.
#: ``True`` means stored now, or present when the store cannot tell the two apart.
PRESENT = Present()


class Foreign:
    """The type of :data:`FOREIGN` (one instance; compare with ``is``)."""

    @override
    def __repr__(self) -> str:
        return "FOREIGN"


#: What :meth:`BlobStore._get_blobs_within` may return for a name whose value it did not
#: read because it cannot be one of the base's: longer than the name's limit, or not a
#: value the store can return (a Redis hash under a page's key). Counted in
#: ``corrupt_objects`` and removed, like a value that fails verification.
FOREIGN = Foreign()


@contextmanager
def _store_errors(mapping: ErrorMap) -> Iterator[None]:
    """``map_errors(mapping)``, plus: other SDK errors raised by the implementer are store failures.

    An argument or configuration error deep in a client call becomes a
    :class:`BackendError`: the caller's arguments were validated before, so it is the
    store's failure, and it must give the failure shape, not reach the engine.
    """
    try:
        with map_errors(mapping):
            yield
    except (BackendError, NotSupportedError, ContractViolationError):
        raise
    except HiCacheStorageError as exc:
        raise BackendError(f"the store raised {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class BlobOptions:
    """Options every :class:`BlobStore` backend has (its options class derives from this).

    Attributes:
        checksum: payload checksum written in each value's header, ``"xxh3"`` or
            ``"none"`` (lengths and names are checked either way; with ``"none"`` a
            damaged payload of the right length is not detected).
        verify_checksum: verify the payload checksum of every value read that has one
            (a value written with ``"none"`` carries none, and is accepted unchecked).
    """

    checksum: Literal["xxh3", "none"] = "xxh3"
    verify_checksum: bool = True


O = TypeVar("O", bound=BlobOptions)


class BlobStore(HiCacheStorage, Generic[O]):
    """Base of stores that hold whole values under string names.

    **What the implementer writes**: :meth:`_get_blobs`, :meth:`_put_blobs_if_absent` and
    :meth:`_exists_blobs`; optionally :meth:`_delete_blobs` and :meth:`_clear_namespace`
    (claim ``Capabilities(delete=True)`` only with both), and :meth:`_get_blobs_within`
    and :meth:`_delete_blobs_if_bad` where the store can bound a read or compare before it
    deletes; class attributes :attr:`name`, :attr:`capabilities`, :attr:`options_class`
    and :attr:`error_map`. Each method gets
    the :class:`~hicache_storage.keys.ObjectName` of every item; the store's key for an
    item is ``name.path`` (ASCII, ``<namespace digest>/<fan-out>/<leaf>``; a store may
    rewrite it to its own key syntax if the rewriting is one-to-one).

    **What the implementer must guarantee** (the base relies on it, and the conformance
    kit checks it):

    * *atomic put*: a value becomes visible whole or not at all; no call, from any thread
      or process, ever returns part of a value being written;
    * *first writer wins*: :meth:`_put_blobs_if_absent` never replaces a value that is
      already stored under a name, and two writers racing on one name leave exactly one
      of their values; it returns True when the name holds a value after the call
      (stored now or already present);
    * *read your writes*: once a put returned True, the value is returned by later
      :meth:`_get_blobs` calls and counted by :meth:`_exists_blobs` (until deleted);
    * *one result per name, in order*, from every batched method. An exception instance
      in an item's slot fails that item alone (logged and counted as an item error);
      an exception raised by the method fails every item of the call;
    * *thread safety*: every method may run in several threads at once;
    * *no retained views*: the payload segments passed to a put are views of the
      caller's memory (a host KV pool), valid only during the call: copy or send them
      before returning, never keep them; a value returned by :meth:`_get_blobs` must not
      change afterwards (``bytes`` are ideal);
    * :meth:`_clear_namespace` removes every value of this namespace and nothing else:
      only the names :meth:`_is_own_name` accepts, not every name that starts with
      :attr:`namespace_prefix` (see there).

    **What the base guarantees** to the engine, on top of :class:`HiCacheStorage`'s
    guard: every value is stored as ``header || payload`` with the name it is stored
    under bound into the header; a value that fails verification (shorter than its
    header, another program's, stored under another name, wrong length, checksum
    mismatch when checked, longer than the target can hold) is a miss, counted in
    ``corrupt_objects``, and removed when the store supports deletion
    (:attr:`remove_corrupt`), so that the next ``set`` can store a good value; no more of a
    value is asked for than the target can hold (where the store implements
    :meth:`_get_blobs_within`); targets are filled completely or not at all: a whole,
    verified value of another size than its target is ``None``/``False``, counted in
    ``size_mismatches``, and removed too (no reader of the namespace can load it, and it
    would hold its key: ``set`` would find the key taken); every engine-facing call makes
    one call of the implementer's methods per batch, except ``batch_exists`` (see
    :attr:`exists_chunk`) and the removal of corrupt values.
    """

    #: The options dataclass (a :class:`BlobOptions` subclass); parsed by ``__init__``.
    options_class: ClassVar[type[BlobOptions]] = BlobOptions
    #: Deletes and clears made through this instance (a server's own evictions and TTLs
    #: are not seen).
    reports_removals: ClassVar[frozenset[str]] = frozenset({"delete", "clear"})
    #: Client exception class -> :class:`~hicache_storage.errors.BackendError` subclass,
    #: applied with :func:`~hicache_storage.errors.map_errors` around every call of the
    #: implementer's methods and to the exceptions they put in result slots. The most
    #: specific class in an exception's MRO wins.
    error_map: ClassVar[ErrorMap] = {}
    #: ``batch_exists`` asks :meth:`_exists_blobs` about this many names first, then
    #: twice as many each time every name of the previous chunk was present, and stops
    #: at the first miss: a long batch whose leading run is short costs one small call,
    #: and one whose keys are all present costs about log2(n / exists_chunk) calls.
    #: 0 asks about the whole batch at once.
    exists_chunk: ClassVar[int] = 128
    #: Remove a value that failed verification (when :meth:`_delete_blobs` is
    #: implemented). Under a rare race (the bad value removed and a good one stored by
    #: others between this read and its removal) the good value goes too: a later miss,
    #: never wrong bytes.
    remove_corrupt: ClassVar[bool] = True

    @override
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, when the class is defined, declarations the base cannot work with."""
        super().__init_subclass__(**kwargs)
        if not (isinstance(cls.options_class, type) and issubclass(cls.options_class, BlobOptions)):
            raise TypeError(
                f"{cls.__name__}.options_class must be a BlobOptions subclass (the base reads "
                f"its checksum options), got {cls.options_class!r}"
            )
        for source, target in cls.error_map.items():
            if not (isinstance(target, type) and issubclass(target, BackendError)):
                raise TypeError(
                    f"{cls.__name__}.error_map maps {source!r} to {target!r}: store failures "
                    "must map to a BackendError type (anything else would reach the engine)"
                )

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options: O = cast("O", parse_options(self.options_class, self.name, options))
        self._algorithm = algorithm_id(self.options.checksum)
        self._log = RateLimitedLog(logger)

    @property
    def namespace_prefix(self) -> str:
        """What every object name of this namespace starts with (``"<digest>/"``)."""
        return f"{self.namespace.digest}/"

    def _is_own_name(self, name: str) -> bool:
        """True if ``name`` (a store key less the store's own prefix) is an object name of this namespace.

        That is ``<digest>/<fan-out>/<leaf>``, with no other ``/``. A name that merely
        starts with :attr:`namespace_prefix` may be another store's: one whose prefix is
        this store's prefix plus ``<digest>/`` (nested in this namespace) has names of
        more parts there. Only the same prefix and namespace make a name this accepts
        (digests all have one length, so the part before ``/<fan-out>/<leaf>`` pins both).
        """
        start = len(self.namespace_prefix)
        return name.startswith(self.namespace_prefix) and bool(_NAME_TAIL.fullmatch(name, start))

    # ------------------------------------------------------------------ implementer's part

    @abc.abstractmethod
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[Blob | Exception | None]:
        """The stored value of each name, in order; ``None`` where nothing is stored."""

    @abc.abstractmethod
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> Sequence[bool | Present | Exception]:
        """Store each value (given as its segments) unless its name already holds one.

        One answer per name: True when the name holds a value after the call, or
        :data:`PRESENT` where the store can tell that it already held one (nothing
        written: not counted in ``bytes_written``). Atomic per value, first writer wins
        (see the class docstring).
        """

    @abc.abstractmethod
    def _exists_blobs(self, names: list[ObjectName]) -> Sequence[bool | Exception]:
        """Whether each name holds a value, in order."""

    def _delete_blobs(self, names: list[ObjectName]) -> Sequence[bool | Exception]:
        """Remove each name's value; True where one was stored. Default: not supported."""
        raise NotSupportedError(f"{type(self).__name__} does not support delete")

    def _get_blobs_within(
        self, names: list[ObjectName], limits: list[int | None]
    ) -> Sequence[Blob | Foreign | Exception | None]:
        """:meth:`_get_blobs`, asking for no more of each value than ``limits[i]`` bytes.

        ``limits[i]`` is the longest value the caller can use (the header plus its
        target's size; None: no limit). A longer value may come back cut to any length
        over the limit, or as :data:`FOREIGN`: either way it is a miss, counted as
        corrupt and removed, so a planted huge value never costs its size in memory.
        Default: :meth:`_get_blobs` (every value read whole, then refused).
        """
        return self._get_blobs(names)

    def _delete_blobs_if_bad(
        self, names: list[ObjectName], seen: list[Blob | Foreign], limits: list[int | None]
    ) -> Sequence[bool | Exception]:
        """Remove each name's value if it is still the bad one that was read.

        ``seen[i]`` is what :meth:`_get_blobs_within` returned for the name, ``limits[i]``
        the limit it was read with. A store that can compare and delete in one step
        removes the value only while it is still the bytes seen, or (for a value seen
        cut or :data:`FOREIGN`) still longer than the limit or not a value of its kind:
        a good value that another writer stored meanwhile is kept. Default:
        :meth:`_delete_blobs`, which under that race removes the good value too (a later
        miss, never wrong bytes).
        """
        return self._delete_blobs(names)

    def _clear_namespace(self) -> None:
        """Remove every value of this namespace (names :meth:`_is_own_name` accepts), only those.

        Default: not supported.
        """
        raise NotSupportedError(f"{type(self).__name__} does not support clear")

    def _errors(self) -> AbstractContextManager[None]:
        """The context that every call of the implementer's methods runs in.

        By default it applies :attr:`error_map` with :func:`~hicache_storage.errors.map_errors`,
        and turns SDK errors other than store failures (``BackendError``),
        ``NotSupportedError`` and ``ContractViolationError`` into ``BackendError``.
        """
        return _store_errors(self.error_map)

    # ------------------------------------------------------------------ plumbing

    def _results(self, method: str, got: object, n: int) -> Sequence[Any]:
        """``got`` if it holds one result per name, else the call fails (counted)."""
        if (
            isinstance(got, Sequence)
            and not isinstance(got, (str, bytes, bytearray))
            and len(got) == n
        ):
            return got
        what = f"{len(got)} results" if isinstance(got, Sequence) else type(got).__name__
        message = f"{type(self).__name__}.{method} returned {what} for {n} names"
        self._record(contract_violations=1)
        if self.strict_contract:
            raise ContractViolationError(message)
        raise BackendError(message + "; one result per name is due")

    def _answered(self, method: str, value: object) -> bool | None:
        """An implementer's yes/no for one item, or None when ``value`` is not a boolean.

        None is a contract violation: logged and counted, and the item fails.
        """
        answer = as_bool(value)
        if answer is None:
            self._record(contract_violations=1)
            message = f"{type(self).__name__}.{method} answered {type(value).__name__!r}"
            if self.strict_contract:
                raise ContractViolationError(message + ", not a bool")
            self._log("answer:" + method, "%s, not a bool: the item fails", message)
        return answer

    def _item_failed(self, op: str, exc: BaseException) -> None:
        """Log an exception found in a result slot (counted by the caller)."""
        self._log_failure(op, mapped_error(exc, self.error_map))

    def _fetch(
        self, op: str, names: list[ObjectName], targets: Sequence[list[memoryview] | None]
    ) -> list[memoryview | None]:
        """The verified payload of each name, from one call of :meth:`_get_blobs_within`.

        ``targets[i]`` is the views of the name's target (None: a new one, any size).
        ``None`` stands for a miss, a failed item, a value that failed verification or
        one of another size than its target (both removed).
        """
        if not names:
            return []
        most = self.capabilities.max_object_bytes  # (no target: no value is longer)
        sizes = [most if v is None else total_nbytes(v) for v in targets]
        limits = [None if n is None else HEADER_SIZE + n for n in sizes]
        with self._errors():
            got = self._get_blobs_within(names, limits)
        blobs = self._results("_get_blobs", got, len(names))
        out: list[memoryview | None] = []
        failed = 0
        bad: list[int] = []
        for i, (name, blob, limit) in enumerate(zip(names, blobs, limits, strict=True)):
            payload: memoryview | None = None
            if blob is None:
                pass
            elif isinstance(blob, BaseException):
                self._item_failed(op, blob)
                failed += 1
            else:
                try:
                    payload = self._payload(name, blob, limit)
                except UnsupportedFormatError as exc:
                    # A newer release's value in a shared store: a miss here, kept.
                    self._log("newer", "object %s (%s): kept; the read is a miss", name.path, exc)
                except CorruptObjectError as exc:
                    self._record(corrupt_objects=1)
                    self._log(
                        "corrupt", "corrupt object %s (%s): the read is a miss", name.path, exc
                    )
                    bad.append(i)
                except (TypeError, BufferError, ValueError):
                    self._item_failed(
                        op,
                        BackendError(
                            f"{type(self).__name__}._get_blobs returned a "
                            f"{type(blob).__name__}, not a bytes-like value"
                        ),
                    )
                    failed += 1
                if payload is not None and targets[i] is not None and payload.nbytes != sizes[i]:
                    self._record(size_mismatches=1)  # whole and verified, but not the page's
                    self._log("size", "object %s holds %d bytes, its target %d: the read is a "
                              "miss", name.path, payload.nbytes, sizes[i])  # fmt: skip
                    bad.append(i)
                    payload = None
            out.append(payload)
        self._add_item_errors(failed)
        if bad:
            self._remove_corrupt(
                [names[i] for i in bad], [blobs[i] for i in bad], [limits[i] for i in bad]
            )
        return out

    def _payload(self, name: ObjectName, blob: Blob | Foreign, limit: int | None) -> memoryview:
        """The payload of ``blob``, verified as read under ``name`` with ``limit``.

        Raises CorruptObjectError if it does not verify or is longer than ``limit`` (or
        :data:`FOREIGN`), TypeError if it is not a bytes-like value.
        """
        if blob is FOREIGN:
            raise CorruptObjectError("not a value of this store's kind, or too long to read")
        view = memoryview(cast("Blob", blob))
        if limit is not None and view.nbytes > limit:
            raise CorruptObjectError(f"longer than the {limit} bytes its target can take")
        if not view.c_contiguous:
            view = memoryview(view.tobytes())  # checksums and copies need one run of bytes
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        header = decode_header(view[:HEADER_SIZE], name.path)
        payload = view[HEADER_SIZE:]
        if self.options.verify_checksum:
            verify_payload(header, [payload])
        elif payload.nbytes != header.payload_len:
            raise CorruptObjectError(
                f"payload is {payload.nbytes} bytes, header says {header.payload_len}"
            )
        return payload

    def _remove_corrupt(
        self, names: list[ObjectName], seen: list[Blob | Foreign], limits: list[int | None]
    ) -> None:
        """Best effort: remove values found bad (not an item failure)."""
        if not self.remove_corrupt or type(self)._delete_blobs is BlobStore._delete_blobs:
            return
        try:
            with self._errors():
                self._delete_blobs_if_bad(names, seen, limits)
        except Exception as exc:  # noqa: BLE001 - the read already answered a miss
            text = scrub(str(exc), self._secret_values())  # a client's error may quote them
            self._log("corrupt-remove", "cannot remove %d corrupt objects: %s", len(names), text)

    def _fill(self, payload: memoryview, target: Any, views: list[memoryview] | None) -> Any:
        """``target`` filled with ``payload`` (a new tensor when ``views`` is None), or None.

        None means that the sizes differ; the target is then left untouched.
        """
        if views is None:
            tensor, views = new_target(payload.nbytes)
            target = tensor
        if not copy_into(views, payload):
            self._record(size_mismatches=1)
            return None
        self._record(bytes_read=payload.nbytes)
        return target

    def _store(
        self, op: str, names: list[ObjectName], values: list[list[memoryview]]
    ) -> list[bool]:
        """Frame and store each value; one call of :meth:`_put_blobs_if_absent`."""
        limit = self.capabilities.max_object_bytes
        out = [False] * len(names)
        todo: list[int] = []
        blobs: list[Segments] = []
        failed = 0
        for i, (name, views) in enumerate(zip(names, values, strict=True)):
            size = total_nbytes(views)
            if limit is not None and size > limit:
                self._item_failed(
                    op, CapacityError(f"{size}-byte value over max_object_bytes={limit}")
                )
                failed += 1
                continue
            header = encode_header(
                size, checksum(views, self._algorithm), self._algorithm, name.path
            )
            todo.append(i)
            blobs.append([header, *views])
        if todo:
            with self._errors():
                got = self._put_blobs_if_absent([names[i] for i in todo], blobs)
            written = 0
            for i, ok in zip(
                todo, self._results("_put_blobs_if_absent", got, len(todo)), strict=True
            ):
                if isinstance(ok, BaseException):
                    self._item_failed(op, ok)
                    failed += 1
                elif ok is PRESENT:
                    out[i] = True
                elif (answer := self._answered("_put_blobs_if_absent", ok)) is None:
                    failed += 1
                elif answer:
                    out[i] = True
                    written += total_nbytes(values[i])
            self._record(bytes_written=written)
        self._add_item_errors(failed)
        return out

    @override
    def health(self) -> Health:
        """One existence check of a name nothing stores: ``down`` if the store fails it.

        The reason names the error's type only (a message may hold an address).
        """
        base = super().health()
        if not base.usable:
            return base
        try:
            with self._errors():
                got = self._exists_blobs([self.object_name("hicache-health-probe")])
            answers = self._results("_exists_blobs", got, 1)
        except Exception as exc:  # noqa: BLE001 - the probe's answer
            return Health("down", type(exc).__name__)
        if isinstance(answers[0], BaseException):
            return Health("down", type(answers[0]).__name__)
        return Health("ok")

    def _ask_exists(self, op: str, names: list[ObjectName]) -> list[bool]:
        """Whether each name holds a value; a failed item is False (counted)."""
        out = self._exists_status(op, names)
        self._add_item_errors(sum(x is None for x in out))
        return [x is True for x in out]

    def _exists_status(self, op: str, names: list[ObjectName]) -> list[bool | None]:
        """Whether each name holds a value; ``None`` for an item the store failed.

        A failure is logged, not counted: the caller counts what mattered to its answer.
        """
        if not names:
            return []
        with self._errors():
            got = self._exists_blobs(names)
        out: list[bool | None] = []
        for present in self._results("_exists_blobs", got, len(names)):
            if isinstance(present, BaseException):
                self._item_failed(op, present)
                out.append(None)
            else:
                out.append(self._answered("_exists_blobs", present))
        return out

    # ------------------------------------------------------------------ engine-facing

    @override
    def get(self, key: str, target: Any = None) -> Any:
        name = self.object_name(key)
        views = None if target is None else target_views(target)
        (payload,) = self._fetch("get", [name], [views])
        return None if payload is None else self._fill(payload, target, views)

    @override
    def batch_get(self, keys: list[str], targets: Sequence[Any] | None = None) -> list[Any]:
        slots = list(targets) if targets is not None else [None] * len(keys)
        views = [None if t is None else target_views(t) for t in slots]
        payloads = self._fetch("batch_get", self.object_names(keys), views)
        return [
            None if p is None else self._fill(p, t, v)
            for p, t, v in zip(payloads, slots, views, strict=True)
        ]

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        views = [target_views(page) for page in pages]  # refuses read-only pages first
        payloads = self._fetch("batch_get_pages", self.object_names(keys), views)
        return [
            p is not None and self._fill(p, page, v) is not None
            for p, page, v in zip(payloads, pages, views, strict=True)
        ]

    @override
    def set(self, key: str, value: Any) -> bool:
        return self._store("set", [self.object_name(key)], [source_views(value)])[0]

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        views = [source_views(v) for v in values]
        return self._store("batch_set", self.object_names(keys), views)

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._store("batch_set_pages", self.object_names(keys), [p.views for p in pages])

    @override
    def exists(self, key: str) -> bool:
        """True if ``key`` holds a value; the value itself is not read.

        A corrupt value therefore exists until a read finds it out (and removes it).
        """
        return self._ask_exists("exists", [self.object_name(key)])[0]

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading keys present; nothing past the first miss is asked about.

        The store is asked in growing chunks (see :attr:`exists_chunk`).
        """
        names = self.object_names(keys)
        count = 0
        chunk = self.exists_chunk if self.exists_chunk > 0 else max(1, len(names))
        while count < len(names):
            for present in self._exists_status("batch_exists", names[count : count + chunk]):
                if not present:
                    # Only a failure that ended the run failed the answer: one past a
                    # plain miss changed nothing (and must not count for the breaker).
                    self._add_item_errors(int(present is None))
                    return count
                count += 1
            chunk *= 2
        return count

    @override
    def batch_exists_each(self, keys: list[str]) -> list[bool]:
        """Whether each key holds a value, asked for every key at once."""
        return self._ask_exists("batch_exists_each", self.object_names(keys))

    @override
    def delete(self, key: str) -> bool:
        name = self.object_name(key)
        with self._errors():
            got = self._delete_blobs([name])
        (done,) = self._results("_delete_blobs", got, 1)
        if isinstance(done, BaseException):
            raise mapped_error(done, self.error_map)
        answer = self._answered("_delete_blobs", done)
        if answer is None:
            raise BackendError(f"{type(self).__name__}._delete_blobs gave no yes/no answer")
        if answer:
            self._removed([key])
        return answer

    @override
    def clear(self) -> None:
        with self._errors():
            self._clear_namespace()
        self._removed(None)
