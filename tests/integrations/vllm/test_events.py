"""Storage-tier KV events, consumed as a router would: a real vLLM publishing its KV
events over ZMQ, and a subscriber decoding vLLM's ``KVEventBatch``.

The publisher binds an ``ipc://`` endpoint (no network at all): vLLM 0.32 binds only
wildcard and ipc endpoints and *connects* to a ``tcp://host:port`` one, and a PUB that
connects to a bound SUB delivered nothing here (pyzmq alone, 127.0.0.1 and ipc alike).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm_engine import BLOCK, engine, generate, totals

PROMPT = list(range(500, 600))  # 100 tokens: 3 full blocks


def _drain(sub: Any, decoder: Any, until: Any, limit: float = 60.0) -> list[BlockStored]:
    """Every ``BlockStored`` received until ``until(events)`` holds (or ``limit`` s)."""
    got: list[BlockStored] = []
    end = time.monotonic() + limit
    while not until(got) and time.monotonic() < end:
        if sub.poll(200):
            _topic, _seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            got.extend(e for e in batch.events if isinstance(e, BlockStored))
    return got


def test_stored_blocks_are_published_with_vllms_own_hashes(
    tiny_model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)  # (before vLLM binds it: zmq connects once it exists)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=endpoint, topic="kv")  # fmt: skip
        options = {"root": str(tmp_path / "kv")}
        with engine(tiny_model, "file", options, enable_prefix_caching=True,
                    kv_events_config=config) as llm:  # fmt: skip
            generate(llm, [PROMPT], max_tokens=4)
            assert totals(llm)["save_blocks"] == 3

            def ours(events: list[BlockStored]) -> list[BlockStored]:
                return [e for e in events if e.medium == "hicache-file"]

            # (Events leave with the engine's steps: a short request makes more.)
            events: list[BlockStored] = []
            for _ in range(5):
                generate(llm, [[7, 8, 9]], max_tokens=1)
                events += _drain(sub, decoder, lambda got: len(ours(got)) >= 3, limit=5)
                if len(ours(events)) >= 3:
                    break
    finally:
        sub.close(0)
        ctx.term()
    stored = ours(events)
    assert len(stored) == 3, events
    # vLLM's own prefix cache published the same blocks (its medium), with its hashes:
    # a router matches ours against them.
    own = {h for e in events if e.medium != "hicache-file" for h in e.block_hashes}
    assert [e.block_hashes[0] for e in stored] and all(e.block_hashes[0] in own for e in stored)
    by_tokens = sorted(stored, key=lambda e: e.token_ids[0])
    assert [e.token_ids for e in by_tokens] == [
        PROMPT[i * BLOCK : (i + 1) * BLOCK] for i in range(3)
    ]
    assert by_tokens[0].parent_block_hash is None
    assert by_tokens[1].parent_block_hash == by_tokens[0].block_hashes[0]
    assert by_tokens[2].parent_block_hash == by_tokens[1].block_hashes[0]
    assert all(e.block_size == BLOCK for e in stored)


def test_blocks_the_store_evicts_or_clears_are_published_as_removed(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The worker's backend evicts the first prompt's blocks to make room for a second
    prompt's (its capacity bound, shrunk here to what it holds), then is cleared: the
    subscriber gets ``BlockRemoved`` with the store's medium for exactly the blocks
    published as stored, each once."""
    from vllm.distributed.kv_events import BlockRemoved

    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    got: list[Any] = []

    def ours(kind: type) -> list[Any]:
        return [
            e for e in got if isinstance(e, kind) and getattr(e, "medium", None) == "hicache-file"
        ]

    def drain(llm: Any, until: Any) -> None:
        for _ in range(8):
            generate(llm, [[7, 8, 9]], max_tokens=1)  # (events leave with steps)
            end = time.monotonic() + 5
            while not until() and time.monotonic() < end:
                if sub.poll(200):
                    _topic, _seq, payload = sub.recv_multipart()
                    got.extend(decoder.decode(payload).events)
            if until():
                return

    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=endpoint, topic="kv")  # fmt: skip
        options = {"root": str(tmp_path / "kv"), "max_size": "1GiB", "eviction_ratio": 1.0}
        with engine(tiny_model, "file", options, enable_prefix_caching=True,
                    kv_events_config=config) as llm:  # fmt: skip
            generate(llm, [PROMPT], max_tokens=4)
            totals(llm)
            drain(llm, lambda: len(ours(BlockStored)) >= 3)
            first = {e.block_hashes[0] for e in ours(BlockStored)}
            assert len(first) == 3
            (worker,) = [c.connector_worker for c in llm.hicache_connectors.values()
                         if c.connector_worker is not None]  # fmt: skip
            backend = worker.backends[0]
            backend._tracker.max_bytes = backend.usage()["used_bytes"]  # full now
            generate(llm, [list(range(300, 400))], max_tokens=4)
            totals(llm)
            drain(llm, lambda: len(ours(BlockStored)) >= 6 and len(ours(BlockRemoved)) >= 3)
            evicted = [e.block_hashes[0] for e in ours(BlockRemoved)]
            assert sorted(evicted) == sorted(first)  # the three oldest, each once
            second = {e.block_hashes[0] for e in ours(BlockStored)} - first
            # (and the first answer's partial last block: an object with no vLLM hash)
            assert len(second) == 3 and backend.get_stats(reset=False).evictions == 4
            backend.clear()
            drain(llm, lambda: len(ours(BlockRemoved)) >= 6)
    finally:
        sub.close(0)
        ctx.term()
    removed = [e.block_hashes[0] for e in ours(BlockRemoved)]
    assert len(removed) == 6 and set(removed) == first | second
