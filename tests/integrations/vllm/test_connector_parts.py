"""HiCacheKVConnector's two halves driven step by step, with vLLM's own config classes.

No engine: the scheduler-side and worker-side connectors are built from a real
``VllmConfig`` (vLLM's ``EngineArgs`` on the tiny model) and a ``KVCacheConfig`` like the
engine's, and fed the steps vLLM would feed them (chunked prefill, a local prefix hit,
a preempted request), with real KV tensors and the real ``file`` backend. What the
engine tests cannot reach (several steps of one prompt, TP shards, refused deployments,
broken hooks) is checked here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_engine import BLOCK, kv_transfer_config

from hicache_storage.errors import ConfigError, UnknownBackendError
from hicache_storage.integrations.vllm import (
    HiCacheConnectorMetadata,
    HiCacheKVConnector,
    HiCacheKVConnectorStats,
    request_seed,
)
from hicache_storage.integrations.vllm import side as hv_side
from hicache_storage.integrations.vllm.scheduler import SchedulerSide
from hicache_storage.integrations.vllm.worker import WorkerSide

NB = 64  # blocks in the test KV cache


def wside(c: HiCacheKVConnector) -> WorkerSide:
    """The worker side of a worker's connector."""
    assert c.connector_worker is not None
    return c.connector_worker


def sside(c: HiCacheKVConnector) -> SchedulerSide:
    """The scheduler side of a scheduler's connector."""
    assert c.connector_scheduler is not None
    return c.connector_scheduler


LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


@pytest.fixture(scope="module")
def base_config(tiny_model: Path) -> Any:
    """A real VllmConfig for the tiny model with the connector configured (on ``file``)."""
    args = EngineArgs(
        model=str(tiny_model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
        max_model_len=256, enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config("file", {"root": "/nonexistent"}),
    )  # fmt: skip
    return args.create_engine_config()


@pytest.fixture
def config(base_config: Any, tmp_path: Path) -> Iterator[Any]:
    """``base_config`` with the connector's extra config on a fresh ``file`` root."""
    ktc = base_config.kv_transfer_config
    saved = dict(ktc.kv_connector_extra_config)
    ktc.kv_connector_extra_config.clear()
    # Loads before the forward pass unless a test asks otherwise (these tests leave
    # requests unfinished, which the default would count as running beside a new one).
    ktc.kv_connector_extra_config.update(
        backend_name="file", root=str(tmp_path / "kv"), async_loads=False
    )
    yield base_config
    ktc.kv_connector_extra_config.clear()
    ktc.kv_connector_extra_config.update(saved)


def kv_config(spec: Any = SPEC, groups: int = 1) -> KVCacheConfig:
    group = KVCacheGroupSpec(list(LAYERS), spec)
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[group] * groups,
                         kv_cache_layout="LBHNC")  # fmt: skip


SWA = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                        sliding_window=40)  # fmt: skip


def hybrid_config(extra: list[Any] = ()) -> KVCacheConfig:  # type: ignore[assignment]
    """vLLM's hybrid allocator's config: a full-attention group (layer 0) and a
    sliding-window group (layer 1, window 40 tokens), then a group of each of ``extra``."""
    groups = [KVCacheGroupSpec([LAYERS[0]], SPEC), KVCacheGroupSpec([LAYERS[1]], SWA)]
    groups += [KVCacheGroupSpec([f"extra.{i}"], spec) for i, spec in enumerate(extra)]
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups,
                         kv_cache_layout="LBHNC")  # fmt: skip


def kv_tensors(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU KV: one allocation, layer outermost, [blocks, heads, block, 2 * head]."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(len(LAYERS), NB, 2, BLOCK, 64, generator=g).to(torch.bfloat16)
    return {name: big[i] for i, name in enumerate(LAYERS)}


def pair(config: Any, seed: int = 0) -> tuple[HiCacheKVConnector, HiCacheKVConnector, dict]:
    """A scheduler-side and a worker-side connector over fresh KV tensors."""
    sched = HiCacheKVConnector(config, SCHED, kv_config())
    worker = HiCacheKVConnector(config, WORKER, kv_config())
    kv = kv_tensors(seed)
    worker.register_kv_caches(kv)
    return sched, worker, kv


def request(req_id: str, tokens: list[int], **extra: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "lora_request": None,
        "mm_features": [],
        "cache_salt": None,
        "prompt_embeds": None,
    }
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, **{**fields, **extra})


def new_req(req_id: str, blocks: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def step(
    new: list[SimpleNamespace] = (),  # type: ignore[assignment]
    cached: list[tuple[str, list[int] | None, int, bool]] = (),  # type: ignore[assignment]
    scheduled: dict[str, int] | None = None,
) -> SimpleNamespace:
    """A SchedulerOutput with what the connector reads. ``cached``: (id, new blocks,
    computed tokens, resumed)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[3]},
        ),
        num_scheduled_tokens=scheduled or {},
    )


def run_step(
    sched: HiCacheKVConnector,
    worker: HiCacheKVConnector,
    out: Any,
    finished: set[str] = frozenset(),  # type: ignore[assignment]
    flush: bool = True,
) -> Any:
    """What vLLM does with one step: build the metadata, load, forward, save, report.

    With ``flush`` the step's background stores are waited for (as if they finished
    before the next step), so a test sees their effect; ``meta.sent`` holds what
    ``get_finished`` reported.
    """
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    if flush:
        assert wside(worker).flush(30)
    meta.sent = worker.get_finished(set(finished))[0]
    worker.clear_connector_metadata()
    return meta


def block(kv: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[b].clone() for t in kv.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


PROMPT = list(range(5, 105))  # 100 tokens: 3 full blocks and 4 tokens


def test_chunked_prefill_stores_each_block_once_then_a_new_request_loads_them(config: Any) -> None:
    sched, worker, kv = pair(config, seed=1)
    r = request("r1", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    # Three chunks of 40, 40 and 20 tokens: a block is stored in the step that fills it.
    m1 = run_step(sched, worker, step([new_req("r1", [5, 9], 0)], scheduled={"r1": 40}))
    m2 = run_step(sched, worker, step(cached=[("r1", [12, 13], 40, False)], scheduled={"r1": 40}))
    m3 = run_step(sched, worker, step(cached=[("r1", None, 80, False)], scheduled={"r1": 20}))
    m4 = run_step(sched, worker, step(cached=[("r1", None, 100, False)], scheduled={"r1": 1}))
    assert [[s.block_ids[0] for s in m.saves] for m in (m1, m2, m3, m4)] == [
        [[5]],
        [[9]],
        [[12]],
        [],
    ]
    assert not any(m.loads for m in (m1, m2, m3, m4))
    assert worker.totals["save_blocks"] == 3 and worker.totals["save_failed_blocks"] == 0
    stored = [block(kv, b) for b in (5, 9, 12)]
    # Stores run in the background: vLLM keeps the blocks until the worker says the
    # request's stores are done (here at once: they are), in the next step.
    assert sched.request_finished(r, [5, 9, 12, 13]) == (True, None)

    # A second request with the same prompt: 3 blocks (96 <= 99 tokens) from the store.
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(r2, None, 3 * BLOCK)
    m = run_step(sched, worker, step([new_req("r2", [20, 21, 22, 23], 96)], scheduled={"r2": 4}),
                 finished={"r1"})  # fmt: skip
    assert m.delayed_frees == ["r1"] and m.sent == {"r1"}
    assert [(s.block_ids[0], len(s.keys)) for s in m.loads] == [([20, 21, 22], 3)]
    # r2's full blocks are all stored already; r1's last block (4 tokens with KV) is
    # stored as a partial block before vLLM frees it.
    assert [(s.req_id, s.block_ids[0]) for s in m.saves] == [("r1", [13])]
    assert all(same(block(kv, b), s) for b, s in zip((20, 21, 22), stored, strict=True))
    assert worker.get_block_ids_with_load_errors() == set()
    assert sched.totals["lookup_hit_blocks"] == 3


def test_a_finished_requests_partial_last_block_serves_the_next_turn(config: Any) -> None:
    """A prompt of 100 tokens (3 blocks and 4 tokens): at the end, its last block is
    stored as a partial block of 4 tokens. The next turn sends those 100 tokens and 10
    more: it loads the 3 blocks and the partial one, and computes from token 100, not 96."""
    sched, worker, kv = pair(config, seed=61)
    r = request("r1", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("r1", [5, 9, 12, 13], 0)], scheduled={"r1": 100}))
    assert sched.request_finished(r, [5, 9, 12, 13]) == (True, None)
    m = run_step(sched, worker, step(), finished={"r1"})
    assert [(s.block_ids[0], len(s.keys)) for s in m.saves] == [([13], 1)] and m.sent == {"r1"}
    assert worker.totals["save_blocks"] == 3 and worker.totals["save_partial_blocks"] == 1
    partial = block(kv, 13)
    turn2 = request("r2", [*PROMPT, *range(700, 710)])
    assert sched.get_num_new_matched_tokens(turn2, 0) == (100, False)  # not 96
    sched.update_state_after_alloc(turn2, None, 100)
    m = run_step(sched, worker, step([new_req("r2", [20, 21, 22, 23], 100)],
                                      scheduled={"r2": 10}))  # fmt: skip
    assert [(s.block_ids[0], len(s.keys)) for s in m.loads] == [([20, 21, 22, 23], 4)]
    assert worker.get_block_ids_with_load_errors() == set()
    assert same(block(kv, 23), partial)  # loaded whole; vLLM computes from slot 4 on
    # Another 4-token tail that differs: never a hit of that partial block.
    other = request("r3", [*PROMPT[:96], 1, 2, 3, 4, *range(700, 710)])
    assert sched.get_num_new_matched_tokens(other, 0) == (96, False)


def test_generated_blocks_are_stored_once_their_kv_and_tokens_exist(config: Any) -> None:
    """Decode steps store the answer's full blocks; the next turn's prompt hits them."""
    sched, worker, kv = pair(config, seed=11)
    prompt = PROMPT[:60]  # 1 full block and 28 tokens
    r = request("a", prompt, all_token_ids=list(prompt))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    m = run_step(sched, worker, step([new_req("a", [1, 2], 0)], scheduled={"a": 60}))
    assert [s.block_ids[0] for s in m.saves] == [[1]]
    computed = 60
    saves = []
    for tok in range(1000, 1010):  # decode: the token sampled last step is fed now
        r.all_token_ids.append(tok)
        m = run_step(sched, worker, step(cached=[("a", None, computed, False)], scheduled={"a": 1}))
        saves.append([s.block_ids[0] for s in m.saves])
        computed += 1
    # Block 2 (tokens 32..63) is full once token 63's KV is computed: the 4th decode step.
    assert saves == [[], [], [], [[2]], [], [], [], [], [], []]
    # Draft tokens (scheduled, not yet accepted: not in the token ids) are never stored.
    r.all_token_ids.extend(range(2000, 2021))  # 91 tokens known, block 3 not full yet
    m = run_step(sched, worker, step(cached=[("a", [3], computed, False)], scheduled={"a": 40}))
    assert m.saves == []
    assert worker.totals["save_blocks"] == 2
    answer = list(r.all_token_ids)
    sched.request_finished(r, [1, 2, 3])

    # The next turn: the whole conversation and new tokens; both blocks from the store.
    nxt = answer + list(range(3000, 3010))
    r2 = request("b", nxt, all_token_ids=list(nxt))
    assert sched.get_num_new_matched_tokens(r2, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(r2, None, 2 * BLOCK)
    m = run_step(sched, worker, step([new_req("b", [7, 8, 9, 10], 64)], scheduled={"b": 37}))
    assert [s.block_ids[0] for s in m.loads] == [[7, 8]]
    assert same(block(kv, 8), block(kv, 2))


def test_the_output_cap_bounds_what_is_stored(config: Any) -> None:
    ktc = config.kv_transfer_config
    ktc.kv_connector_extra_config["store_output_tokens"] = BLOCK
    sched, worker, _ = pair(config, seed=12)
    r = request("a", PROMPT[:32], all_token_ids=list(PROMPT[:32]))
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("a", [1, 2, 3], 0)], scheduled={"a": 32}))
    r.all_token_ids.extend(range(1000, 1000 + 3 * BLOCK))  # 3 blocks of answer
    m = run_step(sched, worker, step(cached=[("a", None, 32, False)], scheduled={"a": 96}))
    # The prompt's block, then 32 output tokens: one more block, not three.
    assert [s.block_ids[0] for s in m.saves] == [[2]]
    assert worker.totals["save_blocks"] == 2


def test_a_full_hit_loads_the_last_block_and_leaves_one_token(config: Any) -> None:
    sched, worker, kv = pair(config, seed=13)
    prompt = PROMPT[: 3 * BLOCK]
    sched.get_num_new_matched_tokens(request("a", prompt), 0)
    run_step(sched, worker, step([new_req("a", [1, 2, 3], 0)], scheduled={"a": 96}))
    r = request("b", prompt)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK - 1, False)
    sched.update_state_after_alloc(r, None, 3 * BLOCK - 1)
    m = run_step(sched, worker, step([new_req("b", [7, 8, 9], 95)], scheduled={"b": 1}))
    assert [s.block_ids[0] for s in m.loads] == [[7, 8, 9]] and m.saves == []
    assert same(block(kv, 9), block(kv, 3))
    # vLLM's own hit of two blocks: the store adds the third, less the last token.
    r = request("c", prompt)
    assert sched.get_num_new_matched_tokens(r, 2 * BLOCK) == (BLOCK - 1, False)
    sched.update_state_after_alloc(r, None, BLOCK - 1)
    m = run_step(sched, worker, step([new_req("c", [1, 2, 12], 95)], scheduled={"c": 1}))
    assert [s.block_ids[0] for s in m.loads] == [[12]]


class Blocks:
    """vLLM's ``KVCacheBlocks`` as the connector reads it (group 0's block ids)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def store_prompt(sched: HiCacheKVConnector, worker: HiCacheKVConnector) -> Any:
    """Request a computes PROMPT in blocks 1-4: its three full blocks are stored."""
    sched.get_num_new_matched_tokens(request("a", PROMPT), 0)
    return run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))


def background_load(
    config: Any, seed: int, hung: Any = None, mode: str = ""
) -> tuple[HiCacheKVConnector, HiCacheKVConnector, dict, Any]:
    """PROMPT stored by a, which keeps running; then b's hit on it, planned as a
    background load into blocks 5-7 (with ``hung``'s fault ``mode`` set first)."""
    config.kv_transfer_config.kv_connector_extra_config["async_loads"] = True
    sched, worker, kv = pair(config, seed=seed)
    store_prompt(sched, worker)
    if hung is not None:
        hung.MODE[0] = mode
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(r, Blocks([5, 6, 7, 8]), 3 * BLOCK)
    return sched, worker, kv, r


def test_a_background_load_is_reported_once_it_has_landed(config: Any) -> None:
    sched, worker, kv, _ = background_load(config, 31)
    # The next step (b is not in it: vLLM holds it until its load is reported).
    m = run_step(sched, worker, step())
    assert [(s.block_ids[0], s.background) for s in m.loads] == [([5, 6, 7], True)]
    assert wside(worker).flush(30, loads=True)
    m = run_step(sched, worker, step())
    assert worker.get_finished(set()) == (None, None)  # reported once, in the last step
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(same(block(kv, b), block(kv, a)) for a, b in ((1, 5), (2, 6), (3, 7)))
    # Then vLLM schedules b with its 96 tokens computed: nothing more to load or store.
    m = run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
    assert m.loads == [] and m.saves == []
    assert worker.totals["load_blocks"] == 3


def test_background_loads_by_default_only_beside_running_requests(config: Any) -> None:
    del config.kv_transfer_config.kv_connector_extra_config["async_loads"]  # the default
    sched, worker, _ = pair(config, seed=32)
    store_prompt(sched, worker)
    sched.request_finished(request("a", PROMPT), [1, 2, 3, 4])
    # Alone: loaded before the forward pass (the lowest TTFT).
    lone = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(lone, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(lone, Blocks([5, 6, 7, 8]), 3 * BLOCK)
    run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
    # Beside b, which is decoding: in the background, so b's steps never wait for it.
    assert sched.get_num_new_matched_tokens(request("c", PROMPT), 0) == (3 * BLOCK, True)


def test_a_hung_background_load_is_reported_failed_at_the_deadline(config: Any, hung: Any) -> None:
    sched, worker, kv, _ = background_load(config, 33, hung, "hangread")
    m = run_step(sched, worker, step())
    assert m.loads and worker.get_block_ids_with_load_errors() == set()
    deadline = time.monotonic() + 30  # (engine_timeout is 0.5 s; a bound for a hang)
    while True:
        worker.bind_connector_metadata(sched.build_connector_meta(step()))
        results = worker.get_transfer_results(set())
        if results.finished_recving or time.monotonic() > deadline:
            break
        worker.clear_connector_metadata()
        time.sleep(0.05)
    assert results.finished_recving == {"b"} and not results.failed_recving
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7}
    worker.clear_connector_metadata()
    assert worker.totals["load_timeouts"] == 1
    for t in kv.values():  # vLLM recomputes the blocks
        t[5:8].fill_(2.5)
    recomputed = [block(kv, b) for b in (5, 6, 7)]
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30, loads=True)
    assert all(same(block(kv, b), w) for b, w in zip((5, 6, 7), recomputed, strict=True))
    assert worker.get_finished(set()) == (None, None)  # never reported twice


def test_a_background_load_that_cannot_be_planned_fails_its_request(config: Any) -> None:
    config.kv_transfer_config.kv_connector_extra_config["async_loads"] = True
    sched, worker, _ = pair(config, seed=34)
    store_prompt(sched, worker)
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(r, object(), 3 * BLOCK)  # (no block ids: a bug)
    assert sched.totals["hook_errors"] == 1
    meta = sched.build_connector_meta(step())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"b"} and results.failed_recving == {"b"}
    worker.clear_connector_metadata()


def test_a_request_aborted_during_its_background_load_is_reported_once(
    config: Any, hung: Any
) -> None:
    """vLLM keeps the blocks of a request whose load is in flight until it is reported
    loaded; the connector must not delay its free too (vLLM would meet its id twice)."""
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra.update(async_loads=True, engine_timeout=30)
    sched, worker, _ = pair(config, seed=41)
    r = request("p", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("p", [1, 2, 3, 4], 0)], scheduled={"p": 100}))
    # Preempted, looked up again: its own blocks hit, loaded in the background (slowly).
    hung.MODE[0] = "hangread"
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(r, Blocks([10, 11, 12]), 3 * BLOCK)
    m = run_step(sched, worker, step(), flush=False)
    assert m.loads and m.sent is None
    assert sched.request_finished(r, [10, 11, 12]) == (False, None)  # aborted: vLLM waits
    m = run_step(sched, worker, step(), finished={"p"}, flush=False)
    assert m.delayed_frees == [] and m.sent is None
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30, loads=True)
    meta = sched.build_connector_meta(step())
    worker.bind_connector_metadata(meta)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"p"} and not results.finished_sending
    worker.clear_connector_metadata()


def test_a_load_into_blocks_a_queued_store_still_reads_cuts_that_store(
    config: Any, hung: Any
) -> None:
    """p's store waits behind a slow one; p is preempted and its blocks go to y, whose
    stored prefix loads into them before the forward pass: p's store must not store y's
    KV under p's keys."""
    sched, worker, kv = pair(config, seed=42)
    y_prompt = list(range(300, 400))
    sched.get_num_new_matched_tokens(request("y0", y_prompt), 0)
    run_step(sched, worker, step([new_req("y0", [1, 2, 3, 4], 0)], scheduled={"y0": 100}))
    hung.MODE[0] = "hangwrite"
    sched.get_num_new_matched_tokens(request("s", list(range(500, 600))), 0)
    run_step(sched, worker, step([new_req("s", [5, 6, 7, 8], 0)], scheduled={"s": 100}),
             flush=False)  # fmt: skip
    sched.get_num_new_matched_tokens(request("p", PROMPT), 0)
    run_step(sched, worker, step([new_req("p", [10, 11, 12, 13], 0)], scheduled={"p": 100}),
             flush=False)  # fmt: skip
    y = request("y", y_prompt)
    assert sched.get_num_new_matched_tokens(y, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(y, None, 3 * BLOCK)
    m = run_step(sched, worker, step([new_req("y", [10, 11, 12, 14], 96)], scheduled={"y": 4}),
                 flush=False)  # fmt: skip
    assert 10 not in m.fresh_blocks  # (vLLM counts loaded blocks as computed)
    assert same(block(kv, 10), block(kv, 1))  # y's KV is in block 10 now
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30)
    assert worker.totals["save_cut_blocks"] == 3  # p's store: cut before it read
    assert sched.get_num_new_matched_tokens(request("q", PROMPT), 0) == (0, False)


def test_a_hung_background_load_never_holds_up_a_load_before_the_forward_pass(
    config: Any, hung: Any
) -> None:
    config.kv_transfer_config.kv_connector_extra_config["async_loads"] = True
    sched, worker, kv = pair(config, seed=43)
    other = list(range(300, 400))
    for rid, prompt, blocks in (("a0", PROMPT, [1, 2, 3, 4]), ("c0", other, [5, 6, 7, 8])):
        sched.get_num_new_matched_tokens(request(rid, prompt), 0)
        run_step(sched, worker, step([new_req(rid, blocks, 0)], scheduled={rid: 100}))
    hung.MODE[0] = "hangread"
    a = request("a", PROMPT)
    assert sched.get_num_new_matched_tokens(a, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(a, Blocks([10, 11, 12, 13]), 3 * BLOCK)
    run_step(sched, worker, step(), flush=False)  # a's load hangs in the background
    assert hung.ENTERED.wait(30)
    hung.MODE[0] = "ok"  # the store answers again (a's read is still out)
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra["async_loads"] = False
    sched2 = HiCacheKVConnector(config, SCHED, kv_config())  # loads before the pass
    c = request("c", other)
    assert sched2.get_num_new_matched_tokens(c, 0) == (3 * BLOCK, False)
    sched2.update_state_after_alloc(c, None, 3 * BLOCK)
    run_step(sched2, worker, step([new_req("c", [20, 21, 22, 23], 96)], scheduled={"c": 4}))
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(same(block(kv, b), block(kv, a_)) for a_, b in ((5, 20), (6, 21), (7, 22)))
    hung.RELEASE.set()
    assert wside(worker).flush(30, loads=True)
    sched2.shutdown()


def test_a_request_whose_background_load_failed_is_not_offered_it_again(
    config: Any, hung: Any
) -> None:
    """vLLM sends a request whose background load failed back to the lookup: the same
    failing load must not come round again (it would loop)."""
    sched, worker, _, r = background_load(config, 44, hung, "torn")
    run_step(sched, worker, step(), flush=False)
    assert wside(worker).flush(30, loads=True)
    run_step(sched, worker, step())
    assert worker.get_block_ids_with_load_errors()  # vLLM goes back to zero, looks up again
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    # Computed afresh: its blocks are stored again (the store had them; no harm).
    m = run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 0)], scheduled={"b": 100}))
    assert [s.block_ids[0] for s in m.saves] == [[5, 6, 7]]


def test_only_blocks_beyond_vllms_own_hit_are_loaded(config: Any) -> None:
    sched, worker, kv = pair(config, seed=2)
    first = request("a", PROMPT)
    sched.get_num_new_matched_tokens(first, 0)
    run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    # vLLM's prefix cache holds 2 blocks: the store's third is the only one loaded.
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 2 * BLOCK) == (BLOCK, False)
    sched.update_state_after_alloc(r, None, BLOCK)
    m = run_step(sched, worker, step([new_req("b", [1, 2, 7, 8], 96)], scheduled={"b": 4}))
    assert [s.block_ids[0] for s in m.loads] == [[7]]
    assert same(block(kv, 7), block(kv, 3))
    # vLLM's own hit covers the store's run: nothing to load.
    assert sched.get_num_new_matched_tokens(request("c", PROMPT), 3 * BLOCK) == (0, False)


def test_blocks_vllm_had_but_the_store_lost_are_stored_again(config: Any) -> None:
    sched, worker, _ = pair(config, seed=3)
    r = request("a", PROMPT[:40])  # one full block, stored
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("a", [1, 2], 0)], scheduled={"a": 40}))
    # A longer prompt whose first 2 blocks vLLM holds locally, of which the store has 1.
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 2 * BLOCK) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    m = run_step(sched, worker, step([new_req("b", [1, 5, 6, 7], 64)], scheduled={"b": 36}))
    assert m.loads == [] and [s.block_ids[0] for s in m.saves] == [[5, 6]]


def test_a_resumed_request_uses_its_new_blocks(config: Any) -> None:
    sched, worker, kv = pair(config, seed=4)
    r = request("a", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("a", [1, 2], 0)], scheduled={"a": 40}))
    # Preempted (blocks freed), then resumed from scratch with other blocks: vLLM asks
    # again, and the stored first block is loaded into the new first block.
    assert sched.get_num_new_matched_tokens(r, 0) == (BLOCK, False)
    sched.update_state_after_alloc(r, None, BLOCK)
    m = run_step(sched, worker, step(cached=[("a", [30, 31], 32, True)], scheduled={"a": 40}))
    assert [s.block_ids[0] for s in m.loads] == [[30]]
    assert [s.block_ids[0] for s in m.saves] == [[31]]
    assert same(block(kv, 30), block(kv, 1))


def test_what_changes_the_kv_changes_the_keys(config: Any) -> None:
    sched = HiCacheKVConnector(config, SCHED, kv_config())
    plain = sched.keys_for(request("a", PROMPT))
    assert plain is not None and len(plain) == 3
    mm = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=40, length=8))
    mm2 = SimpleNamespace(identifier="img-2", mm_position=SimpleNamespace(offset=40, length=8))
    lora = SimpleNamespace(lora_name="adapter", lora_path="/a", lora_int_id=1)
    variants = [
        sched.keys_for(request("a", PROMPT, cache_salt="tenant-1")),
        sched.keys_for(request("a", PROMPT, cache_salt="tenant-2")),
        sched.keys_for(request("a", PROMPT, mm_features=[mm])),
        sched.keys_for(request("a", PROMPT, mm_features=[mm2])),
        sched.keys_for(request("a", PROMPT, lora_request=lora)),
    ]
    firsts = {plain[0]} | {v[0] for v in variants if v}
    assert len(firsts) == 6  # every variant has its own chain from the first block
    assert sched.keys_for(request("a", PROMPT)) == plain  # and it is deterministic
    assert sched.keys_for(request("a", PROMPT, prompt_embeds=torch.zeros(1))) is None
    assert request_seed(request("a", PROMPT, prompt_embeds=torch.zeros(1)))[0] is False
    assert sched.keys_for(request("a", [])) is None
    # Not cacheable: no lookup, and nothing stored.
    r = request("e", PROMPT, prompt_embeds=torch.zeros(1))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert (
        sched.build_connector_meta(
            step([new_req("e", [1, 2, 3, 4], 0)], scheduled={"e": 100})
        ).saves
        == []
    )


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_roles(config: Any, role: str) -> None:
    stored_by_both = pair(config, seed=5)
    s0, w0, _ = stored_by_both
    s0.get_num_new_matched_tokens(request("a", PROMPT), 0)
    run_step(s0, w0, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    config.kv_transfer_config.kv_role = role
    try:
        sched, worker, _ = pair(config, seed=6)
        got = sched.get_num_new_matched_tokens(request("b", PROMPT + [7] * 40), 0)
        meta = run_step(sched, worker, step([new_req("b", [9, 10, 11, 12, 13], 0)],
                                            scheduled={"b": 140}))  # fmt: skip
    finally:
        config.kv_transfer_config.kv_role = "kv_both"
    if role == "kv_producer":  # stores only: no lookup, every full block stored
        assert got == (0, False) and [len(s.keys) for s in meta.saves] == [4]
    else:  # loads only
        assert got == (3 * BLOCK, False) and meta.saves == []


def test_tensor_parallel_shards_must_all_hold_a_block(config: Any) -> None:
    pc = config.parallel_config
    pc.tensor_parallel_size = 2
    try:
        spec = dataclasses.replace(SPEC, num_kv_heads=1)
        sched = HiCacheKVConnector(config, SCHED, kv_config(spec))
        assert len(sside(sched).lookup_backends) == 2
        assert sched.namespace.total_kv_heads == 2 and sched.namespace.kv_heads_per_shard == 1
        keys = sched.keys_for(request("a", PROMPT))
        assert keys is not None
        sside(sched).lookup_backends[0].batch_set(keys[:2], [b"x" * 16] * 2)
        sside(sched).lookup_backends[1].batch_set(keys[:1], [b"y" * 16])
        assert sched.get_num_new_matched_tokens(request("a", PROMPT), 0) == (BLOCK, False)
        # MLA: one copy for every rank (rank-replicated), one lookup.
        mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        sched = HiCacheKVConnector(config, SCHED, kv_config(mla))
        assert sched.namespace.rank_replicated and len(sside(sched).lookup_backends) == 1
    finally:
        pc.tensor_parallel_size = 1


def test_unsupported_deployments_are_refused_at_start(config: Any) -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match="MambaSpec"):
        HiCacheKVConnector(config, SCHED, hybrid_config(extra=[mamba]))
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                        dtype=torch.bfloat16, attention_chunk_size=64)  # fmt: skip
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec"):
        HiCacheKVConnector(config, SCHED, kv_config(chunked))
    other = dataclasses.replace(SPEC, block_size=2 * BLOCK)
    with pytest.raises(ConfigError, match="one block size"):
        HiCacheKVConnector(config, SCHED, hybrid_config(extra=[other]))
    pc = config.parallel_config
    pc.pipeline_parallel_size = 2
    try:
        with pytest.raises(ConfigError, match="pipeline parallelism"):
            HiCacheKVConnector(config, SCHED, kv_config())
    finally:
        pc.pipeline_parallel_size = 1
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra.pop("backend_name")
    with pytest.raises(ConfigError, match="backend_name"):
        HiCacheKVConnector(config, SCHED, kv_config())
    extra["backend_name"] = "no-such-store"
    with pytest.raises(UnknownBackendError):
        HiCacheKVConnector(config, SCHED, kv_config())


def test_kv_tensors_that_contradict_the_config_are_refused(config: Any) -> None:
    worker = HiCacheKVConnector(config, WORKER, kv_config())
    kv = kv_tensors(0)
    with pytest.raises(ConfigError, match="no KV tensor"):
        worker.register_kv_caches({LAYERS[0]: kv[LAYERS[0]]})
    with pytest.raises(ConfigError, match="blocks"):
        worker.register_kv_caches({n: t[:-1] for n, t in kv.items()})
    with pytest.raises(ConfigError, match="float32"):
        worker.register_kv_caches({n: t.float() for n, t in kv.items()})
    assert worker.backend is None


def test_a_broken_request_or_store_never_raises_into_vllm(
    config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sched, worker, _ = pair(config, seed=7)
    caplog.set_level(logging.WARNING)
    # A request vLLM never makes (token ids that are not ids): a miss, logged and counted.
    assert sched.get_num_new_matched_tokens(request("x", [-1] * 40), 0) == (0, False)
    assert sched.totals["hook_errors"] == 1 and "get_num_new_matched_tokens" in caplog.text
    # A load the worker cannot do (its store went away): every block is a load error.
    store_prompt(sched, worker)
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(r, None, 3 * BLOCK)

    def broken(*args: Any) -> list[bool]:
        raise RuntimeError("the mover broke")

    worker.mover.load = broken  # type: ignore[union-attr, method-assign]
    run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert worker.totals["hook_errors"] == 1


def test_stats_are_per_interval_and_sum_across_workers(config: Any) -> None:
    sched, worker, _ = pair(config, seed=8)
    assert worker.get_kv_connector_stats() is None
    store_prompt(sched, worker)
    stats = worker.get_kv_connector_stats()
    assert isinstance(stats, HiCacheKVConnectorStats)
    assert stats.data["save_blocks"] == 3 and stats.data["save_bytes"] == 3 * 2 * 2 * BLOCK * 128
    assert worker.get_kv_connector_stats() is None  # reset by the read
    assert worker.totals["save_blocks"] == 3  # totals are not
    other = HiCacheKVConnector.build_kv_connector_stats({"save_blocks": 2, "save_bytes": 10})
    summed = stats.aggregate(other).reduce()
    assert summed["save_blocks"] == 5 and summed["save_gbps"] > 0
    sched_stats = sched.get_kv_connector_stats()
    assert sched_stats is not None and sched_stats.data["lookups"] == 1
    assert HiCacheKVConnectorStats().is_empty()


def test_metadata_is_plain_data() -> None:
    """vLLM sends the metadata to worker processes: it must pickle."""
    import pickle

    from hicache_storage.integrations.vllm import LoadSpec, SaveSpec

    meta = HiCacheConnectorMetadata([LoadSpec("r", ["k"], [[1]])], [SaveSpec("r", ["k2"], [[2]])])
    assert pickle.loads(pickle.dumps(meta)) == meta


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_nothing_computed_over_a_failed_load_is_stored(config: Any, tmp_path: Path) -> None:
    """A block that failed to load holds no KV of its tokens: blocks computed over it in
    the same step (or in a step vLLM planned before it learned of the failure) are not
    stored; once vLLM has recomputed them, they are."""
    sched, worker, kv = pair(config, seed=9)
    first = request("a", PROMPT[:70])  # stores 2 blocks
    sched.get_num_new_matched_tokens(first, 0)
    run_step(sched, worker, step([new_req("a", [1, 2, 3], 0)], scheduled={"a": 70}))
    assert len(_files(tmp_path / "kv")) == 2
    second_key = sched.keys_for(first)[1]  # type: ignore[index]
    long_prompt = PROMPT + list(range(300, 350))  # 150 tokens: 4 full blocks
    r = request("b", long_prompt)  # the store has the first 2
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(r, None, 2 * BLOCK)
    assert worker.backend is not None
    worker.backend.delete(second_key)  # lost between the lookup and the load
    # This step loads blocks 0-1 (block 1 fails) and computes block 2 over it.
    blocks = [10, 11, 12, 13, 14]
    m = run_step(sched, worker, step([new_req("b", blocks, 64)], scheduled={"b": 36}))
    assert [s.block_ids[0] for s in m.loads] == [[10, 11]] and [
        s.block_ids[0] for s in m.saves
    ] == [[12]]
    assert worker.get_block_ids_with_load_errors() == {11}
    assert worker.totals["save_skipped_blocks"] == 1 and worker.totals["save_blocks"] == 2
    # A step planned before vLLM saw the failure (async scheduling): skipped too.
    m = run_step(sched, worker, step(cached=[("b", None, 100, False)], scheduled={"b": 50}))
    assert [s.block_ids[0] for s in m.saves] == [[13]]
    assert worker.totals["save_skipped_blocks"] == 2 and worker.totals["save_blocks"] == 2
    # vLLM goes back to the failed block and computes blocks 1-3 again, in place: now
    # they are stored, and a new request loads all four, equal to what was computed.
    m = run_step(sched, worker, step(cached=[("b", None, 32, False)], scheduled={"b": 118}))
    assert [s.block_ids[0] for s in m.saves] == [[11, 12, 13]]
    assert worker.totals["save_blocks"] == 5 and wside(worker).tainted == set()
    computed = [block(kv, b) for b in blocks[:4]]
    r2 = request("c", long_prompt)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BLOCK, False)
    sched.update_state_after_alloc(r2, None, 4 * BLOCK)
    run_step(sched, worker, step([new_req("c", [20, 21, 22, 23, 24], 128)], scheduled={"c": 22}))
    assert all(same(block(kv, 20 + i), c) for i, c in enumerate(computed))


def test_a_block_shared_after_a_failed_load_taints_the_sharer(config: Any) -> None:
    sched, worker, _ = pair(config, seed=10)
    wside(worker).tainted.add(5)  # block 5 failed to load for another request
    # A request whose first block is block 5 through vLLM's prefix cache: not stored.
    r = request("a", PROMPT)
    assert sched.get_num_new_matched_tokens(r, BLOCK) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    m = run_step(sched, worker, step([new_req("a", [5, 6, 7, 8], 32)], scheduled={"a": 68}))
    assert [s.block_ids[0] for s in m.saves] == [[5, 6, 7]]  # the store lacks all three
    assert worker.totals["save_blocks"] == 0 and worker.totals["save_skipped_blocks"] == 3
    assert wside(worker).tainted == {5, 6, 7}  # computed over block 5
    # Block 5 loaded whole later: clean again.
    wside(worker).tainted = {5}
    worker.bind_connector_metadata(HiCacheConnectorMetadata())
    worker.clear_connector_metadata()


def test_tp_load_failures_are_shared_or_fail_every_block(config: Any) -> None:
    """With TP, every rank must know every rank's failed blocks; if the ranks cannot be
    asked (no TP group here), every block of the step's loads counts as failed."""
    sched, worker, _ = pair(config, seed=11)
    store_prompt(sched, worker)
    r = request("b", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, 3 * BLOCK)
    wside(worker).tp_size = 2
    run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7}


def test_model_config_changes_that_change_the_kv_change_the_namespace(
    config: Any, tiny_model: Path
) -> None:
    base = HiCacheKVConnector(config, SCHED, kv_config()).namespace
    assert HiCacheKVConnector(config, SCHED, kv_config()).namespace == base  # stable
    for overrides in ({"rope_theta": 500000.0}, {"rms_norm_eps": 0.01}):
        args = EngineArgs(
            model=str(tiny_model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
            max_model_len=256, hf_overrides=overrides,
            kv_transfer_config=config.kv_transfer_config,
        )  # fmt: skip
        other = HiCacheKVConnector(args.create_engine_config(), SCHED, kv_config()).namespace
        assert other.digest != base.digest, overrides
        assert other.model_id == base.model_id


def _attached(c: HiCacheKVConnector) -> bool:
    return (
        bool(c.connector_scheduler and c.connector_scheduler.lookup_backends) or c.mover is not None
    )


def test_an_unreachable_store_at_start_costs_misses_until_it_is_back(
    config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis_server import running

    monkeypatch.setattr(hv_side, "RETRY_FIRST_SECONDS", 0.05)
    monkeypatch.setattr(hv_side, "RETRY_MAX_SECONDS", 0.2)

    with running(tmp_path / "redis") as server:
        server.stop()
        extra = config.kv_transfer_config.kv_connector_extra_config
        extra.clear()
        extra.update(backend_name="redis", url=server.url, prefix="down:", connect_timeout=0.5,
                     async_loads=False)  # fmt: skip
        sched, worker, _ = pair(config, seed=12)  # vLLM starts
        assert not _attached(sched) and not _attached(worker)
        assert sched.get_num_new_matched_tokens(request("a", PROMPT), 0) == (0, False)
        m = run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
        assert len(m.saves) == 1 and worker.totals["save_failed_blocks"] == 3
        assert sched.totals["connect_errors"] >= 1 and worker.totals["connect_errors"] >= 1
        server.start()
        # The background retries attach both halves; no hook waited on them.
        deadline = time.monotonic() + 30
        while not (_attached(sched) and _attached(worker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _attached(sched) and _attached(worker)
        r = request("b", PROMPT)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 0)], scheduled={"b": 100}))
        assert _attached(worker) and worker.totals["save_blocks"] == 3
        assert sched.get_num_new_matched_tokens(request("c", PROMPT), 0) == (3 * BLOCK, False)
        for c in (sched, worker):
            c.shutdown()


def test_blocks_computed_over_a_shared_failed_block_stay_tainted(config: Any) -> None:
    """Async scheduling: a request B hits, through vLLM's prefix cache, a block that
    failed to load for A, in a step vLLM planned before it knew. vLLM rolls A back (A
    computes the block again) but not B: B's blocks computed over the bad one are never
    stored, even after A cleaned the shared block."""
    sched, worker, _ = pair(config, seed=13)
    sched.get_num_new_matched_tokens(request("s", PROMPT[:70]), 0)
    run_step(sched, worker, step([new_req("s", [1, 2, 3], 0)], scheduled={"s": 70}))
    long_a = PROMPT + list(range(300, 350))
    long_b = PROMPT[:64] + list(range(500, 660))
    a, b = request("a", long_a), request("b", long_b)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, None, 2 * BLOCK)
    assert worker.backend is not None
    worker.backend.delete(sched.keys_for(a)[1])  # type: ignore[index]
    run_step(sched, worker, step([new_req("a", [10, 11, 12, 13, 14], 64)], scheduled={"a": 32}))
    assert worker.get_block_ids_with_load_errors() == {11}
    sched.get_num_new_matched_tokens(b, 2 * BLOCK)  # vLLM's prefix cache: blocks 10, 11
    sched.update_state_after_alloc(b, None, 0)
    run_step(sched, worker, step([new_req("b", [10, 11, 40, 41, 42, 43, 44, 45], 64)],
                                 cached=[("a", None, 96, False)], scheduled={"a": 32, "b": 32}))  # fmt: skip
    run_step(sched, worker, step(cached=[("a", None, 32, False), ("b", None, 96, False)],
                                 scheduled={"a": 118, "b": 128}))  # fmt: skip
    keys_b = sched.keys_for(b)
    assert keys_b is not None
    assert [worker.backend.exists(k) for k in keys_b[2:7]] == [False] * 5
    assert 11 not in wside(worker).tainted  # A computed it again
    assert {40, 41, 42, 43, 44} <= wside(worker).tainted


def test_a_block_handed_out_afresh_loses_its_old_taint(config: Any) -> None:
    """A request failed (vLLM's fail policy) after a failed load: its blocks come back to
    other requests, which compute them anew; later turns that reuse them are stored."""
    sched, worker, _ = pair(config, seed=14)
    wside(worker).tainted.update({11, 12, 13})  # what a failed request left behind
    d = request("d", list(range(600, 640)))
    sched.get_num_new_matched_tokens(d, 0)
    sched.update_state_after_alloc(d, None, 0)
    m = run_step(sched, worker, step([new_req("d", [20, 11], 0)], scheduled={"d": 40}))
    assert m.fresh_blocks == [20, 11] and 11 not in wside(worker).tainted
    m = run_step(sched, worker, step(cached=[("d", [12], 40, False)], scheduled={"d": 1}))
    assert m.fresh_blocks == [12] and wside(worker).tainted == {13}
    # The next turn shares blocks 20 and 11 through vLLM's prefix cache: stored.
    e = request("e", list(range(600, 640)) + list(range(700, 764)))
    sched.get_num_new_matched_tokens(e, 2 * BLOCK)
    sched.update_state_after_alloc(e, None, 0)
    m = run_step(sched, worker, step([new_req("e", [20, 11, 30, 31], 64)], scheduled={"e": 40}))
    assert m.fresh_blocks == [30, 31]
    assert worker.totals["save_skipped_blocks"] == 0 and worker.totals["save_blocks"] == 3


# --------------------------------------------------------------------------- deadlines


@pytest.fixture
def hung(config: Any) -> Iterator[Any]:
    """The connector on ``vllm_faults:FlakyFile`` with a 0.5 s engine deadline; every
    hung call is released at the end."""
    import vllm_faults

    extra = config.kv_transfer_config.kv_connector_extra_config
    extra.update(backend_name="vllm_faults:FlakyFile", engine_timeout=0.5)
    vllm_faults.RELEASE.clear()
    vllm_faults.ENTERED.clear()
    try:
        yield vllm_faults
    finally:
        vllm_faults.MODE[0] = "ok"
        vllm_faults.RELEASE.set()


def test_a_hung_store_costs_each_vllm_call_one_deadline_at_most(config: Any, hung: Any) -> None:
    """Reads that never return: the step's load fails after the deadline (vLLM
    recomputes), the next one fails at once, and the late bytes never land in vLLM's KV,
    which vLLM has recomputed by then. Lookups and stores that hang: a miss, a drop."""
    sched, worker, kv = pair(config, seed=20)
    store_prompt(sched, worker)
    assert worker.totals["save_blocks"] == 3

    hung.MODE[0] = "hangread"
    r = request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(r, None, 3 * BLOCK)
    t0 = time.monotonic()
    run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7}
    assert worker.totals["load_timeouts"] == 1
    # vLLM recomputes the blocks; then the hung reads return, late.
    for t in kv.values():
        t[5:8].fill_(1.5)
    recomputed = [block(kv, b) for b in (5, 6, 7)]
    r2 = request("c", PROMPT)
    sched.get_num_new_matched_tokens(r2, 0)
    sched.update_state_after_alloc(r2, None, 3 * BLOCK)
    run_step(sched, worker, step([new_req("c", [9, 10, 11, 12], 96)], scheduled={"c": 4}))
    assert worker.get_block_ids_with_load_errors() == {9, 10, 11}  # at once: still hung
    assert worker.totals["load_timeouts"] == 2
    assert time.monotonic() - t0 < 60  # (a bound for a hang, not a timing claim)
    hung.RELEASE.set()
    deadline = time.monotonic() + 30
    while wside(worker)._load_lane.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not wside(worker)._load_lane.busy
    assert all(
        same(block(kv, b), want) for b, want in zip((5, 6, 7), recomputed, strict=True)
    )  # the late bytes never landed

    hung.RELEASE.clear()
    hung.MODE[0] = "hang"  # lookups and stores hang too
    assert sched.get_num_new_matched_tokens(request("d", PROMPT), 0) == (0, False)
    assert sched.totals["lookup_timeouts"] == 1
    other = list(range(500, 600))
    sched.get_num_new_matched_tokens(request("e", other), 0)
    # A store that hangs never holds up the step (it runs in the background): the
    # request finishes, vLLM keeps its blocks, and engine_timeout after it finished
    # the store is cut and the blocks are freed, while the store still hangs.
    run_step(sched, worker, step([new_req("e", [13, 14, 15, 16], 0)], scheduled={"e": 100}),
             flush=False)  # fmt: skip
    # The step never waited for the store: had it, the deadline would have cut it.
    assert worker.totals["save_timeouts"] == 0
    assert sched.request_finished(request("e", other), [13, 14, 15, 16]) == (True, None)
    m = run_step(sched, worker, step(), finished={"e"}, flush=False)
    assert m.delayed_frees == ["e"] and m.sent is None  # its store still runs
    deadline = time.monotonic() + 30  # (engine_timeout is 0.5 s; a bound for a hang)
    while (m := run_step(sched, worker, step(), flush=False)).sent is None:
        assert time.monotonic() < deadline, "the hung store was never cut"
        time.sleep(0.05)
    assert m.sent == {"e"} and worker.totals["save_timeouts"] == 1
    assert worker.totals["hook_errors"] == 0 and sched.totals["hook_errors"] == 0
    before = [block(kv, b) for b in (13, 14, 15)]
    for t in kv.values():  # freed: vLLM reuses the blocks
        t[13:16].fill_(-3.0)
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30)
    # The hung store had copied its chunk before the cut: it stored those bytes, never
    # what vLLM wrote into the blocks after they were freed.
    assert worker.totals["save_blocks"] == 6
    deadline = time.monotonic() + 30  # (the released lookups finish on their lane)
    while sside(sched)._lookup_lane.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    r = request("f", other)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(r, None, 3 * BLOCK)
    run_step(sched, worker, step([new_req("f", [20, 21, 22, 23], 96)], scheduled={"f": 4}))
    assert all(same(block(kv, b), w) for b, w in zip((20, 21, 22), before, strict=True))
    for c in (sched, worker):
        c.shutdown()


def test_a_block_handed_out_afresh_cuts_a_store_still_to_read_it(config: Any, hung: Any) -> None:
    """A preempted request's blocks go to another request: a background store that has
    not read them yet never stores what the other request writes there."""
    sched, worker, kv = pair(config, seed=21)
    hung.MODE[0] = "hangwrite"
    sched.get_num_new_matched_tokens(request("a", PROMPT), 0)
    run_step(
        sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}), flush=False
    )  # fmt: skip  (a's store hangs: the background thread is busy)
    other = list(range(500, 600))
    sched.get_num_new_matched_tokens(request("b", other), 0)
    run_step(
        sched, worker, step([new_req("b", [5, 6, 7, 8], 0)], scheduled={"b": 100}), flush=False
    )  # fmt: skip  (b's store is queued behind it)
    # b is preempted; its block 6 goes to c, whose forward pass will write it.
    sched.get_num_new_matched_tokens(request("c", list(range(700, 740))), 0)
    m = run_step(sched, worker, step([new_req("c", [6, 9], 0)], scheduled={"c": 40}),
                 flush=False)  # fmt: skip
    assert 6 in m.fresh_blocks
    for t in kv.values():
        t[6].fill_(7.0)  # c's forward pass
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30)
    t = worker.totals
    assert t["save_cut_blocks"] == 3  # all of b's store: cut before it read anything
    assert t["save_blocks"] == 3 + 1  # a's blocks, and c's one full block
    assert sched.get_num_new_matched_tokens(request("d", other), 0) == (0, False)  # none of b's
    assert sched.get_num_new_matched_tokens(request("e", PROMPT), 0) == (3 * BLOCK, False)


def test_stores_queue_up_to_a_bound_behind_a_hung_store(
    config: Any, hung: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_storage.integrations.vllm import worker as worker_mod

    monkeypatch.setattr(worker_mod, "MAX_QUEUED_STORES", 2)
    sched, worker, _ = pair(config, seed=24)
    hung.MODE[0] = "hangwrite"
    for i, blocks in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        rid = f"r{i}"
        sched.get_num_new_matched_tokens(request(rid, [i * 1000 + x for x in PROMPT]), 0)
        run_step(sched, worker, step([new_req(rid, blocks, 0)], scheduled={rid: 100}),
                 flush=False)  # fmt: skip
    assert len(wside(worker)._stores) == 2  # the third step's stores were dropped
    assert worker.totals["save_timeouts"] == 1 and worker.totals["save_failed_blocks"] == 3
    hung.MODE[0] = "ok"
    hung.RELEASE.set()
    assert wside(worker).flush(30)
    assert worker.totals["save_blocks"] == 6


def test_without_staging_a_store_reading_a_fresh_block_is_waited_for(config: Any) -> None:
    """No staging (engine_timeout 0): the store reads vLLM's KV itself, so a block
    handed out afresh waits for it before the forward pass."""
    import threading

    import vllm_faults

    extra = config.kv_transfer_config.kv_connector_extra_config
    extra.update(backend_name="vllm_faults:FlakyFile", engine_timeout=0, staging=False)
    vllm_faults.MODE[0] = "hangwrite"
    vllm_faults.RELEASE.clear()
    try:
        sched, worker, _ = pair(config, seed=22)
        assert type(wside(worker).pool).__name__ == "PagedKVBlocks"
        sched.get_num_new_matched_tokens(request("a", PROMPT), 0)
        run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}),
                 flush=False)  # fmt: skip
        release = threading.Timer(0.3, vllm_faults.RELEASE.set)
        release.start()
        sched.get_num_new_matched_tokens(request("b", list(range(700, 740))), 0)
        meta = sched.build_connector_meta(step([new_req("b", [2, 9], 0)], scheduled={"b": 40}))
        worker.bind_connector_metadata(meta)  # block 2 is a's: wait for a's store
        assert vllm_faults.RELEASE.is_set() and not wside(worker)._stores
        assert worker.totals["save_blocks"] == 3 and worker.totals["save_cut_blocks"] == 0
        worker.clear_connector_metadata()
        for c in (sched, worker):
            c.shutdown()
    finally:
        vllm_faults.MODE[0] = "ok"
        vllm_faults.RELEASE.set()


def test_stores_within_the_step_when_async_saves_is_off(config: Any) -> None:
    config.kv_transfer_config.kv_connector_extra_config["async_saves"] = False
    sched, worker, _ = pair(config, seed=23)
    r = request("a", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}),
             flush=False)  # fmt: skip
    assert worker.totals["save_blocks"] == 3 and not wside(worker)._stores
    assert sched.request_finished(r, [1, 2, 3, 4]) == (False, None)


def test_connector_options_are_checked(config: Any) -> None:
    extra = config.kv_transfer_config.kv_connector_extra_config
    bad = [
        ({"staging_blocks": -1}, "staging_blocks"),
        ({"staging_blocks": 2.7}, "staging_blocks"),
        ({"staging_blocks": 0}, "staging_blocks"),
        ({"staging": "maybe"}, "staging"),
        ({"staging": "false"}, "engine_timeout"),  # no staging needs no deadline
        ({"engine_timeout": -1}, "engine_timeout"),
        ({"engine_timeout": "soon"}, "engine_timeout"),
        ({"engine_timeout": float("inf")}, "engine_timeout"),
        ({"engine_timeout": 1e10}, "engine_timeout"),  # (past what a wait can take)
        ({"admit_after": 0}, "admit_after"),
        ({"admit_after": 1000}, "admit_after"),
    ]
    for options, word in bad:
        saved = dict(extra)
        extra.update(options)
        try:
            with pytest.raises(ConfigError, match=word):
                HiCacheKVConnector(config, SCHED, kv_config())
        finally:
            extra.clear()
            extra.update(saved)
    # A string "false" means false: vLLM's KV straight, no staging (with no deadline).
    extra.update(staging="false", engine_timeout=0)
    worker = HiCacheKVConnector(config, WORKER, kv_config())
    worker.register_kv_caches(kv_tensors(1))
    assert type(wside(worker).pool).__name__ == "PagedKVBlocks"
    worker.shutdown()
    # null is unset, as it was before the options were checked; so is staging "".
    extra.update(staging="", engine_timeout=2, staging_blocks=3, tenant=None)
    worker = HiCacheKVConnector(config, WORKER, kv_config())
    worker.register_kv_caches(kv_tensors(1))
    assert type(wside(worker).pool).__name__ == "StagedKVBlocks"
    assert (wside(worker).pool.rows, wside(worker).pool.lanes) == (
        3,
        3,
    )  # loads, stores, background loads
    worker.shutdown()


def test_a_relative_model_path_names_the_weights_behind_it(
    base_config: Any, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deployments of model="model" from two folders, with other weights behind the
    same config.json, never share a namespace; the same weights elsewhere do."""
    import shutil

    from vllm_engine import build_tiny_model

    for name, seed in (("one", 0), ("two", 1)):
        build_tiny_model(tmp_path / name / "model", seed=seed)
    shutil.copytree(tmp_path / "one" / "model", tmp_path / "three" / "model")
    namespaces = {}
    for name in ("one", "two", "three"):
        monkeypatch.chdir(tmp_path / name)
        args = EngineArgs(
            model="model", dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
            max_model_len=256, kv_transfer_config=base_config.kv_transfer_config,
        )  # fmt: skip
        namespaces[name] = HiCacheKVConnector(
            args.create_engine_config(), SCHED, kv_config()
        ).namespace
    one, two, three = namespaces["one"], namespaces["two"], namespaces["three"]
    assert one.model_id == str((tmp_path / "one" / "model").resolve())
    assert one.digest != two.digest
    assert one.weights_fingerprint != two.weights_fingerprint
    # The same bytes at another path: another name, the same weights.
    assert one.weights_fingerprint == three.weights_fingerprint


def _prefilled(sched: Any, worker: Any, toks: list[int], rid: str = "r1") -> Any:
    """``rid`` prefills PROMPT (3 blocks stored) and samples token 100 (``toks`` grows)."""
    r = request(rid, list(PROMPT), all_token_ids=toks, num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    run_step(sched, worker, step([new_req(rid, [5, 9, 12, 13], 0)], scheduled={rid: 100}))
    toks.append(900)
    r.num_computed_tokens = 100
    return r


def test_a_partial_block_holds_only_kv_that_speculation_kept(config: Any) -> None:
    """Speculative decoding: the last step computes token 100 and 3 drafts, all rejected;
    vLLM rolls its count back to 101. The partial block holds 5 tokens (96-100), never the
    rejected drafts' positions."""
    sched, worker, _ = pair(config, seed=71)
    toks = list(PROMPT)
    r = _prefilled(sched, worker, toks)
    run_step(sched, worker, step(cached=[("r1", None, 100, False)], scheduled={"r1": 4}))
    toks.append(901)  # the correction token, at position 101 (its KV not computed)
    r.num_computed_tokens = 101
    assert sched.request_finished(r, [5, 9, 12, 13]) == (True, None)
    run_step(sched, worker, step(), finished={"r1"})
    assert sched.get_num_new_matched_tokens(request("r2", [*toks, *range(700, 710)]), 0) == (
        101,
        False,
    )


def test_a_partial_store_that_cannot_be_planned_keeps_the_delayed_free(
    config: Any, monkeypatch: Any
) -> None:
    import hicache_storage.integrations.vllm.scheduler as scheduler_module

    sched, worker, _ = pair(config, seed=73)
    r = _prefilled(sched, worker, list(PROMPT))
    assert sside(sched)._reqs["r1"].saves_sent  # its full blocks' stores were sent

    def broken(*args: Any, **kwargs: Any) -> str:
        raise ValueError("unexpected token")

    monkeypatch.setattr(scheduler_module, "partial_page_hash", broken)
    assert sched.request_finished(r, [5, 9, 12, 13]) == (True, None)  # still delayed


def test_a_free_waits_for_a_partial_store_queued_after_get_finished(config: Any) -> None:
    """vLLM with a drafter calls wait_for_save after get_finished: a request whose last
    store comes in that step's metadata is not reported until the store is queued."""
    sched, worker, _ = pair(config, seed=74)
    toks = list(PROMPT)
    r = _prefilled(sched, worker, toks)
    run_step(sched, worker, step(cached=[("r1", None, 100, False)], scheduled={"r1": 1}))
    toks.append(901)
    r.num_computed_tokens = 101
    assert sched.request_finished(r, [5, 9, 12, 13]) == (True, None)
    meta = sched.build_connector_meta(step())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert worker.get_finished({"r1"})[0] in (None, set())  # its store is not queued yet
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert wside(worker).flush(30)
    assert run_step(sched, worker, step()).sent == {"r1"}
    assert not run_step(sched, worker, step()).sent  # once


def test_a_failing_partial_query_keeps_the_full_blocks_hit(config: Any) -> None:
    sched, worker, _ = pair(config, seed=78)
    _prefilled(sched, worker, list(PROMPT))

    def broken(keys: list[str]) -> list[bool]:
        raise RuntimeError("transient")

    sside(sched).lookup_backends[0].batch_exists_each = broken  # type: ignore[method-assign]
    r = request("r2", [*PROMPT[:96], *range(700, 740)])
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, False)


def _deployment(config: Any, tp: int, writer: str, kv: dict[str, torch.Tensor] | None,
                monkeypatch: pytest.MonkeyPatch) -> list[Any]:  # fmt: skip
    """The ranks of a TP ``tp`` deployment with head groups: (scheduler, worker, KV) each,
    the KV cut from ``kv``'s heads (zeros when None)."""
    from vllm.distributed import parallel_state

    config.parallel_config.tensor_parallel_size = tp
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra.update(head_groups=2, writer_id=writer)
    per = 2 // tp
    spec = dataclasses.replace(SPEC, num_kv_heads=per)
    out = []
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=rank: r)
        kvc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_layout="LBHNC",
                            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])  # fmt: skip
        sched = HiCacheKVConnector(config, SCHED, kvc)
        worker = HiCacheKVConnector(config, WORKER, kvc)
        mine = {
            n: kv[n][:, rank * per : (rank + 1) * per].clone() if kv is not None
            else torch.zeros(NB, per, BLOCK, 64, dtype=torch.bfloat16)
            for n in LAYERS
        }  # fmt: skip
        worker.register_kv_caches(mine)
        out.append((sched, worker, mine))
    return out


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_blocks_stored_at_one_tp_size_load_at_another_with_head_groups(
    config: Any, monkeypatch: pytest.MonkeyPatch, writer_tp: int, reader_tp: int
) -> None:
    # (Engine-free, the ranks cannot share load failures: each says it had none.)
    monkeypatch.setattr(WorkerSide, "_all_ranks_failed", lambda self, failed, blocks: failed)
    model = kv_tensors(41)
    try:
        for sched, worker, _ in _deployment(config, writer_tp, "a", model, monkeypatch):
            assert sched.namespace.head_groups == 0  # the rank's own; its store groups it
            assert "-hg-" in sched.namespace.object_layout
            store_prompt(sched, worker)
            assert worker.totals["save_blocks"] == 3 and worker.totals["save_failed_blocks"] == 0
            worker.shutdown()
        per = 2 // reader_tp
        for rank, (sched, worker, kv) in enumerate(
            _deployment(config, reader_tp, "b", None, monkeypatch)
        ):
            r = request("b", PROMPT)
            assert sched.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, False)
            sched.update_state_after_alloc(r, None, 3 * BLOCK)
            run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 96)], scheduled={"b": 4}))
            assert worker.get_block_ids_with_load_errors() == set()
            for got, want in ((5, 1), (6, 2), (7, 3)):
                assert same(
                    block(kv, got),
                    [t[want, rank * per : (rank + 1) * per] for t in model.values()],
                )
            worker.shutdown()
    finally:
        config.parallel_config.tensor_parallel_size = 1
        extra = config.kv_transfer_config.kv_connector_extra_config
        extra.pop("head_groups", None)
        extra.pop("writer_id", None)


# ---------------------------------------------------------------------- hybrid models


class GroupBlocks:
    """vLLM's ``KVCacheBlocks`` of a hybrid model: one list of block ids per group."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(self.groups)


def hybrid_pair(config: Any, seed: int = 0) -> tuple[HiCacheKVConnector, HiCacheKVConnector, Any]:
    """Connectors of a hybrid model whose two groups share one KV tensor, as vLLM's
    hybrid allocator lays them out (a block id belongs to one group at a time)."""
    sched = HiCacheKVConnector(config, SCHED, hybrid_config())
    worker = HiCacheKVConnector(config, WORKER, hybrid_config())
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(NB, 2, BLOCK, 64, generator=g).to(torch.bfloat16)
    worker.register_kv_caches({LAYERS[0]: kv, LAYERS[1]: kv})
    return sched, worker, kv


def hybrid_req(req_id: str, full: list[int], swa: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(full, swa), num_computed_tokens=computed)


def store_hybrid_prompt(sched: HiCacheKVConnector, worker: HiCacheKVConnector) -> list[str]:
    """Request r1 computes PROMPT in blocks 5, 9, 12 (full) and 20-22 (window): its three
    full blocks are stored in both groups. Their keys."""
    r = request("r1", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, 0)
    run_step(sched, worker, step([hybrid_req("r1", [5, 9, 12, 13], [20, 21, 22, 23], 0)],
                                 scheduled={"r1": 100}))  # fmt: skip
    keys = sched.keys_for(r)
    assert keys is not None
    return keys


def test_each_group_of_a_hybrid_model_has_a_namespace_of_its_own(config: Any) -> None:
    sched = HiCacheKVConnector(config, SCHED, hybrid_config())
    full, swa = sched.settings.namespaces
    assert sched.settings.hybrid and full.digest != swa.digest
    assert "-g0of2-full-" in full.object_layout and "-g1of2-swa40-" in swa.object_layout
    assert [g.window for g in sched.settings.groups] == [None, 40]
    # A model of one group keeps the namespace it always had.
    one = HiCacheKVConnector(config, SCHED, kv_config())
    assert not one.settings.hybrid and one.namespace.object_layout == "vllm-LBHNC-h2-d32-L2"
    # A model whose every layer has a sliding window is one group, moved too.
    assert HiCacheKVConnector(config, SCHED, kv_config(SWA)).settings.groups[0].window == 40


def test_a_hybrid_models_blocks_are_stored_per_group_and_a_hit_loads_the_window(
    config: Any,
) -> None:
    sched, worker, kv = hybrid_pair(config, seed=3)
    r = request("r1", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    m = run_step(sched, worker, step([hybrid_req("r1", [5, 9, 12, 13], [20, 21, 22, 23], 0)],
                                     scheduled={"r1": 100}))  # fmt: skip
    assert [s.block_ids for s in m.saves] == [[[5, 9, 12], [20, 21, 22]]]
    keys = sched.keys_for(r)
    assert keys is not None
    for backends in sside(sched).group_backends:
        assert backends[0].batch_exists_each(keys) == [True, True, True]
    page = wside(worker).pools[0].page_bytes
    assert worker.totals["save_blocks"] == 3 and worker.totals["save_bytes"] == 6 * page
    want = {b: kv[b].clone() for b in (5, 9, 12, 21, 22)}
    null = kv[0].clone()
    # The same prompt again: every full block, and the window's (40 tokens before the
    # 96th: blocks 1 and 2) of the sliding-window group; vLLM's null block for block 0.
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, True)  # (in the background)
    sched.update_state_after_alloc(r2, GroupBlocks([30, 31, 32], [0, 41, 42]), 3 * BLOCK)
    m = run_step(sched, worker, step())
    assert [(s.block_ids, s.background) for s in m.loads] == [([[30, 31, 32], [0, 41, 42]], True)]
    assert wside(worker).flush(30, loads=True)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"r2"} and not results.failed_recving
    for dst, src in ((30, 5), (31, 9), (32, 12), (41, 21), (42, 22)):
        assert torch.equal(kv[dst], want[src])
    assert torch.equal(kv[0], null)
    assert worker.totals["load_blocks"] == 3 and worker.totals["load_bytes"] == 5 * page


def test_a_hybrid_hit_is_a_length_every_group_can_restore(config: Any) -> None:
    sched, worker, _ = hybrid_pair(config)
    keys = store_hybrid_prompt(sched, worker)
    swa = sside(sched).group_backends[1][0]
    # Block 0 is outside the window at 96 tokens: lost, the hit stays.
    swa.delete(keys[0])
    assert sched.get_num_new_matched_tokens(request("a", PROMPT), 0) == (3 * BLOCK, True)
    # Block 2 is in it: lost too, no length below is restorable either (each window
    # reaches block 0)...
    swa.delete(keys[2])
    assert sched.get_num_new_matched_tokens(request("b", PROMPT), 0) == (0, False)
    # ...unless vLLM holds block 0 itself: 64 tokens, whose window is blocks 0 and 1.
    assert sched.get_num_new_matched_tokens(request("c", PROMPT), BLOCK) == (BLOCK, True)
    # A full-attention group's lost block ends the run there, whatever the window.
    sside(sched).group_backends[0][0].delete(keys[1])
    assert sched.get_num_new_matched_tokens(request("d", PROMPT), BLOCK) == (0, False)


def test_a_failed_hybrid_load_fails_its_request_never_blocks(config: Any) -> None:
    """vLLM's scheduler takes no failed block ids from a model with several groups (it
    raises): the request is reported failed as a whole, and vLLM recomputes it."""
    sched, worker, _ = hybrid_pair(config)
    keys = store_hybrid_prompt(sched, worker)
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, True)
    sside(sched).group_backends[1][0].delete(keys[2])  # (lost after the lookup)
    sched.update_state_after_alloc(r2, GroupBlocks([30, 31, 32], [0, 41, 42]), 3 * BLOCK)
    run_step(sched, worker, step())
    assert wside(worker).flush(30, loads=True)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"r2"} and results.failed_recving == {"r2"}
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.totals["load_failed_blocks"] == 1
    # vLLM looks the request up again: no hit (the same load would fail again).
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)


def test_a_hybrid_store_skips_the_null_blocks_before_the_window(config: Any) -> None:
    """vLLM's own prefix hit leaves the sliding-window group's blocks before the window
    null: the full group's blocks are stored, the window group's held ones only."""
    sched, worker, _ = hybrid_pair(config)
    r = request("r1", PROMPT)
    assert sched.get_num_new_matched_tokens(r, 2 * BLOCK) == (0, False)  # (store empty)
    sched.update_state_after_alloc(r, None, 0)
    m = run_step(sched, worker, step([hybrid_req("r1", [5, 9, 12, 13], [0, 21, 22, 23], 64)],
                                     scheduled={"r1": 36}))  # fmt: skip
    assert [s.block_ids for s in m.saves] == [[[5, 9, 12], [0, 21, 22]]]
    keys = sched.keys_for(r)
    assert keys is not None
    full, swa = (b[0] for b in sside(sched).group_backends)
    assert full.batch_exists_each(keys) == [True, True, True]
    assert swa.batch_exists_each(keys) == [False, True, True]
    page = wside(worker).pools[0].page_bytes
    t = worker.totals
    assert t["save_blocks"] == 3 and t["save_failed_blocks"] == 0 and t["save_bytes"] == 5 * page


def test_a_taint_in_any_group_stops_what_is_computed_over_it(config: Any) -> None:
    """Every layer's KV at a place depends on every layer's before it: a tainted block
    of any group taints the blocks computed after it, in every group."""
    from hicache_storage.integrations.vllm import SaveSpec

    _, worker, _ = hybrid_pair(config)
    side = wside(worker)
    side.tainted.add(21)
    spec = SaveSpec("r", ["k"], [[12], [22]], prefix_block_ids=[[5, 9, 12], [0, 21, 22]],
                    computed_from=2)  # fmt: skip
    assert side._clean_blocks(spec) is False
    assert side.tainted == {12, 21, 22}
    side.tainted.clear()
    assert side._clean_blocks(spec) is True and side.tainted == set()


def test_a_model_whose_every_layer_has_a_window_fails_loads_per_request(config: Any) -> None:
    """One sliding-window group: vLLM would roll a failed block back to a length whose
    window it no longer holds (null blocks) and compute over them; the load runs in the
    background and a failure fails the request as a whole instead."""
    sched = HiCacheKVConnector(config, SCHED, kv_config(SWA))
    worker = HiCacheKVConnector(config, WORKER, kv_config(SWA))
    worker.register_kv_caches(kv_tensors(4))
    assert not sched.settings.hybrid and sched.settings.whole_request_loads
    r = request("r1", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, 0)
    run_step(sched, worker, step([new_req("r1", [5, 9, 12, 13], 0)], scheduled={"r1": 100}))
    keys = sched.keys_for(r)
    assert keys is not None
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, True)
    sside(sched).lookup_backends[0].delete(keys[1])  # (lost after the lookup)
    sched.update_state_after_alloc(r2, Blocks([0, 31, 32]), 3 * BLOCK)
    run_step(sched, worker, step())
    assert wside(worker).flush(30, loads=True)
    results = worker.get_transfer_results(set())
    assert results.failed_recving == {"r2"} and worker.get_block_ids_with_load_errors() == set()
    assert worker.totals["load_failed_blocks"] == 1


def test_hybrid_plans_follow_vllms_own_block_tables(config: Any) -> None:
    """The tables vLLM offers each step (``kv_connector_block_state``) are the truth: a
    sliding-window block that left the window is null there, never a stale id; a
    request back from a background load through the cached list is no longer pending;
    a hit counts the blocks it returns; null places before a writer's window are not
    stored again at every hit."""
    sched, worker, _ = hybrid_pair(config)
    r = request("r1", PROMPT)
    sched.get_num_new_matched_tokens(r, 2 * BLOCK)
    sched.update_state_after_alloc(r, None, 0)
    run_step(sched, worker, step([hybrid_req("r1", [5, 9, 12, 13], [0, 21, 22, 23], 64)],
                                 scheduled={"r1": 36}))  # fmt: skip
    saved = worker.totals["save_blocks"]
    assert saved == 3
    # Another request hits all three (block 0 of the window group is not needed at 96).
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, True)
    assert sched.totals["lookup_hit_blocks"] == 3
    sched.update_state_after_alloc(r2, GroupBlocks([30, 31, 32], [0, 41, 42]), 3 * BLOCK)
    run_step(sched, worker, step())
    assert wside(worker).flush(30, loads=True)
    assert sside(sched)._reqs["r2"].load_pending
    # Scheduled again through the cached list (resumed), with vLLM's exact tables.
    tables = {"r2": ([30, 31, 32, 33], [0, 0, 42, 43])}
    out = step(cached=[("r2", [33], 96, True)], scheduled={"r2": 4})
    out.scheduled_cached_reqs.new_block_ids = [([30, 31, 32, 33], [0, 41, 42, 43])]
    out.kv_connector_block_state = SimpleNamespace(get_block_ids=tables.get)
    m = run_step(sched, worker, out)
    state = sside(sched)._reqs["r2"]
    assert not state.load_pending and state.block_ids == [[30, 31, 32, 33], [0, 0, 42, 43]]
    assert m.saves == [] and worker.totals["save_blocks"] == saved  # nothing stored again
    # The window block 1 missing from vLLM's table: the lookup of a third request still
    # hits, and a stale id (41) is in no plan.
    assert all(41 not in g for s in m.saves for g in s.prefix_block_ids)


def test_a_failed_alloc_hook_is_not_offered_the_same_load_again(config: Any) -> None:
    """``update_state_after_alloc`` raising for a background load: the load is sent as
    failed (vLLM recomputes), and the lookup vLLM makes then is a miss."""
    sched, worker, _ = hybrid_pair(config)
    r = request("r1", PROMPT)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, 0)
    run_step(sched, worker, step([hybrid_req("r1", [5, 9, 12, 13], [20, 21, 22, 23], 0)],
                                 scheduled={"r1": 100}))  # fmt: skip
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BLOCK, True)

    class Broken:
        def get_block_ids(self) -> Any:
            raise RuntimeError("boom")

    sched.update_state_after_alloc(r2, Broken(), 3 * BLOCK)
    m = sched.build_connector_meta(step())
    assert [(s.req_id, s.failed) for s in m.loads] == [("r2", True)]
    worker.bind_connector_metadata(m)
    worker.start_load_kv(None)
    assert worker.get_transfer_results(set()).failed_recving == {"r2"}
    worker.clear_connector_metadata()
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)


def test_a_window_block_the_store_lost_is_stored_again_by_the_request_that_computes_it(
    config: Any,
) -> None:
    sched, worker, _ = hybrid_pair(config)
    keys = store_hybrid_prompt(sched, worker)
    swa = sside(sched).group_backends[1][0]
    swa.delete(keys[2])  # (evicted from one group only)
    r2 = request("r2", PROMPT)
    assert sched.get_num_new_matched_tokens(r2, 0) == (2 * BLOCK, True)  # window at 64: 0-1
    sched.update_state_after_alloc(r2, GroupBlocks([30, 31], [40, 41]), 2 * BLOCK)
    run_step(sched, worker, step())
    assert wside(worker).flush(30, loads=True)
    m = run_step(sched, worker, step([hybrid_req("r2", [30, 31, 32, 33], [40, 41, 42, 43], 64)],
                                     scheduled={"r2": 36}))  # fmt: skip
    assert [(s.keys, s.block_ids) for s in m.saves] == [(keys[2:3], [[32], [42]])]
    assert swa.batch_exists_each(keys) == [True, True, True]
    assert sched.get_num_new_matched_tokens(request("r3", PROMPT), 0) == (3 * BLOCK, True)


def test_a_stored_block_is_published_once_every_tp_worker_reported_it(config: Any) -> None:
    """Each TP worker stores its shard of a block: the event waits for all of them, in
    whatever steps their stores end, and is published once."""
    from hicache_storage.integrations.vllm.events import (
        HiCacheKVEvents,
        removed_event,
        stored_event,
    )

    pc = config.parallel_config
    pc.tensor_parallel_size = 2
    try:
        spec = dataclasses.replace(SPEC, num_kv_heads=1)
        sched = HiCacheKVConnector(config, SCHED, kv_config(spec))
    finally:
        pc.tensor_parallel_size = 1
    a = stored_event(11, None, [1] * BLOCK, BLOCK, "hicache-file")
    b = stored_event(12, 11, [2] * BLOCK, BLOCK, "hicache-file")

    def step_events(*per_worker: list[Any]) -> Any:
        """A step's container as vLLM joins its workers' (rank i's events first...)."""
        events = HiCacheKVEvents(1)
        events.add_events([(0, e) for e in per_worker[0]])
        for rank, more in enumerate(per_worker[1:], 1):
            events.add_events([(rank, e) for e in more])
            events.increment_workers()
        return SimpleNamespace(kv_cache_events=events)

    sched.update_connector_output(step_events([a, b], [a]))  # rank 1's b still storing
    assert list(sched.take_events()) == [a]
    sched.update_connector_output(step_events([b], []))  # rank 0 again: still one rank
    assert list(sched.take_events()) == []
    sched.update_connector_output(step_events([], [b]))
    assert list(sched.take_events()) == [b]
    # Stored again by a later request: not published again.
    sched.update_connector_output(step_events([a], [a]))
    assert list(sched.take_events()) == []
    # Removed by one rank's store (an eviction): published once, whoever else reports it.
    gone_a = removed_event(11, "hicache-file")
    sched.update_connector_output(step_events([], [gone_a]))
    assert list(sched.take_events()) == [gone_a]
    sched.update_connector_output(step_events([gone_a], []))
    assert list(sched.take_events()) == []
    # A block still waiting for a rank, then removed: never published at all.
    c = stored_event(13, 12, [3] * BLOCK, BLOCK, "hicache-file")
    sched.update_connector_output(step_events([c, removed_event(13, "hicache-file")], []))
    sched.update_connector_output(step_events([], [c]))  # (rank 1 late: c alone again)
    assert list(sched.take_events()) == []
    # Stored again after its removal: published again; in order with a removal.
    sched.update_connector_output(step_events([a], [a, removed_event(12, "hicache-file")]))
    assert list(sched.take_events()) == [a, removed_event(12, "hicache-file")]


def test_the_events_container_keeps_what_every_rank_reported() -> None:
    from hicache_storage.integrations.vllm.events import HiCacheKVEvents, stored_event

    a = stored_event(1, None, [1] * BLOCK, BLOCK, "hicache-file")
    b = stored_event(2, 1, [2] * BLOCK, BLOCK, "hicache-file")
    joined = HiCacheKVEvents(1)
    joined.add_events([(0, a), (0, b), (0, b)])  # (rank 0 reported b twice: one rank)
    joined.add_events([(1, a)])
    joined.increment_workers()
    assert joined.get_number_of_workers() == 2
    assert joined.aggregate().get_all_events() == [a]
    joined.clear_events()
    assert joined.get_all_events() == [] and joined.get_number_of_workers() == 1


def test_admission_stores_a_block_only_from_the_nth_request_that_has_it(config: Any) -> None:
    """``admit_after=2``: the first request's blocks are not stored (counted as not
    admitted); a second request with them stores them; a third loads them. A request
    sharing only the first block stores that one alone: a block past one not admitted
    is never stored (a hit is a leading run, so it could never load)."""
    config.kv_transfer_config.kv_connector_extra_config["admit_after"] = 2
    sched, worker, _ = pair(config, seed=71)
    assert sched.get_num_new_matched_tokens(request("a", PROMPT), 0) == (0, False)
    m = run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    assert m.saves == [] and sched.totals["save_not_admitted_blocks"] == 3
    assert sched.get_num_new_matched_tokens(request("b", PROMPT), 0) == (0, False)
    m = run_step(sched, worker, step([new_req("b", [5, 6, 7, 8], 0)], scheduled={"b": 100}))
    assert [s.block_ids[0] for s in m.saves] == [[5, 6, 7]]
    assert sched.totals["save_not_admitted_blocks"] == 3  # (b's were admitted)
    assert sched.get_num_new_matched_tokens(request("c", PROMPT), 0) == (3 * BLOCK, False)
    # Two new prompts sharing the first block with PROMPT but not the rest: the first
    # has it a third time (admitted, stored already), its new blocks once (refused).
    other = PROMPT[:BLOCK] + list(range(500, 560))
    sched.get_num_new_matched_tokens(request("d", other), 0)
    m = run_step(sched, worker, step([new_req("d", [9, 10, 11], 0)], scheduled={"d": 92}))
    assert m.saves == [] and sched.totals["save_not_admitted_blocks"] == 3 + 1
    sched.get_num_new_matched_tokens(request("e", other), BLOCK)
    m = run_step(sched, worker, step([new_req("e", [9, 12, 13], BLOCK)], scheduled={"e": 60}))
    assert [s.block_ids[0] for s in m.saves] == [[12]]
    assert sched.get_num_new_matched_tokens(request("f", other), 0) == (2 * BLOCK, False)


def test_a_block_stored_removed_and_stored_again_in_one_step_ends_stored(config: Any) -> None:
    """One rank's events of one step keep their order through vLLM's container: a block
    stored, evicted and stored again is published stored, removed, stored (a router's
    last word is that the store holds it)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from hicache_storage.integrations.vllm.events import (
        HiCacheKVEvents,
        removed_event,
        stored_event,
    )

    sched = HiCacheKVConnector(config, SCHED, kv_config())
    a = stored_event(11, None, [1] * BLOCK, BLOCK, "hicache-file")
    events = HiCacheKVEvents(1)
    events.add_events([(0, a), (0, removed_event(11, "hicache-file")), (0, a)])
    sched.update_connector_output(SimpleNamespace(kv_cache_events=events))
    out = list(sched.take_events())
    assert [type(e) for e in out] == [BlockStored, BlockRemoved, BlockStored]


def test_a_block_its_own_store_evicted_is_not_published_as_stored(config: Any) -> None:
    """A store of three blocks into a file store with room for two and a half: the
    batch evicts its own first block. Only the blocks the store still holds are
    published as stored (the evicted one was never published: no removal either)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from hicache_storage.storekit.header import HEADER_SIZE

    saved = getattr(config, "kv_events_config", None)
    config.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    try:
        _, probe, _ = pair(config)
        page = wside(probe).pools[0].page_bytes + HEADER_SIZE
        probe.shutdown()
        extra = config.kv_transfer_config.kv_connector_extra_config
        extra.update(max_size=int(2.5 * page), eviction_ratio=1.0)
        sched, worker, _ = pair(config, seed=3)
        hashes = [bytes([i]) * 32 for i in (1, 2, 3)]
        assert sched.get_num_new_matched_tokens(request("a", PROMPT, block_hashes=hashes), 0) == (
            0,
            False,
        )
        run_step(sched, worker, step([new_req("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
        events = worker.get_kv_connector_kv_cache_events()
        sched.update_connector_output(SimpleNamespace(kv_cache_events=events))
        out = list(sched.take_events())
        backend = wside(worker).backends[0]
        held = [backend.exists(k) for k in sside(sched)._reqs["a"].keys]
        assert held == [False, True, True]
        stored = [e.block_hashes[0] for e in out if isinstance(e, BlockStored)]
        assert stored == [maybe_convert_block_hash(h) for h in hashes[1:]]
        assert not [e for e in out if isinstance(e, BlockRemoved)]
        worker.shutdown()
    finally:
        config.kv_events_config = saved
