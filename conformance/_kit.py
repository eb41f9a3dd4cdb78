"""Shared pieces of the conformance suite: specs, namespaces, data, host pools, subprocesses.

Black-box: only the public API of ``hicache_storage`` is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hicache_storage import (
    HiCacheStorage,
    HostKVPool,
    KVCacheNamespace,
    PageBuffer,
    StorageConfig,
    create_backend,
    page_hashes,
)

__all__ = [
    "RUN_ID",
    "BackendSpec",
    "content",
    "fill_page",
    "make_namespace",
    "make_pool",
    "run_worker",
    "unique_keys",
]

#: One random id per process: every namespace the kit creates carries it in its tenant,
#: so a run never touches data of another run, even on a shared production cluster.
RUN_ID = secrets.token_hex(6)

POOL_SHAPE = {"layer_num": 3, "kv_heads": 2, "head_dim": 16, "page_size": 4}


@dataclass(frozen=True)
class BackendSpec:
    """How to build the backend under test, in this process or another one.

    Attributes:
        name: registry name, ``NAME@DISTRIBUTION`` or ``module:Class``.
        options: backend options (JSON-serializable, so worker processes can use them).
        config_extra: extra :class:`StorageConfig` fields (tp_rank...), rarely needed.
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    config_extra: dict[str, Any] = field(default_factory=dict)

    def create(self, config: StorageConfig) -> HiCacheStorage:
        """Build the backend for ``config``."""
        return create_backend(self.name, config, **self.options)


def make_namespace(tenant_suffix: str = "", **overrides: Any) -> KVCacheNamespace:
    """A namespace of this run (random tenant), matching :func:`make_pool`'s pools."""
    fields: dict[str, Any] = {
        "model_id": "hicache-conformance",
        "dtype": "bfloat16",
        "page_size": POOL_SHAPE["page_size"],
        "object_layout": "page_first",
        "tenant": f"conformance-{RUN_ID}{tenant_suffix}",
    }
    fields.update(overrides)
    return KVCacheNamespace(**fields)


def make_pool(layout: str = "page_first", mla: bool = False, num_pages: int = 16) -> HostKVPool:
    """A small host pool of the kit's page shape, filled with random bytes."""
    import torch

    pool = HostKVPool(
        num_pages=num_pages,
        page_size=POOL_SHAPE["page_size"],
        layer_num=POOL_SHAPE["layer_num"],
        kv_heads=POOL_SHAPE["kv_heads"],
        head_dim=POOL_SHAPE["head_dim"],
        dtype=torch.bfloat16,
        layout=layout,
        mla=mla,
    )
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    return pool


def pool_namespace(pool: HostKVPool, **overrides: Any) -> KVCacheNamespace:
    """The run's namespace for ``pool``'s layout and MLA-ness."""
    return make_namespace(object_layout=pool.layout, rank_replicated=pool.mla, **overrides)


def unique_keys(n: int, salt: str = "") -> list[str]:
    """``n`` chained page hashes no other test uses."""
    start = int.from_bytes(
        hashlib.sha256((salt or secrets.token_hex(8)).encode()).digest()[:4], "little"
    )
    return page_hashes([start + i for i in range(n * 2)], 2)[:n]


def content(key: str, nbytes: int) -> bytes:
    """``nbytes`` of data that only ``key`` produces (so any reader can verify any page)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def fill_page(page: PageBuffer, key: str) -> bytes:
    """Write ``key``'s content into ``page``; return it."""
    data = content(key, page.nbytes)
    off = 0
    for seg in page.segments:
        seg.memoryview[:] = data[off : off + seg.nbytes]
        off += seg.nbytes
    return data


def run_worker(
    spec: BackendSpec, namespace: KVCacheNamespace, task: dict[str, Any]
) -> subprocess.Popen[str]:
    """Start ``python -m hicache_storage.conformance._worker`` on ``task``."""
    payload = json.dumps(
        {"name": spec.name, "options": spec.options, "namespace": namespace.to_dict(), "task": task}
    )
    return subprocess.Popen(
        [sys.executable, "-m", "hicache_storage.conformance._worker", payload],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def iter_pages(pool: HostKVPool, count: int, first_page: int = 0) -> Iterator[PageBuffer]:
    """Page buffers of ``count`` consecutive pages from ``first_page``."""
    ps = pool.page_size
    yield from pool.page_buffers(range(first_page * ps, (first_page + count) * ps))


Factory = Callable[[StorageConfig], HiCacheStorage]
