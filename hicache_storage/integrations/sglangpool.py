"""SGLang's host pools as the SDK reads them (no SGLang import).

:class:`PoolView` gives the SDK's page protocol a checked view of an SGLang host pool
(whole pages only, every segment inside the pool's KV buffer, one byte order for
``layer_first`` pages); :func:`pool_is_mla` and :func:`buffer_ranges` read what a pool
says of itself. Used by :mod:`hicache_storage.integrations.sglang`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache_storage.errors import ConfigError, HostIndicesError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["PoolView", "buffer_ranges", "pool_is_mla"]


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

    Raises :class:`ConfigError` for a pool whose KV buffer is not one CPU tensor (SGLang's
    K-only and split-buffer pools): its pages could not be bounds-checked.
    """

    def __init__(self, pool: Any, mla: bool, dtype: str) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.dtype = dtype  # the logical KV dtype (the pool's may be uint8 for fp8)
        self.layout = str(pool.layout)
        self.mla = mla
        buffer: Any = getattr(pool, "kv_buffer", None)
        if not (hasattr(buffer, "data_ptr") and hasattr(buffer, "nbytes") and buffer.nbytes):
            raise ConfigError(
                f"{type(pool).__name__} keeps its KV in no single kv_buffer tensor; the "
                "adapter moves pages of pools that do (SGLang's MHA and MLA host pools)"
            )
        self.kv_buffer = buffer
        self._lo = int(buffer.data_ptr())
        self._hi = self._lo + int(buffer.nbytes)
        self._v_start = self._lo + int(buffer.nbytes) // 2  # MHA: K half, then V half

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
        if bool((sizes <= 0).any() | (ptrs < self._lo).any() | (ptrs + sizes > self._hi).any()):
            raise HostIndicesError("host indices reach outside the host pool's KV buffer")
        if self.layout == "layer_first" and not self.mla:
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
