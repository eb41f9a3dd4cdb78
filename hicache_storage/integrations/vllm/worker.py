"""The worker side of the vLLM connector: each step's loads and stores, in a worker process.

vLLM's KV tensors become the backend's page pool
(:mod:`hicache_storage.integrations.kvblocks`); before the forward pass the step's blocks
are read into them (:meth:`WorkerSide.start_load_kv`, through a lane with the
connector's deadline), after it the step's new full blocks are stored
(:meth:`WorkerSide.wait_for_save`). A block whose load failed is reported to vLLM, and
nothing computed over it is stored (the taint rule: :meth:`WorkerSide._clean_blocks`).

**Stores off the critical path** (``async_saves``, the default): a step's stores are
queued on a background thread and the step goes on. vLLM's blocks stay what the store
reads until it has read them: a finished request's blocks are freed only once its stores
are done (:meth:`WorkerSide.get_finished`; or ``engine_timeout`` after it finished, when
what is left is cut), and a block vLLM hands to a request afresh (after a preemption)
cuts every store still to read it before the forward pass writes it
(:meth:`WorkerSide.before_step`). A staged store reads vLLM's KV only inside its job's
gate, so a cut store never reads it again; a direct one (no staging, ``engine_timeout``
0) is waited for instead.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.errors import ConfigError, HostIndicesError
from hicache_storage.headgroups import HeadSplit, rank_heads
from hicache_storage.integrations.deadline import Background, Job, Lane
from hicache_storage.integrations.kvblocks import KVBlockMover, StagedKVBlocks, kv_blocks
from hicache_storage.integrations.vllm.events import medium_of, removed_event, stored_event
from hicache_storage.integrations.vllm.metadata import NULL_BLOCK, held_blocks
from hicache_storage.integrations.vllm.side import ConnectorSide, Settings, logger
from hicache_storage.keys import normalize_dtype
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    import torch

    from hicache_storage.integrations.vllm.metadata import (
        HiCacheConnectorMetadata,
        LoadSpec,
        SaveSpec,
    )
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["GroupMovers", "WorkerSide"]

#: Finished request ids remembered, to report a delayed free only once vLLM told of it.
_RECENT_FINISHED = 4096
#: The staging lane of background loads (0: loads before the forward pass, 1: stores).
BACKGROUND_LANE = 2
#: Events kept at most between two steps (past it, the oldest are dropped).
MAX_EVENTS = 65536
#: Stores queued at most (one per step): past it the store is behind (hung or slower
#: than vLLM), and a step's stores are dropped (counted as ``save_timeouts``).
MAX_QUEUED_STORES = 256


@dataclass(frozen=True)
class GroupMovers:
    """One block mover per KV cache group: a block place moves in every group at once.

    Each group's blocks are objects of the group's own namespace (its backend). A key's
    result is True when every group's block of that place moved whole, False when one
    did not, None when no group holds the place (null blocks only: nothing moved).
    """

    movers: tuple[KVBlockMover, ...]

    def save(
        self, keys: list[str], groups: list[list[int]], job: Job[Any] | None = None, lane: int = 1
    ) -> list[bool | None]:
        """Store each group's blocks of ``groups`` (one list per group) under ``keys``."""
        return self._move(True, keys, groups, job, lane)

    def load(
        self, keys: list[str], groups: list[list[int]], job: Job[Any] | None = None, lane: int = 0
    ) -> list[bool | None]:
        """Read ``keys`` into each group's blocks of ``groups``."""
        return self._move(False, keys, groups, job, lane)

    def _move(
        self, save: bool, keys: list[str], groups: list[list[int]], job: Job[Any] | None, lane: int
    ) -> list[bool | None]:
        if len(groups) != len(self.movers) or any(len(ids) != len(keys) for ids in groups):
            raise HostIndicesError(
                f"{len(keys)} keys for blocks {[len(ids) for ids in groups]} of "
                f"{len(self.movers)} groups"
            )
        out: list[bool | None] = [None] * len(keys)
        for mover, ids in zip(self.movers, groups, strict=True):
            places = [p for p, b in enumerate(ids) if b != NULL_BLOCK]
            if not places:
                continue
            move = mover.save if save else mover.load
            got = move([keys[p] for p in places], [ids[p] for p in places], job, lane)
            for p, ok in zip(places, got, strict=True):
                out[p] = bool(ok) and out[p] is not False
        return out

    def moved_bytes(self, groups: list[list[int]], results: list[bool | None]) -> int:
        """The bytes of the held blocks of the places that moved."""
        return sum(
            mover.pool.page_bytes * len(_at([ids], results, True))
            for mover, ids in zip(self.movers, groups, strict=False)
        )


def _at(groups: list[list[int]], results: list[bool | None], ok: bool) -> set[int]:
    """The held blocks of the places whose result is ``ok`` (None counts as moved).

    A place with no result (a spec whose keys and blocks disagree) failed.
    """
    return {
        b
        for ids in groups
        for i, b in enumerate(ids)
        if b != NULL_BLOCK and ((results[i] if i < len(results) else False) is not False) == ok
    }


@dataclass(eq=False)
class _Load:
    """A background load: the request waiting for it, and the blocks it writes."""

    req_id: str
    block_ids: list[list[int]]  # one list per KV cache group
    job: Job[Any] | None = None
    queued: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the loader thread took it (its deadline counts)
    reported: bool = False  # told to vLLM (done, or cut at its deadline)


@dataclass(eq=False)
class _Store:
    """A store queued or running in the background: what it reads, for whom."""

    req_ids: set[str]
    blocks: set[int]
    job: Job[Any] | None = None
    keys: int = 0
    started: float = field(default_factory=time.perf_counter)


class WorkerSide(ConnectorSide):
    """Loads and stores of one TP rank (see the module docs)."""

    def __init__(self, settings: Settings, group_layers: list[list[str]], num_blocks: int) -> None:
        super().__init__(settings)
        #: Each KV cache group's layers (one group unless vLLM's hybrid allocator).
        self._group_layers = [list(names) for names in group_layers]
        self._num_blocks = int(num_blocks)
        self.tp_size = settings.tp_size
        self.backends: list[HiCacheStorage] = []
        self.movers: GroupMovers | None = None
        self.pools: list[Any] = []
        self.rank = 0
        self._writer = True
        self._load_errors: set[int] = set()
        #: Blocks whose KV is not what their tokens make: a load into them failed, or they
        #: were computed over such a block. Nothing computed over them is stored.
        self.tainted: set[int] = set()
        self._load_lane = Lane("hicache-vllm-load")
        self._save_lane = Lane("hicache-vllm-save")
        self._saver = Background("hicache-vllm-store")
        #: Stores not finished yet (this thread adds, the background thread removes).
        self._stores: list[_Store] = []
        #: Finished requests whose blocks vLLM keeps for us: request id -> deadline.
        self._awaiting: dict[str, list[Any]] = {}  # request id -> [deadline, seen]
        self._finished_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._loader = Background("hicache-vllm-loader")
        #: Background loads not reported yet, and the requests whose load is reported
        #: next (``_recv_failed``: as failed as a whole, so vLLM recomputes them).
        self._bg_loads: list[_Load] = []
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        #: Stored and removed blocks not handed to vLLM yet (its KV events on), in order;
        #: and the keys of blocks stored with an event -> vLLM's hash (for removals).
        self._events: list[Any] = []
        self._hashes: collections.OrderedDict[str, Any] = collections.OrderedDict()
        #: Keys (with an event) being stored now, and those of them a backend removed
        #: meanwhile (evicted by the same batch, say): those are not published as stored.
        self._storing: collections.Counter[str] = collections.Counter()
        self._gone_while_storing: set[str] = set()
        self._events_lock = threading.Lock()  # (never held while calling a backend)

    # ------------------------------------------------------------------ ConnectorSide

    @property
    def backend(self) -> HiCacheStorage | None:
        """The first group's backend (None until attached)."""
        return self.backends[0] if self.backends else None

    @property
    def mover(self) -> KVBlockMover | None:
        """The first group's block mover (None until attached)."""
        return self.movers.movers[0] if self.movers is not None else None

    @property
    def pool(self) -> Any:
        """The first group's page pool (None until vLLM registers its KV)."""
        return self.pools[0] if self.pools else None

    @override
    def ready(self) -> bool:
        """True once attached (see :meth:`ConnectorSide.ready`)."""
        return self.movers is not None

    @override
    def _build(self) -> None:
        self._attach()

    @override
    def _take_backends(self) -> list[HiCacheStorage]:
        backends, self.backends, self.movers = self.backends, [], None
        return backends

    @override
    def _live_backends(self) -> list[HiCacheStorage]:
        return list(self.backends)

    @override
    def _lanes(self) -> list[Lane]:
        return [self._load_lane, self._save_lane]

    @override
    def shutdown(self) -> None:
        """Finish the queued stores (within ``engine_timeout``; cut what is left), then close.

        vLLM's KV is still there while it shuts down, so what was sent to be stored is
        stored, as with stores within the step; see :class:`ConnectorSide` for the rest.
        """
        timeout = self.settings.options.engine_timeout
        self.flush(timeout if timeout > 0 else None)
        with self._lock:
            stores = list(self._stores)
        for st in stores:
            if st.job is not None:
                st.job.cancel()
        with self._lock:
            loads = list(self._bg_loads)
        for ld in loads:
            if ld.job is not None:
                ld.job.cancel()
        self._saver.close()
        self._loader.close()
        super().shutdown()

    # ------------------------------------------------------------------ attaching

    def _attach(self) -> None:
        """Build the worker's backend for each group and register its KV pool with it."""
        backends: list[HiCacheStorage] = []
        movers: list[KVBlockMover] = []
        try:
            for group, pool in enumerate(self.pools):
                config = self.settings.storage_config(self.rank, group)
                backends.append(create_backend(self.settings.backend_name, config))
                movers.append(KVBlockMover.attach(backends[-1], pool))
        except BaseException:
            for b in backends:
                b.close()
            raise
        if self._closed.is_set():
            for b in backends:
                b.close()
            return
        if self.settings.events:
            for b in backends:
                b.watch_removals(self._on_removed)
        old, self.backends, self.movers = self.backends, backends, GroupMovers(tuple(movers))
        self._writer = config.is_storage_writer
        for b in old:
            b.close()
        logger.info(
            "HiCacheKVConnector: %s backend, namespaces %s, %s pages of %s bytes",
            self.settings.backend_name,
            ", ".join(ns.digest for ns in self.settings.namespaces or (self.settings.namespace,)),
            type(self.pool).__name__,
            "/".join(str(p.page_bytes) for p in self.pools),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the backend and attach vLLM's KV tensors as its page pool.

        Raises :class:`ConfigError` (vLLM fails to start) when the tensors are not what
        the KV cache config says, so a deployment never runs with a connector that would
        store or load wrong bytes.
        """
        names = [n for group in self._group_layers for n in group]
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing}")
        for n in names:
            t = kv_caches[n]
            if int(t.shape[0]) != self._num_blocks:
                raise ConfigError(
                    f"layer {n}'s KV has {int(t.shape[0])} blocks, the KV cache config "
                    f"{self._num_blocks} (kernel blocks smaller than vLLM's blocks are not "
                    "supported)"
                )
            if normalize_dtype(t.dtype) != self.settings.namespace.dtype:
                raise ConfigError(
                    f"layer {n}'s KV is {t.dtype}, the namespace's {self.settings.namespace.dtype}"
                )
        opts = self.settings.options
        # With a deadline, loads and stores move through staging (a call cut at its
        # deadline never touches vLLM's KV again). A staged pool has a lane each for
        # loads before the forward pass, stores and background loads: none waits for
        # another's I/O.
        direct_ok = all(
            kv_caches[n].device.type == "cpu" and kv_caches[n][0].is_contiguous() for n in names
        )
        staged = (
            opts.staging if opts.staging is not None else (opts.engine_timeout > 0 or not direct_ok)
        )
        # One pool per group, over the group's layers (the groups of a hybrid model share
        # vLLM's KV tensors, each block id belonging to one group at a time).
        self.pools = [
            kv_blocks(
                [kv_caches[n] for n in group],
                self.block_size,
                staging_rows=opts.staging_blocks,
                staged=staged,
                lanes=BACKGROUND_LANE + 1 if staged else 1,
            )
            for group in self._group_layers
        ]
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
            self.rank = 0
        if (
            self.settings.extra_config.get("head_groups")
            and not self.settings.namespace.rank_replicated
        ):
            for pool, group in zip(self.pools, self._group_layers, strict=True):
                pool.head_split = self._head_split([kv_caches[n] for n in group])
        self.connect_or_retry()

    def _head_split(self, layers: list[torch.Tensor]) -> HeadSplit:
        """Where this rank's heads lie in a page (a block of every layer).

        vLLM's CPU KV is ``[blocks, heads, block_size, 2 * head_size]`` per layer: in a
        layer's block each head's bytes are one run, so a head group's bytes are one
        slice per layer (no copy). Other block layouts are refused.
        """
        ns = self.settings.namespace
        first, end = rank_heads(ns.total_kv_heads, self.rank, self.tp_size)
        heads = end - first
        block = layers[0][0]
        if block.dim() < 2 or int(block.shape[0]) != heads or not block.is_contiguous():
            raise ConfigError(
                f"head groups need vLLM's KV blocks with the heads outermost "
                f"([heads, block_size, ...], vLLM's CPU layout); this rank's blocks are "
                f"{tuple(block.shape)} for {heads} KV heads"
            )
        head_bytes = int(block.numel()) * block.element_size() // heads
        return HeadSplit(heads, head_bytes, heads_outer=True, blocks=len(layers))

    def start_load_kv(self, meta: HiCacheConnectorMetadata) -> None:
        """Read this step's blocks into vLLM's paged KV before the forward pass.

        Never raises: a block that did not land whole is reported as a load error, and
        is not stored from, nor is anything computed over it (see :meth:`wait_for_save`).
        """
        self._fresh(meta)
        background = [s for s in meta.loads if s.background]
        if background:
            self._load_in_background(background)
        specs = [s for s in meta.loads if not s.background]
        if not specs:
            return
        # A store still queued may read these blocks (freed by a preempted request, and
        # not "fresh": vLLM counts a loaded block as computed): cut it first.
        self._guard_stores(
            {b for s in specs for b in held_blocks(s.block_ids)},
            isinstance(self.pool, StagedKVBlocks),
        )
        failed, loaded = self._load(specs)
        if self.tp_size > 1:
            # A rank's failed block poisons every rank's later KV (the layers mix the
            # heads): each rank learns every rank's failures before anything is stored.
            failed = self._all_ranks_failed(failed, loaded | failed)
        with self._lock:
            self._load_errors.update(failed)
            self.tainted.difference_update(loaded - failed)
            self.tainted.update(failed)

    def _load_in_background(self, specs: list[LoadSpec]) -> None:
        """Queue loads whose requests wait for them (see :meth:`get_finished`).

        Each request's load is a job of its own on the loader thread. A store still to
        read one of its blocks (freed by a preempted request) is cut first, as for a
        block handed out afresh. A load cut at ``engine_timeout`` never writes into
        vLLM's KV again (staged), and its blocks are reported failed.
        """
        staged = isinstance(self.pool, StagedKVBlocks)
        self.count(background_loads=len(specs))
        self._guard_stores({b for s in specs for b in held_blocks(s.block_ids)}, staged)
        movers = self.movers if self.ready() else None
        for spec in specs:
            # Keys with no block to land in (a spec that contradicts itself) are a failed
            # load, never one reported done over bytes that were not loaded.
            if spec.failed or not spec.keys or not held_blocks(spec.block_ids):
                with self._lock:
                    self._recv_done.add(spec.req_id)
                    if spec.failed or spec.keys:
                        self._recv_failed.add(spec.req_id)
                continue
            ld = _Load(spec.req_id, [list(g) for g in spec.block_ids])

            def load(job: Job[Any], spec: LoadSpec = spec, ld: _Load = ld) -> list[bool | None]:
                ld.started = time.monotonic()
                if movers is None or job.cut:
                    return [False] * len(spec.keys)
                if not staged:
                    return movers.load(spec.keys, spec.block_ids, None)
                return movers.load(spec.keys, spec.block_ids, job, lane=BACKGROUND_LANE)

            def done(job: Job[Any], ld: _Load = ld, spec: LoadSpec = spec) -> None:
                ok = list(job.result) if job.error is None and job.result is not None else []
                ok += [False] * (max([len(spec.keys), *map(len, spec.block_ids)]) - len(ok))
                if job.error is not None:
                    self.count(hook_errors=1)
                    self._log(
                        "load",
                        "HiCacheKVConnector: a load failed (%s); vLLM recomputes",
                        self.failure(job.error),
                    )
                good = sum(1 for x in ok if x)
                self.count(
                    load_blocks=good,
                    load_failed_blocks=sum(1 for x in ok if x is False),
                    load_bytes=movers.moved_bytes(ld.block_ids, ok) if movers is not None else 0,
                    load_seconds=time.monotonic() - ld.queued,
                )
                failed = _at(ld.block_ids, ok, False)
                with self._lock:
                    self._bg_loads.remove(ld)
                    if not ld.reported:
                        ld.reported = True
                        self._settle_load(ld, failed)

            with self._lock:
                self._bg_loads.append(ld)
            ld.job = self._loader.submit(load, done)

    def _settle_load(self, ld: _Load, failed: set[int]) -> None:
        """Report ``ld``'s request as loaded, ``failed`` blocks as load errors (lock held).

        With several KV cache groups or a sliding window, vLLM cannot take failed blocks
        (see :attr:`Settings.whole_request_loads`): the request fails as a whole, and
        vLLM recomputes it (or fails it, by its ``kv_load_failure_policy``).
        """
        if failed and self.settings.whole_request_loads:
            self._recv_failed.add(ld.req_id)
        else:
            self._load_errors.update(failed)
        self.tainted.difference_update(held_blocks(ld.block_ids) - failed)
        self.tainted.update(failed)
        self._recv_done.add(ld.req_id)

    def _guard_stores(self, blocks: set[int], staged: bool) -> None:
        """No store may still read ``blocks``: cut the staged ones, wait for direct ones."""
        if not blocks:
            return
        with self._lock:
            hit = [st for st in self._stores if st.blocks & blocks and st.job is not None]
        for st in hit:
            assert st.job is not None
            if staged:
                st.job.cancel()
            else:
                st.job.wait()

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """``(loaded, failed)``: requests whose background load is reported now, once.

        A load still running ``engine_timeout`` after the loader thread took it is cut
        (it never writes vLLM's KV again) and its blocks are reported failed: vLLM
        recomputes them; so are the loads queued behind it, which would wait for a store
        that hangs. ``failed`` requests are recomputed as a whole.
        """
        timeout = self.settings.options.engine_timeout
        if timeout > 0 and isinstance(self.pool, StagedKVBlocks):
            now = time.monotonic()
            with self._lock:
                waiting = [ld for ld in self._bg_loads if not ld.reported]
                stuck = any(ld.started is not None and now - ld.started > timeout for ld in waiting)
                late = waiting if stuck else []
            for ld in late:
                if ld.job is not None:
                    ld.job.cancel()
                with self._lock:
                    cut = not ld.reported
                    if cut:
                        ld.reported = True
                        self._settle_load(ld, held_blocks(ld.block_ids))
                if cut:
                    self.count(load_timeouts=1)
                    self._log(
                        "deadline:load",
                        "HiCacheKVConnector: a background load took longer than "
                        "engine_timeout (%g s); vLLM recomputes its blocks",
                        timeout,
                    )
        with self._lock:
            done, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        return done, failed

    def _all_ranks_failed(self, failed: set[int], blocks: set[int]) -> set[int]:
        """The union of the TP ranks' failed blocks (every rank has the same loads).

        If the ranks cannot be asked, every block of this step's loads counts as failed.
        """
        try:
            import torch.distributed as dist
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group()
            gathered: list[Any] = [None] * group.world_size
            dist.all_gather_object(gathered, sorted(failed), group=group.cpu_group)
            return {int(b) for part in gathered for b in part or ()}
        except Exception as exc:  # noqa: BLE001 - unknown: the conservative answer
            self._log("tp", "HiCacheKVConnector: cannot share load failures (%s)", exc)
            return set(blocks)

    def _load(self, specs: list[LoadSpec]) -> tuple[set[int], set[int]]:
        """Load the step's blocks: ``(failed, loaded)`` block ids.

        One call on the load lane for every request's blocks, within ``engine_timeout``:
        past it (or while the last load still hangs) every block of the step is failed,
        and the late bytes land in the lane's staging rows only.
        """
        t0 = time.perf_counter()
        movers = self.movers if self.ready() else None

        def load(job: Job[Any] | None) -> list[list[bool | None]]:
            if movers is None:
                return [[False] * len(spec.keys) for spec in specs]
            return [movers.load(spec.keys, spec.block_ids, job) for spec in specs]

        try:
            done, results = self.on_lane(self._load_lane, load, "load")
        except Exception as exc:  # noqa: BLE001 - the blocks are failed loads, not an error
            self.count(hook_errors=1)
            self._log(
                "load",
                "HiCacheKVConnector: a load failed (%s); vLLM recomputes",
                self.failure(exc),
            )
            done, results = False, None
        parts: list[list[bool | None]] = (
            list(results)
            if done and results is not None
            else [[False] * len(s.keys) for s in specs]
        )
        failed: set[int] = set()
        loaded: set[int] = set()
        moved = 0
        for spec, ok in zip(specs, parts, strict=True):
            failed |= _at(spec.block_ids, ok, False)
            loaded |= _at(spec.block_ids, ok, True)
            moved += movers.moved_bytes(spec.block_ids, ok) if movers is not None else 0
        oks = [x for ok in parts for x in ok]
        self.count(
            load_blocks=sum(1 for x in oks if x),
            load_failed_blocks=sum(1 for x in oks if x is False),
            load_bytes=moved,
            load_seconds=time.perf_counter() - t0,
        )
        return failed, loaded - failed

    def _clean_blocks(self, spec: SaveSpec) -> bool:
        """Whether the blocks of ``spec`` were computed over clean KV; updates the taint.

        Walking the request's blocks in order: a block this step did not compute (one
        before the stored range, or from vLLM's prefix cache or the store: before
        ``computed_from``) is as clean as its own taint says; each block this step
        computed (in the stored range) is as clean as everything before it, and is
        marked so. A block stays tainted until it is loaded whole, computed again over
        clean KV, or handed to a request afresh (:meth:`_fresh`).
        """
        tainted = self.tainted
        places = min((len(g) for g in spec.prefix_block_ids), default=0)
        first = places - len(spec.keys)  # the stored range
        bad = False
        for idx in range(places):
            # A place's blocks in every group: each layer's KV there depends on every
            # layer's before it.
            ids = {g[idx] for g in spec.prefix_block_ids} - {NULL_BLOCK}
            if idx < first or idx < spec.computed_from:
                bad = bad or not ids.isdisjoint(tainted)
            elif bad:
                tainted.update(ids)
            else:
                tainted.difference_update(ids)
        return not bad

    def _fresh(self, meta: HiCacheConnectorMetadata) -> None:
        """Forget the taint of blocks vLLM handed to a request afresh (once per step).

        Their old bytes are never read again: the request computes or loads them.
        """
        if meta.fresh_blocks and not meta.fresh_done:
            with self._lock:
                self.tainted.difference_update(meta.fresh_blocks)
        meta.fresh_done = True

    def wait_for_save(self, meta: HiCacheConnectorMetadata) -> None:
        """Store the step's new full blocks (synchronous: done before vLLM frees them).

        A block computed over a block that failed to load (in this step or before vLLM
        has recomputed it) is not stored: its KV is not its tokens'. vLLM recomputes
        those blocks, and the scheduler side plans their store again.
        """
        self._fresh(meta)
        meta.saves_queued = True
        if not meta.saves or not self._writer:
            return
        with self._lock:
            specs = [s for s in meta.saves if self._clean_blocks(s)]
        skipped = sum(len(s.keys) for s in meta.saves) - sum(len(s.keys) for s in specs)
        if skipped:
            self.count(save_skipped_blocks=skipped)
        keys = [k for s in specs for k in s.keys]
        if not keys:
            return
        groups = [[b for s in specs for b in s.block_ids[g]] for g in range(len(self.pools))]
        partial = [s.partial for s in specs for _ in s.keys]
        if self.settings.options.async_saves:
            self._store_in_background(specs, keys, groups, partial)
            return
        t0 = time.perf_counter()
        movers = self.movers if self.ready() else None

        def save(job: Job[Any] | None) -> list[bool | None]:
            return movers.save(keys, groups, job) if movers is not None else [False] * len(keys)

        self._expect_stores(specs)
        try:
            try:
                done, result = self.on_lane(self._save_lane, save, "save")
            except Exception as exc:  # noqa: BLE001 - a store that failed is only a future miss
                self.count(hook_errors=1)
                self._log(
                    "save",
                    "HiCacheKVConnector: a store failed (%s)",
                    self.failure(exc),
                )
                done, result = False, None
            ok: list[bool | None] = list(result) if done and result is not None else []
            ok += [False] * (len(keys) - len(ok))
            self._count_saves(movers, groups, ok, partial, time.perf_counter() - t0, cut=False)
            self._note_stored(specs, ok)
        finally:
            self._stores_ended(specs)

    def _note_stored(self, specs: list[SaveSpec], ok: list[bool | None]) -> None:
        """Keep a ``BlockStored`` event for each block stored whole (vLLM's events on).

        Not for a block a backend removed while it was being stored (its own batch
        evicted it, a clear): the store may no longer hold it.
        """
        if not self.settings.events:
            return
        medium = medium_of(self.settings.backend_name)
        out = []
        named_keys = []
        at = 0
        for spec in specs:
            for j, named in enumerate(spec.events[: len(spec.keys)]):
                if named is not None and at + j < len(ok) and ok[at + j]:
                    block_hash, parent, tokens, lora = named
                    out.append((spec.keys[j], stored_event(block_hash, parent, tokens,
                                                           self.block_size, medium, lora)))  # fmt: skip
                    named_keys.append((spec.keys[j], block_hash))
            at += len(spec.keys)
        if out:
            with self._events_lock:
                gone = self._gone_while_storing
                if gone:
                    out = [(k, e) for k, e in out if k not in gone]
                    named_keys = [(k, h) for k, h in named_keys if k not in gone]
                self._events.extend(e for _, e in out)
                del self._events[:-MAX_EVENTS]
                hashes = self._hashes
                for key, block_hash in named_keys:
                    hashes[key] = block_hash
                    hashes.move_to_end(key)
                while len(hashes) > MAX_EVENTS:
                    hashes.popitem(last=False)

    def _expect_stores(self, specs: list[SaveSpec]) -> None:
        """Note the keys (with an event) a store is about to write (vLLM's events on)."""
        if not self.settings.events:
            return
        named = [k for s in specs for k, e in zip(s.keys, s.events, strict=False) if e is not None]
        if named:
            with self._events_lock:
                self._storing.update(named)

    def _stores_ended(self, specs: list[SaveSpec]) -> None:
        """The store of ``specs`` is over (its events noted): forget its keys."""
        if not self.settings.events:
            return
        named = [k for s in specs for k, e in zip(s.keys, s.events, strict=False) if e is not None]
        with self._events_lock:
            for key in named:
                left = self._storing[key] - 1
                if left > 0:
                    self._storing[key] = left
                else:
                    self._storing.pop(key, None)
                    self._gone_while_storing.discard(key)

    def _on_removed(self, keys: list[str] | None) -> None:
        """A backend removed objects (``None``: cleared): their blocks' removal events.

        Runs on the removing thread, perhaps with the backend's locks held: only
        bookkeeping here. Only blocks this worker stored with an event are known.
        """
        medium = medium_of(self.settings.backend_name)
        with self._events_lock:
            hashes = self._hashes
            if keys is None:
                gone = list(hashes.values())
                hashes.clear()
                self._gone_while_storing.update(self._storing)
            else:
                gone = [h for h in (hashes.pop(k, None) for k in keys) if h is not None]
                self._gone_while_storing.update(k for k in keys if k in self._storing)
            if gone:
                self._events.extend(removed_event(h, medium) for h in gone)
                del self._events[:-MAX_EVENTS]

    def take_events(self) -> list[Any]:
        """The stored and removed blocks' events since the last call (for vLLM)."""
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def _count_saves(
        self,
        movers: GroupMovers | None,
        groups: list[list[int]],
        ok: list[bool | None],
        partial: list[bool],
        seconds: float,
        cut: bool,
    ) -> None:
        """Count a store's results (a place no group holds is not counted)."""
        good = sum(1 for x in ok if x)
        bad = sum(1 for x in ok if x is False)
        parts = sum(1 for x, p in zip(ok, partial, strict=False) if x and p)
        self.count(
            save_blocks=good - parts,
            save_partial_blocks=parts,
            save_failed_blocks=0 if cut else bad,
            save_cut_blocks=bad if cut else 0,
            save_bytes=movers.moved_bytes(groups, ok) if movers is not None else 0,
            save_seconds=seconds,
        )

    def _store_in_background(
        self,
        specs: list[SaveSpec],
        keys: list[str],
        groups: list[list[int]],
        partial: list[bool],
    ) -> None:
        """Queue the step's stores on the background thread (see the module docs)."""
        with self._lock:
            behind = len(self._stores) >= MAX_QUEUED_STORES
        if behind:
            self.count(save_timeouts=1, save_failed_blocks=len(keys))
            self._log(
                "deadline:save",
                "HiCacheKVConnector: %d stores are still queued (the store hangs or is "
                "slower than vLLM); this step's are dropped",
                MAX_QUEUED_STORES,
            )
            return
        movers = self.movers if self.ready() else None
        staged = isinstance(self.pool, StagedKVBlocks)
        st = _Store({s.req_id for s in specs}, held_blocks(groups), keys=len(keys))

        def save(job: Job[Any]) -> list[bool | None]:
            if movers is None or job.cut:
                return [False] * len(keys)
            # Staged: every copy from vLLM's KV inside the job's gate. Direct: the store
            # reads vLLM's KV itself, and before_step waits for it instead.
            return movers.save(keys, groups, job if staged else None)

        def done(job: Job[Any]) -> None:
            ok = list(job.result) if job.error is None and job.result is not None else []
            ok += [False] * (len(keys) - len(ok))
            if job.error is not None:
                self.count(hook_errors=1)
                self._log(
                    "save", "HiCacheKVConnector: a store failed (%s)", self.failure(job.error)
                )
            try:
                self._count_saves(
                    movers, groups, ok, partial, time.perf_counter() - st.started, cut=job.cut
                )
                self._note_stored(specs, ok)
            finally:  # (a store left listed would hold its request's blocks for good)
                self._stores_ended(specs)
                with self._lock:
                    self._stores.remove(st)

        with self._lock:
            self._stores.append(st)
        self._expect_stores(specs)
        try:
            st.job = self._saver.submit(save, done)
        except BaseException:
            self._stores_ended(specs)
            raise

    def flush(self, timeout: float | None = None, loads: bool = False) -> bool:
        """Wait for every store queued so far (and background load, with ``loads``) to end.

        False if ``timeout`` passed first.
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = [st.job for st in self._stores]
            if loads:
                jobs += [ld.job for ld in self._bg_loads]
        for job in jobs:
            left = None if end is None else max(0.0, end - time.monotonic())
            if job is not None and not job.wait(left):
                return False
        return True

    def before_step_safely(self, meta: HiCacheConnectorMetadata) -> None:
        """:meth:`before_step`; a failure waits for every store instead (never raises)."""
        try:
            self.before_step(meta)
        except Exception as exc:  # noqa: BLE001 - vLLM's step must go on, its KV safe
            self._hook_failed("before_step", exc)
            with self._lock:
                stores = list(self._stores)
            for st in stores:
                if st.job is not None:
                    st.job.cancel()
                    if not isinstance(self.pool, StagedKVBlocks):
                        st.job.wait()

    def finished_loads_safely(self) -> tuple[set[str], set[str]]:
        """:meth:`finished_loads`; a failure reports nothing this step (never raises)."""
        try:
            return self.finished_loads()
        except Exception as exc:  # noqa: BLE001 - reported again at the next step
            self._hook_failed("finished_loads", exc)
            return set(), set()

    def get_finished_safely(
        self, meta: HiCacheConnectorMetadata | None, finished_req_ids: set[str]
    ) -> set[str]:
        """:meth:`get_finished`; a failure reports nothing this step (never raises)."""
        try:
            return self.get_finished(meta, finished_req_ids)
        except Exception as exc:  # noqa: BLE001 - reported again at the next step
            self._hook_failed("get_finished", exc)
            return set()

    def before_step(self, meta: HiCacheConnectorMetadata) -> None:
        """Before the forward pass: no store may still read a block handed out afresh.

        vLLM writes those blocks in this step (a preempted request's blocks given to
        another). A staged store still to read one is cut (what it copied is stored, the
        rest dropped and counted as ``save_cut_blocks``); a direct store is waited for.
        """
        self._guard_stores(
            set(meta.fresh_blocks) - {NULL_BLOCK}, isinstance(self.pool, StagedKVBlocks)
        )

    def get_finished(
        self, meta: HiCacheConnectorMetadata | None, finished_req_ids: set[str]
    ) -> set[str]:
        """Requests whose delayed free can happen now: their stores have read their blocks.

        vLLM keeps a finished request's blocks when the scheduler side says so (the
        request's id comes in ``meta.delayed_frees``). Once no store of it is queued or
        running, or ``engine_timeout`` after it finished (its stores are cut then: they
        never read vLLM's KV again), it is reported, once.
        """
        # vLLM names a finished request in finished_req_ids in the step whose metadata
        # announces its delayed free; either may come first, and each is remembered.
        for r in finished_req_ids:
            if r in self._awaiting:
                self._awaiting[r][1] = True
            else:
                self._finished_ids[r] = None
        while len(self._finished_ids) > _RECENT_FINISHED:
            self._finished_ids.popitem(last=False)
        now = time.monotonic()
        timeout = self.settings.options.engine_timeout
        staged = isinstance(self.pool, StagedKVBlocks)
        for r in meta.delayed_frees if meta is not None else ():
            if r not in self._awaiting:
                seen = r in self._finished_ids
                self._finished_ids.pop(r, None)
                self._awaiting[r] = [now + timeout if timeout > 0 else math.inf, seen]
        if not self._awaiting:
            return set()
        with self._lock:
            busy: dict[str, list[_Store]] = {}
            for st in self._stores:
                for r in st.req_ids:
                    busy.setdefault(r, []).append(st)
        # Saves of this step not queued yet (vLLM with a drafter calls wait_for_save after
        # this): their requests wait for the next report.
        unqueued = (
            {s.req_id for s in meta.saves}
            if meta is not None and not getattr(meta, "saves_queued", False)
            else set()
        )
        out = set()
        for r, (deadline, seen) in list(self._awaiting.items()):
            if not seen or r in unqueued:
                continue
            stores = busy.get(r)
            if stores and now >= deadline and staged:
                for st in stores:
                    if st.job is not None:
                        st.job.cancel()
                self.count(save_timeouts=1)
                self._log(
                    "deadline:free",
                    "HiCacheKVConnector: stores of a finished request still running "
                    "engine_timeout (%g s) after it finished; cut, its blocks freed",
                    timeout,
                )
                stores = None
            if not stores:
                out.add(r)
                del self._awaiting[r]
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes or fails them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out
