"""``shm`` on a tmpfs with transparent huge pages against the default ``/dev/shm``, in one run.

tmpfs backs a file with 4 KiB pages unless its mount says otherwise (``huge=`` mount
option) or the system-wide ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` forces
it; ``preadv``/``pwritev`` then walk 512 times fewer pages per 2 MiB object. Only the
operator can choose this (mounting needs root; an unprivileged process can neither
remount ``/dev/shm`` nor reserve hugetlb pages, and ``madvise(MADV_HUGEPAGE)`` applies
to mappings, which ``shm`` does not use). This run mounts a tmpfs with
``huge=within_size`` (``--huge``) in a temporary directory (as root; or give ``--huge-root``, a
directory on such a mount) and moves the same 2 MiB pages (``BenchShape``, bf16,
``page_first``) through ``ShmBackend`` v1 on both, rounds alternating; medians in GB/s.

    sudo .venv/bin/python benchmarks/shm_hugepages.py --pages 256 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hicache_storage import StorageConfig, page_hashes
from hicache_storage.backends import ShmBackend
from hicache_storage.benchkit import BenchShape, namespace_for, verify_pages

sys.path.insert(0, str(Path(__file__).parent))
from v1_pages import V1Pages


@contextlib.contextmanager
def huge_tmpfs(size_mib: int, mode: str) -> Iterator[str]:
    """A tmpfs mounted with ``huge=<mode>`` in a temporary directory (root only)."""
    where = tempfile.mkdtemp(prefix="hicache-huge-")
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,huge={mode},mode=0700",
             "tmpfs", where],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as exc:
        os.rmdir(where)
        raise SystemExit(
            f"cannot mount a tmpfs with huge pages here ({exc}); give --huge-root"
        ) from exc
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=False)
        os.rmdir(where)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--huge",
        default="always",
        choices=["always", "within_size", "advise"],
        help="the huge= option of the tmpfs this run mounts",
    )
    p.add_argument("--huge-root", help="a directory on a tmpfs mounted with huge pages")
    args = p.parse_args()

    shape = BenchShape(pages=args.pages, batch=args.pages)
    pages = V1Pages(shape)
    pool, src, dst, ps = pages.pool, pages.src, pages.dst, shape.page_size
    nbytes = shape.pages * pool.page_bytes
    size_mib = 2 * nbytes // (1 << 20) + 64

    with contextlib.ExitStack() as stack:
        huge = args.huge_root or stack.enter_context(huge_tmpfs(size_mib, args.huge))
        label = "--huge-root" if args.huge_root else f"tmpfs huge={args.huge}"
        roots = {
            "/dev/shm (default mount)": f"/dev/shm/hicache-hp-{secrets.token_hex(4)}",
            label: os.path.join(huge, "kv"),
        }
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in roots}
        try:
            for r in range(args.rounds):
                for name in list(roots)[:: 1 if r % 2 == 0 else -1]:
                    ns = namespace_for(shape, "hp-" + secrets.token_hex(4))
                    b = ShmBackend(StorageConfig(namespace=ns), root=roots[name])
                    b.register_mem_pool_host(pool)
                    keys = page_hashes(
                        torch.randint(0, 2**31 - 1, (shape.pages * ps,)).tolist(), ps
                    )
                    t0 = time.perf_counter()
                    ok = b.batch_set_v1(keys, src)
                    t_set = time.perf_counter() - t0
                    pool.kv_buffer[:, shape.pages * ps :].zero_()
                    t0 = time.perf_counter()
                    ok += b.batch_get_v1(keys, dst)
                    t_get = time.perf_counter() - t0
                    if not all(ok) or verify_pages(pool, src, dst) != 0:
                        raise SystemExit(f"{name}: a page failed or came back wrong")
                    b.clear()
                    b.close()
                    times[name].append((t_set, t_get))
        finally:
            shutil.rmtree(roots["/dev/shm (default mount)"], ignore_errors=True)

    print(f"{shape.pages} pages of {pool.page_bytes >> 20} MiB through ShmBackend v1, "
          f"median of {args.rounds} rounds (GB/s)")  # fmt: skip
    base = None
    for name, ts in times.items():
        s = nbytes / statistics.median(t for t, _ in ts) / 1e9
        g = nbytes / statistics.median(t for _, t in ts) / 1e9
        base = base or (s, g)
        print(f"  {name:26} set {s:5.2f}  get {g:5.2f}   x default: set {s / base[0]:.2f} "
              f"get {g / base[1]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
