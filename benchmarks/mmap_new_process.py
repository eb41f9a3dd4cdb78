"""``mmap`` reads in a new process against reads in the process that wrote the arena.

A process that maps an arena another process filled finds the bytes in the page cache but
has no page-table entries for them: without help every first touch of a 4 KiB page is a
fault. This run measures, on one arena of ``--pages`` objects of ``--page-mib`` MiB:

* **writer**: the filling process reads every object back (its mapping is populated);
* **new process, first read**: a fresh interpreter opens the arena and reads every object
  once (what a restarted engine pays);
* **the same, populated first**: the reader maps the whole data area with
  ``MADV_POPULATE_READ`` before its first read, untimed (what populating at open, off
  the read path, would give), and with the populate timed (whether populating instead
  of faulting is faster in itself); the backend does neither;
* **new process, second read**: the same process again (populated by then);
* **kernel preadv**: the same bytes read from the arena file with ``preadv`` into the
  same destination, in the new process (the kernel's copy from the page cache).

Medians over ``--rounds`` rounds (a new process each round); ratios are to the writer.

    .venv/bin/python benchmarks/mmap_new_process.py --pages 128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hicache_storage import StorageConfig
from hicache_storage.backends import MmapBackend


def _keys(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(n)]


def _read_all(backend: MmapBackend, keys: list[str], dst: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for k, d in zip(keys, dst, strict=True):
        if backend.get(k, d) is None:
            raise SystemExit(f"missing {k}")
    return time.perf_counter() - t0


def reader(path: str, pages: int, page_bytes: int, populate: bool = False) -> dict[str, float]:
    """Run in a new process: first and second read through the backend, then preadv."""

    keys = _keys(pages)
    dst = [torch.empty(page_bytes, dtype=torch.uint8) for _ in keys]
    for d in dst:
        d.fill_(1)  # the destination is resident: only the arena's side is measured
    backend = MmapBackend(StorageConfig(), path=path)
    try:
        spent = 0.0
        if populate:  # every page of the data area mapped in one call (Linux 5.14)
            arena = backend._arena  # (the benchmark looks inside; the backend does not)
            assert arena is not None
            advice = getattr(mmap, "MADV_POPULATE_READ", 22)
            t0 = time.perf_counter()
            arena.map.madvise(advice, arena.data_off, len(arena.map) - arena.data_off)
            spent = time.perf_counter() - t0
        first = _read_all(backend, keys, dst)
        second = _read_all(backend, keys, dst)
    finally:
        backend.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
        off = 0
        for d in dst:  # sequential, the same number of bytes (the layout does not matter)
            off = off if off + page_bytes <= size else 0
            os.preadv(fd, [memoryview(d.numpy())], off)
            off += page_bytes
        raw = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"first": first, "second": second, "preadv": raw, "populate": spent}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--page-mib", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--json", action="store_true")
    p.add_argument("--reader", nargs=4, metavar=("PATH", "PAGES", "BYTES", "POP"),
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args()
    if args.reader:
        path, pages, nbytes, pop = args.reader
        print(json.dumps(reader(path, int(pages), int(nbytes), pop == "1")))
        return 0

    page_bytes = args.page_mib << 20
    total = args.pages * page_bytes
    with tempfile.TemporaryDirectory(prefix="hicache-mmap-np-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "arena")
        backend = MmapBackend(
            StorageConfig(),
            path=path,
            max_size=total * 2 + (64 << 20),
            slot_size=page_bytes,
            checksum="none",
            verify_checksum=False,
        )
        keys = _keys(args.pages)
        gen = torch.Generator().manual_seed(0)
        src = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen) for _ in keys]
        if not all(backend.batch_set(keys, src)):
            raise SystemExit("the fill failed")
        dst = [torch.empty(page_bytes, dtype=torch.uint8) for _ in keys]
        for d in dst:
            d.fill_(1)
        writer, first, first_np, pop_t, second, raw = [], [], [], [], [], []
        for i in range(args.rounds):
            writer.append(_read_all(backend, keys, dst))
            for pop in ("1", "0") if i % 2 == 0 else ("0", "1"):
                out = subprocess.run(
                    [sys.executable, __file__, "--reader", path, str(args.pages),
                     str(page_bytes), pop],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if pop == "1":
                    first_np.append(r["first"])
                    pop_t.append(r["populate"])
                    continue
                first.append(r["first"])
                second.append(r["second"])
                raw.append(r["preadv"])
        if not all(torch.equal(a, b) for a, b in zip(src, dst, strict=True)):
            raise SystemExit("a read returned wrong bytes")
        backend.close()

    def gbps(ts: list[float]) -> float:
        return total / statistics.median(ts) / 1e9

    w = gbps(writer)
    rows = {
        "writer": gbps(writer),
        "new process, first read": gbps(first),
        "the same, populated first": gbps(first_np),
        "  populate, then first read": gbps([a + b for a, b in zip(first_np, pop_t, strict=True)]),
        "new process, second read": gbps(second),
        "kernel preadv (new process)": gbps(raw),
    }
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in rows.items()}))
        return 0
    print(f"{args.pages} objects of {args.page_mib} MiB, median of {args.rounds} rounds")
    print(f"{'':30} {'GB/s':>7} {'x writer':>9}")
    for k, v in rows.items():
        print(f"{k:30} {v:7.2f} {v / w:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
