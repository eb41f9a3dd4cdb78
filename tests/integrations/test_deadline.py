"""Calls an engine waits for only until a deadline (hicache_storage.integrations.deadline).

The thing under test is the caller's logic, so the hung store is a wrapper around the
real ``file`` backend whose calls wait on an event the test controls.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typing_extensions import override

from hicache_storage.config import StorageConfig
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.deadline import Lane, call_with_deadline
from hicache_storage.integrations.kvblocks import KVBlockMover, kv_blocks
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.registry import create_backend
from hicache_storage.wrapper import WrapperBackend

#: A deadline the hung calls always pass (they wait for the test to release them).
DEADLINE = 0.2
NB, H, BS, C, L = 12, 2, 32, 64, 2  # blocks, heads, block size, 2 * head_dim, layers


def _kv(seed: int = 0) -> list[torch.Tensor]:
    """``L`` layers of random bf16 KV in vLLM's CPU layout (one allocation)."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(L, NB, H, BS, C, generator=g).to(torch.bfloat16)
    return [big[i] for i in range(L)]


def _page_bytes(layers: list[torch.Tensor], b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in layers)


def _backend(root: Path) -> HiCacheStorage:
    ns = KVCacheNamespace(model_id="tiny", dtype="bfloat16", page_size=BS,
                          object_layout="vllm-test")  # fmt: skip
    return create_backend("file", StorageConfig(namespace=ns), root=str(root))


def test_a_call_in_time_returns_its_result_and_its_error() -> None:
    lane = Lane("t")
    assert lane.run(lambda job: 41 + 1, 5.0)[0] == "done"
    assert lane.run(lambda job: 7, 5.0)[1].result == 7

    def boom(job: Any) -> int:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        lane.run(boom, 5.0)
    assert not lane.busy
    lane.close()


def test_a_hung_call_is_cut_and_the_next_one_refused_at_once() -> None:
    lane = Lane("t")
    release = threading.Event()
    gate: list[bool] = []

    def hung(job: Any) -> str:
        release.wait()
        with job.commit() as ok:
            gate.append(ok)
        return "late"

    outcome, job = lane.run(hung, DEADLINE)
    assert outcome == "timeout" and job.cut and job.result is None
    assert lane.busy
    outcome, other = lane.run(lambda job: "never run", 60.0)
    assert outcome == "busy" and other.result is None  # answered without waiting
    release.set()
    job._done.wait(10)
    assert gate == [False]  # the late call found the gate to the engine's memory shut
    _wait_idle(lane)  # the lane takes calls again once the hung one returned
    assert lane.run(lambda job: "again", 5.0)[1].result == "again"
    lane.close()
    assert lane.run(lambda job: 1, 5.0)[0] == "busy"  # closed


def _wait_idle(lane: Lane) -> None:
    for _ in range(1000):
        if not lane.busy:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the lane stayed busy")


def test_call_with_deadline() -> None:
    assert call_with_deadline(lambda: 3, 5.0, "t") == (True, 3)
    release = threading.Event()
    assert call_with_deadline(release.wait, DEADLINE, "t") == (False, None)
    release.set()
    with pytest.raises(KeyError):
        call_with_deadline(lambda: dict[str, int]()["x"], 5.0, "t")


def test_a_hung_call_never_keeps_the_process_alive() -> None:
    """Lane threads are daemons: a store that never returns does not block exit."""
    code = (
        "import threading\n"
        "from hicache_storage.integrations.deadline import Lane, call_with_deadline\n"
        "forever = threading.Event()\n"
        "lane = Lane('hung')\n"
        "print(lane.run(lambda job: forever.wait(), 0.1)[0])\n"
        "print(call_with_deadline(forever.wait, 0.1, 'hung')[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["timeout", "False"]


class Held(WrapperBackend):
    """``inner``, with v1 calls that wait for ``release`` before they run."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.finished = threading.Event()

    @override
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: object = None
    ) -> list[bool]:
        self.entered.set()
        self.release.wait()
        try:
            return self.inner.batch_get_v1(keys, host_indices, extra_info)
        finally:
            self.finished.set()

    @override
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: object = None
    ) -> list[bool]:
        self.entered.set()
        self.release.wait()
        try:
            return self.inner.batch_set_v1(keys, host_indices, extra_info)
        finally:
            self.finished.set()


KEYS = [f"{i:064x}" for i in range(1, 4)]


def _stored(tmp_path: Path) -> dict[str, bytes]:
    """Three blocks stored through a plain mover; their pages by key."""
    src = _kv(seed=3)
    mover = KVBlockMover.attach(_backend(tmp_path), kv_blocks(src, BS))
    assert mover.save(KEYS, [0, 1, 2]) == [True] * 3
    return {k: _page_bytes(src, b) for k, b in zip(KEYS, [0, 1, 2], strict=True)}


def test_a_load_cut_at_its_deadline_never_writes_into_the_engines_blocks(tmp_path: Path) -> None:
    want = _stored(tmp_path)
    kv = [torch.zeros_like(t) for t in _kv()]
    held = Held(_backend(tmp_path))
    pool = kv_blocks(kv, BS, staging_rows=4, lanes=2)
    mover = KVBlockMover.attach(held, pool)
    lane = Lane("load")
    outcome, job = lane.run(lambda job: mover.load(KEYS, [5, 6, 7], job), DEADLINE)
    assert outcome == "timeout"
    # vLLM reuses the blocks (recomputes them) while the read is still hung...
    for t in kv:
        t[5:8].fill_(7)
    held.release.set()  # ...then the late bytes arrive
    job._done.wait(10)
    assert held.finished.is_set() and job.result == [False, False, False]
    assert all(bool((t[5:8] == 7).all()) for t in kv)  # the late bytes never landed
    # They landed in the load lane's staging rows, and nowhere else.
    rows = pool.page_buffers(torch.arange(3 * BS), expected_pages=3)
    assert [r.tobytes() for r in rows] == [want[k] for k in KEYS]
    # A load in time lands whole.
    lane2 = Lane("load2")
    assert lane2.run(lambda job: mover.load(KEYS, [9, 10, 11], job), 30.0)[1].result == [True] * 3
    assert [_page_bytes(kv, b) for b in (9, 10, 11)] == [want[k] for k in KEYS]


def test_a_store_cut_at_its_deadline_stores_what_the_blocks_held_in_time(
    tmp_path: Path,
) -> None:
    """The blocks are copied out before the (hung) write; one chunk past the cut is not
    read from the engine at all."""
    kv = _kv(seed=4)
    before = {b: _page_bytes(kv, b) for b in range(4)}
    held = Held(_backend(tmp_path))
    mover = KVBlockMover.attach(held, kv_blocks(kv, BS, staging_rows=2, lanes=2))
    keys = [f"{i:064x}" for i in range(10, 14)]
    lane = Lane("save")
    outcome, job = lane.run(lambda job: mover.save(keys, [0, 1, 2, 3], job), DEADLINE)
    assert outcome == "timeout" and held.entered.is_set()
    for t in kv:  # vLLM reuses the blocks
        t[0:4].fill_(3)
    held.release.set()
    job._done.wait(10)
    assert job.result == [True, True, False, False]  # the second chunk was never copied
    check = _backend(tmp_path)
    assert check.get(keys[0]) is not None
    assert bytes(check.get(keys[0])) == before[0] and bytes(check.get(keys[1])) == before[1]
    assert check.batch_exists(keys[2:]) == 0


def test_lanes_need_a_staged_pool(tmp_path: Path) -> None:
    kv = _kv()
    with pytest.raises(ConfigError, match="staging"):
        kv_blocks(kv, BS, staged=False, lanes=2)
    mover = KVBlockMover.attach(_backend(tmp_path), kv_blocks(kv, BS))
    lane = Lane("x")
    with pytest.raises(ConfigError, match="staged"):
        lane.run(lambda job: mover.load(KEYS, [0, 1, 2], job), 30.0)


def test_a_lane_is_free_again_when_its_caller_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller told "done" that asks again at once is never told "busy". (The lane
    marked itself free only after waking the caller; here the lane's thread is held
    right after it wakes the caller, which asks again in that window.)"""
    import threading

    from hicache_storage.integrations import deadline

    class SlowWake(threading.Event):
        def set(self) -> None:
            super().set()
            threading.Event().wait(0.05)  # (the lane's thread, held after the wake-up)

    class HeldJob(deadline.Job):
        def __init__(self, fn: Any) -> None:
            super().__init__(fn)
            self._done = SlowWake()

    monkeypatch.setattr(deadline, "Job", HeldJob)
    lane = Lane("back-to-back")
    try:
        outcomes = [lane.run(lambda job: 1, 10.0)[0] for _ in range(5)]
    finally:
        lane.close()
    assert outcomes == ["done"] * 5


def test_background_jobs_run_in_order_and_survive_a_failing_completion_step() -> None:
    from hicache_storage.integrations.deadline import Background

    bg = Background("test-background")
    order: list[int] = []

    def boom(_job: object) -> None:
        raise RuntimeError("a completion step that fails")

    first = bg.submit(lambda job: order.append(1), on_done=boom)
    second = bg.submit(lambda job: order.append(2))
    assert second.wait(10) and first.finished
    assert order == [1, 2]  # the thread went on after the failing step
    gate = bg.submit(lambda job: job.cut)
    assert gate.wait(10) and gate.result is False
    bg.close()
    late = bg.submit(lambda job: order.append(3))
    assert late.finished and late.cut and order == [1, 2]  # refused after close, never run
