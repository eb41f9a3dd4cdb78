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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_storage.errors import InvalidTypeError

__all__ = [
    "PageBuffer",
    "Segment",
    "is_tensor",
    "memoryview_at",
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
        return target.views
    if is_tensor(target):
        return [_tensor_view(target)]
    return [_buffer_view(target, writable=True)]


def total_nbytes(views: Sequence[memoryview]) -> int:
    """Sum of the views' lengths in bytes."""
    return sum(v.nbytes for v in views)
