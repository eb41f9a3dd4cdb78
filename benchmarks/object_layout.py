"""Where the 48-byte header goes in a page's file: first (``header || payload``, earlier
releases) or last (``payload || header``, now), side by side.

200 pages of 2 MiB (K and V segments of 1 MiB in a torch tensor, 64-byte aligned as
the host pool's pages are), written to one file each and read back, by:

* **preadv**: what the ``file``/``shm`` backends do: one ``writev`` of header and
  segments, one ``preadv`` back;
* **nixl**: what the ``nixl`` backend does: the header by ``pwrite``, the segments by one
  NIXL transfer (POSIX plugin), and back.

Rounds alternate the layouts' order; every page is checked. GB/s per round:

    .venv/bin/python benchmarks/object_layout.py [--dir /tmp] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nixl_vs_raw import raw_transfer

from hicache_storage.backends._nixl import _nixl_api

N, SEG, HEAD = 200, 1 << 20, 48


def by_preadv(
    paths: list[str], src: torch.Tensor, dst: torch.Tensor, last: bool
) -> tuple[float, float]:
    s, d, h = memoryview(src.numpy()), memoryview(dst.numpy()), b"h" * HEAD
    t = time.perf_counter()
    for i, p in enumerate(paths):
        k, v = s[2 * i * SEG : (2 * i + 1) * SEG], s[(2 * i + 1) * SEG : (2 * i + 2) * SEG]
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.writev(fd, [k, v, h] if last else [h, k, v])
        os.close(fd)
    w = time.perf_counter() - t
    t = time.perf_counter()
    for i, p in enumerate(paths):
        k, v = d[2 * i * SEG : (2 * i + 1) * SEG], d[(2 * i + 1) * SEG : (2 * i + 2) * SEG]
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [k, v, bytearray(HEAD)] if last else [bytearray(HEAD), k, v], 0)
        os.close(fd)
    return w, time.perf_counter() - t


class ByNixl:
    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        api = _nixl_api()
        self.a = api.nixl_agent("layout", api.nixl_agent_config(backends=[]))
        self.a.create_backend("POSIX")
        self.a.register_memory(src)
        self.a.register_memory(dst)
        self.src, self.dst = src, dst

    def _move(self, op: str, base: int, fds: list[int], at: int) -> None:
        mem = [(base + j * SEG, SEG, 0) for j in range(2 * len(fds))]
        places = [(at + (j % 2) * SEG, SEG, fds[j // 2]) for j in range(2 * len(fds))]
        raw_transfer(self.a, op, mem, places, [(fd, 2 * SEG + HEAD) for fd in fds])

    def __call__(self, paths: list[str], last: bool) -> tuple[float, float]:
        at = 0 if last else HEAD
        t = time.perf_counter()
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600) for p in paths]
        for fd in fds:
            os.pwrite(fd, b"h" * HEAD, 2 * SEG if last else 0)
        self._move("WRITE", int(self.src.data_ptr()), fds, at)
        for fd in fds:
            os.close(fd)
        w = time.perf_counter() - t
        t = time.perf_counter()
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        self._move("READ", int(self.dst.data_ptr()), fds, at)
        for fd in fds:
            os.close(fd)
        return w, time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    src = torch.randint(0, 256, (2 * SEG * N,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    nixl = ByNixl(src, dst)
    work = tempfile.mkdtemp(prefix="hicache-layout-", dir=args.dir)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    runners: dict[str, Any] = {"preadv": lambda ps, last: by_preadv(ps, src, dst, last),
                               "nixl": nixl}  # fmt: skip
    try:
        for r in range(args.rounds):
            for way, run in runners.items():
                for last in (True, False) if r % 2 == 0 else (False, True):
                    paths = [os.path.join(work, f"{way}-{last}-{i}") for i in range(N)]
                    w, rd = run(paths, last)
                    if not torch.equal(src, dst):
                        raise RuntimeError("a page read back wrong")
                    dst.zero_()
                    out.setdefault((way, "last" if last else "first"), []).append((w, rd))
                    for path in paths:
                        os.unlink(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = 2 * SEG * N
    print(f"{N} pages x 2 MiB under {args.dir}, GB/s per round; every page checked")
    for (way, where), times in out.items():
        writes = " ".join(f"{nbytes / w / 1e9:5.2f}" for w, _ in times)
        reads = " ".join(f"{nbytes / r / 1e9:5.2f}" for _, r in times)
        print(f"{way:7s} header {where:5s}  write {writes}   read {reads}")
    os._exit(0)  # (NIXL's agent is not torn down: nothing else runs after this)


if __name__ == "__main__":
    raise SystemExit(main())
