"""SGLang's own HiCacheFile next to our file backend through the SGLang adapter, one run.

Run it in the SGLang test venv (``bash scripts/sglang_env.sh`` builds it)::

    .venv-sglang/bin/python benchmarks/sglang_file.py [--pages 128] [--reps 5] [--dir /tmp]

Same directory kind, same 2 MiB pages, batches of 128, repetitions interleaved (the order
rotates each repetition), medians reported. Contenders:

* ``HiCacheFile``: SGLang's file backend, its tensor path (``batch_set`` of page tensors,
  ``batch_get`` into preallocated tensors); it verifies nothing on read;
* ``adapter tensors``: our ``file`` backend behind ``SGLangStorage``, the same tensor path;
* ``adapter v1``: the same through SGLang's zero-copy pair (``interface_v1``), pages moved
  straight between a host pool and the files;
* ``native v1``: our ``file`` backend's own ``batch_set_v1``/``batch_get_v1``, no adapter:
  the adapter's cost is the difference to ``adapter v1``;
* ``raw verified``: the ceiling of a verified read on this machine, no SDK: one file per
  page, read by 4 threads (our default ``max_concurrency``), each an ``open``, one
  ``preadv`` into the target and an xxh3 of it checked against the digest kept at write.

That difference is inside the run-to-run noise of 256 MiB of file I/O, so the adapter's
cost is also measured on its own: a second part calls the same backend instance with
and without the adapter in front, alternately, ``--calls`` times per operation, on
128 small (4 KiB) pages, where the fixed cost per call is most of the time. The adapter
does not touch page bytes, so its cost per call does not grow with the page size: the
median difference per call is reported next to the native 2 MiB-page batch time of the
first part (the share of that batch the adapter adds).

Every read is checked byte for byte after it is timed. Writes land in the page cache and
reads come from it (hot), as in SGLang's own use between prefetches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from hicache_storage import HostKVPool, StorageConfig, create_backend
from hicache_storage.integrations.sglang import SGLangStorage


def sglang_config(extra: dict[str, Any] | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench-model", extra_config=extra,
    )  # fmt: skip


class RawVerified:
    """A file per page, read in parallel and verified with xxh3: the ceiling, no SDK."""

    def __init__(self, root: str, threads: int = 4) -> None:
        self.root, self.digests = root, {}
        self.pool = ThreadPoolExecutor(threads)

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool:
        for key, value in zip(keys, values, strict=True):
            view = memoryview(value.numpy())
            with open(os.path.join(self.root, key), "wb") as f:
                f.write(view)
            self.digests[key] = xxhash.xxh3_64_intdigest(view)
        return True

    def _get(self, key: str, target: torch.Tensor) -> torch.Tensor | None:
        view = memoryview(target.numpy())
        fd = os.open(os.path.join(self.root, key), os.O_RDONLY)
        try:
            got = os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
        ok = got == len(view) and xxhash.xxh3_64_intdigest(view) == self.digests[key]
        return target if ok else None

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[Any]:
        return list(self.pool.map(self._get, keys, targets))

    def close(self) -> None:
        self.pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--calls", type=int, default=400, help="calls per operation, part 2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, batch = args.pages, 128
    # A pool whose pages are 2 MiB: 16 tokens x 32 layers x 8 heads x 128 dim x bf16 x K/V.
    pool = HostKVPool(num_pages=2 * n, page_size=16, layer_num=32, kv_heads=8, head_dim=128,
                      dtype=torch.bfloat16, layout="page_first")  # fmt: skip
    page_bytes = pool.page_bytes
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    src_idx = torch.arange(0, n * 16)
    dst_idx = torch.arange(n * 16, 2 * n * 16)
    src_pages = pool.page_buffers(src_idx)
    want = [p.tobytes() for p in src_pages]
    tensors = [torch.frombuffer(bytearray(w), dtype=torch.uint8) for w in want]
    targets = [torch.empty(page_bytes, dtype=torch.uint8) for _ in range(n)]
    work = tempfile.mkdtemp(prefix="sglang-bench-", dir=args.dir)

    def run_tensors(store: Any, keys: list[str]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            assert store.batch_set(keys[i : i + batch], tensors[i : i + batch]) is True
        t1 = time.perf_counter()
        for i in range(0, n, batch):
            got = store.batch_get(keys[i : i + batch], targets[i : i + batch])
            assert all(g is not None for g in got)
        t2 = time.perf_counter()
        assert all(bytes(t.numpy()) == w for t, w in zip(targets, want, strict=True))
        return t1 - t0, t2 - t1

    def run_v1(store: Any, keys: list[str]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            sl = slice(i * 16, (i + batch) * 16)
            assert store.batch_set_v1(keys[i : i + batch], src_idx[sl]) == [True] * min(
                batch, n - i
            )
        t1 = time.perf_counter()
        for i in range(0, n, batch):
            sl = slice(i * 16, (i + batch) * 16)
            assert store.batch_get_v1(keys[i : i + batch], dst_idx[sl]) == [True] * min(
                batch, n - i
            )
        t2 = time.perf_counter()
        assert [p.tobytes() for p in pool.page_buffers(dst_idx)] == want
        return t1 - t0, t2 - t1

    def hicache_file(root: str) -> Any:
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = root
        return HiCacheFile(sglang_config(None))

    def adapter(root: str) -> Any:
        extra = {"backend_name": "file", "root": root, "interface_v1": True}
        a = SGLangStorage(sglang_config(extra))
        a.register_mem_pool_host(pool)
        return a

    def native(root: str) -> Any:
        cfg = StorageConfig(
            namespace=SGLangStorage(sglang_config({"backend_name": "file"})).namespace_for(pool)
        )
        b = create_backend("file", cfg, root=root)
        b.register_mem_pool_host(pool)
        return b

    contenders: list[tuple[str, Callable[[str], Any], Callable[..., tuple[float, float]]]] = [
        ("HiCacheFile", hicache_file, run_tensors),
        ("adapter tensors", adapter, run_tensors),
        ("adapter v1", adapter, run_v1),
        ("native v1", native, run_v1),
        ("raw verified", RawVerified, run_tensors),
    ]
    results: dict[str, dict[str, list[float]]] = {c[0]: {"set": [], "get": []} for c in contenders}
    total = n * page_bytes
    for rep in range(args.reps):
        # Rotate the order each repetition: write-back of earlier writes slows whoever runs
        # next, so a fixed order would favour the first contender.
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for label, make, run in order:
            root = os.path.join(work, f"{label.replace(' ', '-')}-{rep}")
            os.makedirs(root)
            store = make(root)
            keys = [f"{rep:02d}{i:062x}" for i in range(n)]
            set_s, get_s = run(store, keys)
            results[label]["set"].append(total / set_s / 1e9)
            results[label]["get"].append(total / get_s / 1e9)
            if hasattr(store, "close"):
                store.close()
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{n} pages of {page_bytes >> 20} MiB, batches of {batch}, {args.reps} reps, "
          f"dir {args.dir}; GB/s, median [min-max]")  # fmt: skip
    base = {k: statistics.median(results["HiCacheFile"][k]) for k in ("set", "get")}
    ref = {k: statistics.median(results["native v1"][k]) for k in ("set", "get")}
    for label, r in results.items():
        cells = []
        for k in ("set", "get"):
            med = statistics.median(r[k])
            cells.append(
                f"{k} {med:5.2f} [{min(r[k]):.2f}-{max(r[k]):.2f}] "
                f"{med / base[k]:.2f}x HiCacheFile, {med / ref[k]:.2f}x native"
            )
        print(f"{label:16s} " + " | ".join(cells))
    native_batch_ms = {k: total / (ref[k] * 1e9) / max(1, n // batch) * 1e3 for k in ref}
    adapter_overhead(args.dir, args.calls, native_batch_ms)


def adapter_overhead(directory: str, calls: int, native_batch_ms: dict[str, float]) -> None:
    """Part 2: the adapter's cost per call, alone (see the module docstring)."""
    pool = HostKVPool(num_pages=256, page_size=16, layer_num=1, kv_heads=1, head_dim=64,
                      dtype=torch.bfloat16, layout="page_first")  # fmt: skip
    work = tempfile.mkdtemp(prefix="sglang-bench-overhead-", dir=directory)
    a = SGLangStorage(sglang_config({"backend_name": "file", "root": work, "interface_v1": True}))
    a.register_mem_pool_host(pool)
    native = a.backend
    assert native is not None
    keys = [f"ab{i:062x}" for i in range(128)]
    src, dst = torch.arange(0, 128 * 16), torch.arange(128 * 16, 256 * 16)
    assert native.batch_set_v1(keys, src) == [True] * 128
    ops: dict[str, tuple[Callable[[Any], Any], Any]] = {
        "get": (lambda s: s.batch_get_v1(keys, dst), [True] * 128),
        "set": (lambda s: s.batch_set_v1(keys, src), [True] * 128),  # stored: no write
        "exists": (lambda s: s.batch_exists(keys), 128),
    }
    print(f"adapter cost per call, alone: {calls} alternating calls per operation, "
          f"128 pages of {pool.page_bytes} B, same backend instance; median us per call")  # fmt: skip
    for op, (call, expect) in ops.items():
        times: dict[str, list[float]] = {"adapter": [], "native": []}
        for i in range(calls):
            for label in ("adapter", "native") if i % 2 else ("native", "adapter"):
                store = a if label == "adapter" else native
                t0 = time.perf_counter()
                out = call(store)
                times[label].append(time.perf_counter() - t0)
                assert out == expect, (op, label)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        extra = med["adapter"] - med["native"]
        share = ""
        if op in native_batch_ms:
            share = (f"; {extra / 1e3 / native_batch_ms[op] * 100:+.2f}% of a native 2 MiB-page "
                     f"batch of 128 ({native_batch_ms[op]:.1f} ms)")  # fmt: skip
        print(f"  {op:7s} native {med['native']:8.1f}  adapter {med['adapter']:8.1f}  "
              f"adapter adds {extra:+7.1f} us{share}")  # fmt: skip
    a.close()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
