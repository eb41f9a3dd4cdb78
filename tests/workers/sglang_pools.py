"""SGLang's own host pools (0.5.23), built on CPU for the adapter's tests.

``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` take their geometry from a device
pool's buffer description; on this CPU machine the "device" buffers are CPU tensors, and
the host pool is built unpinned (pinning calls cudaHostRegister). Everything else is
SGLang's code: the host ``kv_buffer`` in each layout, the allocator, ``get_data_page`` /
``set_from_flat_data_page`` (the controller's tensor path) and ``get_page_buffer_meta``
(its zero-copy path).

Import this only where SGLang's host-pool chain can load (``.venv-sglang``, with the
torchvision stand-in installed: tests/integrations/sglang/conftest.py does both).
"""

from __future__ import annotations

import queue
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

__all__ = [
    "MHA_LAYOUTS",
    "MLA_LAYOUTS",
    "fill_random",
    "mamba_pool",
    "mha_pool",
    "mla_pool",
    "page_bytes",
]

#: The layouts SGLang 0.5.23's host pools have (MLA has no page_head).
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
    start_layer: int = 0,
) -> Any:
    """SGLang's MHA host pool in ``layout``, with random contents."""
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    pool = MHATokenToKVPoolHost(
        info, host_to_device_ratio=ratio, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
        start_layer=start_layer, end_layer=start_layer + layers,
    )  # fmt: skip
    return fill_random(pool)


def mla_pool(
    layout: str,
    *,
    layers: int = 3,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
    page_size: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """SGLang's MLA host pool in ``layout``, with random contents."""
    width = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(device_tokens, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim, kv_cache_dim=width, dtype=dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(
        info, host_to_device_ratio=ratio, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
        start_layer=0, end_layer=layers, target_layer_num=layers,
    )  # fmt: skip
    return fill_random(pool)


def mamba_pool(*, slots: int = 16, layers: int = 2, ratio: float = 2.0) -> Any:
    """SGLang's Mamba state host pool (one page: one request's state slot), random.

    A temporal state of 2x3 float32 and a conv state of 5 bfloat16 per layer (68 bytes of
    state per slot over 2 layers), in ``page_first``: the layout Mamba pools require.
    """
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 2, 3),
        conv=(torch.zeros(layers, slots, 5, dtype=torch.bfloat16),),
    )
    pool = MambaPoolHost(info, ratio, 0, device_capacity=slots, pin_memory=False,
                         device="cpu", layout="page_first")  # fmt: skip
    return fill_random(pool)


def fill_random(pool: Any, seed: int = 0) -> Any:
    """Fill ``pool``'s whole KV buffer (each of its tensors) with random bytes; return it."""
    g = torch.Generator().manual_seed(seed)
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, (list, tuple)) else [pool.kv_buffer]
    for buffer in buffers:
        flat = buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    return pool


def page_bytes(pool: Any, first_index: int) -> bytes:
    """The bytes of the page starting at host index ``first_index``, by SGLang's tensor path."""
    page = pool.get_data_page(first_index, flat=True)
    return bytes(page.contiguous().view(torch.uint8).numpy().tobytes())


def controller(storage: Any, pool: Any, *, v1: bool = True) -> Any:
    """SGLang's HiCacheController with only the state its storage methods read."""
    from sglang.srt.managers.cache_controller import HiCacheController

    c = HiCacheController.__new__(HiCacheController)
    c.storage_backend = storage
    c.storage_host_pool = c.mem_pool_host = pool
    c.page_size = pool.page_size
    c.storage_config = storage.storage_config
    c.prefetch_sync_queue = queue.Queue()
    c.page_get_func = c._page_get_zero_copy if v1 else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if v1 else c._generic_page_set
    return c


def first_indices(indices: torch.Tensor, page_size: int) -> list[int]:
    return [int(i) for i in indices[::page_size]]


def transfer(c: Any, tokens: list[int], keys: list[str], dst: torch.Tensor) -> int:
    """SGLang's prefetch transfer of ``keys`` into host indices ``dst``: pages loaded."""
    from sglang.srt.managers.cache_controller import PrefetchOperation

    op = PrefetchOperation("req", tokens)
    op.hash_value, op.host_indices = keys, dst
    return int(c._page_transfer(op))


def prompt(pages: int, page_size: int, seed: int = 0) -> tuple[list[int], list[str]]:
    """Token ids of ``pages`` full pages and SGLang's own storage keys for them."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (pages * page_size,), generator=g).tolist()
    return tokens, list(get_storage_hash_str(tokens, None, page_size=page_size))
