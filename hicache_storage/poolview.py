"""SGLang's host pools as the SDK reads them (no SGLang import).

:class:`PoolView` gives the SDK's page protocol a checked view of an SGLang host pool
(whole pages only, every segment inside the pool's KV buffer, one byte order for
``layer_first`` pages); :func:`pool_is_mla` and :func:`buffer_ranges` read what a pool
says of itself. Used by :mod:`hicache_storage.integrations.sglang` and
:mod:`hicache_storage.sidepools`;
no engine import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache_storage.errors import ConfigError, HostIndicesError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["PoolView", "buffer_ranges", "pool_fact", "pool_is_mla"]


def pool_fact(pool: Any, name: str) -> Any:
    """``pool.<name>``; a pool without it is a :class:`ConfigError` that names it.

    Engines and their tests hand over stand-ins of their host pools: one that lacks an
    attribute the SDK reads must fail the attach with a message, not an AttributeError.
    """
    try:
        value = getattr(pool, name)
    except AttributeError:
        value = None
    if value is None:
        raise ConfigError(
            f"the host pool ({type(pool).__name__}) has no {name!r}: a host pool must give "
            "its dtype, page_size and layout (and its memory: kv_buffer)"
        )
    return value


def pool_is_mla(pool: Any) -> bool | None:
    """Whether SGLang host pool ``pool`` holds MLA pages, from the pool itself.

    MLA pools keep one latent vector per token (``kv_lora_rank``), MHA pools K and V
    heads (``head_num``); an SDK pool says so itself (``mla``). None: the pool does not
    tell.
    """
    own = getattr(pool, "mla", getattr(pool, "is_mla", None))
    if isinstance(own, bool):
        return own
    if getattr(pool, "kv_lora_rank", None) is not None:
        return True
    if getattr(pool, "head_num", None) is not None:
        return False
    return None


class PoolView:
    """SGLang's host pool as the SDK's protocol reads it.

    It exposes the facts the backend checks against its namespace (``page_size``,
    ``dtype``, ``layout``, ``mla``) and SGLang's own ``get_page_buffer_meta``, checked
    and put in the SDK's segment order, so v1 pages are resolved by the pool that owns
    them and never reach outside it.

    The pool's memory is its ``kv_buffer`` (one tensor, or a list of them), else what
    ``get_hybrid_pool_buffer()`` names (a hybrid model's side pools: Mamba states,
    DeepSeek's indexer...); every segment must lie inside one of those buffers. Raises
    :class:`ConfigError` for a pool that names no memory of its own: its pages could not
    be bounds-checked. ``layout`` overrides the pool's own name for it.
    """

    def __init__(self, pool: Any, mla: bool, dtype: str, layout: str | None = None) -> None:
        self.pool = pool
        self.page_size = int(pool_fact(pool, "page_size") or 1)
        self.dtype = dtype  # the logical KV dtype (the pool's may be uint8 for fp8)
        self.layout = layout if layout is not None else str(pool_fact(pool, "layout"))
        self.mla = mla
        # What head groups read of an MHA pool's geometry (hicache_storage.headgroups).
        self.head_num = getattr(pool, "head_num", None)
        self.head_dim = getattr(pool, "head_dim", None)
        self.v_head_dim = getattr(pool, "v_head_dim", None)
        self.layer_num = getattr(pool, "layer_num", None)
        self.itemsize = getattr(getattr(pool, "dtype", None), "itemsize", None)
        buffer: Any = getattr(pool, "kv_buffer", None)
        ranges = buffer_ranges(buffer)
        if not ranges and callable(getattr(pool, "get_hybrid_pool_buffer", None)):
            try:
                ranges = buffer_ranges(pool.get_hybrid_pool_buffer())
            except Exception:  # noqa: BLE001 - no buffers to name: refused below
                ranges = []
        ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
        if not ranges:
            raise ConfigError(
                f"{type(pool).__name__} names no host memory of its own (no kv_buffer "
                "tensor, no hybrid pool buffers); the adapter moves pages only of "
                "pools whose pages it can bounds-check"
            )
        self.kv_buffer = buffer
        self._ranges = ranges
        lo, hi = ranges[0]
        # MHA layer_first in one tensor: the K half, then the V half (see below)
        self._v_start = lo + (hi - lo) // 2 if len(ranges) == 1 else None

    def get_page_buffer_meta(self, indices: Any) -> tuple[Sequence[int], Sequence[int]]:
        """The pointer and size of every segment of every page of ``indices``.

        SGLang's own answer, after two checks SGLang does not make: ``indices`` must be
        whole pages (page-aligned runs of ``page_size``), and every segment must lie
        inside the pool's KV buffer; otherwise :class:`HostIndicesError` (the call
        fails, nothing is read or written). And one change of order: SGLang lists an MHA
        ``layer_first`` page's segments layer by layer (K0, V0, K1, V1...), while the
        SDK's ``layer_first`` page, and SGLang's own tensor path (``get_data_page``), hold
        every layer's K, then every layer's V. Each page's K segments (those in the first
        half of the KV buffer) are put first, in their order, so a ``layer_first`` page
        has one byte order whichever path or engine stored it.
        """
        import torch

        idx = torch.as_tensor(indices).reshape(-1).to(device="cpu", dtype=torch.int64)
        ps = self.page_size
        if idx.numel() == 0 or idx.numel() % ps:
            raise HostIndicesError(f"{idx.numel()} host indices are not whole pages of {ps}")
        rows = idx.view(-1, ps)
        if bool(((rows[:, 0] % ps) != 0).any()) or bool(
            (rows != rows[:, :1] + torch.arange(ps)).any()
        ):
            raise HostIndicesError("host indices are not page-aligned runs of page_size")
        raw_ptrs, raw_sizes = self.pool.get_page_buffer_meta(idx)
        ptrs = torch.as_tensor(list(raw_ptrs), dtype=torch.int64)
        sizes = torch.as_tensor(list(raw_sizes), dtype=torch.int64)
        if ptrs.numel() != sizes.numel() or ptrs.numel() == 0:
            raise HostIndicesError("the pool gave no segments, or sizes that do not match")
        inside = torch.zeros_like(ptrs, dtype=torch.bool)
        for lo, hi in self._ranges:
            inside |= (ptrs >= lo) & (ptrs + sizes <= hi)
        if bool((sizes <= 0).any()) or not bool(inside.all()):
            raise HostIndicesError("host indices reach outside the host pool's KV buffer")
        if self.layout == "layer_first" and not self.mla and self._v_start is not None:
            pages = rows.shape[0]
            if ptrs.numel() % pages:
                raise HostIndicesError("the pool gave a segment count that is not per page")
            grid = ptrs.view(pages, -1)
            order = torch.argsort((grid >= self._v_start).to(torch.int8), dim=1, stable=True)
            ptrs = torch.gather(grid, 1, order).reshape(-1)
            sizes = torch.gather(sizes.view(pages, -1), 1, order).reshape(-1)
        return ptrs.tolist(), sizes.tolist()


def buffer_ranges(buffer: Any) -> list[tuple[int, int]]:
    """``[(start, end)]`` address ranges of a pool's KV buffer (a tensor or several)."""
    if isinstance(buffer, (list, tuple)):
        return [r for b in buffer for r in buffer_ranges(b)]
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "nbytes"):
        start = int(buffer.data_ptr())
        return [(start, start + int(buffer.nbytes))]
    return []
