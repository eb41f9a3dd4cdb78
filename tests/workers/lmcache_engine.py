"""A real LMCacheEngine on the CPU with the hicache plugin, for tests and the benchmark.

LMCache's ``MockGPUConnector`` stands in for the GPU side; :class:`SeededConnector`
fills each chunk it stores from a generator seeded by the chunk's start and content
seed, and keeps what it retrieves, so a test can check every chunk byte for byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

#: (layers, heads, head dim) and tokens per chunk of the tests' model.
LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 16, 16
_ids = itertools.count()


def seeded_values(shape: Any, dtype: torch.dtype, start: int, seed: int) -> torch.Tensor:
    """The content of the chunk that starts at token ``start`` (for ``seed``)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + start)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def chunk_values(shape: Any, dtype: torch.dtype, start: int, seed: int) -> torch.Tensor:
    """What :class:`SeededConnector` stores at ``start``: :data:`FILL`'s values."""
    return FILL(shape, dtype, start, seed)


#: The chunk contents the connector stores (a benchmark swaps in a cheaper one: seeded
#: random numbers for 8 MiB chunks cost more than the store being measured).
FILL = seeded_values


class SeededConnector(MockGPUConnector):  # type: ignore[misc]
    """Stores seeded content; keeps the chunks it is given back, by start token."""

    def __init__(self, kv_shape: tuple[int, ...], seed: int = 0) -> None:
        super().__init__(kv_shape)
        self.seed = seed
        self.retrieved: dict[int, torch.Tensor] = {}

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for mo, s in zip(memory_objs, starts, strict=True):
            t = mo.tensor
            t.copy_(chunk_values(t.shape, t.dtype, int(s), self.seed))

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for mo, s in zip(memory_objs, starts, strict=True):
            self.retrieved[int(s)] = mo.tensor.clone()

    def wrong_chunks(self) -> list[int]:
        """Starts of the retrieved chunks whose bytes are not the seeded ones."""
        bad = []
        for s, t in sorted(self.retrieved.items()):
            want = chunk_values(t.shape, t.dtype, s, self.seed)
            if not torch.equal(t.view(torch.uint8), want.view(torch.uint8)):
                bad.append(s)
        return bad


def plugin_config(backend_name: str, options: dict[str, Any], *, name: str = "hicache",
                  **extra: Any) -> dict[str, Any]:  # fmt: skip
    """The ``extra_config`` entries of the hicache plugin on ``backend_name``."""
    prefix = f"remote_storage_plugin.{name}."
    return {
        prefix + "module_path": "hicache_storage.integrations.lmcache",
        prefix + "class_name": "HiCacheConnectorAdapter",
        prefix + "backend_name": backend_name,
        prefix + "backend_options": options,
        **{prefix + k: v for k, v in extra.items()},
    }


@contextmanager
def engine(
    extra_config: dict[str, Any],
    *,
    plugins: list[str] | None = None,
    model: str = "acme/lmcache-test",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    timeout: float = 2.0,
    max_local_cpu_size: float = 0.05,
    destroy: bool = True,
    **config: Any,
) -> Iterator[tuple[Any, SeededConnector]]:
    """A started ``LMCacheEngine`` whose only remote store is the configured plugin(s).

    ``destroy=False`` leaves it running at the end (LMCache's own redis connector does not
    return from its close here, 0.5.6).
    """
    kv_shape = (LAYERS, 2, CHUNK, HEADS, HEAD_DIM)
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=max_local_cpu_size,
        blocking_timeout_secs=timeout,
        remote_storage_plugins=plugins if plugins is not None else ["hicache"],
        extra_config=extra_config, **config,
    )  # fmt: skip
    md = LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=dtype, kv_shape=kv_shape, chunk_size=CHUNK,
    )  # fmt: skip
    gpu = SeededConnector(kv_shape, seed)
    name = f"hicache-test-{next(_ids)}"
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, md, gpu, lambda t, r: None, lambda o, r: o)
    try:
        eng.post_init()
        yield eng, gpu
    finally:
        if destroy:
            LMCacheEngineBuilder.destroy(name)


def remote_connector(eng: Any, plugin: str = "hicache") -> Any:
    """The plugin's connector object inside ``eng`` (through LMCache's wrappers)."""
    backend = eng.storage_manager.storage_backends[f"RemoteBackend-{plugin}"]
    conn = backend.connection
    while hasattr(conn, "connector") or hasattr(conn, "_connector"):
        conn = getattr(conn, "connector", None) or conn._connector
    return conn


def all_tokens(n_chunks: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + n_chunks * CHUNK + 5)


def mask(tokens: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(tokens, dtype=torch.bool)
