"""The ``memory`` backend: a process-local store, shared by instances of one store name."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig, create_backend
from hicache_storage.backends import MemoryBackend, MemoryOptions
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import ConfigError
from hicache_storage.storekit.header import HEADER_SIZE, decode_header


@contextlib.contextmanager
def unreachable_store(backend: HiCacheStorage) -> Iterator[None]:
    """Every call into the store raises, as a client whose server went away would."""

    def down(*args: Any) -> Any:
        raise ConnectionError("store unreachable")

    methods = ("_get_blobs", "_put_blobs_if_absent", "_exists_blobs", "_delete_blobs")
    for name in methods:
        setattr(backend, name, down)
    try:
        yield
    finally:
        for name in methods:
            delattr(backend, name)


class TestMemoryConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self) -> BackendSpec:
        return BackendSpec("memory", {})

    @pytest.fixture
    def break_store(self) -> Callable[[HiCacheStorage], Any]:
        return unreachable_store


class TestMemoryConformanceNoChecksum(BackendConformance):
    """The same checks with the payload checksum opted out, in a store of its own."""

    @pytest.fixture
    def backend_spec(self) -> BackendSpec:
        return BackendSpec("memory", {"store": "unchecksummed", "checksum": "none"})


def ns(tenant: str = "") -> KVCacheNamespace:
    return KVCacheNamespace(model_id="m", dtype="bfloat16", page_size=4, tenant=tenant)


@pytest.fixture
def store_name() -> str:
    """A store of this test alone."""
    return f"test-{uuid.uuid4().hex[:8]}"


def make(store: str, tenant: str = "", **options: Any) -> MemoryBackend:
    return MemoryBackend(StorageConfig(namespace=ns(tenant)), store=store, **options)


def test_found_by_name_with_its_capabilities() -> None:
    b = create_backend("memory", StorageConfig())
    assert isinstance(b, MemoryBackend)
    assert b.capabilities.delete is True
    assert b.capabilities.persistent is False and b.capabilities.shared is False
    assert isinstance(b.options, MemoryOptions) and b.options.store == "default"
    assert b.options.checksum == "xxh3" and b.options.verify_checksum is True


def test_instances_of_one_store_share_pages_and_other_stores_do_not(store_name: str) -> None:
    a, twin = make(store_name), make(store_name)
    elsewhere = make(store_name + "-other")
    assert a.set("k", b"shared") is True
    assert bytes(twin.get("k").numpy()) == b"shared"
    assert twin.set("k", b"second") is True  # first writer wins across instances
    assert bytes(a.get("k").numpy()) == b"shared"
    assert elsewhere.exists("k") is False


def test_namespaces_in_one_store_are_apart_and_clear_is_scoped(store_name: str) -> None:
    mine, theirs = make(store_name, "a"), make(store_name, "b")
    mine.set("k", b"mine")
    theirs.set("k", b"theirs")
    assert bytes(mine.get("k").numpy()) == b"mine"
    mine.clear()
    assert mine.exists("k") is False and make(store_name, "a").exists("k") is False
    assert bytes(theirs.get("k").numpy()) == b"theirs"
    assert mine.set("k", b"again") is True and bytes(mine.get("k").numpy()) == b"again"


def test_a_stored_page_is_a_copy_of_the_caller_memory(store_name: str) -> None:
    b = make(store_name)
    src = torch.arange(16, dtype=torch.uint8)
    b.set("k", src)
    src.fill_(0)  # the host pool reuses the page after the write
    got = b.get("k")
    assert got.tolist() == list(range(16))
    got.fill_(7)  # nor does the caller's result alias the store
    assert b.get("k").tolist() == list(range(16))


def test_values_carry_the_header_and_a_damaged_one_is_a_miss(store_name: str) -> None:
    b = make(store_name)  # default options: the payload checksum is verified
    b.set("k", b"payload")
    path = b.object_name("k").path
    blob = b._pages[path]
    assert decode_header(blob, path).payload_len == 7 and blob[HEADER_SIZE:] == b"payload"
    b._pages[path] = blob[:-1] + b"X"
    assert b.get("k") is None
    assert b.get_stats().corrupt_objects == 1
    assert b.exists("k") is False  # removed, so the next set can store a good page
    assert b.set("k", b"payload") is True and bytes(b.get("k").numpy()) == b"payload"


def test_flipped_payload_bytes_are_a_miss_by_default_and_served_only_when_opted_out(
    store_name: str,
) -> None:
    page = bytes(range(256)) * 16
    for options, hit in (({}, False), ({"checksum": "none"}, True)):
        b = make(store_name, **options)
        assert b.set("k", page) is True
        path = b.object_name("k").path
        blob = bytearray(b._pages[path])
        blob[HEADER_SIZE + 1000] ^= 0x5A  # one payload byte; header, length and name intact
        b._pages[path] = bytes(blob)
        got = b.get("k")
        assert (got is not None) is hit, options
        b.clear()


def test_options_are_checked_and_read_from_the_environment(
    store_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError):
        MemoryBackend(StorageConfig(), store="")
    with pytest.raises(ConfigError):
        MemoryBackend(StorageConfig(), root="/tmp")
    monkeypatch.setenv("HICACHE_STORAGE_MEMORY_STORE", store_name)
    from_env = MemoryBackend(StorageConfig(namespace=ns()))
    assert from_env.options.store == store_name
    from_env.set("k", b"v")
    assert make(store_name).exists("k") is True


def test_threads_writing_the_same_keys_leave_one_whole_value(store_name: str) -> None:
    keys = [f"k{i}" for i in range(200)]
    backends = [make(store_name) for _ in range(4)]
    results: list[list[bool]] = [[] for _ in backends]
    barrier = threading.Barrier(len(backends))

    def write(i: int) -> None:
        barrier.wait()
        results[i] = backends[i].batch_set(keys, [bytes([i]) * 64 for _ in keys])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == [True] * len(keys) for r in results)
    for got in backends[0].batch_get(keys):
        data = bytes(got.numpy())
        assert len(data) == 64 and len(set(data)) == 1  # one writer's value, whole


def test_the_backends_package_exports_every_lazy_name() -> None:
    import hicache_storage.backends as pkg

    lazy = pkg._LAZY
    assert sorted(pkg.__all__) == sorted(lazy)
    assert pkg.MemoryBackend is MemoryBackend and pkg.MemoryOptions is MemoryOptions
