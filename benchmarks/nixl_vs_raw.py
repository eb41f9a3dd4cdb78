"""Side by side, in one run, on one filesystem: the ``nixl`` backend's v1 path and raw NIXL
transfers (POSIX plugin) doing the same work.

For 1000 pages of 64 KiB and 200 pages of 2 MiB (bf16, ``page_first``, K and V segments)
of one host pool, in batches of 128:

* **ours**: ``batch_set_v1`` / ``batch_get_v1`` through the ``nixl`` backend (a
  temporary per page, the header, one NIXL transfer of the batch's segments, then
  publication by link; reads: open, size and header checks, one transfer, xxh3 verified);
* **ours, checksum none**: the same with ``checksum="none"`` (no hash on either side);
* **raw NIXL**: what one writes by hand with the NIXL agent and no SDK: per batch, open
  one file per page in place (``O_CREAT``), register the files, one ``WRITE`` of the same
  segments, deregister, close; reads the same way with ``READ``. No header, no check, no
  atomic publication (SGLang's own NIXL backend writes in place too);
* **file v1**: the ``file`` backend on the same pages (``writev``/``preadv``), for scale.

Rounds alternate the contenders' order; medians. Every page read back through the
backend is verified byte for byte (outside the timings); raw reads are verified too.

    .venv/bin/python benchmarks/nixl_vs_raw.py --rounds 5 [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs
from v1_pages import V1Pages

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend, NixlBackend
from hicache_storage.backends._nixl import _nixl_api
from hicache_storage.benchkit import BenchShape, namespace_for, verify_pages


def raw_transfer(
    a: Any, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
    files: list[tuple[int, int]],
) -> None:  # fmt: skip
    """One NIXL transfer as one writes it by hand: register the files, transfer, poll,
    release, deregister (``local``: DRAM ``(addr, len, 0)``; ``remote``: ``(offset, len,
    fd)``; ``files``: ``(fd, size)``)."""
    file_reg = a.register_memory(np.array([(0, n, fd) for fd, n in files], np.uint64), "FILE")
    h = a.initialize_xfer(
        op, a.get_xfer_descs(np.array(local, np.uint64), "DRAM"),
        a.get_xfer_descs(np.array(remote, np.uint64), "FILE"), a.name,
    )  # fmt: skip
    state = a.transfer(h)
    while state == "PROC":
        state = a.check_xfer_state(h)
    a.release_xfer_handle(h)
    a.deregister_memory(file_reg)
    if state != "DONE":
        raise RuntimeError(f"raw {op} failed")


class RawNixl:
    """Pages as files in one directory, moved by a NIXL agent with the POSIX plugin."""

    def __init__(self, pages: V1Pages, directory: str) -> None:
        api = _nixl_api()
        self.agent = api.nixl_agent("raw", api.nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX")
        self.reg = self.agent.register_memory(pages.pool.kv_buffer)
        self.pages, self.directory = pages, directory

    def _move(self, op: str, paths: list[str], part: list[Any], flags: int) -> None:
        a = self.agent
        fds = [os.open(p, flags, 0o600) for p in paths]
        try:
            local, remote = [], []
            for fd, page in zip(fds, part, strict=True):
                off = 0
                for s in page.segments:
                    local.append((s.ptr, s.nbytes, 0))
                    remote.append((off, s.nbytes, fd))
                    off += s.nbytes
            raw_transfer(
                a, op, local, remote, [(fd, p.nbytes) for fd, p in zip(fds, part, strict=True)]
            )
        finally:
            for fd in fds:
                os.close(fd)

    def round(self, out: dict[str, list[float]]) -> int:
        pages, shape = self.pages, self.pages.shape
        paths = [os.path.join(self.directory, secrets.token_hex(16)) for _ in range(shape.pages)]

        def go(op: str, part_pages: list[Any], flags: int) -> None:
            for i in range(0, shape.pages, shape.batch):
                self._move(op, paths[i : i + shape.batch], part_pages[i : i + shape.batch], flags)

        out["raw set"].append(
            timed(lambda: go("WRITE", pages.src_pages, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        )
        pages.clear_destination()
        out["raw get"].append(timed(lambda: go("READ", pages.dst_pages, os.O_RDONLY)))
        bad = int(verify_pages(pages.pool, pages.src, pages.dst))
        for p in paths:
            os.unlink(p)
        return bad


def run_shape(shape: BenchShape, rounds: int, base: str) -> dict[str, Any]:
    pages = V1Pages(shape)
    work = tempfile.mkdtemp(prefix="hicache-nixl-bench-", dir=base)
    ns = StorageConfig(namespace=namespace_for(shape, "bench"))
    ours = NixlBackend(ns, root=os.path.join(work, "ours"))
    plain = NixlBackend(ns, root=os.path.join(work, "plain"), checksum="none")
    file_b = FileBackend(ns, root=os.path.join(work, "file"))
    for b in (ours, plain, file_b):
        b.register_mem_pool_host(pages.pool)
    raw_dir = os.path.join(work, "raw")
    os.mkdir(raw_dir)
    raw = RawNixl(pages, raw_dir)
    names = ["ours", "ours, checksum none", "raw", "file v1"]
    out: dict[str, list[float]] = {f"{n} {op}": [] for n in names for op in ("set", "get")}
    bad = 0

    def through(label: str, b: Any) -> Any:
        def go() -> None:
            nonlocal bad
            got: dict[str, list[float]] = {"ours set": [], "ours get": []}
            bad += pages.ours(b, got)
            out[f"{label} set"] += got["ours set"]
            out[f"{label} get"] += got["ours get"]

        return go

    def raw_round() -> None:
        nonlocal bad
        bad += raw.round(out)

    order = [through("ours", ours), through("ours, checksum none", plain), raw_round,
             through("file v1", file_b)]  # fmt: skip
    try:
        for r in range(rounds):
            for fn in order if r % 2 == 0 else order[::-1]:
                fn()
    finally:
        for b in (ours, plain, file_b):
            b.close()
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {k: pages.nbytes / statistics.median(v) / 1e9 for k, v in out.items()}
    result["mismatched pages"] = bad
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    args = p.parse_args()
    shapes = [
        ("1000 x 64 KiB", BenchShape(pages=1000, batch=128, layer_num=1)),
        ("200 x 2 MiB", BenchShape(pages=200, batch=128)),
    ]
    print(f"files under {args.dir}, {args.rounds} rounds, medians, GB/s (ratio to raw NIXL)")
    for label, shape in shapes:
        r = run_shape(shape, args.rounds, args.dir)
        print(f"\n{label}: pages verified: {'OK' if r['mismatched pages'] == 0 else 'MISMATCH'}")
        print(f"  {'contender':22s} {'set':>7s} {'ratio':>6s} {'get':>7s} {'ratio':>6s}")
        for name in ("ours", "ours, checksum none", "raw", "file v1"):
            s, g = r[f"{name} set"], r[f"{name} get"]
            print(f"  {name:22s} {s:7.3f} {s / r['raw set']:6.2f} {g:7.3f} {g / r['raw get']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
