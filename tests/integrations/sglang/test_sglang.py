"""The SGLang adapter inside the real SGLang package (0.5.23, in .venv-sglang).

SGLang's own factory builds the adapter through its ``dynamic`` backend, for each of our
node-local backends; the adapter then answers every call SGLang's controller makes, with
SGLang's contract where our native API differs (one bool from ``batch_set``, the pointer
form of ``get``/``set``).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as SGLangHiCacheStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache_storage import HostKVPool, page_hashes
from hicache_storage.errors import ConfigError, UnknownBackendError
from hicache_storage.integrations.sglang import SGLangStorage

MODULE = "hicache_storage.integrations.sglang"


def sglang_config(
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    metrics: bool = True,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name="acme/llama-test", extra_config=extra,
    )  # fmt: skip


def make_pool(layout: str = "page_first", mla: bool = False) -> HostKVPool:
    pool = HostKVPool(num_pages=16, page_size=4, layer_num=2, kv_heads=2, head_dim=16,
                      dtype=torch.bfloat16, layout=layout, mla=mla)  # fmt: skip
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    return pool


def build(name: str, tmp_path: Path, **config: Any) -> SGLangStorage:
    extra = {"backend_name": name, "module_path": MODULE, "class_name": "SGLangStorage",
             "interface_v1": True, "prefetch_threshold": 256, **backend_options(name, tmp_path)}  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", sglang_config(extra, **config), None)
    assert isinstance(backend, SGLangStorage)
    assert isinstance(backend, SGLangHiCacheStorage)  # a real subclass of SGLang's class
    return backend


BACKENDS = ["file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglangs_factory_builds_it_and_v1_pages_round_trip_byte_exact(
    name: str, layout: str, tmp_path: Path
) -> None:
    b = build(name, tmp_path)
    pool = make_pool(layout)
    b.register_mem_pool_host(pool)
    keys = page_hashes(list(range(8 * 4)), 4)
    src = torch.arange(0, 8 * 4)
    dst = torch.arange(8 * 4, 16 * 4)
    want = [p.tobytes() for p in pool.page_buffers(src)]
    assert b.batch_set_v1(keys, src) == [True] * 8
    assert b.batch_exists([*keys, "missing"]) == 8
    assert b.batch_get_v1(keys, dst) == [True] * 8
    assert [p.tobytes() for p in pool.page_buffers(dst)] == want
    b.clear()
    assert b.batch_exists(keys) == 0
    b.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_batch_set_is_one_bool_false_when_any_page_failed(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = build(name, tmp_path)
    b.register_mem_pool_host(make_pool())
    ok = [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]
    assert b.batch_set(["a", "b", "c"], ok) is True
    got = b.get("b")
    assert got is not None and torch.equal(got, ok[1])
    # One page the store refuses (a full store, a dead server): the batch is not done,
    # whatever the others did. A list would be truthy here and count as a backup.
    assert b.backend is not None
    real_set = b.backend.set
    monkeypatch.setattr(
        b.backend,
        "batch_set",
        lambda keys, values: [
            k != "e" and real_set(k, v) for k, v in zip(keys, values, strict=True)
        ],
    )
    assert b.batch_set(["d", "e", "f"], ok) is False
    assert b.exists("d") and not b.exists("e") and b.exists("f")
    b.close()


def test_the_pointer_form_reads_and_writes_only_inside_the_host_pool(tmp_path: Path) -> None:
    b = build("memory", tmp_path)
    pool = make_pool()
    b.register_mem_pool_host(pool)
    page = pool.page_buffers(torch.arange(0, 4))[0]
    seg = page.segments[0]
    assert b.set("k", None, seg.ptr, seg.nbytes) is True
    stored = bytes(seg.memoryview)
    other = pool.page_buffers(torch.arange(4, 8))[0].segments[0]
    assert b.get("k", other.ptr, other.nbytes) == other.ptr
    assert bytes(other.memoryview) == stored
    # An address outside the pool: a failed call, and nothing written there.
    outside = ctypes.create_string_buffer(b"\x11" * seg.nbytes, seg.nbytes)
    address = ctypes.addressof(outside)
    assert b.get("k", address, seg.nbytes) is None
    assert outside.raw == b"\x11" * seg.nbytes
    assert b.set("k2", None, address, seg.nbytes) is False
    assert b.get("k", seg.ptr, seg.nbytes * 10**6) is None  # runs past the pool's end
    b.close()


def test_before_the_pool_tensor_calls_are_served_and_the_others_fail_cleanly(
    tmp_path: Path,
) -> None:
    """Tensor calls need no pool (SGLang's own tests make them so; see
    test_sglang_own_tests.py); host indices and addresses mean nothing without one."""
    b = build("memory", tmp_path)
    assert b.get("k") is None
    assert b.set("k", torch.ones(4, dtype=torch.uint8)) is True
    assert b.batch_exists(["k"]) == 1
    assert b.batch_get_v1(["k"], torch.arange(4)) == [False]
    assert b.batch_set_v1(["j"], torch.arange(4)) == [False]
    page = bytearray(16)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    assert b.set("j", None, address, 16) is False
    assert b.get("k", address, 4) is None
    # After close nothing is served, tensor calls included.
    b.close()
    assert b.set("m", torch.ones(4, dtype=torch.uint8)) is False
    assert b.batch_exists(["k"]) == 0


def test_an_unknown_backend_name_is_a_clear_error_at_construction() -> None:
    extra = {"backend_name": "no-such-store", "module_path": MODULE, "class_name": "SGLangStorage"}
    with pytest.raises(UnknownBackendError, match=r"no-such-store.*installed: file"):
        StorageBackendFactory.create_backend("dynamic", sglang_config(extra), None)
    with pytest.raises(ConfigError, match="backend_name"):
        SGLangStorage(sglang_config({}))


def test_metrics_have_sglangs_shape_and_reset_on_read(tmp_path: Path) -> None:
    b = build("memory", tmp_path)
    b.register_mem_pool_host(make_pool())
    keys = page_hashes(list(range(12)), 4)
    b.batch_set_v1(keys, torch.arange(12))
    b.batch_get_v1(keys, torch.arange(12, 24))
    m = b.get_stats()
    assert (m.backup_pgs, m.prefetch_pgs) == ([3], [3])
    assert len(m.backup_bandwidth) == len(m.prefetch_bandwidth) == 1
    assert b.get_stats().backup_pgs == []
    b.close()


def test_sglangs_own_storage_metrics_show_our_figures(tmp_path: Path) -> None:
    """What ``--enable-storage-metrics`` does with a backend's ``get_stats()``: SGLang's
    own collector records it in its ``sglang:`` histograms."""
    from prometheus_client import REGISTRY
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    labels = {"storage_backend": f"hicache-{tmp_path.name}"}
    collector = StorageMetricsCollector(labels=labels)
    b = build("memory", tmp_path)
    b.register_mem_pool_host(make_pool())
    keys = page_hashes(list(range(12)), 4)
    b.batch_set_v1(keys, torch.arange(12))
    b.batch_get_v1(keys[:2], torch.arange(12, 20))
    collector.log_storage_metrics(b.get_stats())
    b.close()

    def value(name: str) -> float:
        got = REGISTRY.get_sample_value(name, labels)
        return 0.0 if got is None else float(got)

    assert value("sglang:backup_pgs_count") == 1 and value("sglang:backup_pgs_sum") == 3
    assert value("sglang:prefetch_pgs_count") == 1 and value("sglang:prefetch_pgs_sum") == 2
    assert value("sglang:prefetch_bandwidth_count") == value("sglang:backup_bandwidth_count") == 1


def test_ranks_and_models_never_share_pages(tmp_path: Path) -> None:
    pool = make_pool()
    keys = page_hashes(list(range(4)), 4)
    r0 = build("file", tmp_path, tp_rank=0, tp_size=2)
    r1 = build("file", tmp_path, tp_rank=1, tp_size=2)
    for b in (r0, r1):
        b.register_mem_pool_host(pool)
    assert r0.batch_set_v1(keys, torch.arange(4)) == [True]
    assert r1.batch_exists(keys) == 0  # another rank's heads are other bytes
    mla0 = build("file", tmp_path, tp_rank=0, tp_size=2, mla=True)
    mla1 = build("file", tmp_path, tp_rank=1, tp_size=2, mla=True)
    mla_pool = make_pool(mla=True)
    for b in (mla0, mla1):
        b.register_mem_pool_host(mla_pool)
    assert mla0.batch_set_v1(keys, torch.arange(4)) == [True]
    assert mla1.batch_exists(keys) == 1  # MLA pages are the same on every rank
    assert r0.batch_exists(keys) == 1 and mla0.batch_exists(keys) == 1  # ...and apart
    for b in (r0, r1, mla0, mla1):
        b.close()


def test_a_prefetch_and_a_backup_thread_on_one_adapter(tmp_path: Path) -> None:
    """The controller's pattern: one thread backs pages up in batches while another
    checks the leading run and prefetches it; every page read is the page written."""
    b = build("file", tmp_path)
    pool = HostKVPool(num_pages=512, page_size=4, layer_num=2, kv_heads=2, head_dim=16,
                      dtype=torch.bfloat16)  # fmt: skip
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    b.register_mem_pool_host(pool)
    keys = page_hashes(list(range(256 * 4)), 4)
    want = {
        k: p.tobytes() for k, p in zip(keys, pool.page_buffers(torch.arange(256 * 4)), strict=True)
    }
    errors: list[str] = []

    def backup() -> None:
        for start in range(0, 256, 128):
            idx = torch.arange(start * 4, (start + 128) * 4)
            if b.batch_set_v1(keys[start : start + 128], idx) != [True] * 128:
                errors.append("backup failed")

    def prefetch() -> None:
        for _ in range(20):
            n = b.batch_exists(keys[:128])
            if n:
                dst = torch.arange(256 * 4, (256 + n) * 4)
                got = b.batch_get_v1(keys[:n], dst)
                pages = pool.page_buffers(dst)
                for k, ok, p in zip(keys[:n], got, pages, strict=True):
                    if ok and p.tobytes() != want[k]:
                        errors.append(f"wrong bytes for {k}")

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert b.batch_exists(keys) == 256
    b.close()


def test_the_printed_flags_build_a_working_backend_in_sglang(tmp_path: Path) -> None:
    """``hicache-storage sglang-args`` output, as SGLang's server would parse it."""
    import json

    from hicache_storage.cli.main import sglang_flags

    flags, env = sglang_flags("file", {"root": str(tmp_path / "kv")})
    assert env == []
    assert flags[flags.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(flags[flags.index("--hicache-storage-backend-extra-config") + 1])
    b = StorageBackendFactory.create_backend("dynamic", sglang_config(extra), None)
    assert isinstance(b, SGLangStorage)
    b.register_mem_pool_host(make_pool())
    keys = page_hashes(list(range(8)), 4)
    assert b.batch_set_v1(keys, torch.arange(8)) == [True, True]
    assert b.batch_exists(keys) == 2
    assert any((tmp_path / "kv").rglob("*"))  # the pages are where the flags said
    b.close()


# --------------------------------------------------------------------------- review round


class EnginePool:
    """What the adapter sees of SGLang's own host pool: no page_buffers, the engine's
    get_page_buffer_meta, its attributes. Built over our pool for its memory."""

    def __init__(self, inner: HostKVPool, *, dtype: Any = None, layers: tuple[int, int] | None = None,
                 heads: int | None = 2) -> None:  # fmt: skip
        self.inner = inner
        self.page_size = inner.page_size
        self.layout = inner.layout
        self.dtype = dtype if dtype is not None else inner.dtype
        self.kv_buffer = inner.kv_buffer
        if heads is not None:
            self.head_num = heads
        if layers is not None:
            self.start_layer, self.end_layer = layers

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        return self.inner.get_page_buffer_meta(indices)


def test_fp8_formats_stored_as_uint8_never_share_pages(tmp_path: Path) -> None:
    inner = make_pool()
    raw = EnginePool(inner, dtype=torch.uint8)  # how SGLang keeps every fp8 KV cache
    b = build("memory", tmp_path)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        b.register_mem_pool_host(raw)  # which fp8 is it? refused, not guessed
    extra = {"backend_name": "memory", "store": f"fp8-{tmp_path.name}"}
    e4m3 = SGLangStorage(sglang_config({**extra, "kv_cache_dtype": "fp8_e4m3"}))
    e5m2 = SGLangStorage(sglang_config({**extra, "kv_cache_dtype": "fp8_e5m2"}))
    for a in (e4m3, e5m2):
        a.register_mem_pool_host(raw)
    assert e4m3.namespace_for(raw).dtype == "float8_e4m3fn"
    keys = page_hashes(list(range(4)), 4)
    assert e4m3.batch_set_v1(keys, torch.arange(4)) == [True]
    assert e5m2.batch_exists(keys) == 0
    for a in (b, e4m3, e5m2):
        a.close()


def test_a_layer_first_engine_pool_is_stored_in_the_sdks_byte_order(tmp_path: Path) -> None:
    """An engine pool that lists a layer_first page's segments K0, V0, K1, V1 (as SGLang's
    does) is stored as every layer's K, then every V: the SDK's (and SGLang's tensor
    path's) order, so the layout name means one byte order."""
    inner = make_pool("layer_first")

    class Interleaved(EnginePool):
        def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
            ptrs, sizes = self.inner.get_page_buffer_meta(indices)
            per = self.inner.segments_per_page
            out: list[int] = []
            for p in range(0, len(ptrs), per):
                ks, vs = ptrs[p : p + per // 2], ptrs[p + per // 2 : p + per]
                out += [x for kv in zip(ks, vs, strict=True) for x in kv]
            return out, sizes

    engine = Interleaved(inner)
    assert (
        engine.get_page_buffer_meta(torch.arange(4))[0]
        != inner.get_page_buffer_meta(torch.arange(4))[0]
    )
    extra = {"backend_name": "memory", "store": f"lf-{tmp_path.name}", "interface_v1": True}
    a = SGLangStorage(sglang_config(extra))
    a.register_mem_pool_host(engine)
    keys = page_hashes(list(range(8)), 4)
    assert a.batch_set_v1(keys, torch.arange(8)) == [True, True]
    want = [p.tobytes() for p in inner.page_buffers(torch.arange(8))]
    got = [a.get(k) for k in keys]
    assert [bytes(g.numpy()) for g in got if g is not None] == want
    a.close()


def test_pipeline_stages_are_named_by_the_layers_they_hold(tmp_path: Path) -> None:
    inner = make_pool()
    extra = {"backend_name": "memory", "store": f"pp-{tmp_path.name}", "interface_v1": True}
    a = SGLangStorage(sglang_config(extra))
    b = SGLangStorage(sglang_config(extra))
    a.register_mem_pool_host(EnginePool(inner, layers=(16, 18)))
    b.register_mem_pool_host(EnginePool(inner, layers=(20, 22)))  # another partition
    keys = page_hashes(list(range(4)), 4)
    assert a.batch_set_v1(keys, torch.arange(4)) == [True]
    assert b.batch_exists(keys) == 0
    assert a.namespace_for(EnginePool(inner, layers=(16, 18))).layer_range == (16, 18)
    a.close()
    b.close()


def test_a_deployment_without_a_model_name_must_say_which_model(tmp_path: Path) -> None:
    cfg = sglang_config({"backend_name": "memory", "store": f"nm-{tmp_path.name}"})
    cfg.model_name = None
    a = SGLangStorage(cfg)
    with pytest.raises(ConfigError, match="model_id"):
        a.register_mem_pool_host(make_pool())
    cfg2 = sglang_config({"backend_name": "memory", "model_id": "acme/other"})
    cfg2.model_name = None
    b = SGLangStorage(cfg2)
    b.register_mem_pool_host(make_pool())
    assert b.backend is not None and b.backend.namespace.model_id == "acme/other"
    b.close()


def test_a_side_pool_that_cannot_be_moved_fails_the_attach_with_its_reason(
    tmp_path: Path,
) -> None:
    b = build("memory", tmp_path)
    with pytest.raises(ConfigError, match="before the KV pool"):
        b.register_mem_host_pool_v2(make_pool(), "swa")
    b.register_mem_pool_host(make_pool())
    b.register_mem_host_pool_v2(object(), "kv")  # (the KV pool: moved through v1)
    with pytest.raises(ConfigError, match="no host memory"):
        b.register_mem_host_pool_v2(SimpleNamespace(page_size=1, layout="page_first"), "mamba")
    b.on_host_pools_registered()
    assert b.batch_get_v2([SimpleNamespace(name="mamba", keys=["a" * 64], host_indices=None)]) == {
        "mamba": [False]
    }  # never registered: a miss
    b.close()


def test_sglangs_allocator_key_and_a_module_class_backend_are_accepted(tmp_path: Path) -> None:
    extra = {"backend_name": "hicache_storage.backends._memory:MemoryBackend",
             "allocator": "shm", "store": f"al-{tmp_path.name}", "interface_v1": True}  # fmt: skip
    b = StorageBackendFactory.create_backend("dynamic", sglang_config({**extra, "module_path": MODULE, "class_name": "SGLangStorage"}), None)  # fmt: skip
    b.register_mem_pool_host(make_pool())
    assert b.batch_set_v1(page_hashes(list(range(4)), 4), torch.arange(4)) == [True]
    b.close()


def test_an_empty_pointer_write_is_refused(tmp_path: Path) -> None:
    b = build("memory", tmp_path)
    pool = make_pool()
    b.register_mem_pool_host(pool)
    seg = pool.page_buffers(torch.arange(0, 4))[0].segments[0]
    assert b.set("k", None, seg.ptr, 0) is False
    assert not b.exists("k")
    b.close()


def test_argument_errors_are_failed_calls_on_sglangs_threads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's prefetch and backup threads get a failure result, never an exception."""
    b = build("memory", tmp_path)
    b.register_mem_pool_host(make_pool())
    bad_key = "../../etc/passwd"
    assert b.get(bad_key) is None
    assert b.set(bad_key, torch.ones(4, dtype=torch.uint8)) is False
    assert b.exists(bad_key) is False
    assert b.batch_exists([bad_key]) == 0
    assert b.batch_set_v1([bad_key], torch.arange(4)) == [False]
    assert b.batch_get(["a", "b"], [torch.empty(4, dtype=torch.uint8)]) == [None, None]
    strided = torch.empty(8, dtype=torch.uint8)[::2]
    assert b.set("ok", torch.ones(4, dtype=torch.uint8)) is True
    assert b.get("ok", strided) is None  # not contiguous: refused, not raised
    assert "returning its failure result" in caplog.text
    b.close()
