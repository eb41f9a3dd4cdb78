"""Pages any TP size can read: a rank's page stored as head-group objects.

A TP rank of an MHA model holds ``H / tp_size`` of the model's ``H`` KV heads, so the page
it stores is a miss for a deployment of another TP size. :class:`HeadGroupStore` stores
each page instead as ``head_groups`` (``G``) objects of ``H / G`` heads each, over any
backend; a rank writes and reads the objects of the heads it holds, so every TP size whose
ranks hold whole groups (``tp_size`` divides ``G``; with more ranks than heads, one head
per group) shares the same objects.

* **Namespace.** The objects live in the rank namespace with ``head_groups=G`` and
  ``kv_heads_per_shard=H/G``: the same for every TP size that shares, and apart from the
  pages of another model, dtype, page size, layout or group count (other bytes).
* **Object.** Group ``g`` of page ``key`` is the object ``<key>.h<a>-<b>`` (its first and
  last head): the bytes of those heads in the page's own byte order (the layout's, with
  the rank's other heads left out), then a 16-byte write tag. ``page_head`` pages give
  each group's bytes as slices of the page (zero-copy: two segments and the tag);
  ``layer_first``, ``page_first`` and ``page_first_direct`` keep heads inside each row of
  a token and layer, so a group's bytes are gathered into one buffer to store and
  scattered back after a read (a copy per page, measured in ``benchmarks/head_groups.py``).
* **One write per rank's page.** A rank assembles a page only from groups with the same
  write tag; otherwise the page is a miss (counted as ``corrupt_objects``) and the rank
  removes its groups of it, so the next backup stores it whole. The tag is the writer
  instance's: every rank of one engine instance has the same one (``writer_id`` in the
  options; else agreed through ``torch.distributed``'s store when it is initialized,
  per ``writer_scope``; else one drawn at random, which ranks of one deployment in
  separate processes do not share). Groups from two instances (two writes whose bytes
  may differ: other TP sizes reduce in other orders) never make one rank's page. Not
  checked: across the ranks of one reader (each checks its own groups), and an
  instance's own two writes of a page after one of its group objects was lost alone.

Usage: ``head_groups`` (and ``writer_id``) in a backend's extra config make
:func:`~hicache_storage.registry.create_backend` build the backend this way; or
``HeadGroupStore(config, inner_factory, head_groups)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from hicache_storage.breaker import Health
from hicache_storage.buffers import PageBuffer, Segment, source_views, target_views
from hicache_storage.config import StorageConfig
from hicache_storage.errors import ConfigError, InvalidArgumentError, InvalidKeyError
from hicache_storage.keys import KEY_MAX_LEN, KVCacheNamespace, validate_key
from hicache_storage.protocol import HiCacheStorage

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from hicache_storage.protocol import HostPool

__all__ = [
    "TAG_BYTES",
    "HeadGroupStore",
    "HeadSplit",
    "agreed_writer_id",
    "grouped_namespace",
    "head_group_options",
    "rank_heads",
]

logger = logging.getLogger(__name__)

#: Bytes of the write tag at the end of every head-group object.
TAG_BYTES = 16
#: Staging memory per thread for the layouts that gather a group's bytes (a batch is
#: moved in runs of pages that fit it, one page at least).
STAGING_BYTES = 64 << 20
_STORE_KEY = "hicache-storage/writer-id"


def rank_heads(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The KV heads ``[first, end)`` TP rank ``tp_rank`` of ``tp_size`` holds.

    ``tp_size`` ranks split ``total`` heads evenly; with more ranks than heads, each head
    is held by ``tp_size / total`` neighbouring ranks (SGLang's and vLLM's rule).
    """
    if total <= 0:
        raise ConfigError("head groups need total_kv_heads in the namespace")
    if tp_size <= total:
        if total % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide the {total} KV heads")
        per = total // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total:
        raise ConfigError(f"the {total} KV heads do not divide tp_size={tp_size}")
    head = tp_rank * total // tp_size
    return head, head + 1


def agreed_writer_id(scope: str = "") -> str | None:
    """A writer id every process of this ``torch.distributed`` world shares, or None.

    The first process to ask puts a random id in the default store (compare-and-set);
    the others read it back. ``scope`` keeps apart the writers of one world that are
    separate instances (SGLang's data-parallel replicas: ``"dp1"``). None when
    ``torch.distributed`` is not initialized.
    """
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        key = f"{_STORE_KEY}/{scope}" if scope else _STORE_KEY
        got = store.compare_set(key, "", secrets.token_hex(16))
        text = bytes(got).decode("ascii")
    except Exception as exc:  # noqa: BLE001 - no agreement: the caller draws its own id
        logger.warning("head groups: no writer id from torch.distributed's store (%s)", exc)
        return None
    return text or None


@dataclass(frozen=True)
class HeadSplit:
    """Where a rank's heads lie in one of its pages.

    Attributes:
        heads: KV heads in the rank's page.
        head_bytes: bytes of one head in a row (``heads_outer`` False: every segment is
            rows of ``heads * head_bytes``, a token and layer each) or in a block
            (``heads_outer`` True, ``page_head``: the page is ``blocks`` blocks, K then V,
            each the heads one after the other).
        heads_outer: the heads are the outer axis of each block (zero-copy groups).
        blocks: blocks per page when ``heads_outer``.
    """

    heads: int
    head_bytes: int
    heads_outer: bool
    blocks: int = 2

    @classmethod
    def for_pool(cls, pool: Any) -> HeadSplit:
        """The split of an SDK or SGLang MHA host pool's pages (from its attributes).

        A pool that knows its own split says so in ``head_split`` (the vLLM
        connector's block pools).
        """
        declared = getattr(pool, "head_split", None)
        if isinstance(declared, HeadSplit):
            return declared
        layout = str(getattr(pool, "layout", "") or "")
        heads = getattr(pool, "kv_heads", None) or getattr(pool, "head_num", None)
        head_dim = getattr(pool, "head_dim", None)
        dtype = getattr(pool, "dtype", None)
        itemsize = getattr(pool, "itemsize", None) or getattr(dtype, "itemsize", None)
        missing = [
            name
            for name, value in (("kv_heads/head_num", heads), ("head_dim", head_dim),
                                ("dtype", itemsize))
            if not isinstance(value, int) or value <= 0
        ]  # fmt: skip
        if missing:
            raise ConfigError(
                f"head groups: the host pool ({type(pool).__name__}) does not say "
                f"{', '.join(missing)}; its pages cannot be split by head"
            )
        v_head_dim = getattr(pool, "v_head_dim", None)
        if v_head_dim is not None and v_head_dim != head_dim:
            raise ConfigError(
                f"head groups: K heads of {head_dim} and V heads of {v_head_dim} elements; "
                "pages split by head need one head size"
            )
        assert isinstance(heads, int)
        assert isinstance(head_dim, int)
        assert isinstance(itemsize, int)
        if layout == "page_head":
            layers = getattr(pool, "layer_num", None)
            ps = int(getattr(pool, "page_size", 0) or 0)
            if not isinstance(layers, int) or layers <= 0 or ps <= 0:
                raise ConfigError("head groups: a page_head pool must say layer_num and page_size")
            return cls(heads, ps * layers * head_dim * itemsize, heads_outer=True)
        if layout in ("layer_first", "page_first", "page_first_direct"):
            return cls(heads, head_dim * itemsize, heads_outer=False)
        raise ConfigError(f"head groups: unknown host layout {layout!r}")


def _sub(seg: Segment, offset: int, nbytes: int) -> Segment:
    return Segment(seg.ptr + offset, nbytes, seg.memoryview[offset : offset + nbytes])


def _array_segment(arr: np.ndarray[Any, Any]) -> Segment:
    view = memoryview(arr.data).cast("B")  # (the array's own buffer)
    return Segment(int(arr.ctypes.data), int(arr.nbytes), view)


def _bytes_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view``'s bytes, no copy.

    (torch's strided copy is several times faster than numpy's for these transposes.)
    """
    with warnings.catch_warnings():  # (a read-only view warns; it is only read)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _slices(page: PageBuffer, start: int, end: int) -> list[Segment]:
    """The segments of ``page`` that hold its bytes ``[start, end)`` (no copy)."""
    out: list[Segment] = []
    pos = 0
    for seg in page.segments:
        lo, hi = max(start, pos), min(end, pos + seg.nbytes)
        if lo < hi:
            out.append(_sub(seg, lo - pos, hi - lo))
        pos += seg.nbytes
        if pos >= end:
            break
    return out


class HeadGroupStore(HiCacheStorage):
    """A rank's KV pages as head-group objects in another backend (see the module doc).

    Args:
        config: the rank's config: its namespace (with ``total_kv_heads``), TP rank and
            size, pipeline stage.
        inner_factory: builds the backend that holds the objects, from the config of
            the group namespace (rank independent: ``tp_size`` 1).
        head_groups: objects per page over all heads (``G``); must divide the KV heads,
            and every TP size that shares must divide it (or exceed the heads, with
            ``G`` equal to the heads).
        writer_id: what names this writer instance's writes (the same on every rank of
            one instance); default: agreed through ``torch.distributed``, else random.
        writer_scope: which instance of the ``torch.distributed`` world this rank
            writes for, when one world holds several (``"dp<rank>"``).
    """

    #: Calls reach the store through ``inner``, which the metrics count (not twice).
    wraps_backend = True

    def __init__(
        self,
        config: StorageConfig,
        inner_factory: Callable[[StorageConfig], HiCacheStorage],
        head_groups: int,
        writer_id: str | None = None,
        writer_scope: str = "",
    ) -> None:
        ns = config.namespace
        if ns.rank_replicated:
            raise ConfigError("head groups: an MLA namespace has no heads to split (no need)")
        total = ns.total_kv_heads
        if not isinstance(head_groups, int) or isinstance(head_groups, bool) or head_groups <= 0:
            raise ConfigError(f"head_groups must be a positive int, got {head_groups!r}")
        if total <= 0:
            raise ConfigError("head groups need total_kv_heads in the namespace")
        if total % head_groups:
            raise ConfigError(f"head_groups={head_groups} does not divide the {total} KV heads")
        per = total // head_groups
        first, end = rank_heads(total, config.tp_rank, config.tp_size)
        if first % per or end % per:
            raise ConfigError(
                f"TP rank {config.tp_rank} of {config.tp_size} holds KV heads {first}-{end - 1}, "
                f"which are not whole groups of {per} (head_groups={head_groups}); choose "
                "head_groups a multiple of every TP size that shares pages"
            )
        inner_config = StorageConfig(
            namespace=grouped_namespace(ns, head_groups),
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            extra_config=config.extra_config,
        )
        super().__init__(config)
        self.inner = inner_factory(inner_config)
        self.capabilities = self.inner.capabilities
        self.name = f"head groups of {per} over {self.inner.name or type(self.inner).__name__}"
        self.head_groups = head_groups
        self.heads = (first, end)
        self.group_heads = per
        self._suffixes = [f".h{h}-{h + per - 1}" for h in range(first, end, per)]
        # One limit for every rank: the longest suffix any group has.
        self._max_key = KEY_MAX_LEN - len(f".h{total - per}-{total - 1}")
        #: What names this instance's writes; resolved when a pool is attached (only a
        #: writer attaches one), see :meth:`_resolve_writer`.
        self.writer_id = None if writer_id is None else str(writer_id)
        self.writer_scope = str(writer_scope)
        self.tag = b""
        self._split: HeadSplit | None = None
        self._local = threading.local()  # each thread's staging arena

    def _resolve_writer(self) -> None:
        if self.writer_id is None:
            self.writer_id = agreed_writer_id(self.writer_scope)
            if self.writer_id is None:
                self.writer_id = secrets.token_hex(16)
                if self.config.tp_size > 1:
                    logger.warning(
                        "head groups: no writer_id and no torch.distributed: rank %d draws "
                        "its own, so a smaller TP reads none of this instance's pages",
                        self.config.tp_rank,
                    )
        self.tag = hashlib.blake2b(self.writer_id.encode(), digest_size=TAG_BYTES).digest()

    # ------------------------------------------------------------------ geometry

    @override
    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        """Attach the rank's host pool; its head count must be this rank's."""
        split = HeadSplit.for_pool(mem_pool_host)
        want = self.heads[1] - self.heads[0]
        if split.heads != want:
            raise ConfigError(
                f"head groups: the host pool holds {split.heads} KV heads, but TP rank "
                f"{self.config.tp_rank} of {self.config.tp_size} holds {want}"
            )
        super().register_mem_pool_host(mem_pool_host)
        self._resolve_writer()
        self._split = split
        # The group backend gets the pool too: stores that register host memory (RDMA)
        # then move the page_head groups' slices without staging them.
        self.inner.register_mem_pool_host(mem_pool_host)

    def _groups_of(self, page: PageBuffer, split: HeadSplit) -> list[Segment] | None:
        """page_head: each group's slices, concatenated per group (None: wrong size)."""
        block = split.heads * split.head_bytes
        if page.nbytes != split.blocks * block:
            return None
        return [
            s
            for g in range(len(self._suffixes))
            for b in range(split.blocks)
            for s in _slices(
                page,
                b * block + g * self.group_heads * split.head_bytes,
                b * block + (g + 1) * self.group_heads * split.head_bytes,
            )
        ]

    def _arena(self, nbytes: int) -> np.ndarray[Any, Any]:
        """This thread's staging memory, at least ``nbytes``.

        (Kept from call to call: fresh memory costs a page fault per 4 KiB at each.)
        """
        arena: np.ndarray[Any, Any] | None = getattr(self._local, "arena", None)
        if arena is None or arena.nbytes < nbytes:
            arena = np.empty(-(-nbytes // (1 << 20)) << 20, dtype=np.uint8)
            self._local.arena = arena
        return arena

    def _chunks(self, pages: Sequence[PageBuffer]) -> list[tuple[int, int]]:
        """Runs of pages whose staging fits :data:`STAGING_BYTES` (one page at least)."""
        split = self._split
        if split is None or split.heads_outer:
            return [(0, len(pages))]
        out: list[tuple[int, int]] = []
        lo, size = 0, 0
        extra = TAG_BYTES * len(self._suffixes)
        for i, page in enumerate(pages):
            need = page.nbytes + extra
            if i > lo and size + need > STAGING_BYTES:
                out.append((lo, i))
                lo, size = i, 0
            size += need
        out.append((lo, len(pages)))
        return out

    def _pages(
        self, pages: Sequence[PageBuffer], tags: np.ndarray[Any, Any] | None
    ) -> tuple[list[PageBuffer | None], list[np.ndarray[Any, Any] | None]]:
        """Each page's group buffers (page-major), and the staging buffer of each page.

        ``tags`` None: a write (every object ends with this instance's tag); else a read
        (each object's tag lands in ``tags[page, group]``). A page of the wrong size gives
        ``None`` buffers (it fails). The row layouts stage in this thread's arena: the
        buffers are valid until this thread's next call.
        """
        split = self._split
        assert split is not None
        n_groups = len(self._suffixes)
        group_bytes = self.group_heads * split.head_bytes  # of one row or one block
        own_tag = None if tags is not None else _array_segment(np.frombuffer(self.tag, np.uint8))
        out: list[PageBuffer | None] = []
        staged: list[np.ndarray[Any, Any] | None] = []
        arena = None
        if not split.heads_outer:
            arena = self._arena(sum(p.nbytes for p in pages) + TAG_BYTES * n_groups * len(pages))
        used = 0
        for p, page in enumerate(pages):

            def tag_of(g: int, p: int = p) -> Segment:
                if tags is None:
                    assert own_tag is not None
                    return own_tag
                return _array_segment(tags[p, g])

            if split.heads_outer:
                parts = self._groups_of(page, split)
                if parts is None:
                    out.extend([None] * n_groups)
                    staged.append(None)
                    continue
                per = len(parts) // n_groups
                out.extend(
                    PageBuffer([*parts[g * per : (g + 1) * per], tag_of(g)])
                    for g in range(n_groups)
                )
                staged.append(None)
                continue
            row = split.heads * split.head_bytes
            if page.nbytes % row or any(s.nbytes % row for s in page.segments):
                out.extend([None] * n_groups)
                staged.append(None)
                continue
            rows = page.nbytes // row
            width = rows * group_bytes + TAG_BYTES
            assert arena is not None
            buf = arena[used : used + n_groups * width].reshape(n_groups, width)
            used += n_groups * width
            if tags is None:
                self._gather(page, buf, rows, row, group_bytes)
            out.extend(PageBuffer([_array_segment(buf[g])]) for g in range(n_groups))
            staged.append(buf)
        return out, staged

    def _gather(
        self, page: PageBuffer, buf: np.ndarray[Any, Any], rows: int, row: int, group_bytes: int
    ) -> None:
        n_groups = buf.shape[0]
        body = buf[:, : rows * group_bytes].reshape(n_groups, rows, group_bytes)
        r = 0
        for seg in page.segments:
            k = seg.nbytes // row
            src = _bytes_tensor(seg.memoryview).view(k, n_groups, group_bytes)
            torch.from_numpy(body[:, r : r + k, :]).copy_(src.permute(1, 0, 2))
            r += k
        buf[:, rows * group_bytes :] = np.frombuffer(self.tag, np.uint8)

    def _scatter(self, page: PageBuffer, buf: np.ndarray[Any, Any]) -> None:
        split = self._split
        assert split is not None
        n_groups = buf.shape[0]
        row = split.heads * split.head_bytes
        group_bytes = self.group_heads * split.head_bytes
        rows = page.nbytes // row
        body = buf[:, : rows * group_bytes].reshape(n_groups, rows, group_bytes)
        r = 0
        for seg in page.segments:
            k = seg.nbytes // row
            dst = _bytes_tensor(seg.memoryview).view(k, n_groups, group_bytes)
            dst.copy_(torch.from_numpy(body[:, r : r + k, :]).permute(1, 0, 2))
            r += k

    def _group_keys(self, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k) > self._max_key:
                raise InvalidKeyError(
                    f"key is {len(k)} characters long; with head groups the limit is "
                    f"{self._max_key}"
                )
            if k.endswith("."):
                raise InvalidKeyError(
                    f"invalid key {k!r}: with head groups a key must not end with '.'"
                )
        return [k + s for k in keys for s in self._suffixes]

    # ------------------------------------------------------------------ pages

    def _in_runs(
        self,
        keys: list[str],
        pages: Sequence[PageBuffer],
        run: Callable[[list[str], Sequence[PageBuffer]], list[bool]],
    ) -> list[bool]:
        """``run`` over the runs of pages that fit the staging memory (all fail unattached)."""
        if self._split is None:
            self._hicache_state().log(
                "hg:nopool", "%s: pages before register_mem_pool_host(); all fail", self.name
            )
            return [False] * len(keys)
        self._group_keys(keys)  # (bad keys raise before anything is moved)
        out: list[bool] = []
        for lo, hi in self._chunks(pages):
            out += run(keys[lo:hi], pages[lo:hi])
        return out

    def _move(
        self,
        op: Callable[[list[str], Sequence[PageBuffer]], list[bool]],
        keys: list[str],
        group_pages: list[PageBuffer | None],
    ) -> list[bool]:
        """Run ``op`` (the inner store's page call) on the groups that have a buffer.

        One answer per group of ``keys``' pages, page-major; False where there is none.
        """
        flat_keys = self._group_keys(keys)
        todo = [i for i, gp in enumerate(group_pages) if gp is not None]
        done = [False] * len(flat_keys)
        if todo:
            res = op([flat_keys[i] for i in todo], [group_pages[i] for i in todo])  # type: ignore[misc]
            for i, ok in zip(todo, res, strict=True):
                done[i] = bool(ok)
        return done

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._in_runs(keys, pages, self._set_run)

    def _set_run(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        n_groups = len(self._suffixes)
        done = self._move(self.inner.batch_set_pages, keys, self._pages(pages, None)[0])
        return [all(done[p * n_groups : (p + 1) * n_groups]) for p in range(len(keys))]

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._in_runs(keys, pages, self._get_run)

    def _get_run(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        n_groups = len(self._suffixes)
        tags = np.zeros((len(keys), n_groups, TAG_BYTES), dtype=np.uint8)
        group_pages, staged = self._pages(pages, tags)
        done = self._move(self.inner.batch_get_pages, keys, group_pages)
        out: list[bool] = []
        bad = [False] * len(keys)
        mixed = 0
        for p, page in enumerate(pages):
            ok = all(done[p * n_groups : (p + 1) * n_groups])
            buf = staged[p]
            if ok:
                page_tags = buf[:, -TAG_BYTES:] if buf is not None else tags[p]
                if n_groups > 1 and bool((page_tags != page_tags[0]).any()):
                    ok = False
                    bad[p] = True
                    mixed += 1
            if ok and buf is not None:
                self._scatter(page, buf)
            out.append(ok)
        if mixed:
            self._record(corrupt_objects=mixed)
            self._hicache_state().log(
                "hg:mixed",
                "%s: %d page(s) have head groups from different writers; read as misses "
                "and their groups removed, so the next backup stores them again",
                self.name,
                mixed,
            )
            self._drop([keys[p] for p, ok in enumerate(out) if not ok and bad[p]])
        return out

    def _drop(self, keys: list[str]) -> None:
        """Remove this rank's groups of ``keys`` (pages of two writers' groups).

        First writer wins never replaces an object, so such a page would stay a miss
        that ``exists`` calls a hit, and no backup could mend it; without its groups it
        is a plain miss, and the next backup stores it whole. Best effort: a store that
        cannot delete keeps them (still misses, never wrong).
        """
        if not self.inner.capabilities.delete:
            return
        for k in self._group_keys(keys):
            try:
                self.inner.delete(k)
            except Exception as exc:  # noqa: BLE001 - best effort, logged once
                self._log_failure("delete", exc)

    # ------------------------------------------------------------------ exists

    @override
    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        if not keys:
            return 0
        run = int(self.inner.batch_exists(self._group_keys(keys), extra_info))
        return min(len(keys), max(0, run) // len(self._suffixes))

    @override
    def batch_exists_each(self, keys: list[str]) -> list[bool]:
        each = self.inner.batch_exists_each(self._group_keys(keys))
        n = len(self._suffixes)
        return [all(each[p * n : (p + 1) * n]) for p in range(len(keys))]

    @override
    def exists(self, key: str) -> bool:
        return bool(self.batch_exists_each([key])[0])

    # ------------------------------------------------------------------ whole values

    def _page_bytes(self) -> int | None:
        pool = self.mem_pool_host
        split = self._split
        if pool is None or split is None:
            return None
        if split.heads_outer:
            return split.blocks * split.heads * split.head_bytes
        nbytes = getattr(pool, "page_bytes", None)
        if isinstance(nbytes, int):
            return nbytes
        ps = int(getattr(pool, "page_size", 0) or 0)
        layers = int(getattr(pool, "layer_num", 0) or 0)
        return 2 * ps * layers * split.heads * split.head_bytes

    def _scratch(self, nbytes: int) -> tuple[np.ndarray[Any, Any], PageBuffer]:
        arr = np.empty(nbytes, dtype=np.uint8)
        return arr, PageBuffer([_array_segment(arr)])

    @override
    def get(self, key: str, target: Any = None) -> Any:
        """Read a whole page (the rank's heads, in the pool's page byte order)."""
        validate_key(key)
        nbytes = self._page_bytes()
        if nbytes is None:
            self._hicache_state().log(
                "hg:nopool", "%s: get before register_mem_pool_host(); a miss", self.name
            )
            return None
        if isinstance(target, PageBuffer):
            return target if self.batch_get_pages([key], [target])[0] else None
        views = target_views(target) if target is not None else None
        if views is not None and sum(v.nbytes for v in views) != nbytes:
            self._record(size_mismatches=1)
            return None
        arr, page = self._scratch(nbytes)
        if not self.batch_get_pages([key], [page])[0]:
            return None
        if views is None:
            return arr.tobytes()
        pos = 0
        for v in views:
            v[:] = arr.data[pos : pos + v.nbytes]
            pos += v.nbytes
        return target

    @override
    def set(self, key: str, value: Any) -> bool:
        """Store a whole page (the rank's heads, in the pool's page byte order)."""
        validate_key(key)
        if isinstance(value, PageBuffer):
            return bool(self.batch_set_pages([key], [value])[0])
        views = source_views(value)
        nbytes = sum(v.nbytes for v in views)
        if self._page_bytes() not in (None, nbytes):
            raise InvalidArgumentError(
                f"a page of this rank is {self._page_bytes()} bytes, got {nbytes}"
            )
        arr, page = self._scratch(nbytes)
        pos = 0
        for v in views:
            arr[pos : pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            pos += v.nbytes
        return bool(self.batch_set_pages([key], [page])[0])

    @override
    def batch_get(self, keys: list[str], targets: Sequence[Any] | None = None) -> list[Any]:
        if targets is None:
            return [self.get(k) for k in keys]
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        return [self.set(k, v) for k, v in zip(keys, values, strict=True)]

    # ------------------------------------------------------------------ the rest

    @override
    def delete(self, key: str) -> bool:
        validate_key(key)
        gone = [self.inner.delete(k) for k in self._group_keys([key])]  # (every group)
        return any(gone)

    @override
    def clear(self) -> None:
        """Clear the group namespace: every TP size's pages of this namespace."""
        self.inner.clear()

    @override
    def usage(self) -> dict[str, int]:
        return self.inner.usage()

    @property
    @override
    def reports_removals(self) -> frozenset[str]:  # type: ignore[override]
        """What the inner backend reports."""
        return self.inner.reports_removals

    @override
    def watch_removals(self, listener: Callable[[list[str] | None], None]) -> bool:
        """The inner backend's removals, as the engine's keys.

        Any group's object gone takes its page (a page needs every group).
        """

        def outer(keys: list[str] | None) -> None:
            if keys is None:
                listener(None)
                return
            pages = {k.rsplit(".h", 1)[0] for k in keys if ".h" in k}
            if pages:
                listener(sorted(pages))

        return self.inner.watch_removals(outer)

    @override
    def health(self) -> Health:
        """The inner backend's health (closed: ``down``)."""
        if self._hicache_state().closed:
            return Health("down", "closed")
        return self.inner.health()

    @override
    def close(self) -> None:
        self.inner.close()


def head_group_options(options: Mapping[str, Any]) -> tuple[int | None, str | None, str]:
    """``head_groups``, ``writer_id`` and ``writer_scope`` of an extra config (checked)."""
    groups = options.get("head_groups")
    writer = options.get("writer_id")
    scope = options.get("writer_scope") or ""
    if not isinstance(scope, str):
        raise ConfigError(f"writer_scope must be a string, got {type(scope).__name__}")
    if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool)):
        raise ConfigError(f"head_groups must be an int, got {groups!r}")
    if writer is not None and not isinstance(writer, str):
        raise ConfigError(f"writer_id must be a string, got {type(writer).__name__}")
    return groups, writer, scope


def grouped_namespace(ns: KVCacheNamespace, head_groups: int) -> KVCacheNamespace:
    """The namespace head-group objects of ``ns``'s pages live in."""
    if not ns.total_kv_heads or ns.total_kv_heads % head_groups:
        raise ConfigError(f"head_groups={head_groups} does not divide total_kv_heads")
    return dataclasses.replace(
        ns, kv_heads_per_shard=ns.total_kv_heads // head_groups, head_groups=head_groups
    )
