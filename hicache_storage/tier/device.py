"""The device (L1) KV pool and the copies between it and the host pool, layer by layer.

The device pool holds, per layer, the K and V of ``num_pages`` pages (MLA: one latent
tensor per layer), on CUDA when it is there and on the CPU otherwise, with the host
pool's geometry (page size, heads, head dim, dtype). Copies run per layer and count
finished layers (:class:`LayerProgress`), so layer ``l`` can be used as soon as it
arrived while the next layers still copy (on CUDA: non-blocking copies from pinned host
memory, one event per layer).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.host_pool import HostKVPool

__all__ = ["DevicePool", "LayerProgress", "host_page_layer"]


def host_page_layer(host: HostKVPool, page: int, layer: int) -> list[torch.Tensor]:
    """Views of host page ``page``'s KV in ``layer``, no copy.

    ``[K, V]`` (MLA: ``[latent]``), each shaped ``(page_size, heads, head_dim)``.
    """
    buf, ps = host.kv_buffer, host.page_size
    rows = slice(page * ps, (page + 1) * ps)
    halves = [buf] if host.mla else [buf[0], buf[1]]
    out = []
    for half in halves:
        if host.layout == "layer_first":
            out.append(half[layer, rows])
        elif host.layout == "page_first":
            out.append(half[rows, layer])
        elif host.layout == "page_first_direct":
            out.append(half[page, layer])
        else:  # page_head: (pages, heads, page_size, layers, dim)
            out.append(half[page, :, :, layer].transpose(0, 1))
    return out


class LayerProgress:
    """How many layers of a load have arrived; :meth:`wait` for one of them."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._done = 0
        self._events: list[Any] = []
        self._cond = threading.Condition()

    def _arrived(self, event: Any = None) -> None:
        with self._cond:
            self._events.append(event)
            self._done += 1
            self._cond.notify_all()

    @property
    def done(self) -> int:
        """Layers whose copy was issued and (on CPU) finished."""
        return self._done

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` has arrived; False on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done > layer, timeout):
                return False
            event = self._events[layer]
        if event is not None:
            event.synchronize()
        return True


class DevicePool:
    """KV pages on the device, per layer, with the host pool's geometry and a page allocator.

    Args:
        host: the host pool whose geometry the pages take.
        num_pages: device pages.
        device: ``"cuda"`` when available, else ``"cpu"`` (the default picks).
    """

    def __init__(self, host: HostKVPool, num_pages: int, device: str | None = None) -> None:
        if num_pages <= 0:
            raise ConfigError(f"num_pages must be positive, got {num_pages}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.host = host
        self.num_pages, self.page_size = num_pages, host.page_size
        self.layer_num, self.mla = host.layer_num, host.mla
        shape = (num_pages, host.page_size, host.kv_heads, host.head_dim)
        halves = 1 if host.mla else 2
        self.layers = [
            [torch.zeros(shape, dtype=host.dtype, device=self.device) for _ in range(halves)]
            for _ in range(host.layer_num)
        ]
        self._lock = threading.Lock()
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        """Pages not allocated."""
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages, or None when fewer are free."""
        with self._lock:
            if len(self._free) < n:
                return None
            return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back."""
        with self._lock:
            self._free.extend(pages)

    def page_layer(self, page: int, layer: int) -> list[torch.Tensor]:
        """Views of device page ``page``'s KV in ``layer`` (as :func:`host_page_layer`)."""
        return [half[page] for half in self.layers[layer]]

    def load(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> LayerProgress:
        """Copy host pages into device pages, layer by layer (L2 -> L1)."""
        progress = LayerProgress(self.layer_num)
        cuda = self.device.type == "cuda"
        for layer in range(self.layer_num):
            for d, h in zip(device_pages, host_pages, strict=True):
                for dst, src in zip(
                    self.page_layer(d, layer), host_page_layer(self.host, h, layer), strict=True
                ):
                    dst.copy_(src, non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            progress._arrived(event)
        return progress

    def store(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device pages into host pages (L1 -> L2), all layers; returns when done."""
        for layer in range(self.layer_num):
            for d, h in zip(device_pages, host_pages, strict=True):
                for dst, src in zip(
                    host_page_layer(self.host, h, layer), self.page_layer(d, layer), strict=True
                ):
                    dst.copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
