"""The workload, the stand-in model and the replay, over a faulty backend too."""

from __future__ import annotations

import itertools
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HostKVPool
from hicache_storage.conformance.wrappers import FaultyBackend
from hicache_storage.tier import DevicePool
from hicache_storage.tier.workload import (
    fill_page,
    ideal_hit_tokens,
    page_differs,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from tier_replay import SMALL, replay_small


def test_the_trace_grows_histories_and_shares_system_prompts() -> None:
    reqs = list(SMALL.requests())
    assert len(reqs) == SMALL.count == 12
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt[: len(prev.prompt) + len(prev.answer)] == prev.prompt + prev.answer
    assert reqs[0].prompt[:64] in [r.prompt[:64] for r in reqs[1:]]
    assert list(SMALL.requests())[5] == reqs[5]  # deterministic
    hit, total = ideal_hit_tokens(reqs, 8)
    assert 0 < hit < total


def test_the_stand_in_model_is_deterministic_and_tells_pages_apart() -> None:
    host = HostKVPool(num_pages=4, page_size=8, layer_num=2, kv_heads=2, head_dim=16)
    dev = DevicePool(host, 4)
    fill_page(dev, 0, "a")
    fill_page(dev, 1, "a")
    fill_page(dev, 2, "b")
    assert not page_differs(dev, 0, "a") and not page_differs(dev, 1, "a")
    assert page_differs(dev, 2, "a")
    dev.page_layer(1, 1)[1].view(-1).view(torch.uint8)[7] ^= 1
    assert page_differs(dev, 1, "a")


def test_a_failing_store_never_fails_the_run_or_serves_wrong_pages() -> None:
    result, cache = replay_small(
        "memory",
        {"store": f"wl-{uuid.uuid4().hex[:8]}"},
        wrap=lambda b: FaultyBackend(b, failure_rate=0.3, seed=5, partial=True),
    )
    assert result.requests == 12
    assert result.verification_errors == 0 and result.verified_pages > 0
    assert cache.stats.backup_failed_tokens + cache.stats.backup_retries > 0  # faults happened
    assert cache._backup_thread.is_alive() is False  # closed cleanly, not died


@pytest.mark.parametrize("name", ["file", "shm", "mmap", "memory", "nixl"])
def test_the_replay_is_byte_exact_on_every_local_backend(name: str, tmp_path: Path) -> None:
    shm_dir = f"/dev/shm/hicache-tier-{uuid.uuid4().hex[:8]}"
    every: dict[str, dict[str, Any]] = {
        "file": {"root": str(tmp_path / "file")},
        "shm": {"root": shm_dir},
        "mmap": {"path": str(tmp_path / "arena"), "max_size": "64MiB", "prefault": False},
        "memory": {"store": f"wl-{uuid.uuid4().hex[:8]}"},
        "nixl": {"root": str(tmp_path / "nixl")},
    }
    try:
        result, cache = replay_small(name, every[name], prefetch_policy="wait_complete")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert result.verification_errors == 0 and result.verified_pages > 0
    assert result.storage_hit_tokens > 0  # pages came back from this store
    assert cache.stats.backup_failed_tokens == 0
