"""Zero-copy views of host memory.

A :class:`PageBuffer` is one KV page of host memory as one or more contiguous
:class:`Segment`s (K and V halves, or one segment per layer). Each segment exposes its
address, its length and a writable :class:`memoryview` over the same bytes, so a backend
can hand the memory straight to ``os.writev``/``os.preadv``, a socket, or an RDMA client.

This module does not import torch at import time. Tensors are handled through their
``data_ptr()``/``nbytes`` and ``is_contiguous()``, duck-typed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from typing_extensions import override

from hicache_storage.errors import HostIndicesError, InvalidTypeError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

#: What ``get`` may fill: a CPU tensor, a writable bytes-like object or a page buffer.
ReadTarget: TypeAlias = "torch.Tensor | PageBuffer | bytearray | memoryview"
#: What ``set`` may store: a CPU tensor, a page buffer or any bytes-like object.
WriteValue: TypeAlias = "torch.Tensor | PageBuffer | bytes | bytearray | memoryview"
#: Host-pool token indices of a v1 call: a 1-D integer tensor or a sequence of ints,
#: ``page_size`` indices per page.
HostIndices: TypeAlias = "torch.Tensor | Sequence[int]"

__all__ = [
    "HostIndices",
    "PageBuffer",
    "ReadTarget",
    "Segment",
    "WriteValue",
    "copy_into",
    "is_tensor",
    "memoryview_at",
    "new_target",
    "pages_from_meta",
    "source_views",
    "target_views",
    "total_nbytes",
]


def memoryview_at(ptr: int, nbytes: int, owner: object) -> memoryview:
    """Return a writable byte memoryview over ``nbytes`` at address ``ptr``.

    ``owner`` (the tensor or buffer that owns the memory) is kept alive as long as the
    memoryview is.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    arr = (ctypes.c_char * nbytes).from_address(ptr)
    arr._hicache_owner = owner  # type: ignore[attr-defined]
    return memoryview(arr).cast("B")


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous range of host memory."""

    ptr: int
    nbytes: int
    memoryview: memoryview


class PageBuffer:
    """One page of host memory as contiguous segments (no copy).

    Attributes:
        segments: the page's segments, in the order they are stored.
        nbytes: total bytes of the page.
    """

    __slots__ = ("nbytes", "segments")

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.nbytes: int = sum(s.nbytes for s in self.segments)

    @property
    def views(self) -> list[memoryview]:
        """The segments' memoryviews."""
        return [s.memoryview for s in self.segments]

    def tobytes(self) -> bytes:
        """Copy the page's bytes (for tests and debugging; not for the hot path)."""
        return b"".join(s.memoryview for s in self.segments)

    @override
    def __repr__(self) -> str:
        return f"PageBuffer(segments={len(self.segments)}, nbytes={self.nbytes})"


def is_tensor(obj: object) -> bool:
    """True if ``obj`` looks like a torch tensor (without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_view(t: Any) -> memoryview:
    if t.device.type != "cpu":
        raise InvalidTypeError(f"tensor must live in CPU memory, not {t.device}")
    if not t.is_contiguous():
        raise InvalidTypeError("tensor must be contiguous (call .contiguous() first)")
    return memoryview_at(int(t.data_ptr()), int(t.nbytes), t)


def _buffer_view(obj: Any, *, writable: bool) -> memoryview:
    try:
        mv = memoryview(obj)
    except TypeError as exc:
        raise InvalidTypeError(
            f"expected a tensor, a PageBuffer or a bytes-like object, got {type(obj).__name__}"
        ) from exc
    if writable and mv.readonly:
        raise InvalidTypeError(f"target {type(obj).__name__} is read-only")
    if not mv.c_contiguous:
        raise InvalidTypeError("buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def source_views(value: object) -> list[memoryview]:
    """Return the bytes of a value to store, as memoryviews (no copy where possible).

    Accepts a :class:`PageBuffer`, a CPU torch tensor (a non-contiguous one is copied to
    a contiguous one first) or any bytes-like object.
    """
    if isinstance(value, PageBuffer):
        return value.views
    if is_tensor(value):
        t: Any = value
        if t.device.type != "cpu":
            raise InvalidTypeError(f"tensor must live in CPU memory, not {t.device}")
        if not t.is_contiguous():
            t = t.contiguous()
        return [memoryview_at(int(t.data_ptr()), int(t.nbytes), t)]
    if value is None:
        raise InvalidTypeError("value must not be None")
    return [_buffer_view(value, writable=False)]


def target_views(target: object) -> list[memoryview]:
    """Return writable memoryviews over a read target (PageBuffer, tensor or buffer)."""
    if isinstance(target, PageBuffer):
        views = target.views
        if any(v.readonly for v in views):
            raise InvalidTypeError("target PageBuffer has a read-only segment")
        return views
    if is_tensor(target):
        return [_tensor_view(target)]
    return [_buffer_view(target, writable=True)]


def total_nbytes(views: Sequence[memoryview]) -> int:
    """Sum of the views' lengths in bytes."""
    return sum(v.nbytes for v in views)


def copy_into(views: Sequence[memoryview], data: Sequence[memoryview] | bytes | memoryview) -> bool:
    """Scatter ``data`` across the writable ``views`` in order; False if sizes differ.

    ``data`` is one buffer or several (the segments of a stored value); nothing is written
    when the total sizes differ, so a target is never partly filled.
    """
    parts = [memoryview(data)] if isinstance(data, (bytes, bytearray, memoryview)) else data
    parts = [p if p.format == "B" and p.ndim == 1 else p.cast("B") for p in parts]
    if total_nbytes(parts) != total_nbytes(views):
        return False
    if len(parts) == 1 and len(views) == 1:
        views[0][:] = parts[0]
        return True
    src = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
    off = 0
    for v in views:
        n = v.nbytes
        v[:] = src[off : off + n]
        off += n
    return True


def new_target(nbytes: int) -> tuple[Any, list[memoryview]]:
    """A new 1-D uint8 CPU tensor of ``nbytes`` and a writable view of it, for ``get(key)``."""
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, [memoryview_at(int(t.data_ptr()), nbytes, t)]


def pages_from_meta(pool: Any, host_indices: Any, n: int) -> list[PageBuffer]:
    """Page buffers from a reference-engine pool's ``get_page_buffer_meta(indices)``.

    The pool returns one pointer and one size per segment, pages in order; ``n`` pages of
    ``page_size`` indices each are expected, else :class:`HostIndicesError`.
    """
    page_size = int(pool.page_size)
    count = len(host_indices)
    if count != n * page_size:
        raise HostIndicesError(f"got {count} host indices for {n} keys; expected {n * page_size}")
    if n == 0:
        return []
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if len(ptrs) % n or len(ptrs) != len(sizes):
        raise HostIndicesError(f"pool returned {len(ptrs)} segments for {n} pages")
    per = len(ptrs) // n
    owner = getattr(pool, "kv_buffer", pool)
    return [
        PageBuffer(
            [
                Segment(int(p), int(s), memoryview_at(int(p), int(s), owner))
                for p, s in zip(
                    ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True
                )
            ]
        )
        for i in range(n)
    ]
