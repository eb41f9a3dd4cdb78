"""The host (L2) KV pool: pages of KV in CPU memory, addressed by host token index.

Buffer shapes follow the reference engine, so page buffers and pointer metadata are
interchangeable with its ``HostKVCache``:

=====================  ==================================================  =====================
layout                 MHA ``kv_buffer`` shape                              MLA ``kv_buffer`` shape
=====================  ==================================================  =====================
``layer_first``        ``(2, layer_num, size, kv_heads, head_dim)``         ``(layer_num, size, 1, head_dim)``
``page_first``         ``(2, size, layer_num, kv_heads, head_dim)``         ``(size, layer_num, 1, head_dim)``
``page_first_direct``  ``(2, num_pages, layer_num, page_size, kv_heads,     ``(num_pages, layer_num, page_size,
                       head_dim)``                                          1, head_dim)``
``page_head``          ``(2, num_pages, kv_heads, page_size, layer_num,     (none: MHA only)
                       head_dim)``
=====================  ==================================================  =====================

``size = num_pages * page_size`` tokens. Page ``p`` covers host indices
``[p * page_size, (p + 1) * page_size)``.

Segments per page (what :meth:`HostKVPool.get_page_buffer_meta` returns): MHA
``page_first``/``page_first_direct``/``page_head``: 2 (K, V); MHA ``layer_first``: ``2 * layer_num``
(K of each layer, then V of each layer); MLA ``page_first``/``page_first_direct``: 1;
MLA ``layer_first``: ``layer_num``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from hicache_storage.buffers import PageBuffer, Segment, memoryview_at
from hicache_storage.errors import ConfigError, HostIndicesError, InvalidTypeError
from hicache_storage.layouts import LAYOUTS, MLA_LAYOUTS

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["LAYOUTS", "HostKVPool"]

logger = logging.getLogger(__name__)


class HostKVPool:
    """KV pages in CPU memory (pinned when CUDA is available), with a page allocator.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page.
        layer_num: layers held by this pool.
        kv_heads: KV heads per token on this rank (ignored for MLA, which has 1).
        head_dim: head dimension (for MLA, the compressed KV dimension).
        dtype: element type of the KV cache.
        layout: one of :data:`LAYOUTS` (for MLA, of :data:`MLA_LAYOUTS`).
        mla: True for MLA (one latent vector per token and layer, no K/V split).
        pin_memory: pin the buffer; default: only when CUDA is available.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_num: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
        mla: bool = False,
        pin_memory: bool | None = None,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("layer_num", layer_num),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
        if mla and layout not in MLA_LAYOUTS:
            raise ConfigError(f"an MLA pool has no {layout!r} layout; choose one of {MLA_LAYOUTS}")
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layer_num = layer_num
        self.kv_heads = 1 if mla else kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        self.mla = mla
        self.size = num_pages * page_size
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.kv_buffer = torch.zeros(self._shape(), dtype=dtype, pin_memory=pin_memory)
        self._base_ptr = int(self.kv_buffer.data_ptr())
        self._base_view = memoryview_at(self._base_ptr, int(self.kv_buffer.nbytes), self.kv_buffer)
        self._offsets, self._seg_bytes = self._segment_plan()
        self.page_bytes = len(self._offsets) * self._seg_bytes
        # Allocator: free pages, pages freed since the last merge, and an allocated mark.
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._pending_free: list[int] = []
        self._allocated = bytearray(num_pages)

    # ------------------------------------------------------------------ geometry

    def _shape(self) -> tuple[int, ...]:
        L, S, P, ps, H, D = (
            self.layer_num,
            self.size,
            self.num_pages,
            self.page_size,
            self.kv_heads,
            self.head_dim,
        )
        if self.mla:
            return {
                "layer_first": (L, S, 1, D),
                "page_first": (S, L, 1, D),
                "page_first_direct": (P, L, ps, 1, D),
            }[self.layout]
        return {
            "layer_first": (2, L, S, H, D),
            "page_first": (2, S, L, H, D),
            "page_first_direct": (2, P, L, ps, H, D),
            "page_head": (2, P, H, ps, L, D),
        }[self.layout]

    def _segment_plan(self) -> tuple[list[int], int]:
        """Return the byte offset of each segment of page 0, and the segment length.

        Every segment has the same length, which is also the stride from one page's
        segment to the next page's: page ``p``'s segment ``i`` starts at
        ``offsets[i] + p * length``.
        """
        L, S, ps = self.layer_num, self.size, self.page_size
        token_bytes = self.kv_heads * self.head_dim * self.itemsize  # one token, one layer
        halves = 1 if self.mla else 2
        half_bytes = S * L * token_bytes  # one of K/V over the whole pool
        if self.layout == "layer_first":
            seg = ps * token_bytes
            plan = [
                kv * half_bytes + layer * S * token_bytes
                for kv in range(halves)
                for layer in range(L)
            ]
            return plan, seg
        # The page-major layouts: a page's tokens are contiguous per half.
        seg = ps * L * token_bytes
        return [kv * half_bytes for kv in range(halves)], seg

    @property
    def segments_per_page(self) -> int:
        """Number of contiguous segments of one page."""
        return len(self._offsets)

    # ------------------------------------------------------------------ allocator

    def available_size(self) -> int:
        """Free capacity in tokens."""
        with self._lock:
            return (len(self._free) + len(self._pending_free)) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` (a multiple of page_size) and return their host indices.

        Returns ``None`` when the pool has no room. Raises when ``num_tokens`` is not a
        positive multiple of page_size, or when the allocator finds a page that is already
        allocated (a double allocation, i.e. a corrupted free list).
        """
        if not isinstance(num_tokens, int) or num_tokens <= 0 or num_tokens % self.page_size:
            raise HostIndicesError(
                f"alloc needs a positive multiple of page_size={self.page_size}, got {num_tokens}"
            )
        need = num_tokens // self.page_size
        with self._lock:
            if len(self._free) < need and self._pending_free:
                # Deferred merge: freed pages rejoin the free list only when needed.
                self._free.extend(sorted(self._pending_free, reverse=True))
                self._pending_free.clear()
            if len(self._free) < need:
                return None
            pages = [self._free.pop() for _ in range(need)]
            for p in pages:
                if self._allocated[p]:
                    raise HostIndicesError(f"double allocation of host page {p}")
                self._allocated[p] = 1
        page_t = torch.tensor(pages, dtype=torch.int64)
        return (page_t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, indices: torch.Tensor | Sequence[int]) -> int:
        """Free the pages of ``indices``; return the number of tokens freed.

        Raises :class:`HostIndicesError` on a page that is not allocated (double free) or on
        misaligned indices; nothing is freed then.
        """
        pages = self._pages_of(indices)
        with self._lock:
            for p in pages:
                if not self._allocated[p]:
                    raise HostIndicesError(f"double free of host page {p}")
            if len(set(pages)) != len(pages):
                raise HostIndicesError("free() got the same page twice")
            for p in pages:
                self._allocated[p] = 0
            self._pending_free.extend(pages)
        return len(pages) * self.page_size

    # ------------------------------------------------------------------ page access

    def _pages_of(
        self, indices: torch.Tensor | Sequence[int], expected_pages: int | None = None
    ) -> list[int]:
        """Validate host indices and return the page numbers they cover, in order."""
        if isinstance(indices, torch.Tensor):
            if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise InvalidTypeError(f"host indices must be integers, got {indices.dtype}")
            idx = indices.detach().to("cpu", torch.int64).reshape(-1)
        else:
            try:
                idx = torch.as_tensor(list(indices), dtype=torch.int64).reshape(-1)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidTypeError(
                    "host indices must be a tensor or a sequence of ints"
                ) from exc
        n = idx.numel()
        ps = self.page_size
        if n % ps:
            raise HostIndicesError(f"{n} host indices is not a multiple of page_size={ps}")
        if expected_pages is not None and n != expected_pages * ps:
            raise HostIndicesError(
                f"got {n} host indices for {expected_pages} keys; expected "
                f"len(keys) * page_size = {expected_pages * ps}"
            )
        if n == 0:
            return []
        if int(idx.min()) < 0 or int(idx.max()) >= self.size:
            raise HostIndicesError(f"host indices out of range [0, {self.size})")
        rows = idx.view(-1, ps)
        starts = rows[:, 0]
        if bool((starts % ps).any()) or not bool(
            (rows == starts[:, None] + torch.arange(ps)).all()
        ):
            raise HostIndicesError(
                "host indices are not page aligned: each page must be page_size consecutive "
                "indices starting at a multiple of page_size"
            )
        return (starts // ps).tolist()

    def page_buffers(
        self, indices: torch.Tensor | Sequence[int], expected_pages: int | None = None
    ) -> list[PageBuffer]:
        """Return one :class:`PageBuffer` per page of ``indices`` (views, no copy)."""
        out: list[PageBuffer] = []
        base = self._base_view
        seg = self._seg_bytes
        for p in self._pages_of(indices, expected_pages):
            segs = []
            for off0 in self._offsets:
                off = off0 + p * seg
                segs.append(Segment(self._base_ptr + off, seg, base[off : off + seg]))
            out.append(PageBuffer(segs))
        return out

    def get_page_buffer_meta(
        self, indices: torch.Tensor | Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Return ``(ptrs, sizes)``: every segment of every page, pages in order."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for page in self.page_buffers(indices):
            for s in page.segments:
                ptrs.append(s.ptr)
                sizes.append(s.nbytes)
        return ptrs, sizes

    def describe(self) -> dict[str, Any]:
        """Facts about the pool, for logs and reports."""
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "layer_num": self.layer_num,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "layout": self.layout,
            "mla": self.mla,
            "page_bytes": self.page_bytes,
            "segments_per_page": self.segments_per_page,
        }

    @override
    def __repr__(self) -> str:
        d = self.describe()
        return "HostKVPool(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"
