"""storekit.BlobStore through a small dict-backed subclass: framing, verification, targets,
leading runs, per-item failures, error mapping and one implementer call per batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch

from hicache_storage import Capabilities, KVCacheNamespace, PageBuffer, Segment, StorageConfig
from hicache_storage.buffers import memoryview_at
from hicache_storage.conformance.data import make_pool, pool_namespace
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    ConfigError,
    ContractViolationError,
    NotSupportedError,
)
from hicache_storage.keys import ObjectName, object_name
from hicache_storage.storekit.blobstore import (
    FOREIGN,
    Blob,
    BlobOptions,
    BlobStore,
    Foreign,
    Segments,
)
from hicache_storage.storekit.header import HEADER_SIZE, decode_header


class ClientError(Exception):
    """The exceptions of an imaginary client library."""


class ClientTimeout(ClientError):
    pass


class DictBlobs(BlobStore[BlobOptions]):
    """Values in a dict; records every call; can fail a call or one item on demand."""

    name = "dictblobs"
    capabilities = Capabilities(delete=True)
    error_map: ClassVar[dict[type[BaseException], type[BackendError]]] = {
        ClientTimeout: BackendTimeoutError,
        ClientError: BackendError,
    }

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, int]] = []  # (method, number of names)
        self.segment_counts: list[int] = []  # segments of each blob put
        self.slot_errors: dict[str, Exception] = {}  # name.path -> exception in its slot
        self.raises: Exception | None = None  # raised by the next implementer call

    def _enter(self, method: str, names: list[ObjectName]) -> None:
        self.calls.append((method, len(names)))
        if self.raises is not None:
            raise self.raises

    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | Exception | None]:
        self._enter("get", names)
        return [self.slot_errors.get(n.path) or self.data.get(n.path) for n in names]

    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> Sequence[bool | Exception]:
        self._enter("put", names)
        out: list[bool | Exception] = []
        for n, segments in zip(names, blobs, strict=True):
            self.segment_counts.append(len(segments))
            if n.path in self.slot_errors:
                out.append(self.slot_errors[n.path])
                continue
            self.data.setdefault(n.path, b"".join(segments))
            out.append(True)
        return out

    def _exists_blobs(self, names: list[ObjectName]) -> Sequence[bool | Exception]:
        self._enter("exists", names)
        return [self.slot_errors.get(n.path) or n.path in self.data for n in names]

    def _delete_blobs(self, names: list[ObjectName]) -> Sequence[bool | Exception]:
        self._enter("delete", names)
        return [self.data.pop(n.path, None) is not None for n in names]

    def _clear_namespace(self) -> None:
        self._enter("clear", [])
        for path in [p for p in self.data if p.startswith(self.namespace_prefix)]:
            del self.data[path]

    def stored(self, key: str) -> bytes:
        return self.data[self.object_name(key).path]

    def put_raw(self, key: str, blob: bytes) -> None:
        self.data[self.object_name(key).path] = blob


class NoDelete(DictBlobs):
    capabilities = Capabilities()
    _delete_blobs = BlobStore._delete_blobs
    _clear_namespace = BlobStore._clear_namespace


def ns(tenant: str = "") -> KVCacheNamespace:
    return KVCacheNamespace(model_id="m", dtype="bfloat16", page_size=4, tenant=tenant)


@pytest.fixture
def store() -> DictBlobs:
    return DictBlobs(StorageConfig(namespace=ns()))


def as_bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.numpy().tobytes()
    if isinstance(value, PageBuffer):
        return value.tobytes()
    return bytes(value)


def page(*sizes: int, fill: int | None = None) -> PageBuffer:
    """A page of several segments, each its own tensor (random bytes, or ``fill``)."""
    segments = []
    for n in sizes:
        t = (
            torch.full((n,), fill, dtype=torch.uint8)
            if fill is not None
            else torch.randint(0, 256, (n,), dtype=torch.uint8)
        )
        segments.append(Segment(int(t.data_ptr()), n, memoryview_at(int(t.data_ptr()), n, t)))
    return PageBuffer(segments)


# ---------------------------------------------------------------------- framing


def test_round_trip_stores_header_then_payload(store: DictBlobs) -> None:
    assert store.set("k1", b"hello") is True
    blob = store.stored("k1")
    assert len(blob) == HEADER_SIZE + 5 and blob[HEADER_SIZE:] == b"hello"
    header = decode_header(blob, store.object_name("k1").path)
    assert header.payload_len == 5 and header.algorithm == 1  # xxh3 by default
    got = store.get("k1")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8
    assert as_bytes(got) == b"hello"
    assert store.get_stats().bytes_read == 5


def test_checksum_option_and_unknown_options() -> None:
    b = DictBlobs(StorageConfig(namespace=ns()), checksum="none")
    b.set("k", b"abc")
    assert decode_header(b.stored("k")).algorithm == 0
    with pytest.raises(ConfigError):
        DictBlobs(StorageConfig(), checksum="md5")
    with pytest.raises(ConfigError):
        DictBlobs(StorageConfig(), colour="blue")


def test_zero_length_values(store: DictBlobs) -> None:
    assert store.set("empty", b"") is True
    assert len(store.stored("empty")) == HEADER_SIZE
    assert store.exists("empty") is True
    got = store.get("empty")
    assert isinstance(got, torch.Tensor) and got.numel() == 0
    target = bytearray()
    assert store.get("empty", target) is target
    assert store.get("empty", bytearray(1)) is None  # a 1-byte target is the wrong size


# ---------------------------------------------------------------------- verification


def corrupt_variants(store: DictBlobs) -> dict[str, bytes]:
    store.set("good", b"x" * 64)
    good = store.stored("good")
    other = DictBlobs(StorageConfig(namespace=ns("another-tenant")))
    other.set("victim", b"y" * 64)
    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    store.set("neighbour", b"z" * 64)
    return {
        "bit flip in the payload": bytes(flipped),
        "truncated payload": good[:-1],
        "longer than its header says": good + b"\0",
        "shorter than a header": good[: HEADER_SIZE - 1],
        "empty": b"",
        "foreign (not ours)": b"PK\x03\x04" + bytes(100),
        "from another namespace": other.stored("victim"),
        "stored under another name": store.stored("neighbour"),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "bit flip in the payload",
        "truncated payload",
        "longer than its header says",
        "shorter than a header",
        "empty",
        "foreign (not ours)",
        "from another namespace",
        "stored under another name",
    ],
)
def test_bad_values_are_counted_misses_and_removed(store: DictBlobs, variant: str) -> None:
    blob = corrupt_variants(store)[variant]
    store.put_raw("victim", blob)
    store.get_stats(reset=True)
    sentinel = bytearray(b"\xab" * len(blob))
    assert store.get("victim") is None
    stats = store.get_stats()
    assert stats.corrupt_objects == 1
    assert stats.op("get").errors == 0  # a bad value is a miss, not a store failure
    assert store.object_name("victim").path not in store.data  # removed: the key can heal
    store.put_raw("victim", blob)
    assert store.get("victim", sentinel) is None and sentinel == b"\xab" * len(blob)
    assert store.batch_get(["victim", "good"])[0] is None
    assert store.set("victim", b"fresh") is True
    assert as_bytes(store.get("victim")) == b"fresh"


def test_truncation_is_caught_without_a_checksum() -> None:
    b = DictBlobs(StorageConfig(namespace=ns()), checksum="none", verify_checksum=False)
    b.set("k", b"0123456789")
    b.put_raw("k", b.stored("k")[:-3])
    assert b.get("k") is None
    assert b.get_stats().corrupt_objects == 1


def test_a_store_without_delete_keeps_the_bad_value_and_still_misses() -> None:
    b = NoDelete(StorageConfig(namespace=ns()))
    b.set("k", b"abc")
    b.put_raw("k", b.stored("k")[:-1])
    assert b.get("k") is None and b.get("k") is None
    assert b.get_stats().corrupt_objects == 2
    assert ("delete", 1) not in b.calls
    with pytest.raises(NotSupportedError):
        b.delete("k")
    with pytest.raises(NotSupportedError):
        b.clear()


def test_a_value_that_is_not_bytes_fails_its_item(store: DictBlobs) -> None:
    store.set("a", b"1")
    store.data[store.object_name("b").path] = "text"  # type: ignore[assignment]
    assert [as_bytes(x) if x is not None else None for x in store.batch_get(["a", "b"])] == [
        b"1",
        None,
    ]
    assert store.get_stats().op("batch_get").errors == 1


# ---------------------------------------------------------------------- targets


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_size_target_is_none_untouched_and_the_value_removed(
    store: DictBlobs, delta: int
) -> None:
    """A value of another size than its target is a miss that writes nothing, and is
    removed (it would hold its key for good): longer than the target, it is corrupt (not
    read whole where the store can bound reads); shorter, a size mismatch."""
    targets: list[Any] = [
        bytearray(b"\x11" * (32 + delta)),
        torch.full((32 + delta,), 0x11, dtype=torch.uint8),
        page(16, 16 + delta, fill=0x11),
    ]
    reads = [
        *[lambda t=t: store.get("k", t) is None for t in targets],
        lambda: store.batch_get(["k"], [targets[0]]) == [None],
        lambda: store.batch_get_pages(["k"], [targets[2]]) == [False],
    ]
    for read in reads:
        assert store.set("k", b"v" * 32) is True
        assert read()
        assert store.object_name("k").path not in store.data
    for target in targets:
        assert as_bytes(target) == b"\x11" * (32 + delta)
    stats = store.get_stats()
    assert (stats.corrupt_objects, stats.size_mismatches) == ((5, 0) if delta < 0 else (0, 5))
    assert store.get_stats().op("get").errors == 0


class Bounded(DictBlobs):
    """Reads cut at one byte past each limit ("hash" values come back FOREIGN), and a
    record of the limits asked and of what was handed over for removal."""

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.limits: list[int | None] = []
        self.removed: list[tuple[object, int | None]] = []

    def _get_blobs_within(
        self, names: list[ObjectName], limits: list[int | None]
    ) -> Sequence[bytes | Foreign | None]:
        self.limits += limits
        values = [self.data.get(n.path) for n in names]
        return [
            FOREIGN if v == b"hash" else v if v is None or n is None else v[: n + 1]
            for v, n in zip(values, limits, strict=True)
        ]

    def _delete_blobs_if_bad(
        self, names: list[ObjectName], seen: list[Blob | Foreign], limits: list[int | None]
    ) -> Sequence[bool | Exception]:
        self.removed += [
            (s if isinstance(s, Foreign) else len(s), n) for s, n in zip(seen, limits, strict=True)
        ]
        return super()._delete_blobs_if_bad(names, seen, limits)


def test_reads_ask_for_what_the_target_can_take_and_refuse_more() -> None:
    """A target of n bytes: the store is asked for at most header + n bytes; a longer
    value (cut) or a FOREIGN one is corrupt, handed over for removal with its limit."""
    b = Bounded(StorageConfig(namespace=ns()))
    b.set("ok", b"a" * 32)
    b.set("big", b"b" * 10_000)
    b.put_raw("hash", b"hash")
    targets = [bytearray(32) for _ in range(3)]
    got = b.batch_get(["ok", "big", "hash"], targets)
    assert got[0] is targets[0] and targets[0] == b"a" * 32
    assert got[1:] == [None, None] and targets[1] == targets[2] == bytearray(32)
    assert b.limits == [HEADER_SIZE + 32] * 3
    assert b.removed == [(HEADER_SIZE + 33, HEADER_SIZE + 32), (FOREIGN, HEADER_SIZE + 32)]
    assert b.get_stats().corrupt_objects == 2
    assert sorted(b.data) == [b.object_name("ok").path]
    b.limits.clear()
    assert as_bytes(b.get("ok")) == b"a" * 32  # no target: no limit
    assert b.limits == [None]


def test_without_a_target_the_limit_is_max_object_bytes() -> None:
    class Small(Bounded):
        capabilities = Capabilities(delete=True, max_object_bytes=100)

    b = Small(StorageConfig(namespace=ns()))
    b.put_raw("k", b"x" * 1000)
    assert b.get("k") is None
    assert b.limits == [HEADER_SIZE + 100] and b.get_stats().corrupt_objects == 1


def test_a_miss_leaves_the_target_untouched(store: DictBlobs) -> None:
    target = bytearray(b"\x22" * 8)
    assert store.get("absent", target) is None and target == b"\x22" * 8
    assert store.get_stats().op("get").errors == 0


def test_multi_segment_pages_round_trip_without_joining(store: DictBlobs) -> None:
    src = [page(100, 28, 3), page(1, 1, 200)]
    assert store.batch_set_pages(["p0", "p1"], src) == [True, True]
    assert store.segment_counts == [4, 4]  # header + 3 segments, handed over unjoined
    dst = [page(64, 67, fill=0), page(2, 200, fill=0)]  # other segment boundaries
    assert store.batch_get_pages(["p0", "p1"], dst) == [True, True]
    assert [d.tobytes() for d in dst] == [s.tobytes() for s in src]
    assert as_bytes(store.get("p0")) == src[0].tobytes()


def test_v1_round_trip_through_a_host_pool() -> None:
    pool = make_pool("layer_first", num_pages=8)
    b = DictBlobs(StorageConfig(namespace=pool_namespace(pool)))
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = ["a", "b", "c"]
    before = [p.tobytes() for p in pool.page_buffers(torch.arange(3 * ps))]
    assert b.batch_set_v1(keys, torch.arange(3 * ps)) == [True] * 3
    assert b.batch_get_v1(keys, torch.arange(3 * ps, 6 * ps)) == [True] * 3
    after = [p.tobytes() for p in pool.page_buffers(torch.arange(3 * ps, 6 * ps))]
    assert after == before
    assert b.calls == [("put", 3), ("get", 3)]


# ---------------------------------------------------------------------- semantics


def test_set_on_an_existing_key_is_a_no_op(store: DictBlobs) -> None:
    assert store.set("k", b"first") is True
    stored = store.stored("k")
    assert store.set("k", b"second") is True
    assert store.batch_set(["k"], [b"third"]) == [True]
    assert store.stored("k") is stored
    assert as_bytes(store.get("k")) == b"first"


def test_batch_exists_counts_the_leading_run(store: DictBlobs) -> None:
    keys = [f"k{i}" for i in range(6)]
    store.batch_set([keys[i] for i in (0, 1, 3, 4, 5)], [b"v"] * 5)
    store.calls.clear()
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[2:]) == 0
    assert store.batch_exists(keys[3:]) == 3
    assert store.batch_exists([]) == 0
    assert store.calls == [("exists", 6), ("exists", 4), ("exists", 3)]  # one call each


def test_batch_exists_chunks_grow_and_stop_at_the_first_miss() -> None:
    class Chunked(DictBlobs):
        exists_chunk = 2

    b = Chunked(StorageConfig(namespace=ns()))
    keys = [f"k{i}" for i in range(12)]
    b.batch_set([k for i, k in enumerate(keys) if i != 4], [b"v"] * 11)
    b.calls.clear()
    assert b.batch_exists(keys) == 4
    assert b.calls == [("exists", 2), ("exists", 4)]  # nothing asked past the miss
    b.calls.clear()
    assert b.batch_exists(keys[5:]) == 7
    assert b.calls == [("exists", 2), ("exists", 4), ("exists", 1)]
    b.calls.clear()
    assert b.batch_exists(["absent", *keys]) == 0
    assert b.calls == [("exists", 2)]


def test_one_implementer_call_per_batch(store: DictBlobs) -> None:
    keys = [f"k{i}" for i in range(50)]
    store.batch_set(keys, [bytes([i]) * 10 for i in range(50)])
    store.batch_get(keys)
    store.batch_get(keys, [bytearray(10) for _ in keys])
    store.batch_get_pages(keys, [page(5, 5) for _ in keys])
    store.batch_set_pages([k + "p" for k in keys], [page(5, 5) for _ in keys])
    store.batch_exists(keys)
    assert store.calls == [
        ("put", 50),
        ("get", 50),
        ("get", 50),
        ("get", 50),
        ("put", 50),
        ("exists", 50),
    ]
    store.calls.clear()
    assert store.batch_get([]) == [] and store.batch_set([], []) == []
    assert store.calls == []


def test_delete_and_clear_stay_in_the_namespace() -> None:
    shared: dict[str, bytes] = {}
    mine, other = (DictBlobs(StorageConfig(namespace=ns(t))) for t in ("a", "b"))
    mine.data = other.data = shared
    mine.batch_set(["k1", "k2"], [b"1", b"2"])
    other.set("k1", b"o")
    assert mine.delete("k1") is True and mine.delete("k1") is False
    mine.clear()
    assert mine.batch_exists(["k2"]) == 0
    assert as_bytes(other.get("k1")) == b"o"


def test_own_names_have_the_namespace_shape_only(store: DictBlobs) -> None:
    """What clear() may remove: <digest>/<two hex>/<leaf>; not the names of a prefix nested
    in the namespace (<digest>/<digest>/...), nor anything else under <digest>/."""
    d = store.namespace_prefix
    own = store.object_name("k").path
    assert store._is_own_name(own)
    assert store._is_own_name(object_name(store.namespace.digest, "k", "h0-7").path)
    nested = [d + own, d + ns("b").digest + "/ab/k"]
    others = [*nested, d + "ab/k/x", d + "AB/k", d + "a/k", d + "ab/", d + "abc/k", "x" + own]
    assert not [n for n in others if store._is_own_name(n)]


def test_max_object_bytes_fails_the_item_without_storing_it() -> None:
    class Small(DictBlobs):
        capabilities = Capabilities(delete=True, max_object_bytes=8)

    b = Small(StorageConfig(namespace=ns()))
    assert b.batch_set(["ok", "big"], [b"12345678", b"123456789"]) == [True, False]
    assert not b.exists("big")
    assert b.get_stats().op("batch_set").errors == 1


# ---------------------------------------------------------------------- failures


def test_an_exception_in_a_slot_fails_that_item_only(
    store: DictBlobs, caplog: pytest.LogCaptureFixture
) -> None:
    keys = ["a", "b", "c"]
    store.batch_set(keys, [b"1", b"2", b"3"])
    store.slot_errors[store.object_name("b").path] = ClientTimeout("b is slow")
    store.get_stats(reset=True)
    with caplog.at_level(logging.WARNING):
        got = store.batch_get(keys)
    assert [None if g is None else as_bytes(g) for g in got] == [b"1", None, b"3"]
    assert store.batch_set(["b", "d"], [b"x", b"4"]) == [False, True]
    assert store.batch_exists(keys) == 1
    assert store.exists("b") is False
    stats = store.get_stats()
    assert (stats.op("batch_get").ok, stats.op("batch_get").errors) == (2, 1)
    assert (stats.op("batch_set").ok, stats.op("batch_set").errors) == (1, 1)
    assert stats.op("batch_exists").errors == 1
    assert stats.op("exists").errors == 1
    assert "BackendTimeoutError" in caplog.text and "b is slow" in caplog.text


def test_error_map_gives_the_declared_type_and_failure_shapes(
    store: DictBlobs, caplog: pytest.LogCaptureFixture
) -> None:
    store.set("k", b"v")
    store.raises = ClientTimeout("no answer in 2 s")
    target = bytearray(b"\x33")
    with caplog.at_level(logging.WARNING):
        assert store.get("k") is None
        assert store.get("k", target) is None and target == b"\x33"
        assert store.set("n", b"v") is False
        assert store.exists("k") is False
        assert store.batch_exists(["k", "n"]) == 0
        assert store.batch_get(["k", "n"]) == [None, None]
        assert store.batch_set(["k", "n"], [b"1", b"2"]) == [False, False]
    assert "BackendTimeoutError: no answer in 2 s" in caplog.text
    with pytest.raises(BackendTimeoutError) as info:
        store.delete("k")
    assert isinstance(info.value.__cause__, ClientTimeout)
    store.raises = ClientError("broken pipe")
    with pytest.raises(BackendError) as generic:
        store.clear()
    assert type(generic.value) is BackendError
    store.raises = None
    stats = store.get_stats()
    assert stats.op("get").errors == 2 and stats.op("batch_get").errors == 2
    # Recovered with the client: at once, or (five reads failed in a row: the circuit
    # breaker opened) once its health probe finds the store back.
    assert store.circuit in ("closed", "open")
    end = time.monotonic() + 20
    while (got := store.get("k")) is None:
        assert time.monotonic() < end, "no recovery"
        time.sleep(0.05)
    assert as_bytes(got) == b"v"


class WrongLength(DictBlobs):
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | Exception | None]:
        return [*super()._get_blobs(names), None]


def test_a_result_of_the_wrong_length_fails_the_call() -> None:
    b = WrongLength(StorageConfig(namespace=ns()))
    b.set("k", b"v")
    assert b.batch_get(["k"]) == [None]
    stats = b.get_stats()
    assert stats.contract_violations == 1 and stats.op("batch_get").errors == 1
    b.strict_contract = True
    with pytest.raises(ContractViolationError, match=r"_get_blobs returned 2 results for 1"):
        b.get("k")
