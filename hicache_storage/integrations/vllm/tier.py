"""Any hicache-storage backend as a secondary tier of vLLM's native KV offloading.

vLLM's offloading (``--kv-offloading-backend native``, ``TieringOffloadingSpec``) keeps
KV chunks in a CPU primary tier and cascades them to secondary tiers
(``vllm/v1/kv_offload/tiering``). :class:`HiCacheTier` is such a tier over any backend
the registry knows, loaded by module path, with no change to vLLM::

    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{
            "type": "HiCacheTier",
            "module_path": "hicache_storage.integrations.vllm.tier",
            "backend_name": "file", "root": "/var/cache/kv"}]}

Every key of the tier's entry other than ``type``, ``module_path``, ``backpressure``
and the tier's own options (``model_id``, ``tenant``, ``weights_fingerprint``,
``engine_timeout``, ``io_jobs``: jobs in flight at once per direction, default 4) is the
backend's option, as in the connector.

**What it guarantees.** A chunk is one stored object (the backend's atomic publication
and checksums); a chunk that did not load whole (missing, damaged, a store error) makes
its job fail, and only the chunks that landed whole are in ``successful_keys``. Keys are
vLLM's offload keys in a namespace naming the model (with its weights' fingerprint), the
KV dtype, the chunk's bytes and token span, the KV layout and the parallel layout, so
another model or layout never reads these chunks. Every method vLLM calls returns at
once: lookups, stores and loads run on threads of their own (a lookup answers RETRY
until its answer is known). A job still running ``engine_timeout`` seconds after it
started is reported failed, and from then on never touches the primary tier again:
with a deadline, chunks move through a staging buffer and are copied to or from the
primary tier only inside the job's gate (without one, ``engine_timeout: 0``, the backend
reads and writes the primary tier directly and a job is waited for as long as it takes).

Importing this module needs vLLM; ``import hicache_storage`` never imports it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache_storage.config import StorageConfig
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.deadline import Background, Job
from hicache_storage.integrations.kvblocks import KVBlockMover, kv_blocks
from hicache_storage.integrations.weights import model_identity
from hicache_storage.keys import KVCacheNamespace, normalize_dtype
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["HiCacheTier"]

#: Seconds a lookup's answer is reused before the store is asked again.
LOOKUP_TTL = 2.0
#: Bytes of a job thread's staging lane (at least one chunk, at most 64 chunks): a job
#: moves in pieces of that many chunks.
STAGING_BYTES = 8 << 20


class _Options:
    """The tier's own options besides the namespace's, checked."""

    def __init__(self, engine_timeout: float = 5.0, io_jobs: int = 4) -> None:
        if not 0 <= float(engine_timeout) <= threading.TIMEOUT_MAX:
            raise ConfigError(f"engine_timeout={engine_timeout} must be from 0 (no deadline)")
        if not isinstance(io_jobs, int) or not 1 <= io_jobs <= 64:
            raise ConfigError(f"io_jobs={io_jobs!r} must be a whole number from 1 to 64")
        self.engine_timeout = float(engine_timeout)
        self.io_jobs = io_jobs


class _Entry:
    """A job not reported yet: its direction, thread, Job and start."""

    def __init__(self, tj: TransferJob, store: bool) -> None:
        self.tj = tj
        self.store = store
        self.thread = 0
        self.job: Job[Any] | None = None
        self.started: float | None = None  # when its thread took it (its deadline counts)


class HiCacheTier(SecondaryTierManager):  # type: ignore[misc]
    """A hicache-storage backend below vLLM's CPU tier (see the module docs)."""

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        backend_name: str = "file",
        model_id: str | None = None,
        tenant: str = "",
        weights_fingerprint: str = "",
        engine_timeout: float = 5.0,
        io_jobs: int = 4,
        **backend_options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = _Options(engine_timeout, io_jobs)
        config = offloading_spec.config
        if len(config.groups) != 1:
            raise ConfigError(
                f"HiCacheTier moves one KV cache group, this model has {len(config.groups)}"
            )
        self.tokens_per_chunk = int(config.groups[0].tokens_per_block) * int(
            config.cache.blocks_per_chunk
        )
        self.num_chunks = int(primary_kv_view.shape[0]) if primary_kv_view.shape else 0
        self.chunk_bytes = self.block_size_bytes
        self.namespace = _namespace(
            config, self.chunk_bytes, self.tokens_per_chunk, model_id, tenant, weights_fingerprint
        )
        # The primary tier as a pool of chunk pages (its own memory, or through staging
        # with a deadline so that a job cut at it never touches the primary tier again).
        flat = torch.frombuffer(primary_kv_view.cast("B"), dtype=torch.uint8)
        chunks = flat.view(self.num_chunks, self.chunk_bytes)
        staged = self.options.engine_timeout > 0
        n = self.options.io_jobs
        # Staged: a lane of rows for each job thread (loads 0..n-1, stores n..2n-1).
        pool = kv_blocks(
            [chunks],
            self.tokens_per_chunk,
            staging_rows=max(1, min(64, STAGING_BYTES // max(1, self.chunk_bytes))),
            staged=staged,
            lanes=2 * n if staged else 1,
        )
        pool.dtype = self.namespace.dtype  # (the bytes are KV of this dtype, seen as bytes)
        self.backend = create_backend(
            backend_name, StorageConfig(namespace=self.namespace, extra_config=backend_options)
        )
        try:
            self.mover = KVBlockMover.attach(self.backend, pool)
        except BaseException:
            self.backend.close()
            raise
        self._lock = threading.Lock()
        self._stores = [Background(f"hicache-tier-store-{i}") for i in range(n)]
        self._loads = [Background(f"hicache-tier-load-{i}") for i in range(n)]
        self._turn = {True: -1, False: -1}
        self._lookups = Background("hicache-tier-lookup")
        #: Jobs not reported yet, by job id.
        self._jobs: dict[int, _Entry] = {}
        self._finished: list[JobResult] = []
        self._known: dict[OffloadKey, tuple[bool, float]] = {}  # key -> (present, when)
        self._asking: dict[OffloadKey, float] = {}  # key -> when it was asked
        #: (store?, thread) stuck in a call cut at its deadline, until it returns.
        self._stuck: set[tuple[bool, int]] = set()
        self.counters = {"stored": 0, "loaded": 0, "failed_jobs": 0, "timeouts": 0}

    # ------------------------------------------------------------------ lookups

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS when known (within :data:`LOOKUP_TTL`); else RETRY, asked in the background.

        A lookup the store has not answered within ``engine_timeout`` is a MISS (the
        request goes on without the tier), until the store answers it.
        """
        now = time.monotonic()
        with self._lock:
            known = self._known.get(key)
            if known is not None and now - known[1] < LOOKUP_TTL:
                return LookupResult.HIT if known[0] else LookupResult.MISS
            asked = self._asking.get(key)
            if asked is not None:
                timeout = self.options.engine_timeout
                late = timeout > 0 and now - asked > timeout
                return LookupResult.MISS if late else LookupResult.RETRY
            self._asking[key] = now

        def ask(_job: Job[Any]) -> bool:
            return bool(self.backend.exists(key.hex()))

        def done(job: Job[Any]) -> None:
            with self._lock:
                self._asking.pop(key, None)
                if job.error is None:
                    if len(self._known) > 1 << 16:
                        self._known.clear()
                    self._known[key] = (bool(job.result), time.monotonic())

        self._lookups.submit(ask, done)
        return LookupResult.RETRY

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: each backend keeps its own recency on reads."""

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # ------------------------------------------------------------------ jobs

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a store of primary chunks ``chunk_ids`` under ``keys`` (returns at once)."""
        self._submit(job_metadata, store=True)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a load of ``keys`` into primary chunks ``chunk_ids`` (returns at once)."""
        self._submit(job_metadata, store=False)

    def _pick(self, store: bool) -> int | None:
        """A job thread of the direction, round robin, or None when every one is stuck.

        A thread is stuck in a call cut at its deadline until the call returns (the lock
        is held).
        """
        n = self.options.io_jobs
        for _ in range(n):
            self._turn[store] = (self._turn[store] + 1) % n
            if (store, self._turn[store]) not in self._stuck:
                return self._turn[store]
        return None

    def _submit(self, tj: TransferJob, store: bool) -> None:
        keys = [k.hex() for k in tj.keys]
        ids = [int(c) for c in tj.chunk_ids]
        staged = self.options.engine_timeout > 0
        n = self.options.io_jobs
        entry = _Entry(tj, store)
        with self._lock:  # (before it runs: its end finds it here)
            thread = self._pick(store)
            if thread is None:  # every thread waits for a hung call: fail at once
                self._finished.append(JobResult(job_id=tj.job_id, success=False))
                self.counters["failed_jobs"] += 1
                return
            entry.thread = thread
            self._jobs[tj.job_id] = entry
        mover = self.mover

        def run(job: Job[Any]) -> list[bool]:
            entry.started = time.monotonic()
            if len(keys) != len(ids) or job.cut:
                return [False] * len(keys)
            gate = job if staged else None
            if store:
                return mover.save(keys, ids, gate, lane=n + thread)
            return mover.load(keys, ids, gate, lane=thread)

        def done(job: Job[Any]) -> None:
            ok = list(job.result) if job.error is None and job.result is not None else []
            ok += [False] * (len(keys) - len(ok))
            self._report(entry, ok)

        job = (self._stores if store else self._loads)[thread].submit(run, done)
        with self._lock:
            entry.job = job

    def _report(self, entry: _Entry, ok: list[bool]) -> None:
        tj, store = entry.tj, entry.store
        with self._lock:
            if entry.started is not None:  # its call returned: the thread is free again
                self._stuck.discard((store, entry.thread))
            if self._jobs.pop(tj.job_id, None) is None:
                return  # reported (failed) at its deadline already
            good = sum(ok)
            result = JobResult(
                job_id=tj.job_id,
                success=good == len(ok),
                successful_keys=None
                if store or good == len(ok)
                else [k for k, x in zip(tj.keys, ok, strict=True) if x],
                transfer_time=time.monotonic() - entry.started if entry.started else 0.0,
                transfer_bytes=good * self.chunk_bytes,
            )
            self._finished.append(result)
            self.counters["stored" if store else "loaded"] += good
            self.counters["failed_jobs"] += int(not result.success)
            now = time.monotonic()
            for k, x in zip(tj.keys, ok, strict=True):
                if store and x:
                    self._known[k] = (True, now)  # stored now
                elif not store and not x:
                    self._known[k] = (False, now)  # a failed load is a miss for a while

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs ended since the last call; a job past ``engine_timeout`` is reported failed.

        So are the jobs queued behind it on its thread (they would wait for a call that
        hangs); the thread takes no new job until that call returns. A job reported this
        way never touches the primary tier again (its gate is shut before it is reported).
        """
        timeout = self.options.engine_timeout
        with self._lock:
            if timeout > 0:
                now = time.monotonic()
                stuck = {
                    (e.store, e.thread)
                    for e in self._jobs.values()
                    if e.started is not None and now - e.started > timeout
                }
                self._stuck |= stuck
                for jid, e in list(self._jobs.items()):
                    if (e.store, e.thread) not in stuck:
                        continue
                    del self._jobs[jid]
                    if e.job is not None:
                        e.job.cancel()  # (never waits on this lock: no deadlock)
                    self._finished.append(JobResult(job_id=jid, success=False))
                    self.counters["timeouts"] += 1
                    self.counters["failed_jobs"] += 1
            out, self._finished = self._finished, []
        return out

    @override
    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs or self._finished)

    @override
    def drain_jobs(self) -> None:
        """Wait for every job still allowed to touch the primary tier (cut ones are not)."""
        with self._lock:
            jobs = [e.job for e in self._jobs.values() if e.job is not None]
        for job in jobs:
            job.wait()

    @override
    def shutdown(self) -> None:
        """Finish the jobs (within ``engine_timeout``, the rest cut), then close the backend."""
        timeout = self.options.engine_timeout
        end = time.monotonic() + timeout if timeout > 0 else None
        with self._lock:
            jobs = [e.job for e in self._jobs.values() if e.job is not None]
        for job in jobs:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not job.wait(left):
                job.cancel()
        for bg in (*self._stores, *self._loads, self._lookups):
            bg.close()
        self.backend.close()
        # Let go of the primary tier's memory (vLLM unmaps it after the tiers shut down).
        self.mover.pool = None  # type: ignore[assignment]
        self.mover.backend = None  # type: ignore[assignment]


def _namespace(
    config: Any,
    chunk_bytes: int,
    tokens: int,
    model_id: str | None,
    tenant: str,
    weights_fingerprint: str,
) -> KVCacheNamespace:
    """What keeps this deployment's chunks apart from every other's."""
    resolved, weights = model_identity(str(config.model.name))
    par = config.parallel
    parallel = (
        "any"
        if getattr(par, "is_parallelism_agnostic", False)
        else f"tp{par.tp_size}-pp{par.pp_size}-ws{par.world_size}"
    )
    layout = f"vllm-offload-chunk:{config.kv_cache_layout}:{chunk_bytes}B:{parallel}"
    # Canonical and direct pages are different byte orders; a replicated layout keeps one
    # copy of what every worker holds.
    if getattr(config, "canonical_layout", False):
        layout += ":canonical"
    if getattr(config, "replicated_layout", False):
        layout += ":replicated"
    return KVCacheNamespace(
        model_id=model_id or resolved,
        dtype=normalize_dtype(str(config.model.dtype)),
        page_size=tokens,
        object_layout=layout,
        tenant=tenant,
        weights_fingerprint=":".join(x for x in (weights, weights_fingerprint) if x),
    )
