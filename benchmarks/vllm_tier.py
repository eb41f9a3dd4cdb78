"""Our backends as vLLM's secondary tier against vLLM's own ``fs`` tier, in one run.

Both tiers are built by vLLM's ``SecondaryTierFactory`` over the same primary tier (a
page-aligned CPU buffer of chunks, as vLLM's own tests build it) with a real
``OffloadingConfig``, and run the same jobs: every chunk stored in jobs of ``--job``
chunks, then loaded into other chunks; the clock stops when ``get_finished_jobs`` has
reported every job. ``HiCacheTier`` runs with its defaults (``file`` on ``--dir``,
checksums written and verified, a 5 s deadline through staging); ``fs`` with its own
(16 read and 16 write threads). Chunks of 2 MiB and of 64 KiB; rounds alternate the
order; medians in chunks per second and GB/s; every loaded chunk is compared byte for
byte outside the timings.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_tier.py --rounds 5
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "integrations" / "vllm"))


def build(kind: str, root: str, primary: np.ndarray, chunk: int, timeout: float) -> Any:
    from test_tier import offloading_config
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    spec = MagicMock()
    cfg = offloading_config()
    spec.config = cfg.__class__(**{**cfg.__dict__, "worker_kv_bytes_per_block": chunk})
    spec.blocks_per_chunk = 1
    spec.kv_events_config.enable_kv_cache_events = False
    entry: dict[str, Any]
    if kind == "fs":
        entry = {"type": "fs", "root_dir": root}
    else:
        entry = {"type": "HiCacheTier", "module_path": "hicache_storage.integrations.vllm.tier",
                 "backend_name": "file", "root": root, "engine_timeout": timeout}  # fmt: skip
    return SecondaryTierFactory.create_secondary_tier(entry, primary.data, spec)


def run_jobs(tier: Any, jobs: list[Any], store: bool) -> float:
    t0 = time.perf_counter()
    for j in jobs:
        (tier.submit_store if store else tier.submit_load)(j)
    want, got = {j.job_id for j in jobs}, set()
    while want - got:
        for r in tier.get_finished_jobs():
            if not r.success:
                raise SystemExit(f"a {'store' if store else 'load'} job failed")
            got.add(r.job_id)
        time.sleep(0.0005)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--job", type=int, default=16, help="chunks per job")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--engine-timeout", type=float, default=5.0, help="HiCacheTier's deadline")
    args = p.parse_args()
    from test_tier import CTX
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    job_ids = iter(range(1, 1 << 30))
    print(f"median of {args.rounds} rounds; file system under {args.dir}")
    print(f"  {'':28} {'store /s':>9} {'GB/s':>6} {'load /s':>9} {'GB/s':>6}   x fs (store, load)")
    for chunk, n in ((2 << 20, 256), (64 << 10, 4096)):
        buf = mmap.mmap(-1, 2 * n * chunk)  # page aligned, as vLLM's primary tier
        primary = np.frombuffer(buf, dtype=np.uint8).reshape(2 * n, chunk)
        primary[:n] = np.random.default_rng(0).integers(0, 256, (n, chunk), dtype=np.uint8)
        times: dict[str, list[tuple[float, float]]] = {"fs": [], "hicache": []}
        for r in range(args.rounds):
            for kind in ("fs", "hicache") if r % 2 == 0 else ("hicache", "fs"):
                root = tempfile.mkdtemp(prefix=f"tier-{kind}-", dir=args.dir)
                tier = build(kind, root, primary, chunk, args.engine_timeout)
                salt = (r * 2 + (kind == "fs")).to_bytes(4, "big")
                keys = [make_offload_key(salt + i.to_bytes(28, "big"), 0) for i in range(n)]

                def jobs(first: int, keys: list[Any] = keys, n: int = n) -> list[Any]:
                    return [TransferJob(job_id=next(job_ids), keys=keys[i : i + args.job],
                                        chunk_ids=np.arange(first + i, first + min(n, i + args.job)),
                                        is_promotion=False, req_context=CTX)
                            for i in range(0, n, args.job)]  # fmt: skip

                t_store = run_jobs(tier, jobs(0), store=True)
                primary[n:] = 0
                t_load = run_jobs(tier, jobs(n), store=False)
                if not np.array_equal(primary[:n], primary[n:]):
                    raise SystemExit(f"{kind}: a loaded chunk came back wrong")
                times[kind].append((t_store, t_load))
                tier.shutdown()
                shutil.rmtree(root, ignore_errors=True)
        base = None
        for kind, label in (("fs", "vLLM fs tier"), ("hicache", "HiCacheTier (file)")):
            s = statistics.median(t for t, _ in times[kind])
            g = statistics.median(t for _, t in times[kind])
            base = base or (s, g)
            print(f"  {label + f', {chunk >> 10} KiB':28} {n / s:9.0f} {n * chunk / s / 1e9:6.2f} "
                  f"{n / g:9.0f} {n * chunk / g / 1e9:6.2f}   {base[0] / s:.2f}, {base[1] / g:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
