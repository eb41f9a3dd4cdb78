"""Deliberately broken backends: each breaks one rule the conformance kit enforces.

``MemStore`` is a correct, minimal, process-local store (the control); every other class
breaks exactly one rule, the way real backends in the field have. The kit must fail each
with a message naming that rule (tests/conformance_kit/test_teeth.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hicache_storage import Capabilities, HiCacheStorage, HostKVPool, PageBuffer, StorageConfig
from hicache_storage.backends import FileBackend
from hicache_storage.buffers import copy_into, is_tensor, source_views, target_views, total_nbytes
from hicache_storage.keys import ObjectName
from hicache_storage.storekit.header import checksum, encode_header

_DATA: dict[str, bytes] = {}
_LOCK = threading.Lock()


def _fill(target: Any, blob: bytes) -> Any:
    return target if copy_into(target_views(target), blob) else None


def _tensor(blob: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if blob
        else torch.empty(0, dtype=torch.uint8)
    )


class MemStore(HiCacheStorage):
    """Correct: one dict per process, shared by every instance (so clear() is store-wide)."""

    capabilities = Capabilities(delete=True)

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)

    def _name(self, key: str) -> str:
        return self.object_name(key).path

    def get(self, key: str, target: Any = None) -> Any:
        with _LOCK:
            blob = _DATA.get(self._name(key))
        if blob is None:
            return None
        return _tensor(blob) if target is None else _fill(target, blob)

    def set(self, key: str, value: Any) -> bool:
        blob = b"".join(source_views(value))
        with _LOCK:
            _DATA.setdefault(self._name(key), blob)
        return True

    def exists(self, key: str) -> bool:
        with _LOCK:
            return self._name(key) in _DATA

    def delete(self, key: str) -> bool:
        with _LOCK:
            return _DATA.pop(self._name(key), None) is not None

    def clear(self) -> None:
        prefix = self.namespace.digest + "/"
        with _LOCK:
            for name in [n for n in _DATA if n.startswith(prefix)]:
                del _DATA[name]


class WrongLengthBatchGet(MemStore):
    def batch_get(self, keys: list[str], targets: Any = None) -> Any:
        return [None] * (len(keys) + 1)


class AllHitsBatchExists(MemStore):
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return sum(self.exists(k) for k in keys)  # counts every hit, not the leading run


class ClearsEverything(MemStore):
    def clear(self) -> None:
        with _LOCK:
            _DATA.clear()  # the reference file backend's bug: every tenant gone


class NotUsableAfterClear(MemStore):
    def clear(self) -> None:
        super().clear()
        self._cleared = True

    def set(self, key: str, value: Any) -> bool:
        if getattr(self, "_cleared", False):
            raise ConnectionError("connection dropped by clear()")
        return super().set(key, value)


class PartialFill(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        with _LOCK:
            blob = _DATA.get(self._name(key))
        if blob is None or target is None:
            return super().get(key, target)
        view = target_views(target)[0]
        n = min(view.nbytes, len(blob))
        view[:n] = blob[:n]  # fills what fits, then reports a miss
        return target if n == len(blob) == view.nbytes else None


class ReplacesExisting(MemStore):
    def set(self, key: str, value: Any) -> bool:
        with _LOCK:
            _DATA[self._name(key)] = b"".join(source_views(value))
        return True


class IgnoresNamespace(MemStore):
    def _name(self, key: str) -> str:
        return key  # the reference engine's dtype / tenant collisions


class NoneFromV1(MemStore):
    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> Any:
        return None  # the 0.5.23 default body

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> Any:
        return [True] * (2 * len(keys))  # K and V counted separately


class MissIsError(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        if not self.exists(key):
            raise KeyError(key)  # a miss is not an error
        return super().get(key, target)


class ClaimsZeroCopy(MemStore):
    capabilities = Capabilities(zero_copy=True, delete=True)


class SharedStaging(MemStore):
    """One bounce buffer for both directions, no lock: corrupts under two threads."""

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self._staging = bytearray(1 << 20)

    def set(self, key: str, value: Any) -> bool:
        blob = b"".join(source_views(value))
        self._staging[: len(blob)] = blob
        time.sleep(0.0005)
        with _LOCK:
            _DATA.setdefault(self._name(key), bytes(self._staging[: len(blob)]))
        return True

    def get(self, key: str, target: Any = None) -> Any:
        with _LOCK:
            blob = _DATA.get(self._name(key))
        if blob is None:
            return None
        self._staging[: len(blob)] = blob
        time.sleep(0.0005)
        data = bytes(self._staging[: len(blob)])
        return _tensor(data) if target is None else _fill(target, data)


class ForgetfulPersistent(MemStore):
    """Claims persistence, keeps pages per instance."""

    capabilities = Capabilities(delete=True, persistent=True)

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self._mine: dict[str, bytes] = {}

    def get(self, key: str, target: Any = None) -> Any:
        blob = self._mine.get(self._name(key))
        if blob is None:
            return None
        return _tensor(blob) if target is None else _fill(target, blob)

    def set(self, key: str, value: Any) -> bool:
        self._mine.setdefault(self._name(key), b"".join(source_views(value)))
        return True

    def exists(self, key: str) -> bool:
        return self._name(key) in self._mine

    def delete(self, key: str) -> bool:
        return self._mine.pop(self._name(key), None) is not None

    def clear(self) -> None:
        self._mine.clear()


class ClaimsShared(MemStore):
    """Claims other processes see its pages; they live in this process only."""

    capabilities = Capabilities(delete=True, shared=True)


class OverflowingV1(MemStore):
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        out = []
        for key, page in zip(keys, pages, strict=True):
            with _LOCK:
                blob = _DATA.get(self._name(key))
            if blob is None or len(blob) != page.nbytes:
                out.append(False)
                continue
            off = 0
            for seg in page.segments:
                chunk = blob[off : off + seg.nbytes] + b"\xee"  # one byte too many
                ctypes.memmove(seg.ptr, chunk, len(chunk))
                off += seg.nbytes
            out.append(True)
        return out


class DropsValueHalf(MemStore):
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        for key, page in zip(keys, pages, strict=True):
            with _LOCK:
                _DATA.setdefault(self._name(key), bytes(page.segments[0].memoryview))  # K only
        return [True] * len(keys)


class ReversedSegments(MemStore):
    """v1 round-trips, but stores a page's segments in reverse order (legacy reads differ)."""

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        for key, page in zip(keys, pages, strict=True):
            with _LOCK:
                _DATA.setdefault(
                    self._name(key), b"".join(bytes(s.memoryview) for s in reversed(page.segments))
                )
        return [True] * len(keys)

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        out = []
        for key, page in zip(keys, pages, strict=True):
            with _LOCK:
                blob = _DATA.get(self._name(key))
            if blob is None or len(blob) != page.nbytes:
                out.append(False)
                continue
            off = 0
            for seg in reversed(page.segments):
                seg.memoryview[:] = blob[off : off + seg.nbytes]
                off += seg.nbytes
            out.append(True)
        return out


class DropsLargeValues(MemStore):
    def set(self, key: str, value: Any) -> bool:
        if total_nbytes(source_views(value)) > 16 * 2**20:
            return True  # says stored, stores nothing
        return super().set(key, value)


class AcceptsAnything(MemStore):
    def set(self, key: str, value: Any) -> bool:
        with _LOCK:
            _DATA.setdefault(self._name(key), repr(value).encode())
        return True


class IgnoresTarget(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        with _LOCK:
            blob = _DATA.get(self._name(key))
        return None if blob is None else _tensor(blob)  # a new tensor even when given a target


class WriteBehind(MemStore):
    """Acknowledges a write before it is visible (an asynchronous flush)."""

    def set(self, key: str, value: Any) -> bool:
        name, blob = self._name(key), b"".join(source_views(value))

        def flush() -> None:
            with _LOCK:
                _DATA.setdefault(name, blob)

        timer = threading.Timer(0.3, flush)
        timer.daemon = True
        timer.start()
        return True


class ZeroesTargetOnMiss(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        if target is not None and not self.exists(key):
            for view in target_views(target):
                view[:] = bytes(view.nbytes)
            return None
        return super().get(key, target)


class HitOnSizeMismatch(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        with _LOCK:
            blob = _DATA.get(self._name(key))
        if blob is None or target is None:
            return super().get(key, target)
        view = target_views(target)[0]
        n = min(view.nbytes, len(blob))
        view[:n] = blob[:n]
        return target  # reports a hit whatever the sizes


class DeleteNoop(MemStore):
    def delete(self, key: str) -> bool:
        return True


class UncheckedV1Indices(MemStore):
    """Takes each page's first index and rounds it down, whatever the indices were."""

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        pool = self.mem_pool_host
        assert isinstance(pool, HostKVPool)  # the kit registers a HostKVPool
        ps = pool.page_size
        for i, key in enumerate(keys):
            first = int(host_indices[i * ps]) if i * ps < len(host_indices) else 0
            page = min(first // ps, pool.num_pages - 1)
            (buf,) = pool.page_buffers(range(page * ps, (page + 1) * ps))
            self.set(key, buf)
        return [True] * len(keys)


class V1WithoutPool(MemStore):
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        if self.mem_pool_host is None:
            return [True] * len(keys)  # nothing to copy from, says stored anyway
        result: list[bool] = super().batch_set_v1(keys, host_indices, extra_info)
        return result


class EmptyValuesLost(MemStore):
    def set(self, key: str, value: Any) -> bool:
        if total_nbytes(source_views(value)) == 0:
            return True
        return super().set(key, value)


class StatsNone(MemStore):
    def get_stats(self, reset: bool = True) -> Any:
        return None


class BytesNotTensor(MemStore):
    def get(self, key: str, target: Any = None) -> Any:
        if target is None:
            with _LOCK:
                return _DATA.get(self._name(key))
        return super().get(key, target)


class EmptyOnMiss(MemStore):
    """Returns an empty value for a miss, as some store clients do."""

    def get(self, key: str, target: Any = None) -> Any:
        got = super().get(key, target)
        return torch.empty(0, dtype=torch.uint8) if got is None else got


class ZeroFillsTensorOnMiss(MemStore):
    """The engine's case: a miss into a tensor target (the engine's staging page) is
    zero-filled and reported as a hit; buffer targets are handled correctly."""

    def get(self, key: str, target: Any = None) -> Any:
        if is_tensor(target) and not self.exists(key):
            target.zero_()
            return target
        return super().get(key, target)


class WrapsAt64(MemStore):
    """Stages a batch's pages through a 64-entry descriptor ring that is not refreshed when
    it wraps: right for every batch up to 64 pages, page i of a 128-page batch gets page
    i-64's bytes (and reports True)."""

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        ring: list[bytes | None] = [None] * 64
        for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
            slot = i % 64
            if ring[slot] is None:
                ring[slot] = page.tobytes()
            with _LOCK:
                _DATA.setdefault(self._name(key), ring[slot] or b"")
        return [True] * len(keys)


class ExistsCapped64(MemStore):
    """Answers batch_exists with one pipelined round trip of at most 64 keys: right for
    small batches, under-counts the engine's 128 (prefetches it then never asks for)."""

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        count = 0
        for k in keys[:64]:
            if not self.exists(k):
                break
            count += 1
        return count


class Int64Ids(MemStore):
    """Names objects by the int64 of a key's first 16 hex characters (the engine's own
    KV-event id): distinct for page hashes, colliding for the keys derived from one
    (``<hash>_k``, ``<hash>_v``, ``<hash>.mamba``, rank suffixes)."""

    def _name(self, key: str) -> str:
        head = key[:16]
        if len(head) == 16 and all(c in "0123456789abcdef" for c in head):
            key = str(int(head, 16))
        return self.object_name(key).path


class SwallowsStoreErrors(FileBackend):
    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        try:
            return super()._write(name, views)
        except Exception:  # noqa: BLE001 - the very bug this class demonstrates
            return True  # "stored"


@contextlib.contextmanager
def broken_directory(backend: HiCacheStorage) -> Iterator[None]:
    """Replace a file backend's namespace directory by a regular file, then restore it."""
    directory = backend.directory  # type: ignore[attr-defined]
    os.rename(directory, directory + ".aside")
    with open(directory, "wb") as f:
        f.write(b"not a directory")
    try:
        yield
    finally:
        os.unlink(directory)
        os.rename(directory + ".aside", directory)


class InPlaceFile(FileBackend):
    """Writes the final file in place, slowly: readers and crashes see partial pages."""

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        path = self._path(name)
        if os.path.exists(path):
            return True
        os.makedirs(os.path.dirname(path), exist_ok=True)
        header = encode_header(total_nbytes(views), checksum(views, 1), 1, name.path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, header)
            for view in views:
                for off in range(0, view.nbytes, 1 << 18):
                    os.write(fd, view[off : off + (1 << 18)])
                    time.sleep(0.002)
        finally:
            os.close(fd)
        return True


__all__ = [
    name
    for name, obj in globals().items()
    if isinstance(obj, type) and issubclass(obj, HiCacheStorage)
]


class SetReportsExisted(MemStore):
    """Answers ``set`` with whether the key was there before (a SETNX-style reply read
    backwards): a new key is stored, and reported False."""

    def set(self, key: str, value: Any) -> bool:
        existed = self.exists(key)
        super().set(key, value)
        return existed


class BatchSetReportsFalse(MemStore):
    """Stores a batch, then reports each key by comparing its client's reply (``b"OK"``)
    with True: every key of the batch reads as not stored."""

    def batch_set(self, keys: list[str], values: Any) -> list[bool]:
        replies: list[Any] = []
        for k, v in zip(keys, values, strict=True):
            replies.append(b"OK" if self.set(k, v) else b"ERR")
        return [reply is True for reply in replies]


class ExistsStopsShort(MemStore):
    """Counts the leading run of ``batch_exists`` with a loop that never reaches the last
    key: one short whenever the whole batch is present."""

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        count = 0
        for k in keys[:-1]:
            if not self.exists(k):
                break
            count += 1
        return count


class DropsPastBatchBudget(MemStore):
    """Buffers a batch's pages in an 8 MiB client-side pipeline and drops what does not
    fit, still reporting True: right for small batches, loses the tail of a big one."""

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        budget = 8 * 2**20
        for key, page in zip(keys, pages, strict=True):
            budget -= page.nbytes
            if budget >= 0:
                self.set(key, page)
        return [True] * len(keys)


class DropsFirstWrite(FileBackend):
    """Connects lazily and drops the request that opened the connection: the first write
    of each process reports failure. Nothing is wrong in a process that starts by
    reading; a fresh writer process (the kit's workers) fails at once."""

    _connected = False
    _connect_lock = threading.Lock()

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        with self._connect_lock:
            first, DropsFirstWrite._connected = not DropsFirstWrite._connected, True
        return False if first else super()._write(name, views)


__all__ += [
    "BatchSetReportsFalse",
    "DropsFirstWrite",
    "DropsPastBatchBudget",
    "ExistsStopsShort",
    "SetReportsExisted",
]


class OneSlotPerKey(MemStore):
    """Keeps one slot per key, tagged with the writer's namespace: another namespace's write
    evicts the page, so a namespace's own page reads back as a miss (None where the kit
    expects bytes)."""

    def set(self, key: str, value: Any) -> bool:
        with _LOCK:
            _DATA[key] = self.namespace.digest.encode() + b"\0" + b"".join(source_views(value))
        return True

    def _mine(self, key: str) -> bytes | None:
        with _LOCK:
            blob = _DATA.get(key)
        tag = self.namespace.digest.encode() + b"\0"
        return blob[len(tag) :] if blob is not None and blob.startswith(tag) else None

    def get(self, key: str, target: Any = None) -> Any:
        blob = self._mine(key)
        if blob is None:
            return None
        return _tensor(blob) if target is None else _fill(target, blob)

    def exists(self, key: str) -> bool:
        return self._mine(key) is not None


class DecodedResponses(MemStore):
    """Returns a value read without a target as text, as a Redis client built with
    ``decode_responses=True`` does: neither bytes nor a tensor."""

    def get(self, key: str, target: Any = None) -> Any:
        got = super().get(key, target)
        if target is None and got is not None:
            return got.numpy().tobytes().decode("latin-1")
        return got


class SkipsWideTensorTargets(MemStore):
    """Fills a tensor target only when it is uint8, and returns a wider one (int32,
    bfloat16...) as it was, reported as a hit: a dtype branch that forgot to copy."""

    def get(self, key: str, target: Any = None) -> Any:
        if is_tensor(target) and target.dtype != torch.uint8 and self.exists(key):
            return target
        return super().get(key, target)


class RefusesFloat8(MemStore):
    """Raises in its constructor for a KV dtype it was not written for."""

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        if self.namespace.dtype.startswith("float8"):
            raise ValueError(f"unsupported dtype {self.namespace.dtype}")


class RemembersFailedWrites(FileBackend):
    """A write-behind index: each name is noted before its write is tried, and a name the
    store does not hold but the index does counts as present (its write is "on its way").
    A write that raised while the store was down then exists for good, and never reads."""

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._index: set[str] = set()

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        self._index.add(name.path)
        return super()._write(name, views)

    def exists(self, key: str) -> bool:
        on_disk = self._exists_at(self._root_prefix + self.object_path(key))  # raises when down
        return on_disk or self.object_name(key).path in self._index

    def delete(self, key: str) -> bool:
        self._index.discard(self.object_name(key).path)
        return super().delete(key)

    def clear(self) -> None:
        self._index.clear()
        super().clear()


class FaultHookWithoutBackend(FileBackend):
    """A correct store, qualified with :func:`paused_directory`, a ``break_store`` hook
    written to the zero-argument shape docs/vendors.md once showed."""


@contextlib.contextmanager
def paused_directory() -> Iterator[None]:
    """A ``break_store`` hook of the wrong shape: the kit calls ``break_store(backend)``."""
    yield


__all__ += [
    "DecodedResponses",
    "FaultHookWithoutBackend",
    "OneSlotPerKey",
    "RefusesFloat8",
    "RemembersFailedWrites",
    "SkipsWideTensorTargets",
]


class IgnoresPool(MemStore):
    """Names objects by the namespace without its ``pool``: a hybrid model's side pools
    (Mamba states, SWA pages) land on the KV pool's objects of the same keys."""

    def _name(self, key: str) -> str:
        import dataclasses

        return f"{dataclasses.replace(self.namespace, pool='').digest}/{key}"


class WarmNamespaceExists(MemStore):
    """Answers ``exists`` from a per-namespace "warm" flag (any page stored there), as a
    store that assumes pages only ever come as leading runs might: sparse states (a
    Mamba state where a radix node ended) all look present."""

    def exists(self, key: str) -> bool:
        prefix = self.namespace.digest + "/"
        with _LOCK:
            return any(name.startswith(prefix) for name in _DATA)


class DropsSmallSegments(MemStore):
    """Stores only a page's segments of 64 bytes or more, as a store that assumes every
    segment is a whole K or V half might: a head group's 16-byte writer tag is lost, and
    its objects come back shorter than stored."""

    def set(self, key: str, value: Any) -> bool:
        if isinstance(value, PageBuffer):
            value = b"".join(bytes(s.memoryview) for s in value.segments if s.nbytes >= 64)
        return super().set(key, value)
