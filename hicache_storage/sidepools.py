"""A hybrid model's side pools in any backend (what SGLang's v2 pool transfers move).

A hybrid model keeps more than KV pages in SGLang's host memory: Mamba states, the
sliding-window (SWA) pool, DeepSeek's indexer, a draft model's KV. SGLang registers each
pool with ``register_mem_host_pool_v2`` and moves their pages with ``batch_exists_v2`` /
``batch_get_v2`` / ``batch_set_v2``, one :class:`PoolTransfer` per pool. The KV pool's
pages go through v1 as always; every other pool gets a backend of its own, built through
the registry like the KV one, over a namespace that adds the pool's name and page geometry
to the KV namespace (:func:`side_namespace`): a page of one pool can never be read as
another pool's, nor as another geometry's.

What ``batch_exists_v2`` answers follows SGLang 0.5.23's own backends
(``HiCacheFile``), so SGLang's controller reads it the same way:

* the KV pool's leading run ``kv`` bounds everything;
* an ``ALL_PAGES`` pool (the indexer, a draft's KV) cuts the usable prefix at its first
  missing page;
* a ``TRAILING_PAGES`` pool (Mamba, SWA) makes a prefix of ``p`` pages usable only when
  the window of pages ending at ``p`` is stored (``len(transfer.keys)`` pages: a Mamba
  state is usable only where one was stored);
* a ``BLOCK_GROUPS`` pool reports the pages its leading complete groups cover and never
  cuts the hit;
* ``restorable_prefix_pages`` lists every usable prefix length, which SGLang intersects
  across ranks; ``kv_hit_pages`` is the longest.

A pool that cannot be moved is refused when it is registered, with the reason
(registering raises: SGLang fails the attach, nothing is half-moved); a transfer for a
pool that has no backend (never registered, or its backend did not attach in time) is
answered as misses.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache_storage.errors import ConfigError
from hicache_storage.keys import KVCacheNamespace, normalize_dtype
from hicache_storage.poolview import PoolView, pool_is_mla
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.config import StorageConfig

__all__ = ["SidePool", "exists_fold", "pool_name", "side_namespace"]

logger = logging.getLogger(__name__)

#: Extra-config keys of the KV pool's pages only (head groups: hicache_storage.headgroups).
_KV_ONLY = frozenset({"head_groups", "writer_id", "writer_scope"})

#: Pools whose pages hold each TP rank's own state, even in an MLA model.
PER_RANK_POOLS = frozenset({"mamba"})


def pool_name(name: Any) -> str:
    """SGLang's ``PoolName`` (a str enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


def _page_geometry(view: PoolView) -> list[int]:
    """The byte sizes of the segments of one page of ``view``'s pool."""
    import torch

    try:
        _, sizes = view.get_page_buffer_meta(torch.arange(view.page_size))
    except NotImplementedError as exc:
        raise ConfigError(
            f"{type(view.pool).__name__} gives no page addresses ({exc}); its pages "
            "cannot be moved without a copy, which the adapter does not make"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the pool's own error, reported as refused
        raise ConfigError(
            f"{type(view.pool).__name__}: the pages' addresses cannot be read ({exc})"
        ) from None
    return [int(s) for s in sizes]


def side_namespace(
    kv: KVCacheNamespace, name: str, pool: Any, identity: str = ""
) -> tuple[KVCacheNamespace, Any]:
    """The namespace of side pool ``name``'s pages, and the view the backend moves them by.

    The KV namespace (model, weights, logical KV dtype, tenant, layers...) plus, in the
    ``pool`` field, the pool's name, layout, own dtype and page geometry (the bytes of
    each segment of a page) and ``identity`` (what else tells two such pools apart: a
    draft model's checkpoint); the page size is the pool's own. Rank sharing: Mamba
    states are per rank whatever the model; a pool that says what it holds (MLA pages:
    shared by every rank; MHA heads: per rank) is filed so; any other pool (an indexer,
    DeepSeek's compressed pools) follows the KV pool, as SGLang's own backends file it
    (in an MLA model only rank 0 writes those pools, and every rank reads them).
    """
    layout = str(getattr(pool, "layout", "") or "opaque")
    try:
        own_dtype = normalize_dtype(getattr(pool, "dtype", None) or "uint8")
    except ConfigError:
        own_dtype = "uint8"
    says = pool_is_mla(pool)
    replicated = name not in PER_RANK_POOLS and (says if says is not None else kv.rank_replicated)
    view = PoolView(pool, replicated, kv.dtype, layout=layout)
    geometry = "+".join(str(s) for s in _page_geometry(view))
    tag = f"{name}/{layout}/{own_dtype}/{geometry}" + (f"/{identity}" if identity else "")
    fields: dict[str, Any] = {
        "pool": tag,
        "page_size": view.page_size,
        "object_layout": layout,
        "rank_replicated": replicated,
    }
    if replicated or kv.rank_replicated:
        fields.update(total_kv_heads=0, kv_heads_per_shard=0)
    return dataclasses.replace(kv, **fields), view


@dataclass
class SidePool:
    """One side pool: SGLang's host pool and the backend its pages live in."""

    name: str
    pool: Any
    page_size: int
    backend: HiCacheStorage

    @classmethod
    def build(
        cls,
        name: str,
        pool: Any,
        kv: KVCacheNamespace,
        config: StorageConfig,
        backend_name: str,
        identity: str = "",
    ) -> SidePool:
        """The backend for ``pool``'s pages (raises what stops it: the attach fails)."""
        namespace, view = side_namespace(kv, name, pool, identity)
        # (Side pools are stored per rank or replicated, never split by head group.)
        extra = {k: v for k, v in config.extra_config.items() if k not in _KV_ONLY}
        backend = create_backend(
            backend_name, dataclasses.replace(config, namespace=namespace, extra_config=extra)
        )
        try:
            backend.register_mem_pool_host(view)
        except BaseException:
            backend.close()
            raise
        return cls(name, pool, view.page_size, backend)

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's page is stored in this pool (one answer per key)."""
        return [bool(x) for x in self.backend.batch_exists_each(list(keys))]


def _trailing(present: Sequence[bool], window: int) -> set[int]:
    """The prefix lengths ``p`` whose last ``window`` pages (fewer at the start) are all present."""
    out: set[int] = set()
    run = 0
    for i, here in enumerate(present):
        run = run + 1 if here else 0
        if run >= min(window, i + 1):
            out.add(i + 1)
    return out


def _block_groups(present: Sequence[bool], transfer: Any) -> int:
    """The pages that the leading complete groups of ``present`` cover."""
    group = max(1, int(getattr(transfer, "group_pages", 0) or 1))
    covered = 0
    while covered + group <= len(present) and all(present[covered : covered + group]):
        covered += group
    return covered


def exists_fold(
    kv_pages: int, transfers: Sequence[Any], sides: dict[str, SidePool], keys: Sequence[str]
) -> tuple[int, dict[str, int], list[int]]:
    """``(kv_hit_pages, verdict per pool, restorable prefix lengths)`` (see the module docs).

    ``kv_pages`` is the KV pool's leading run of ``keys``. A pool without a backend (not
    registered, or refused) holds nothing.
    """
    restorable = list(range(1, kv_pages + 1))
    verdicts: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    head = list(keys[:kv_pages])
    for t in transfers:
        name = pool_name(t.name)
        if name == "kv":
            continue
        side = sides.get(name)
        policy = pool_name(getattr(t, "hit_policy", "all_pages"))
        if policy == "trailing_pages":
            present = side.present(head) if side is not None and head else []
            usable = _trailing(present, max(1, len(t.keys or ())))
            verdict = max(usable, default=0)
        elif policy == "block_groups":
            present = side.present(head) if side is not None and head else []
            verdict = _block_groups(present, t)
            if verdict:
                verdicts[name] = verdict
            continue  # (reported, never cuts the hit)
        else:
            verdict = int(side.backend.batch_exists(head)) if side is not None and head else 0
            usable = set(range(1, verdict + 1))
        restorable = [p for p in restorable if p in usable]
        if verdict:
            verdicts[name] = verdict
        if not restorable:
            break
    return (restorable[-1] if restorable else 0), verdicts, restorable
