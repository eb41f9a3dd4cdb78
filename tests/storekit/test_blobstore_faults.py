"""BlobStore, wrappers and the guard under the faults a review found: secrets in a
removal log, implementer answers that are not booleans, SDK errors raised deep in a
client, buffers that are not contiguous, newer formats in a shared store, no-op puts in
the byte counters, closed instances that still delete, wrappers reading state too early."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from hicache_storage import Capabilities, PageBuffer, Segment, StorageConfig, WrapperBackend
from hicache_storage.backends import FileBackend, MemoryBackend
from hicache_storage.buffers import memoryview_at
from hicache_storage.conformance.wrappers import FaultyBackend
from hicache_storage.errors import (
    BackendClosedError,
    BackendError,
    ConfigError,
    ErrorMap,
    InvalidTypeError,
    NotSupportedError,
    map_errors,
)
from hicache_storage.keys import ObjectName
from hicache_storage.storekit.blobstore import BlobOptions, BlobStore, Segments
from hicache_storage.storekit.header import HEADER_SIZE

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-PASSWORD-42"


@dataclass(frozen=True)
class SecretOptions(BlobOptions):
    password: str = ""


class Scripted(BlobStore[SecretOptions]):
    """A dict store whose answers and failures each test scripts."""

    name = "scripted"
    capabilities = Capabilities(delete=True)
    options_class = SecretOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(StorageConfig(), **options)
        self.data: dict[str, Any] = {}
        self.put_answer: object = True
        self.exists_answer: object = None  # None: the truth
        self.raise_in_get: Exception | None = None
        self.raise_in_delete: Exception | None = None

    def _get_blobs(self, names: list[ObjectName]) -> Sequence[Any]:
        if self.raise_in_get is not None:
            raise self.raise_in_get
        return [self.data.get(n.path) for n in names]

    def _put_blobs_if_absent(self, names: list[ObjectName], blobs: list[Segments]) -> list[Any]:
        for n, b in zip(names, blobs, strict=True):
            self.data.setdefault(n.path, b"".join(b))
        return [self.put_answer] * len(names)

    def _exists_blobs(self, names: list[ObjectName]) -> list[Any]:
        if self.exists_answer is not None:
            return [self.exists_answer] * len(names)
        return [n.path in self.data for n in names]

    def _delete_blobs(self, names: list[ObjectName]) -> list[Any]:
        if self.raise_in_delete is not None:
            raise self.raise_in_delete
        return [self.data.pop(n.path, None) is not None for n in names]

    def _clear_namespace(self) -> None:
        self.data.clear()


def test_the_corrupt_removal_log_never_quotes_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    b = Scripted(password=SECRET)
    assert b.set("k", b"x" * 64)
    path = b.object_name("k").path
    b.data[path] = b.data[path][: HEADER_SIZE + 10]  # truncated: corrupt, to be removed
    b.raise_in_delete = ConnectionError(f"auth failed for redis://:{SECRET}@127.0.0.1:1/0")
    with caplog.at_level(logging.DEBUG):
        assert b.get("k") is None
    assert "cannot remove" in caplog.text  # the removal failed and was logged...
    assert SECRET not in caplog.text  # ...without the password


@pytest.mark.parametrize("answer", ["stored?", 0.5, object(), KeyError, 2])
def test_a_put_answer_that_is_not_a_bool_is_never_a_success(answer: object) -> None:
    b = Scripted()
    b.put_answer = answer
    b.get_stats()
    assert b.set("k", b"v") is False
    stats = b.get_stats()
    assert stats.contract_violations == 1
    assert stats.op("set").errors == 1
    assert stats.bytes_written == 0


@pytest.mark.parametrize("answer", ["no", "0", 0.0, object()])
def test_an_exists_answer_that_is_not_a_bool_is_a_miss(answer: object) -> None:
    b = Scripted()
    assert b.set("a", b"1")
    b.exists_answer = answer
    assert b.exists("a") is False
    assert b.batch_exists(["a", "b"]) == 0
    assert b.get_stats().contract_violations >= 2


def test_numpy_and_int_booleans_are_answers() -> None:
    import numpy as np

    b = Scripted()
    for answer in (np.bool_(True), 1):
        b.put_answer = answer
        assert b.set(f"k{answer!r}", b"v") is True
    b.exists_answer = np.bool_(True)
    assert b.exists("anything") is True


@pytest.mark.parametrize("error", [ConfigError("bad endpoint"), InvalidTypeError("deep")])
def test_an_sdk_argument_error_inside_the_store_is_a_store_failure(error: Exception) -> None:
    """The caller's arguments were checked already: this is the store failing, so the
    engine gets the failure shape, not the exception."""
    b = Scripted()
    b.raise_in_get = error
    assert b.get("k") is None
    assert b.batch_get(["a", "b"]) == [None, None]
    assert b.get_stats().op("batch_get").errors == 2


def test_an_unsupported_delete_still_says_so() -> None:
    class NoDelete(Scripted):
        _delete_blobs = BlobStore._delete_blobs  # type: ignore[assignment]

    with pytest.raises(NotSupportedError):
        NoDelete().delete("k")


def test_a_non_contiguous_value_fails_nobody_else() -> None:
    b = Scripted()
    assert b.set("good", b"A" * 4) and b.set("odd", b"B" * 4)
    odd = b.object_name("odd").path
    doubled = bytearray(len(b.data[odd]) * 2)
    doubled[::2] = b.data[odd]
    b.data[odd] = memoryview(doubled)[::2]  # the right bytes, as a strided view
    got = b.batch_get(["good", "odd"])
    assert [bytes(t.numpy()) for t in got] == [b"A" * 4, b"B" * 4]


def _newer(blob: bytes) -> bytes:
    """``blob`` with its header's version raised to 99 (and its CRC made right)."""
    head = bytearray(blob[:40])
    head[4] = 99
    return bytes(head) + struct.pack("<II", zlib.crc32(bytes(head)), 0) + blob[HEADER_SIZE:]


def test_a_newer_formats_value_is_a_miss_but_is_kept() -> None:
    b = Scripted()
    assert b.set("k", b"v" * 10)
    path = b.object_name("k").path
    b.data[path] = _newer(b.data[path])
    assert b.get("k") is None
    assert path in b.data  # another release's page: not removed
    b.data[path] = b.data[path][:4] + b"\x02" + b.data[path][5:]  # version byte damaged
    assert b.get("k") is None
    assert path not in b.data  # damage (the header CRC fails): removed


def test_the_file_backend_keeps_a_newer_formats_object(root: str) -> None:
    b = FileBackend(StorageConfig(), root=root)
    assert b.set("k", b"v" * 10)
    path = b._path(b.object_name("k"))
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:  # file-like stores keep the header as a trailer
        f.write(blob[:-HEADER_SIZE] + _newer(blob[-HEADER_SIZE:]))
    assert b.get("k") is None
    assert Path(path).exists()
    b.close()


def test_a_no_op_set_writes_no_bytes() -> None:
    b = MemoryBackend(store="faults-noop")
    try:
        assert b.set("k", b"x" * 100)
        assert b.get_stats().bytes_written == 100
        assert b.set("k", b"y" * 100)  # already there: first writer wins, nothing written
        assert b.batch_set(["k", "k2"], [b"z" * 100, b"w" * 50]) == [True, True]
        assert b.get_stats().bytes_written == 50
        assert bytes(b.get("k").numpy()) == b"x" * 100
    finally:
        b.clear()
        b.close()


def test_a_closed_instance_does_not_delete_or_clear_a_shared_store() -> None:
    a, other = MemoryBackend(store="faults-closed"), MemoryBackend(store="faults-closed")
    try:
        assert a.set("k1", b"1") and a.set("k2", b"2")
        a.close()
        with pytest.raises(BackendClosedError):
            a.delete("k1")
        with pytest.raises(BackendClosedError):
            a.clear()
        assert other.exists("k1") and other.exists("k2")
    finally:
        other.clear()
        other.close()


def test_a_failed_nested_batch_counts_every_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_get_v1 runs batch_get_pages as a nested call: when the store is down, every
    page of the batch is an error, not one."""
    from hicache_storage.conformance.data import make_pool, pool_namespace

    pool = make_pool(num_pages=4)
    b = MemoryBackend(StorageConfig(namespace=pool_namespace(pool)), store="faults-nested")
    b.register_mem_pool_host(pool)

    def down(names: object) -> list[bool]:
        raise ConnectionError("down")

    monkeypatch.setattr(b, "_get_blobs", down)
    monkeypatch.setattr(b, "_put_blobs_if_absent", lambda names, blobs: down(names))
    b.get_stats()
    idx = torch.arange(4 * pool.page_size)
    keys = ["a", "b", "c", "d"]
    assert b.batch_set_v1(keys, idx) == [False] * 4
    assert b.batch_get_v1(keys, idx) == [False] * 4
    stats = b.get_stats()
    assert stats.op("batch_set_v1").errors == 4
    assert stats.op("batch_get_v1").errors == 4
    b.close()


def test_a_wrapper_reads_capabilities_and_pool_of_its_inner_backend_at_each_use() -> None:
    from hicache_storage.conformance.data import make_pool, pool_namespace

    pool = make_pool(num_pages=2)
    inner = MemoryBackend(StorageConfig(namespace=pool_namespace(pool)), store="faults-wrap")
    w = WrapperBackend(inner)
    inner.capabilities = Capabilities(delete=True, max_object_bytes=123456)  # refined later
    assert w.capabilities.max_object_bytes == 123456
    inner.register_mem_pool_host(pool)  # registered on inner after wrapping
    idx = torch.arange(pool.page_size)
    assert w.batch_set_v1(["p"], idx) == [True]
    assert w.batch_get_v1(["p"], idx) == [True]
    w.capabilities = Capabilities()  # the wrapper's own, when set
    assert w.capabilities.max_object_bytes is None
    inner.clear()
    w.close()


def test_injected_page_failures_count_as_errors() -> None:
    from hicache_storage.conformance.data import make_pool, pool_namespace

    pool = make_pool(num_pages=8)
    inner = MemoryBackend(StorageConfig(namespace=pool_namespace(pool)), store="faults-inj")
    f = FaultyBackend(inner, failure_rate=1.0, partial=True, seed=1)
    f.register_mem_pool_host(pool)
    assert (
        f.batch_set_v1([f"k{i}" for i in range(8)], torch.arange(8 * pool.page_size)) == [False] * 8
    )
    assert f.get_stats().op("batch_set_v1").errors == 8
    inner.clear()
    f.close()


def test_a_page_with_a_read_only_segment_is_refused_before_any_byte_is_written() -> None:
    writable = torch.zeros(8, dtype=torch.uint8)
    ro = memoryview(bytes(8))
    page = PageBuffer(
        [
            Segment(
                int(writable.data_ptr()), 8, memoryview_at(int(writable.data_ptr()), 8, writable)
            ),
            Segment(0, 8, ro),
        ]
    )
    b = Scripted()
    assert b.set("k", bytes(range(16)))
    with pytest.raises(InvalidTypeError, match="read-only"):
        b.get("k", page)
    assert bytes(writable.numpy()) == bytes(8)  # untouched


def test_map_errors_never_maps_an_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt), map_errors({BaseException: BackendError}):
        raise KeyboardInterrupt


def test_the_sqlite_example_refuses_a_private_in_memory_database() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from hicache_storage.errors import ConfigError\n"
        "from hicache_vendor_example import SQLiteBackend\n"
        "for path in (':memory:', 'file:x?mode=memory'):\n"
        "    try:\n"
        "        SQLiteBackend(path=path)\n"
        "    except ConfigError as exc:\n"
        "        print('refused', 'memory' in str(exc))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "examples" / "vendor-backend")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.split() == ["refused", "True", "refused", "True"], r.stderr


def test_the_guard_takes_numpy_booleans_for_what_they_say() -> None:
    """numpy 2's boolean scalar is ``numpy.bool``: a backend answering with one (a numpy
    mask, say) must not see its True replaced by False as a contract violation."""
    import numpy as np

    class NumpyAnswers(Scripted):
        def set(self, key: str, value: Any) -> bool:
            super().set(key, value)
            return np.bool_(True)  # type: ignore[return-value]

        def exists(self, key: str) -> bool:
            return np.bool_(super().exists(key))  # type: ignore[return-value]

    b = NumpyAnswers()
    assert b.set("k", b"v") is True
    assert b.exists("k") is True and b.exists("nope") is False
    assert b.get_stats().contract_violations == 3  # each non-bool answer is still reported


def test_a_blob_store_class_with_unusable_declarations_is_refused_when_defined() -> None:
    @dataclass(frozen=True)
    class PlainOptions:  # not a BlobOptions: no checksum fields for the base to read
        endpoint: str = ""

    with pytest.raises(TypeError, match="BlobOptions"):

        class BadOptions(Scripted):
            options_class = PlainOptions  # type: ignore[assignment]

    with pytest.raises(TypeError, match="BackendError"):

        class BadMap(Scripted):
            error_map: ClassVar[ErrorMap] = {KeyError: ConfigError}  # type: ignore[dict-item]


# --------------------------------------------------------------------------- second round


def test_a_subclass_close_that_calls_super_closes_the_inner_backend() -> None:
    """close() is guarded on every class that defines it: the guard must let a subclass's
    super().close() run the parent's close, or a wrapper never closes what it wraps."""
    order: list[str] = []

    class Flushing(WrapperBackend):
        def close(self) -> None:
            order.append("flush")
            super().close()

    inner = MemoryBackend(store="faults-superclose")
    w = Flushing(inner)
    w.close()
    w.close()  # idempotent: the bodies ran once
    assert order == ["flush"]
    assert inner.closed and w.closed
    with pytest.raises(BackendClosedError):
        inner.delete("k")


def test_close_called_again_from_inside_close_does_not_recurse() -> None:
    calls: list[str] = []

    class Reentrant(Scripted):
        def close(self) -> None:
            calls.append("close")
            self.close()  # the same body again: returns at once

    b = Reentrant()
    b.close()
    assert calls == ["close"] and b.closed


def test_batch_get_pages_refuses_a_read_only_page_before_writing_any() -> None:
    writable = torch.zeros(8, dtype=torch.uint8)
    page = PageBuffer(
        [
            Segment(
                int(writable.data_ptr()), 8, memoryview_at(int(writable.data_ptr()), 8, writable)
            ),
            Segment(0, 8, memoryview(bytes(8))),
        ]
    )
    b = Scripted()
    assert b.set("k", bytes(range(16)))
    with pytest.raises(InvalidTypeError, match="read-only"):
        b.batch_get_pages(["k"], [page])
    assert bytes(writable.numpy()) == bytes(8)


def test_a_nested_failure_after_reported_item_errors_counts_each_item_once() -> None:
    class Chunked(Scripted):
        def batch_get_pages(self, keys: list[str], pages: Any) -> list[bool]:
            self._add_item_errors(1)  # one item reported failed...
            raise ConnectionError("...then the whole call fails")

        def batch_get(self, keys: list[str], targets: Any = None) -> list[Any]:
            return [None] * 2 + [
                bool(x) for x in self.batch_get_pages(keys[2:], [None] * len(keys[2:]))
            ]

    b = Chunked()
    b.batch_get(["a", "b", "c", "d"])
    op = b.get_stats().op("batch_get")
    assert op.errors == 2  # c and d, once each: not 1 + 2
    assert op.items == 4


def test_numpy_answers_in_lists_and_counts_keep_their_meaning() -> None:
    import numpy as np

    class Vectorised(Scripted):
        def batch_set(self, keys: list[str], values: Any) -> list[bool]:
            super().batch_set(keys, values)
            return list(np.ones(len(keys), dtype=bool))

        def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
            return np.int64(super().batch_exists(keys))  # type: ignore[return-value]

        def exists(self, key: str) -> bool:
            return 2  # type: ignore[return-value]  # not an answer: never "present"

    b = Vectorised()
    assert b.batch_set(["a", "b"], [b"1", b"2"]) == [True, True]
    assert b.batch_exists(["a", "b", "c"]) == 2
    assert b.exists("a") is False
    assert b.get_stats().contract_violations == 3


def test_a_wrapper_class_declares_default_capabilities_for_the_registry() -> None:
    assert FaultyBackend.capabilities == Capabilities()
    assert WrapperBackend.capabilities.claimed() == []
