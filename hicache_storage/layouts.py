"""The host-pool layouts the SDK knows, in one place.

A layout says how the host pool arranges its KV buffer, which decides how many segments
a page's :class:`~hicache_storage.buffers.PageBuffer` has and in what order a page's bytes
are stored (the shapes are tabled in :mod:`hicache_storage.host_pool`):

* ``layer_first``: one buffer per layer, tokens inside; a page is one segment per layer
  and K/V half;
* ``page_first``: tokens outermost, then layers; a page is one segment per K/V half;
* ``page_first_direct``: pages outermost, then layers, then the page's tokens; a page is
  one segment per K/V half, in a different byte order from ``page_first``;
* ``page_head``: pages outermost, then KV heads, then the page's tokens, then layers
  (SGLang's layout for splitting heads between ranks of different TP sizes); a page is
  one segment per K/V half, in a third byte order. MHA only: an MLA page has no heads.

A namespace whose ``object_layout`` is a layout name holds pages in that layout; pools of
another layout are refused at ``register_mem_pool_host`` (an ``opaque`` namespace takes
any).
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = ["LAYOUTS", "MLA_LAYOUTS", "POOL_KINDS", "POOL_KIND_IDS", "Layout"]

#: One of the layout names.
Layout: TypeAlias = Literal["layer_first", "page_first", "page_first_direct", "page_head"]

#: Every layout name, in a stable order (the order of :data:`Layout`).
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

#: The layouts an MLA pool can have (``page_head`` splits heads, which MLA does not have).
MLA_LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first", "page_first_direct")

#: Every valid ``(layout, mla)`` pair, MHA first: what a test of every pool kind covers.
POOL_KINDS: tuple[tuple[Layout, bool], ...] = tuple(
    (layout, mla) for mla in (False, True) for layout in (MLA_LAYOUTS if mla else LAYOUTS)
)


#: A test id for each :data:`POOL_KINDS` pair, in the same order: ``"page_first-mha"``.
POOL_KIND_IDS: tuple[str, ...] = tuple(
    f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in POOL_KINDS
)
