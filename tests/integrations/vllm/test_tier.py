"""HiCacheTier as vLLM's native secondary tier, built the way vLLM tests its own tiers.

vLLM's CPU offloading needs a GPU, so (as vLLM's tests of its ``fs`` tier do) the tier is
built directly, here through vLLM's own ``SecondaryTierFactory`` by module path, over a
memoryview of a CPU tensor standing for the primary tier, with a real
``OffloadingConfig``; jobs are vLLM's ``TransferJob`` with real offload keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from hicache_storage.errors import ConfigError

WORKERS = Path(__file__).parents[2] / "workers"
CHUNKS, CHUNK = 16, 64 << 10  # primary-tier chunks, bytes per chunk
CTX = ReqContext(req_id="r")


def offloading_config(model: str = "tiny-model", groups: int = 1) -> OffloadingConfig:
    group = OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0)
    parallel = OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )  # fmt: skip
    return OffloadingConfig(
        groups=(group,) * groups, worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=False,
        extra_config={}, engine_id="e0", model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1), parallel=parallel,
        kv_cache_layout="NHD",
    )  # fmt: skip


def make_tier(options: dict[str, Any], model: str = "tiny-model", seed: int = 0) -> tuple:
    """A tier over a fresh primary tier of random chunks: (tier, primary tensor)."""
    primary = torch.randint(0, 256, (CHUNKS, CHUNK), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
    spec = MagicMock()
    spec.config = offloading_config(model)
    entry = {"type": "HiCacheTier", "module_path": "hicache_storage.integrations.vllm.tier",
             **options}  # fmt: skip
    tier = SecondaryTierFactory.create_secondary_tier(entry, primary.numpy().data, spec)
    return tier, primary


def key(i: int) -> Any:
    return make_offload_key(i.to_bytes(32, "big"), 0)


_ids = iter(range(1, 1 << 30))


def job(keys: list[Any], chunks: list[int]) -> TransferJob:
    import numpy as np

    return TransferJob(job_id=next(_ids), keys=keys, chunk_ids=np.array(chunks),
                       is_promotion=False, req_context=CTX)  # fmt: skip


def results(tier: Any, jobs: list[TransferJob], timeout: float = 30) -> dict[int, Any]:
    """Poll get_finished_jobs until every job of ``jobs`` is reported (once each)."""
    want = {j.job_id for j in jobs}
    got: dict[int, Any] = {}
    end = time.monotonic() + timeout
    while want - set(got) and time.monotonic() < end:
        for r in tier.get_finished_jobs():
            assert r.job_id not in got, "a job reported twice"
            got[r.job_id] = r
        time.sleep(0.01)
    assert not want - set(got), f"jobs never reported: {want - set(got)}"
    return got


def lookup(tier: Any, k: Any) -> LookupResult:
    """vLLM's way: ask again while the answer is RETRY."""
    end = time.monotonic() + 30
    while (r := tier.lookup(k, CTX)) == LookupResult.RETRY and time.monotonic() < end:
        time.sleep(0.01)
    return r


@pytest.mark.parametrize("name", ["file", "shm", "mmap"])
def test_chunks_stored_then_loaded_into_other_chunks_are_the_same_bytes(
    name: str, tmp_path: Path
) -> None:
    opts: dict[str, dict[str, Any]] = {
        "file": {"root": str(tmp_path / "kv")},
        "shm": {"root": str(tmp_path / "shm")},
        "mmap": {"path": str(tmp_path / "arena"), "max_size": "16MiB", "prefault": False},
    }
    tier, primary = make_tier({"backend_name": name, **opts[name]})  # fmt: skip
    try:
        assert tier.lookup(key(1), CTX) == LookupResult.RETRY  # asked in the background
        assert lookup(tier, key(1)) == LookupResult.MISS
        store = job([key(1), key(2), key(3)], [0, 1, 2])
        tier.submit_store(store)
        (r,) = results(tier, [store]).values()
        assert r.success and r.transfer_bytes == 3 * CHUNK
        assert lookup(tier, key(2)) == LookupResult.HIT
        want = primary[:3].clone()
        load = job([key(3), key(1), key(2)], [10, 11, 12])
        tier.submit_load(load)
        (r,) = results(tier, [load]).values()
        assert r.success
        assert torch.equal(primary[10], want[2]) and torch.equal(primary[11], want[0])
        assert torch.equal(primary[12], want[1])
    finally:
        tier.shutdown()


def test_a_damaged_or_missing_chunk_fails_its_job_and_never_lands(tmp_path: Path) -> None:
    from hicache_storage.conformance.data import tree_files

    tier, primary = make_tier({"backend_name": "file", "root": str(tmp_path / "kv")})
    try:
        store = job([key(1), key(2)], [0, 1])
        tier.submit_store(store)
        assert results(tier, [store])[store.job_id].success
        for path in tree_files(str(tmp_path / "kv")):
            if os.path.getsize(path) > CHUNK // 2:  # flip a payload byte of one chunk
                with open(path, "r+b") as f:
                    f.seek(100)
                    b = f.read(1)
                    f.seek(100)
                    f.write(bytes([b[0] ^ 0xFF]))
                break  # one damaged chunk
        before = primary[8:11].clone()
        load = job([key(1), key(2), key(9)], [8, 9, 10])  # (key 9 was never stored)
        tier.submit_load(load)
        r = results(tier, [load])[load.job_id]
        assert not r.success
        ok = set(r.successful_keys or ())
        assert key(9) not in ok and len(ok) == 1  # one damaged, one missing, one good
        for i, k in enumerate([key(1), key(2), key(9)]):
            if k in ok:
                assert torch.equal(primary[8 + i], primary[[0, 1][i]])
            else:
                assert torch.equal(primary[8 + i], before[i])  # a failed chunk never lands
    finally:
        tier.shutdown()


def test_a_hung_store_costs_jobs_never_vllms_thread_and_late_bytes_never_land(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(WORKERS))
    import vllm_faults

    vllm_faults.RELEASE.clear()
    vllm_faults.MODE[0] = "ok"
    tier, primary = make_tier({"backend_name": "vllm_faults:FlakyFile",
                               "root": str(tmp_path / "kv"), "engine_timeout": 0.5})  # fmt: skip
    try:
        store = job([key(1)], [0])
        tier.submit_store(store)
        assert results(tier, [store])[store.job_id].success
        vllm_faults.MODE[0] = "hang"
        before = primary[5].clone()
        load, behind = job([key(1)], [5]), job([key(1)], [6])
        tier.submit_load(load)
        tier.submit_load(behind)  # queued behind the hung one
        assert tier.lookup(key(7), CTX) == LookupResult.RETRY
        # Every call answered before the deadline cut anything: none waited on the hang.
        assert tier.counters["timeouts"] == 0
        got = results(tier, [load, behind])
        assert not got[load.job_id].success and not got[behind.job_id].success
        primary[5].fill_(9)  # vLLM reuses the chunk
        vllm_faults.MODE[0] = "ok"
        vllm_faults.RELEASE.set()
        tier.drain_jobs()
        time.sleep(0.2)
        assert bool((primary[5] == 9).all()) and not torch.equal(before, primary[5])
        assert tier.get_finished_jobs() == []  # never reported twice
        assert tier.counters["timeouts"] == 2
    finally:
        vllm_faults.MODE[0] = "ok"
        vllm_faults.RELEASE.set()
        tier.shutdown()


@pytest.fixture
def faults() -> Any:
    sys.path.insert(0, str(WORKERS))
    import vllm_faults

    vllm_faults.RELEASE.clear()
    for v in vllm_faults.KEY_FAULTS.values():
        v.clear()
    yield vllm_faults
    for v in vllm_faults.KEY_FAULTS.values():
        v.clear()
    vllm_faults.RELEASE.set()


def test_one_hung_job_fails_only_its_thread_and_the_jobs_behind_it(
    tmp_path: Path, faults: Any
) -> None:
    tier, primary = make_tier({"backend_name": "vllm_faults:KeyFaults", "io_jobs": 2,
                               "root": str(tmp_path / "kv"), "engine_timeout": 0.5})  # fmt: skip
    try:
        stores = [job([key(i)], [i]) for i in range(1, 5)]
        for j in stores:
            tier.submit_store(j)
        assert all(r.success for r in results(tier, stores).values())
        faults.KEY_FAULTS["HANG"].add(key(1).hex())
        hung, healthy = job([key(1)], [10]), job([key(2)], [11])  # threads 0 and 1
        behind = job([key(3)], [12])  # queued on thread 0, behind the hung call
        for j in (hung, healthy, behind):
            tier.submit_load(j)
        got = results(tier, [hung, healthy, behind])
        assert got[healthy.job_id].success and torch.equal(primary[11], primary[2])
        assert not got[hung.job_id].success and not got[behind.job_id].success
        # While the call hangs, new jobs go to the free thread and succeed.
        later = [job([key(4)], [13]), job([key(2)], [14])]
        for j in later:
            tier.submit_load(j)
        assert all(r.success for r in results(tier, later).values())
        faults.RELEASE.set()
        tier.drain_jobs()
        time.sleep(0.2)
        assert tier.get_finished_jobs() == []  # no job reported twice
    finally:
        faults.RELEASE.set()
        tier.shutdown()


def test_a_failed_load_reads_as_a_miss_and_a_hung_lookup_as_a_miss(
    tmp_path: Path, faults: Any
) -> None:
    tier, _ = make_tier({"backend_name": "vllm_faults:KeyFaults",
                         "root": str(tmp_path / "kv"), "engine_timeout": 0.3})  # fmt: skip
    try:
        store = job([key(1)], [0])
        tier.submit_store(store)
        assert results(tier, [store])[store.job_id].success
        assert lookup(tier, key(1)) == LookupResult.HIT
        faults.KEY_FAULTS["FAIL_READ"].add(key(1).hex())
        load = job([key(1)], [5])
        tier.submit_load(load)
        assert not results(tier, [load])[load.job_id].success
        assert tier.lookup(key(1), CTX) == LookupResult.MISS  # not promoted again at once
        faults.KEY_FAULTS["HANG"].add(key(7).hex())
        assert tier.lookup(key(7), CTX) == LookupResult.RETRY
        time.sleep(0.4)
        assert tier.lookup(key(7), CTX) == LookupResult.MISS  # past the deadline
        assert lookup(tier, key(8)) == LookupResult.MISS  # (queued behind it: late too)
    finally:
        faults.RELEASE.set()
        tier.shutdown()


def test_canonical_and_direct_layouts_never_share_chunks(tmp_path: Path) -> None:
    from hicache_storage.integrations.vllm.tier import _namespace

    cfg = offloading_config()
    canonical = cfg.__class__(**{**cfg.__dict__, "canonical_layout": True})
    a = _namespace(cfg, CHUNK, 32, None, "", "")
    b = _namespace(canonical, CHUNK, 32, None, "", "")
    assert a.digest != b.digest


def test_another_process_loads_what_one_stored_and_another_model_never_does(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "kv")
    tier, primary = make_tier({"backend_name": "file", "root": root})
    store = job([key(1), key(2)], [3, 4])
    tier.submit_store(store)
    assert results(tier, [store])[store.job_id].success
    tier.shutdown()
    script = f"""
import json, sys, time
sys.path[:0] = {[str(Path(__file__).parent), str(WORKERS)]!r}
import test_tier as t
out = {{}}
for model in ("tiny-model", "other-model"):
    tier, primary = t.make_tier({{"backend_name": "file", "root": {root!r}}}, model, seed=5)
    out[model] = t.lookup(tier, t.key(2)).name
    if model == "tiny-model":
        load = t.job([t.key(1), t.key(2)], [0, 1])
        tier.submit_load(load)
        out["ok"] = t.results(tier, [load])[load.job_id].success
        out["bytes"] = primary[:2].flatten()[:64].tolist()
    tier.shutdown()
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()},
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiny-model"] == "HIT" and out["ok"]
    assert out["bytes"] == primary[3:5].flatten()[:64].tolist()
    assert out["other-model"] == "MISS"  # another model's namespace


def test_the_tier_refuses_what_it_cannot_move(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engine_timeout"):
        make_tier({"backend_name": "file", "root": str(tmp_path), "engine_timeout": -1})
    spec = MagicMock()
    spec.config = offloading_config(groups=2)
    primary = torch.zeros(CHUNKS, CHUNK, dtype=torch.uint8)
    entry = {"type": "HiCacheTier", "module_path": "hicache_storage.integrations.vllm.tier",
             "backend_name": "file", "root": str(tmp_path)}  # fmt: skip
    with pytest.raises(ConfigError, match="group"):
        SecondaryTierFactory.create_secondary_tier(entry, primary.numpy().data, spec)
