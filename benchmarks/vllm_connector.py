"""The vLLM connector's own cost, side by side with the backend's v1 path, in one run.

On the tiny test model nothing is compute bound, so this measures the connector itself,
with KV shaped like real models' on vLLM's CPU backend (``[blocks, kv_heads, 32, 2 *
head_dim]`` bf16 per layer, layer outermost; one stored page = one block of every layer):

* **connector**: the worker-side ``HiCacheKVConnector`` (built from a real ``VllmConfig``)
  storing each step's new blocks in ``wait_for_save`` and loading them into other blocks
  in ``start_load_kv``, from the metadata the scheduler side would send, with its default
  deadline (``engine_timeout`` 5 s): every call on a lane, through staging rows and one
  tensor copy per layer per chunk to or from vLLM's KV;
* **connector, no deadline**: the same with ``engine_timeout: 0``: page buffers straight
  over vLLM's KV tensors (one segment per layer), no copy;
* **backend v1**: the same backend's ``batch_set_v1`` / ``batch_get_v1`` on the same
  number of pages of the same size, from a host pool (``page_first``: 2 segments a page),
  in batches of the same size: what the backend does on its own.

Both are timed over the same rounds (their order alternates), medians in GB/s; every
block loaded is checked byte for byte outside the timings. Then the scheduler side: the
latency of ``get_num_new_matched_tokens`` for one 2048-token prompt (64 blocks: hashing
the chain and one ``batch_exists``), stored and not stored, against ``batch_exists``
alone on the same keys.

    bash scripts/vllm_env.sh && .venv-vllm/bin/python benchmarks/vllm_connector.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "workers"))
import vllm_engine  # (sets vLLM's environment before it is imported)
from hot_paths import timed

BLOCK = 32
#: (name, layers, kv heads, head dim, blocks per round, blocks per request)
SHAPES = [
    ("8B-like (32 layers, 8 heads, d128): 4 MiB blocks", 32, 8, 128, 96, 16),
    ("0.5B-like (24 layers, 2 heads, d64): 384 KiB blocks", 24, 2, 64, 512, 64),
]


def _worker(backend: str, options: dict[str, Any], model: Path, kcc: Any, kv: dict) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from hicache_storage.integrations.vllm import HiCacheKVConnector

    args = EngineArgs(
        model=str(model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
        max_model_len=256, kv_transfer_config=vllm_engine.kv_transfer_config(backend, options),
    )  # fmt: skip
    worker = HiCacheKVConnector(args.create_engine_config(), KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(kv)
    return worker


def build(backend: str, options: dict[str, Any], shape: tuple, model: Path) -> dict[str, Any]:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from hicache_storage import HostKVPool, StorageConfig
    from hicache_storage.integrations.vllm import HiCacheKVConnector
    from hicache_storage.keys import KVCacheNamespace
    from hicache_storage.registry import create_backend

    _, layers, heads, dim, blocks, _ = shape
    args = EngineArgs(
        model=str(model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
        max_model_len=256, kv_transfer_config=vllm_engine.kv_transfer_config(backend, options),
    )  # fmt: skip
    config = args.create_engine_config()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim,
                             dtype=torch.bfloat16)  # fmt: skip
    kcc = KVCacheConfig(num_blocks=2 * blocks + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout="LBHNC")  # fmt: skip
    # Block 0 is vLLM's null block (never stored or loaded): blocks 1.. are the pages.
    big = torch.empty(layers, 2 * blocks + 1, heads, BLOCK, 2 * dim, dtype=torch.bfloat16)
    big.view(torch.int16).random_(-(2**15), 2**15 - 1)
    kv = {n: big[i] for i, n in enumerate(names)}
    worker = _worker(backend, options, model, kcc, kv)
    direct = _worker(backend, {**options, "engine_timeout": 0}, model, kcc, kv)
    assert type(direct.mover.pool).__name__ == "PagedKVBlocks", "not the direct pool"
    assert type(worker.mover.pool).__name__ == "StagedKVBlocks", "not the staged pool"
    sched = HiCacheKVConnector(config, KVConnectorRole.SCHEDULER, kcc)
    # The backend's own v1 path: a host pool of the same pages, another namespace.
    pool = HostKVPool(2 * blocks + 1, BLOCK, layers, heads, dim, torch.bfloat16,
                      layout="page_first")  # fmt: skip
    assert pool.page_bytes == worker.mover.pool.page_bytes, (pool.page_bytes,)
    pool.kv_buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    ns = KVCacheNamespace.for_pool(pool, model_id="bench-v1")
    raw = create_backend(backend, StorageConfig(namespace=ns), **options)
    raw.register_mem_pool_host(pool)
    return {"worker": worker, "direct": direct, "sched": sched, "kv": big, "raw": raw,
            "pool": pool}  # fmt: skip


def round_(parts: dict[str, Any], shape: tuple, n: int, order: int) -> dict[str, float]:
    """One round: every contender stores ``blocks`` pages and loads them back; seconds."""
    import torch

    from hicache_storage.integrations.kvblocks import block_slots
    from hicache_storage.integrations.vllm import HiCacheConnectorMetadata, LoadSpec, SaveSpec

    _, _, _, _, blocks, per_req = shape
    raw, big = parts["raw"], parts["kv"]
    keys = [f"{n:08x}{i:056x}" for i in range(blocks)]
    src, dst = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    chunks = range(0, blocks, per_req)

    def conn_save(worker: Any, prefix: str) -> None:
        meta = HiCacheConnectorMetadata(saves=[
            SaveSpec(f"r{i}", [prefix + k[1:] for k in keys[i : i + per_req]],
                     [src[i : i + per_req]]) for i in chunks])  # fmt: skip
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        # Stores run off the critical path (async_saves): a store is timed to its end.
        assert worker._worker().flush(timeout=60)
        worker.clear_connector_metadata()

    def conn_load(worker: Any, prefix: str) -> None:
        meta = HiCacheConnectorMetadata(loads=[
            LoadSpec(f"r{i}", [prefix + k[1:] for k in keys[i : i + per_req]],
                     [dst[i : i + per_req]]) for i in chunks])  # fmt: skip
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.clear_connector_metadata()

    def raw_io(op: str, blocks_: list[int], prefix: str) -> None:
        call = getattr(raw, op)
        for i in chunks:
            ok = call([prefix + k[1:] for k in keys[i : i + per_req]],
                      block_slots(blocks_[i : i + per_req], BLOCK))  # fmt: skip
            if not all(ok):
                raise RuntimeError(f"backend {op} failed")

    out: dict[str, float] = {}
    bits = big.view(torch.int16)  # (bitwise: random bits include NaNs)
    contenders: list[tuple[str, Any, Any, Any]] = [
        (name, parts[part], lambda w=parts[part], p=p: conn_save(w, p),
         lambda w=parts[part], p=p: conn_load(w, p))
        for name, part, p in (("connector", "worker", "b"), ("no deadline", "direct", "c"))
    ] + [("backend v1", None, lambda: raw_io("batch_set_v1", src, "a"),
          lambda: raw_io("batch_get_v1", dst, "a"))]  # fmt: skip
    for name, worker, save, load in contenders if order % 2 == 0 else contenders[::-1]:
        before = dict(worker.totals) if worker is not None else {}
        out[f"{name} store"] = timed(save)
        out[f"{name} load"] = timed(load)
        if worker is not None:
            assert worker.totals["save_failed_blocks"] == before["save_failed_blocks"]
            assert worker.totals["load_failed_blocks"] == before["load_failed_blocks"]
            # Checks, outside the timings: every block loaded is the block stored.
            assert torch.equal(bits[:, blocks + 1 :], bits[:, 1 : blocks + 1]), (
                f"{name} loaded other bytes"
            )
            big[:, blocks + 1 :].zero_()
    pool = parts["pool"].kv_buffer
    for i in range(blocks):
        s = parts["pool"].page_buffers(block_slots([src[i]], BLOCK))[0].tobytes()
        d = parts["pool"].page_buffers(block_slots([dst[i]], BLOCK))[0].tobytes()
        assert s == d, "backend v1 loaded other bytes"
    pool.view(torch.uint8)  # (keep the pool alive to here)
    for b in (parts["worker"].backend, raw):
        b.clear()
    return out


def scheduler_latency(parts: dict[str, Any], reps: int) -> dict[str, float]:
    """Microseconds per request of the scheduler-side lookup, 2048-token prompts."""
    import torch

    from hicache_storage.integrations.vllm import HiCacheConnectorMetadata, SaveSpec

    sched, worker = parts["sched"], parts["worker"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 30000, (2048 + 5,), generator=gen).tolist() for _ in range(reps)]

    def req(i: int, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(request_id=f"q{i}-{time.perf_counter_ns()}", prompt_token_ids=tokens,
                               lora_request=None, mm_features=[], cache_salt=None,
                               prompt_embeds=None)  # fmt: skip

    miss = [timed(lambda p=p, i=i: sched.get_num_new_matched_tokens(req(i, p), 0))
            for i, p in enumerate(prompts)]  # fmt: skip
    # Store the first 64 blocks of each prompt (through the worker), then look up again.
    for i, p in enumerate(prompts):
        keys = sched.keys_for(req(i, p))[:64]
        blocks = [list(range(1, 65))]  # one list per KV cache group; 0 is the null block
        worker.bind_connector_metadata(
            HiCacheConnectorMetadata(saves=[SaveSpec("s", keys, blocks)])
        )
        worker.wait_for_save()
        assert worker._worker().flush(timeout=60)  # (stores run off the critical path)
    hit = [timed(lambda p=p, i=i: sched.get_num_new_matched_tokens(req(i, p), 0))
           for i, p in enumerate(prompts)]  # fmt: skip
    keys_all = [sched.keys_for(req(i, p)) for i, p in enumerate(prompts)]
    backend = sched.connector_scheduler.lookup_backends[0]
    exists = [timed(lambda k=k: backend.batch_exists(k)) for k in keys_all]
    got = sched.get_num_new_matched_tokens(req(0, prompts[0]), 0)
    assert got == (64 * BLOCK, False), got
    worker.backend.clear()
    med = statistics.median
    return {"miss": med(miss) * 1e6, "hit (64 blocks)": med(hit) * 1e6,
            "batch_exists alone": med(exists) * 1e6}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="file,shm")
    ap.add_argument("--dir", default=None, help="where the file backend writes (default /tmp)")
    args = ap.parse_args()
    model = vllm_engine.build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    print(f"host: {os.cpu_count()} CPUs; vLLM CPU KV layout; medians of {args.rounds} rounds")
    for backend in args.backends.split(","):
        for shape in SHAPES:
            base = Path(tempfile.mkdtemp(prefix="vllm-bench-", dir=args.dir))
            options = {"file": {"root": str(base / "kv")},
                       "shm": {"root": f"/dev/shm/hicache-vllm-bench-{os.getpid()}"},
                       "memory": {"store": "bench"}}[backend]  # fmt: skip
            parts = build(backend, options, shape, model)
            blocks, per_req = shape[4], shape[5]
            nbytes = blocks * parts["worker"].mover.pool.page_bytes
            times: dict[str, list[float]] = {}
            for r in range(args.rounds):
                for k, v in round_(parts, shape, r, r).items():
                    times.setdefault(k, []).append(v)
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            print(f"\n{backend}, {shape[0]}, {blocks} blocks in requests of {per_req}:")
            for op in ("store", "load"):
                c, d = gbps[f"connector {op}"], gbps[f"no deadline {op}"]
                b = gbps[f"backend v1 {op}"]
                print(f"  {op:5s}  connector {c:6.2f} GB/s ({c / b:.2f}x)   no deadline "
                      f"{d:6.2f} GB/s ({d / b:.2f}x)   backend v1 {b:6.2f} GB/s")  # fmt: skip
            lat = scheduler_latency(parts, reps=20)
            print("  scheduler lookup per 2048-token request: "
                  + ", ".join(f"{k} {v:.0f} us" for k, v in lat.items()))  # fmt: skip
            for b in (parts["worker"], parts["direct"], parts["sched"]):
                b.shutdown()
            parts["raw"].close()


if __name__ == "__main__":
    main()
