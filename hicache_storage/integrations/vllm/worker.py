"""The worker side of the vLLM connector: each step's loads and stores, in a worker process.

vLLM's KV tensors become the backend's page pool
(:mod:`hicache_storage.integrations.kvblocks`); before the forward pass the step's blocks
are read into them (:meth:`WorkerSide.start_load_kv`), after it the step's new full
blocks are stored (:meth:`WorkerSide.wait_for_save`), each through a lane with the
connector's deadline. A block whose load failed is reported to vLLM, and nothing
computed over it is stored (the taint rule: :meth:`WorkerSide._clean_blocks`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.deadline import Lane
from hicache_storage.integrations.kvblocks import KVBlockMover, kv_blocks
from hicache_storage.integrations.vllm.side import ConnectorSide, Settings, logger
from hicache_storage.keys import normalize_dtype
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    import torch

    from hicache_storage.integrations.deadline import Job
    from hicache_storage.integrations.vllm.metadata import (
        HiCacheConnectorMetadata,
        LoadSpec,
        SaveSpec,
    )
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["WorkerSide"]


class WorkerSide(ConnectorSide):
    """Loads and stores of one TP rank (see the module docs)."""

    def __init__(self, settings: Settings, layer_names: list[str], num_blocks: int) -> None:
        super().__init__(settings)
        self._layer_names = list(layer_names)
        self._num_blocks = int(num_blocks)
        self.tp_size = settings.tp_size
        self.backend: HiCacheStorage | None = None
        self.mover: KVBlockMover | None = None
        self.pool: Any = None
        self.rank = 0
        self._writer = True
        self._load_errors: set[int] = set()
        #: Blocks whose KV is not what their tokens make: a load into them failed, or they
        #: were computed over such a block. Nothing computed over them is stored.
        self.tainted: set[int] = set()
        self._load_lane = Lane("hicache-vllm-load")
        self._save_lane = Lane("hicache-vllm-save")

    # ------------------------------------------------------------------ ConnectorSide

    @override
    def ready(self) -> bool:
        """True once attached (see :meth:`ConnectorSide.ready`)."""
        return self.mover is not None

    @override
    def _build(self) -> None:
        self._attach()

    @override
    def _take_backends(self) -> list[HiCacheStorage]:
        backend, self.backend, self.mover = self.backend, None, None
        return [backend] if backend is not None else []

    @override
    def _lanes(self) -> list[Lane]:
        return [self._load_lane, self._save_lane]

    # ------------------------------------------------------------------ attaching

    def _attach(self) -> None:
        """Build the worker's backend and register the KV pool with it."""
        config = self.settings.storage_config(self.rank)
        backend = create_backend(self.settings.backend_name, config)
        try:
            mover = KVBlockMover.attach(backend, self.pool)
        except BaseException:
            backend.close()
            raise
        if self._closed.is_set():
            backend.close()
            return
        old, self.backend, self.mover = self.backend, backend, mover
        self._writer = config.is_storage_writer
        if old is not None:
            old.close()
        logger.info(
            "HiCacheKVConnector: %s backend, namespace %s, %s pages of %d bytes",
            self.settings.backend_name,
            self.settings.namespace.digest,
            type(self.pool).__name__,
            self.pool.page_bytes,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the backend and attach vLLM's KV tensors as its page pool.

        Raises :class:`ConfigError` (vLLM fails to start) when the tensors are not what
        the KV cache config says, so a deployment never runs with a connector that would
        store or load wrong bytes.
        """
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing}")
        layers = [kv_caches[n] for n in self._layer_names]
        for n, t in zip(self._layer_names, layers, strict=True):
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
        # With a deadline, loads and stores each move through a staging lane of their own,
        # so that a call cut at its deadline never touches vLLM's KV again.
        self.pool = kv_blocks(
            layers,
            self.block_size,
            staging_rows=opts.staging_blocks,
            staged=opts.staging,
            lanes=2 if opts.engine_timeout > 0 else 1,
        )
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
            self.rank = 0
        self.connect_or_retry()

    def start_load_kv(self, meta: HiCacheConnectorMetadata) -> None:
        """Read this step's blocks into vLLM's paged KV before the forward pass.

        Never raises: a block that did not land whole is reported as a load error, and
        is not stored from, nor is anything computed over it (see :meth:`wait_for_save`).
        """
        self._fresh(meta)
        if not meta.loads:
            return
        failed, loaded = self._load(meta.loads)
        if self.tp_size > 1:
            # A rank's failed block poisons every rank's later KV (the layers mix the
            # heads): each rank learns every rank's failures before anything is stored.
            failed = self._all_ranks_failed(failed, loaded | failed)
        with self._lock:
            self._load_errors.update(failed)
            self.tainted.difference_update(loaded - failed)
            self.tainted.update(failed)

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
        mover = self.mover if self.ready() else None
        blocks = [b for spec in specs for b in spec.block_ids]

        def load(job: Job[Any] | None) -> list[list[bool]]:
            if mover is None:
                return [[False] * len(spec.block_ids) for spec in specs]
            return [mover.load(spec.keys, spec.block_ids, job) for spec in specs]

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
        oks = [x for part in results or () for x in part] if done else [False] * len(blocks)
        failed = {b for b, x in zip(blocks, oks, strict=True) if not x}
        loaded = {b for b, x in zip(blocks, oks, strict=True) if x} - failed
        good = sum(1 for x in oks if x)
        self.count(
            load_blocks=good,
            load_failed_blocks=len(oks) - good,
            load_bytes=good * (self.pool.page_bytes if self.pool is not None else 0),
            load_seconds=time.perf_counter() - t0,
        )
        return failed, loaded

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
        first = len(spec.prefix_block_ids) - len(spec.block_ids)  # the stored range
        bad = False
        for idx, b in enumerate(spec.prefix_block_ids):
            if idx < first or idx < spec.computed_from:
                bad = bad or b in tainted
            elif bad:
                tainted.add(b)
            else:
                tainted.discard(b)
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
        if not meta.saves or not self._writer:
            return
        with self._lock:
            specs = [s for s in meta.saves if self._clean_blocks(s)]
        skipped = sum(len(s.block_ids) for s in meta.saves) - sum(len(s.block_ids) for s in specs)
        if skipped:
            self.count(save_skipped_blocks=skipped)
        keys = [k for s in specs for k in s.keys]
        blocks = [b for s in specs for b in s.block_ids]
        if not keys:
            return
        t0 = time.perf_counter()
        mover = self.mover if self.ready() else None

        def save(job: Job[Any] | None) -> list[bool]:
            return mover.save(keys, blocks, job) if mover is not None else [False] * len(keys)

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
        ok = list(result) if done and result is not None else [False] * len(keys)
        good = sum(ok)
        self.count(
            save_blocks=good,
            save_failed_blocks=len(ok) - good,
            save_bytes=good * self.pool.page_bytes,
            save_seconds=time.perf_counter() - t0,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes or fails them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out
