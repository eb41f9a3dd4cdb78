"""The host-pool layouts the SDK knows, in one place.

A layout says how the host pool arranges its KV buffer, which decides how many segments
a page's :class:`~hicache_storage.buffers.PageBuffer` has and in what order a page's bytes
are stored (the shapes are tabled in :mod:`hicache_storage.host_pool`):

* ``layer_first``: one buffer per layer, tokens inside; a page is one segment per layer
  and K/V half;
* ``page_first``: tokens outermost, then layers; a page is one segment per K/V half;
* ``page_first_direct``: pages outermost, then layers, then the page's tokens; a page is
  one segment per K/V half, in a different byte order from ``page_first``.

A namespace whose ``object_layout`` is a layout name holds pages in that layout; pools of
another layout are refused at ``register_mem_pool_host`` (an ``opaque`` namespace takes
any).
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = ["LAYOUTS", "Layout"]

#: One of the layout names.
Layout: TypeAlias = Literal["layer_first", "page_first", "page_first_direct"]

#: Every layout name, in a stable order (the order of :data:`Layout`).
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
