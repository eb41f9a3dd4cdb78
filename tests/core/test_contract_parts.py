"""The parts of the contract a backend, a wrapper or a tier builds on.

Capabilities (serialised, refined per instance), the ``overrides`` predicate the kit
uses, the per-item failure helper, the public wrapper base, the namespace/pool check and
the buffer helpers that every whole-value store shares.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from hicache_storage import (
    Capabilities,
    HiCacheStorage,
    KVCacheNamespace,
    StorageConfig,
    WrapperBackend,
)
from hicache_storage.buffers import copy_into, new_target, source_views, target_views
from hicache_storage.errors import InvalidArgumentError, InvalidTypeError, NamespaceMismatchError
from hicache_storage.layouts import LAYOUTS


class Dict(HiCacheStorage):
    name = "dict"

    def __init__(self, config: StorageConfig | None = None) -> None:
        super().__init__(config)
        self.data: dict[str, bytes] = {}

    def get(self, key: str, target: Any = None) -> Any:
        blob = self.data.get(key)
        if blob is None:
            return None
        if target is None:
            t, views = new_target(len(blob))
            copy_into(views, blob)
            return t
        return target if copy_into(target_views(target), blob) else None

    def set(self, key: str, value: Any) -> bool:
        self.data.setdefault(key, b"".join(bytes(v) for v in source_views(value)))
        return True

    def exists(self, key: str) -> bool:
        return key in self.data


class NativePages(Dict):
    def batch_get_pages(self, keys: list[str], pages: Any) -> list[bool]:
        return [self.get(k, p) is not None for k, p in zip(keys, pages, strict=True)]


# --------------------------------------------------------------------------- capabilities


def test_capabilities_to_dict_lists_every_field_json_ready() -> None:
    caps = Capabilities(zero_copy=True, max_object_bytes=7, layouts=frozenset({"page_first"}))
    d = caps.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(Capabilities)}
    assert d["zero_copy"] is True and d["delete"] is False
    assert d["max_object_bytes"] == 7
    assert d["layouts"] == ["page_first"]
    assert Capabilities().to_dict()["layouts"] == sorted(LAYOUTS)


def test_claimed_names_only_the_optional_features() -> None:
    assert Capabilities().claimed() == []  # mla=True by default is not a claim
    caps = Capabilities(delete=True, shared=True, persistent=False)
    assert caps.claimed() == ["delete", "shared"]


def test_an_instance_may_refine_its_class_capabilities() -> None:
    class Sized(Dict):
        capabilities = Capabilities(delete=True)

        def __init__(self, limit: int) -> None:
            super().__init__()
            self.capabilities = dataclasses.replace(type(self).capabilities, max_object_bytes=limit)

    a, b = Sized(10), Sized(20)
    assert (a.capabilities.max_object_bytes, b.capabilities.max_object_bytes) == (10, 20)
    assert Sized.capabilities.max_object_bytes is None  # what the registry reads
    assert a.capabilities.delete is True


# --------------------------------------------------------------------------- overrides


def test_overrides_tells_a_native_path_from_the_default_loop() -> None:
    assert Dict.overrides("get") is True
    assert Dict.overrides("batch_get_pages") is False
    assert NativePages.overrides("batch_get_pages") is True
    assert NativePages.overrides("batch_set_pages") is False
    # Inherited from a class that overrides it: still native.
    assert type("Sub", (NativePages,), {}).overrides("batch_get_pages") is True  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError):
        Dict.overrides("no_such_op")


# --------------------------------------------------------------------------- _map_pages


class _Threads:
    """A mapper spreading items over 4 worker threads (what IOPool.map does for backends)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(4)

    def map(self, fn: Any, n: int) -> list[bool]:
        return list(self.executor.map(fn, range(n)))

    def close(self) -> None:
        self.executor.shutdown()


class PerItem(Dict):
    def __init__(self) -> None:
        super().__init__()
        self.pool = _Threads()

    def batch_get_pages(self, keys: list[str], pages: Any) -> list[bool]:
        def one(i: int) -> object:
            if i % 3 == 0:
                raise OSError(5, "injected")
            return True if i % 3 == 1 else None

        return self._map_pages("batch_get_pages", len(keys), one, self.pool.map)


def test_map_pages_counts_every_failed_item_from_worker_threads() -> None:
    b = PerItem()
    b.get_stats()
    n = 300
    keys = [f"k{i}" for i in range(n)]
    out = b.batch_get_pages(keys, [None] * n)
    assert out == [i % 3 == 1 for i in range(n)]
    op = b.get_stats().op("batch_get_pages")
    assert op.errors == n // 3, op  # one per raising item, none lost to a race
    assert op.ok == n // 3
    b.pool.close()


# --------------------------------------------------------------------------- WrapperBackend


class Counting(WrapperBackend):
    def __init__(self, inner: HiCacheStorage) -> None:
        super().__init__(inner)
        self.ops: list[str] = []
        self._lock = threading.Lock()

    def _before(self, op: str) -> None:
        with self._lock:
            self.ops.append(op)


def test_wrapper_forwards_and_takes_the_inner_capabilities_and_namespace() -> None:
    inner = Dict()
    inner.capabilities = Capabilities(delete=True, max_object_bytes=99)
    w = Counting(inner)
    assert w.capabilities == inner.capabilities
    assert w.namespace == inner.namespace and w.config is inner.config
    assert w.set("a", b"xyz") is True
    assert inner.data == {"a": b"xyz"}
    assert w.batch_exists(["a", "b"]) == 1
    assert bytes(w.get("a").numpy()) == b"xyz"
    assert w.ops == ["set", "batch_exists", "get"]
    assert "Counting(dict)" in w.name


def test_a_wrapper_serves_v1_through_the_pool_already_on_its_inner_backend() -> None:
    from hicache_storage.host_pool import HostKVPool

    pool = HostKVPool(
        num_pages=2, page_size=4, layer_num=1, kv_heads=1, head_dim=8, dtype=torch.float16
    )
    pool.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.arange(pool.kv_buffer.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    )
    inner = Dict()
    inner.register_mem_pool_host(pool)
    w = Counting(inner)
    assert w.batch_set_v1(["a"], torch.arange(4)) == [True]
    assert inner.data["a"] == b"".join(
        bytes(v) for v in pool.page_buffers(torch.arange(4), 1)[0].views
    )


def test_a_failing_inner_store_gives_the_wrappers_failure_shape() -> None:
    class Broken(Dict):
        def get(self, key: str, target: Any = None) -> Any:
            raise ConnectionError("down")

    w = Counting(Broken())
    assert w.get("a") is None
    assert w.batch_get(["a", "b"]) == [None, None]


# --------------------------------------------------------------------------- check_pool


def test_check_pool_names_each_mismatch_and_accepts_a_matching_pool() -> None:
    from hicache_storage.host_pool import HostKVPool

    pool = HostKVPool(
        num_pages=2, page_size=4, layer_num=1, kv_heads=1, head_dim=8, dtype=torch.float16
    )
    ns = KVCacheNamespace.for_pool(pool, model_id="m")
    ns.check_pool(pool)  # no error
    other = KVCacheNamespace(
        model_id="m", dtype="bfloat16", page_size=8, object_layout="layer_first"
    )
    with pytest.raises(NamespaceMismatchError) as info:
        other.check_pool(pool)
    text = str(info.value)
    for part in ("page_size 4 != namespace page_size 8", "dtype", "layout", "for_pool"):
        assert part in text


# --------------------------------------------------------------------------- buffers


def test_copy_into_scatters_across_segments_and_refuses_a_size_mismatch() -> None:
    a, b = bytearray(3), bytearray(5)
    views = [memoryview(a), memoryview(b)]
    assert copy_into(views, b"abcdefgh") is True
    assert (bytes(a), bytes(b)) == (b"abc", b"defgh")
    assert copy_into(views, [memoryview(b"12345678")]) is True
    assert copy_into(views, [memoryview(b"1234"), memoryview(b"5678")]) is True
    assert (bytes(a), bytes(b)) == (b"123", b"45678")
    assert copy_into(views, b"short") is False
    assert (bytes(a), bytes(b)) == (b"123", b"45678")  # untouched


def test_new_target_is_a_uint8_tensor_behind_its_view() -> None:
    t, (view,) = new_target(6)
    assert t.dtype == torch.uint8 and t.numel() == 6
    view[:] = b"qwerty"
    assert bytes(t.numpy()) == b"qwerty"


# --------------------------------------------------------------------------- batch lengths


@pytest.mark.parametrize(
    ("op", "second"),
    [
        ("batch_get", [bytearray(1)]),
        ("batch_set", [b"x"]),
        ("batch_get_pages", [None]),
        ("batch_set_pages", [None]),
    ],
)
def test_the_guard_refuses_a_per_key_argument_of_another_length(op: str, second: list) -> None:
    """One check in the guard, before any implementation runs (none checks it itself)."""
    calls: list[str] = []

    class Recording(NativePages):
        def batch_set_pages(self, keys: list[str], pages: Any) -> list[bool]:
            calls.append("ran")
            return [True] * len(keys)

    b = Recording()
    with pytest.raises(InvalidArgumentError, match="2 keys but 1"):
        getattr(b, op)(["a", "b"], second)
    with pytest.raises(InvalidArgumentError, match="2 keys but 1"):
        getattr(b, op)(keys=["a", "b"], **{_PARAM[op]: second})
    assert calls == []
    assert getattr(b, op)([], []) == (0 if op == "batch_exists" else [])


_PARAM = {
    "batch_get": "targets",
    "batch_set": "values",
    "batch_get_pages": "pages",
    "batch_set_pages": "pages",
}


def test_missing_or_unsized_per_key_arguments_are_typed_errors() -> None:
    b = Dict()
    assert b.batch_get(["a"]) == [None]  # targets may be omitted
    with pytest.raises(InvalidArgumentError, match="no values"):
        b.batch_set(["a"], None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="must be a sequence"):
        b.batch_set(["a"], (v for v in [b"x"]))  # type: ignore[arg-type]
