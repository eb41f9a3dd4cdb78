"""The protocol layer every backend inherits: shapes, failure handling, validation, v1.

The backends here are small in-memory classes on purpose: the thing under test is the
SDK's wrapping of *any* implementation (what a vendor writes), not a store.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from hicache_storage import Capabilities, HiCacheStorage, KVCacheNamespace, StorageConfig
from hicache_storage.buffers import copy_into, source_views, target_views
from hicache_storage.conformance.data import make_pool, pool_namespace
from hicache_storage.errors import (
    ContractViolationError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTypeError,
    NamespaceMismatchError,
    NotSupportedError,
)
from hicache_storage.layouts import POOL_KIND_IDS, POOL_KINDS


class DictBackend(HiCacheStorage):
    """The three abstract methods, nothing else: every default is exercised."""

    name = "dict"

    def __init__(self, config: StorageConfig | None = None) -> None:
        super().__init__(config)
        self.data: dict[str, bytes] = {}
        self.closes = 0

    def get(self, key: str, target: Any = None) -> Any:
        blob = self.data.get(key)
        if blob is None:
            return None
        if target is None:
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return target if copy_into(target_views(target), blob) else None

    def set(self, key: str, value: Any) -> bool:
        self.data.setdefault(key, b"".join(bytes(v) for v in source_views(value)))
        return True

    def exists(self, key: str) -> bool:
        return key in self.data

    def close(self) -> None:
        self.closes += 1


class NewTensorBackend(DictBackend):
    """A get that ignores the target and returns a new tensor (common in the wild)."""

    def get(self, key: str, target: Any = None) -> Any:
        blob = self.data.get(key)
        return None if blob is None else torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class Exploding(DictBackend):
    def get(self, key: str, target: Any = None) -> Any:
        raise ConnectionError("store down")

    def set(self, key: str, value: Any) -> bool:
        raise OSError(28, "No space left on device")

    def exists(self, key: str) -> bool:
        raise TimeoutError("slow")

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        raise RuntimeError("bug in vendor code")


class WrongShapes(DictBackend):
    def batch_set(self, keys: list[str], values: Any) -> Any:
        return True  # the reference's bool

    def batch_get(self, keys: list[str], targets: Any = None) -> Any:
        return [None] * (len(keys) + 1)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> Any:
        return len(keys) + 5

    def batch_set_pages(self, keys: list[str], pages: Any) -> Any:
        return [True] * (2 * len(keys))  # K and V counted separately

    def batch_get_pages(self, keys: list[str], pages: Any) -> Any:
        return None

    def exists(self, key: str) -> Any:
        return 1


KEYS = ["k0", "k1", "k2"]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_default_batch_shapes(n: int) -> None:
    b = DictBackend()
    keys = KEYS[:n]
    vals = [bytes([i]) * 8 for i in range(n)]
    assert b.batch_set(keys, vals) == [True] * n
    assert b.batch_exists(keys) == n
    got = b.batch_get(keys)
    assert len(got) == n
    assert [bytes(t.numpy()) for t in got] == vals
    targets = [bytearray(8) for _ in range(n)]
    assert b.batch_get(keys, targets) == targets
    assert [bytes(t) for t in targets] == vals
    assert b.batch_get(["missing"] * n) == [None] * n


def test_batch_exists_is_the_leading_run() -> None:
    b = DictBackend()
    b.set("a", b"1")
    b.set("c", b"3")
    assert b.batch_exists(["a", "b", "c"]) == 1
    assert b.batch_exists(["b", "a"]) == 0
    assert b.batch_exists([]) == 0


def test_set_existing_is_a_no_op_returning_true() -> None:
    b = DictBackend()
    assert b.set("k", b"old")
    assert b.set("k", b"new")
    assert b.data["k"] == b"old"


def test_failures_become_failure_shapes_and_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    b = Exploding()
    with caplog.at_level(logging.WARNING):
        assert b.get("k") is None
        assert b.set("k", b"v") is False
        assert b.exists("k") is False
        assert b.batch_exists(KEYS) == 0
        assert b.batch_get(KEYS) == [None] * 3
        assert b.batch_set(KEYS, [b"1", b"2", b"3"]) == [False] * 3
        for _ in range(20):
            b.get("k")
    stats = b.get_stats()
    assert stats.op("get").errors == 21
    assert stats.op("get").ok == 0
    assert stats.op("batch_get").errors == 3
    assert stats.op("batch_set").errors == 3
    assert stats.op("batch_exists").errors == 3
    assert "RuntimeError" in caplog.text
    assert "store down" in caplog.text
    # Rate limited: 21 failing gets, far fewer log records.
    assert sum("Exploding.get failed" in r.getMessage() for r in caplog.records) == 1


def test_invalid_arguments_still_raise() -> None:
    b = Exploding()
    for call in (
        lambda: b.get("../x"),
        lambda: b.set("", b"v"),
        lambda: b.exists("a/b"),
        lambda: b.batch_exists(["ok", "no\x00"]),
        lambda: b.batch_get_v1(["a b"], torch.arange(4)),
    ):
        with pytest.raises(InvalidKeyError):
            call()
    with pytest.raises(InvalidArgumentError):
        DictBackend().batch_set(["a", "b"], [b"1"])
    with pytest.raises(InvalidArgumentError):
        DictBackend().batch_get(["a", "b"], [bytearray(1)])


def test_wrong_shapes_are_replaced_and_counted() -> None:
    b = WrongShapes()
    assert b.batch_set(KEYS, [b"1", b"2", b"3"]) == [True] * 3
    assert b.batch_get(KEYS) == [None] * 3
    assert b.batch_exists(KEYS) == 0
    assert b.exists("k") is True
    pool = make_pool()
    b.register_mem_pool_host(pool)
    idx = torch.arange(3 * pool.page_size)
    assert b.batch_set_v1(KEYS, idx) == [False] * 3  # 2N can never be trusted
    assert b.batch_get_v1(KEYS, idx) == [False] * 3
    assert b.get_stats().contract_violations == 6


def test_strict_mode_raises_on_violations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_STRICT", "1")
    b = WrongShapes()
    assert b.strict_contract
    with pytest.raises(ContractViolationError, match="batch_exists returned 8 for 3 keys"):
        b.batch_exists(KEYS)
    b.strict_contract = False
    assert b.batch_exists(KEYS) == 0


def test_close_is_idempotent_and_later_calls_fail_cleanly() -> None:
    b = DictBackend()
    b.set("k", b"v")
    with b:
        pass
    b.close()
    b.close()
    assert b.closes == 1
    assert b.closed
    assert b.get("k") is None
    assert b.set("x", b"v") is False
    assert b.batch_exists(["k"]) == 0
    assert b.get_stats().op("get").errors == 1


@pytest.mark.parametrize("cls", [DictBackend, NewTensorBackend])
@pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
def test_default_v1_round_trip(cls: type[DictBackend], layout: str, mla: bool) -> None:
    pool = make_pool(layout, mla)
    b = cls(StorageConfig(namespace=pool_namespace(pool)))
    b.register_mem_pool_host(pool)
    src = pool.alloc(3 * pool.page_size)
    dst = pool.alloc(3 * pool.page_size)
    assert src is not None
    assert dst is not None
    assert b.batch_set_v1(KEYS, src) == [True] * 3
    extra = pool.alloc(pool.page_size)
    assert extra is not None
    assert b.batch_get_v1([*KEYS, "gone"], torch.cat([dst, extra])) == [True] * 3 + [False]
    assert [p.tobytes() for p in pool.page_buffers(src)] == [
        p.tobytes() for p in pool.page_buffers(dst)
    ]


def test_v1_index_problems_fail_every_page() -> None:
    pool = make_pool()
    b = DictBackend(StorageConfig(namespace=pool_namespace(pool)))
    assert b.batch_set_v1(KEYS, torch.arange(3 * pool.page_size)) == [False] * 3  # no pool yet
    b.register_mem_pool_host(pool)
    assert b.batch_set_v1(KEYS, torch.arange(2 * pool.page_size)) == [False] * 3  # wrong length
    assert (
        b.batch_set_v1(KEYS, torch.arange(1, 3 * pool.page_size + 1)) == [False] * 3
    )  # misaligned
    assert b.data == {}
    assert b.batch_set_v1([], torch.arange(0)) == []


def test_register_rejects_mismatched_pools() -> None:
    pool = make_pool("page_first")
    for ns, what in [
        (
            KVCacheNamespace(
                model_id="m", dtype="bfloat16", page_size=8, object_layout="page_first"
            ),
            "page_size",
        ),
        (
            KVCacheNamespace(
                model_id="m", dtype="float16", page_size=4, object_layout="page_first"
            ),
            "dtype",
        ),
        (
            KVCacheNamespace(
                model_id="m", dtype="bfloat16", page_size=4, object_layout="layer_first"
            ),
            "layout",
        ),
        (
            KVCacheNamespace(
                model_id="m",
                dtype="bfloat16",
                page_size=4,
                object_layout="page_first",
                rank_replicated=True,
            ),
            "MLA",
        ),
    ]:
        with pytest.raises(NamespaceMismatchError, match=what):
            DictBackend(StorageConfig(namespace=ns)).register_mem_pool_host(pool)

    class PageFirstOnly(DictBackend):
        capabilities = Capabilities(layouts=frozenset({"page_first"}), mla=False)

    with pytest.raises(NotSupportedError, match="layer_first"):
        PageFirstOnly().register_mem_pool_host(make_pool("layer_first"))
    with pytest.raises(NotSupportedError, match="MLA"):
        PageFirstOnly().register_mem_pool_host(make_pool("page_first", mla=True))


class ReferenceStylePool:
    """Only what SGLang's HostKVCache offers: page_size, layout and pointer metadata."""

    def __init__(self) -> None:
        self.inner = make_pool()
        self.page_size = self.inner.page_size
        self.layout = "page_first"
        self.kv_buffer = self.inner.kv_buffer

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        return self.inner.get_page_buffer_meta(indices)


def test_v1_works_with_a_reference_style_pool() -> None:
    rp = ReferenceStylePool()
    b = DictBackend()
    b.register_mem_pool_host(rp)
    ps = rp.page_size
    assert b.batch_set_v1(KEYS, torch.arange(3 * ps)) == [True] * 3
    assert b.batch_get_v1(KEYS, torch.arange(3 * ps, 6 * ps)) == [True] * 3
    a = [p.tobytes() for p in rp.inner.page_buffers(torch.arange(3 * ps))]
    c = [p.tobytes() for p in rp.inner.page_buffers(torch.arange(3 * ps, 6 * ps))]
    assert a == c
    assert b.batch_get_v1(KEYS, torch.arange(2 * ps)) == [False] * 3


def test_stats_reset_on_read_by_default() -> None:
    b = DictBackend()
    b.set("a", b"1")
    b.get("a")
    b.get("b")
    s = b.get_stats(reset=False)
    assert (s.op("get").calls, s.op("get").ok, s.op("get").items) == (2, 1, 2)
    assert b.get_stats().op("set").ok == 1
    assert b.get_stats().ops == {}


def test_optional_operations_and_options() -> None:
    b = DictBackend()
    with pytest.raises(NotSupportedError):
        b.delete("k")
    with pytest.raises(NotSupportedError):
        b.clear()
    with pytest.raises(InvalidArgumentError, match="takes no options"):
        HiCacheStorage.__init__(b, None, colour="red")


class StoreMixin:
    """An implementation in a mixin that does not derive from HiCacheStorage."""

    def get(self, key: str, target: Any = None) -> Any:
        raise OSError(5, "I/O error")

    def set(self, key: str, value: Any) -> bool:
        raise OSError(5, "I/O error")

    def exists(self, key: str) -> bool:
        raise OSError(5, "I/O error")


class MixedIn(StoreMixin, HiCacheStorage):
    pass


def test_mixin_implementations_are_guarded_too() -> None:
    b = MixedIn()
    assert b.get("k") is None
    assert b.set("k", b"v") is False
    assert b.exists("k") is False
    with pytest.raises(InvalidKeyError):
        b.exists("../etc")


def test_missing_arguments_raise_instead_of_failing_quietly() -> None:
    b = DictBackend()
    with pytest.raises(InvalidTypeError, match="batch_set"):
        b.batch_set(["a", "b"])  # type: ignore[call-arg]
    with pytest.raises(InvalidTypeError):
        b.set("a")  # type: ignore[call-arg]
