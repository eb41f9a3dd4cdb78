"""The tier controller: prefetch (L3 -> L2), load (L2 -> L1), write policies, backup.

Modelled on the reference's HiCache controller, with its known faults fixed:

* prefetch runs on ``io_workers`` threads, so one slow prefetch does not hold up the
  others (the reference has one I/O thread);
* a backup batch that fails is retried ``backup_retries`` times, then its pages are
  recorded as failed (``backup_failed_tokens``), never acknowledged as stored;
* the host pool keeps room for storage hits: a prefetch evicts least-recently-used host
  pages that are safe to drop (stored, or also on the device) instead of dropping the
  hits when the host pool is no larger than the device pool;
* with ``torch.distributed`` initialised, every rank performs the same all-reduces
  (MIN) for every query, zero hits included, so ranks agree and never deadlock;
* a backend that raises, times out or fails degrades to misses; no worker thread dies;
  host pages of a failed prefetch are freed; failures are logged at a bounded rate;
* a store that hangs costs one wait: while a read a request gave up on still hangs, new
  prefetches are misses at once (as existence queries are), and the I/O threads are
  daemon threads, so one stuck in the store never keeps the process from exiting.

It talks to storage only through :class:`~hicache_storage.protocol.HiCacheStorage`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.admission import SeenCounter
from hicache_storage.errors import BackendClosedError, BackendError, ConfigError
from hicache_storage.keys import page_hashes
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.tier.config import TierConfig, TierStats
from hicache_storage.tier.device import LayerProgress
from hicache_storage.tier.index import PageEntry, PrefixIndex, PrefixMatch
from hicache_storage.tier.workers import Workers, agree

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from hicache_storage.host_pool import HostKVPool
    from hicache_storage.protocol import HiCacheStorage
    from hicache_storage.tier.device import DevicePool

__all__ = ["Lease", "PrefetchOp", "TieredCache"]

logger = logging.getLogger(__name__)


class PrefetchOp:
    """A prefetch of ``keys`` from storage into host pages, in batches on the I/O threads.

    Once settled (:meth:`TieredCache.finish_prefetch`), no batch starts any more, and a
    batch still running frees its own host pages when it ends.
    """

    PENDING, RUNNING, DONE, CANCELLED = range(4)

    def __init__(self, keys: list[str], host_pages: list[int], batch: int) -> None:
        self.keys, self.host_pages = keys, host_pages
        self.batches = [(i, min(i + batch, len(keys))) for i in range(0, len(keys), batch)]
        self.state = [self.PENDING] * len(self.batches)
        self._ok = [False] * len(keys)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self.short = False  # a batch ended short: later batches are not read
        self.settled = False
        self._freeing = 0  # settled batches still freeing their pages
        self.held: list[PageEntry] = []  # index entries kept for the request
        self.started = time.perf_counter()
        self.ended = self.started

    def _start(self, b: int) -> bool:
        """Batch ``b`` may run (else it is cancelled: stopped, short, or settled)."""
        with self._cond:
            if self.state[b] != self.PENDING or self._stop.is_set() or self.short or self.settled:
                if self.state[b] == self.PENDING:
                    self.state[b] = self.CANCELLED
                    self._cond.notify_all()
                return False
            self.state[b] = self.RUNNING
            return True

    def _batch_done(self, b: int, ok: list[bool]) -> bool:
        """Record batch ``b``'s pages.

        True if the op was settled meanwhile: then the batch's pages are its own to free.
        """
        lo, hi = self.batches[b]
        with self._cond:
            self._ok[lo:hi] = ok[: hi - lo]
            self.short = self.short or not all(ok)
            self.state[b] = self.DONE
            self.ended = time.perf_counter()
            if self.settled:
                self._freeing += 1  # wait() waits for the pages to be freed too
            self._cond.notify_all()
            return self.settled

    def _freed(self) -> None:
        """A settled batch freed its pages."""
        with self._cond:
            self._freeing -= 1
            self._cond.notify_all()

    def _over(self) -> bool:
        done = (self.DONE, self.CANCELLED)
        return all(st in done for st in self.state) and self._freeing == 0

    @property
    def finished(self) -> bool:
        """Every batch ran or was cancelled (and freed what it had to)."""
        with self._cond:
            return self._over()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every batch ran or was cancelled; False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._over, timeout)

    def _settle(self) -> tuple[int, list[int]]:
        """Stop the op: (pages of the leading run, host pages to free now).

        Pending batches are cancelled; pages of running batches stay with them.
        """
        with self._cond:
            self._stop.set()
            self.settled = True
            n = 0
            while n < len(self._ok) and self._ok[n]:
                n += 1
            free = []
            for b, (lo, hi) in enumerate(self.batches):
                if self.state[b] == self.PENDING:
                    self.state[b] = self.CANCELLED
                if self.state[b] != self.RUNNING:
                    free += [p for i, p in enumerate(self.host_pages[lo:hi], lo) if i >= n]
            return n, free


@dataclass
class Lease:
    """Device pages a request uses: the first ``len(device_pages)`` pages of its prompt.

    ``reused`` of them came from the cache (device, host or storage; ``on_device`` of
    those were on the device already); the rest were computed. ``progress`` says which
    layers of the loaded pages arrived.
    """

    keys: list[str]
    device_pages: list[int]
    reused: int
    progress: LayerProgress | None = None
    on_device: int = 0  # of the reused pages, those already on the device
    scratch: list[int] = field(default_factory=list)  # pages of its own, freed on release
    released: bool = False


@dataclass
class _Fill:
    """What :meth:`TieredCache.acquire` fills for a prompt: chosen under the lock.

    ``loads``: ``(i, device page, host page)`` of pages loaded from the host; ``computed``: pages
    computed into the entry's own device page; ``private``: pages computed into a page of
    this request's own (another request reads the entry's), also in ``scratch``.
    """

    entries: list[PageEntry]
    reuse: int
    on_device: int
    lease_pages: list[int] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)
    loads: list[tuple[int, int, int]] = field(default_factory=list)
    computed: list[tuple[int, int]] = field(default_factory=list)
    private: list[tuple[int, int]] = field(default_factory=list)

    def filling(self) -> list[int]:
        """The prompt's pages being filled in their entries' own device pages."""
        return [i for i, _, _ in self.loads] + [i for i, _ in self.computed]


class TieredCache:
    """A KV cache over a device pool, a host pool and any storage backend.

    Args:
        backend: L3 storage (registered with ``host`` here).
        host: the host (L2) pool.
        device: the device (L1) pool, of the host pool's geometry.
        config: behaviour (:class:`TierConfig`).
        salt: the first link of every page-hash chain (see :func:`page_hashes`).
    """

    def __init__(
        self,
        backend: HiCacheStorage,
        host: HostKVPool,
        device: DevicePool,
        config: TierConfig | None = None,
        salt: str | None = None,
    ) -> None:
        self.backend, self.host, self.device = backend, host, device
        self.config = config or TierConfig()
        self.page_size = host.page_size
        self.salt = salt
        self.index = PrefixIndex()
        #: How often prompts used each page, across evictions (``admit_after``).
        self.admission = SeenCounter(self.config.admit_after)
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._lock = threading.RLock()
        self._log = RateLimitedLog(logger)
        self._io = Workers(self.config.io_workers, "hicache-prefetch")
        # Prefetches whose request gave up waiting on a read still running: while one is
        # there, new prefetches are misses at once.
        self._hung: set[PrefetchOp] = set()
        # Existence queries on a thread of their own, one at a time: a query that hangs
        # makes the next ones misses at once, and never holds up the prefetch threads.
        self._exists_pool = Workers(1, "hicache-exists")
        self._exists_future: Any = None
        self._prefetch_pages = 0  # host pages held by running prefetches
        self._backups: queue.Queue[tuple[list[str], list[int]] | None] = queue.Queue()
        self._backup_pending = 0
        self._queued: set[str] = set()  # keys waiting for the backup thread
        self._failed: set[str] = set()  # keys whose backup failed (counted once)
        self._backup_idle = threading.Condition(self._lock)
        self._ready = threading.Condition(self._lock)
        self._closed = False
        backend.register_mem_pool_host(host)
        self._backup_thread = threading.Thread(
            target=self._backup_loop, name="hicache-backup", daemon=True
        )
        self._backup_thread.start()

    # ------------------------------------------------------------------ lookups

    def keys_of(self, token_ids: Sequence[int]) -> list[str]:
        """The page hashes of the full pages of ``token_ids``."""
        n = len(token_ids) // self.page_size * self.page_size
        return page_hashes(list(token_ids[:n]), self.page_size, self.salt)

    def match_prefix(self, keys: list[str]) -> PrefixMatch:
        """The prompt's device-ready prefix and its logical prefix, in pages.

        The logical prefix adds what storage holds after the host-known pages (one
        existence query in chunks of ``exists_chunk``, stopping at the first miss, agreed
        by MIN over the ranks).
        """
        with self._lock:
            local = self.index.match(keys)
        # Every rank counts from the same point: the host prefix, agreed first.
        host = agree(local.host_pages)
        device = min(local.device_pages, host)
        mine, answered = self._storage_run(keys[host:])
        stored = agree(mine)
        if answered:  # (a failed or refused query proves nothing about what it holds)
            with self._lock:
                self._not_stored(keys[host + mine :])  # (this rank's own answer)
        return PrefixMatch(keys, device, host, host + stored)

    def _not_stored(self, keys: list[str]) -> None:
        """Forget that storage holds ``keys``: its leading run ended before them (lock held).

        A store can lose pages it held (a restart, eviction, a TTL). Trusted still, such
        a page would never be written again when it is computed again, and no prompt
        through it would hit storage again; forgotten, it is backed up as a new page
        (a page the store does hold is written again at worst: first writer wins).
        """
        for key in keys:
            entry = self.index.entries.get(key)
            if entry is not None and entry.stored:
                entry.stored = False
                self.index._forget_if_empty(entry)

    def _storage_run(self, keys: list[str]) -> tuple[int, bool]:
        """The leading run of ``keys`` in storage, and whether the store answered.

        0 for a store that fails, or that hangs past ``exists_timeout`` (the query runs
        on an I/O thread); not answered then, nor while the backend's circuit breaker
        is open (its answer was a refusal, not a miss).
        """
        run = 0
        chunk = self.config.exists_chunk
        answered = True
        for at in range(0, len(keys), chunk):
            part = keys[at : at + chunk]
            stuck = self._exists_future
            if stuck is not None and not stuck.done():
                self._count(storage_errors=1)  # the last query still hangs: a miss
                answered = False
                break
            try:
                future = self._exists_pool.submit(self.backend.batch_exists, part)
                self._exists_future = future
                found = int(future.result(self.config.exists_timeout))
            except Exception:  # noqa: BLE001 - a store that fails or hangs is a miss
                self._count(storage_errors=1)
                found = 0
                answered = False
            run += max(0, min(found, len(part)))
            if found < len(part):
                break
        if answered and getattr(self.backend, "circuit", "off") == "open":
            answered = False
        return run, answered

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, match: PrefixMatch) -> PrefetchOp | None:
        """Start reading the storage part of ``match``'s logical prefix into host pages.

        None when it is shorter than ``prefetch_threshold`` tokens, when prefetches hold
        too much of the host pool (rate limiting), when no host room can be made, or while
        a read an earlier request gave up waiting for still hangs (``prefetch_hung``).
        Every rank takes the same decision (MIN-agreed).
        """
        keys = match.keys[match.host_pages : match.logical_pages]
        threshold = self.config.prefetch_threshold
        if not keys or len(keys) * self.page_size < threshold:
            return None
        if self._closed:  # (every rank closes at once: no reduce is skipped alone)
            self._count(prefetch_dropped=1)
            return None
        with self._lock:
            self._hung = {op for op in self._hung if not op.finished}
            # Rate limiting: prefetches hold at most this much of the host pool; a long
            # hit is cut to what fits (its leading part is what a request can use).
            room = int(self.config.prefetch_host_fraction * self.host.num_pages)
            room -= self._prefetch_pages
            want = max(0, min(len(keys), room))
            if self._hung:  # the store still hangs on an earlier read: a miss at once
                pages = []
            elif want and want * self.page_size >= threshold:
                pages = self._host_pages(want) or []
            else:
                pages = []
        take = agree(len(pages))  # every rank prefetches the same pages, or none
        if take < len(pages):
            self._free_host(pages[take:])
            pages = pages[:take]
        if not pages or take * self.page_size < threshold:
            self._free_host(pages)
            if self._hung:
                self._count(prefetch_hung=1, storage_errors=1)
            else:
                self._count(prefetch_dropped=1)
            return None
        keys = keys[:take]
        op = PrefetchOp(keys, pages, self.config.batch_pages)
        with self._lock:
            self._prefetch_pages += len(pages)
        for b in range(len(op.batches)):
            self._io.submit(self._prefetch_batch, op, b)
        return op

    def _prefetch_batch(self, op: PrefetchOp, b: int) -> None:
        lo, hi = op.batches[b]
        if not op._start(b):
            return
        ok = [False] * (hi - lo)
        try:
            idx = self._host_indices(op.host_pages[lo:hi])
            got = list(self.backend.batch_get_v1(op.keys[lo:hi], idx))[: hi - lo]
            run = 0
            while run < len(got) and got[run] is True:
                run += 1
            ok[:run] = [True] * run
            self._count(prefetch_bytes=run * self.host.page_bytes)
        except Exception:  # noqa: BLE001 - counted and logged (rate limited): a miss
            self._count(storage_errors=1)
            self._log("prefetch", "prefetch batch failed; its pages are misses", exc_info=True)
        finally:
            if op._batch_done(b, ok):  # settled meanwhile: these pages are ours to free
                with self._lock:
                    self._prefetch_pages -= hi - lo
                    self._free_host(op.host_pages[lo:hi])
                op._freed()

    def finish_prefetch(self, op: PrefetchOp) -> int:
        """Wait for ``op`` as the prefetch policy says; keep its leading run.

        ``best_effort`` takes what arrived by now; ``timeout`` waits up to its limit;
        ``wait_complete`` waits for every batch. The leading run (agreed over the ranks)
        goes into the index as host pages; the rest is freed (a batch still running
        frees its pages when it ends). Returns the pages taken.
        """
        if op.settled:  # once per op: its pages belong to the index now
            return 0
        policy, cap = self.config.prefetch_policy, self.config.prefetch_max_wait
        waited_out = False
        if policy == "timeout":
            tokens = len(op.keys) * self.page_size
            waited_out = not op.wait(
                min(
                    cap,
                    self.config.prefetch_timeout_base
                    + self.config.prefetch_timeout_per_ki_token * tokens / 1024,
                )
            )
        elif policy == "wait_complete":
            waited_out = not op.wait(cap)  # (a store that hangs must not hang the request)
        done, free = op._settle()
        if waited_out and not op.finished:  # a read still running after the wait
            with self._lock:
                self._hung.add(op)
        self._count(prefetch_seconds=op.ended - op.started)
        take = agree(done)
        if take == len(op.keys):
            self._count(prefetch_completed=1)
        elif op.short:
            self._count(prefetch_short=1)
        else:
            self._count(prefetch_terminated=1)
        with self._lock:
            running = len(op.host_pages) - done - len(free)  # freed by their batches
            self._prefetch_pages -= len(op.host_pages) - running
            for key, page in zip(op.keys[:take], op.host_pages[:take], strict=True):
                entry = self.index.get(key)
                if entry.host is None and entry.device is None:
                    entry.stored = True
                    self.index.set_host(entry, page)
                else:
                    self._free_host([page])
                entry.pins += 1  # held for the request (acquire lets them go)
                op.held.append(entry)
            self._free_host([*op.host_pages[take:done], *free])
        self._count(prefetched_tokens=take * self.page_size)
        self._count(bytes_read=take * self.host.page_bytes)
        return take

    # ------------------------------------------------------------------ requests

    def acquire(
        self,
        keys: list[str],
        compute: Callable[[int, int], None],
        reuse_limit: int | None = None,
        timeout: float | None = None,
        prefetched: PrefetchOp | None = None,
    ) -> Lease:
        """Put the prompt's pages on the device and pin them for the request.

        Pages held on the device are reused; pages held on the host are loaded (layer by
        layer); the rest of the prompt, from the first page held nowhere (or from
        ``reuse_limit``: what the ranks agreed to reuse), is computed: ``compute(i,
        device_page)`` fills device page ``device_page`` with page ``i``'s KV. A page to
        compute that another request is using is computed into a page of this request's
        own (freed on release), never over the one being read. New pages are then
        written back as the write policy says. ``prefetched``: the prefetch whose pages
        were held for this request (:meth:`finish_prefetch`); they are let go here.

        Waits (up to ``timeout`` seconds, default ``TierConfig.acquire_timeout``) for
        pages another request is filling and for device pages other requests hold;
        :class:`BackendError` after that. If ``compute`` or the load raises, every page
        it was filling is dropped (never left as if filled), the pins are released, and
        the exception propagates.
        """
        if self._closed:
            raise BackendClosedError("the tiered cache is closed")
        if reuse_limit is not None and reuse_limit < 0:
            raise ConfigError(f"reuse_limit must be >= 0, got {reuse_limit}")
        if len(keys) > self.device.num_pages:
            raise ConfigError(
                f"a prompt of {len(keys)} pages cannot fit a device pool of "
                f"{self.device.num_pages} pages"
            )
        wait = self.config.acquire_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait  # (the wait for the lock counts too)
        with self._lock:
            try:
                fill = self._pin_prompt(keys, reuse_limit, wait, deadline)
            finally:
                if prefetched is not None:
                    self._let_go(prefetched)
            self.admission.see(keys)
        progress = self._fill(fill, compute)
        with self._lock:
            for i in fill.filling():
                fill.entries[i].ready = True
            self._ready.notify_all()
            for i, _ in fill.computed:
                fill.entries[i].hits = 1
            self._write_policy(fill.entries)
        return Lease(
            keys, fill.lease_pages, fill.reuse, progress, fill.on_device, scratch=fill.scratch
        )

    def _pin_prompt(
        self, keys: list[str], reuse_limit: int | None, wait: float, deadline: float
    ) -> _Fill:
        """Pin the prompt's pages and give each a device page: what :meth:`acquire` fills.

        Under the lock. Waits (until ``deadline``, ``wait`` seconds after the call began)
        for pages another request is filling and for device pages; :class:`BackendError`
        after that.
        """
        while True:
            # Pages another request is filling are waited for, never taken half-filled.
            if not self._ready.wait_for(
                lambda: self._all_ready(keys), max(0.0, deadline - time.monotonic())
            ):
                raise BackendError(f"pages of the prompt stayed busy for {wait} s")
            match = self.index.match(keys)
            reuse = match.host_pages
            if reuse_limit is not None:
                reuse = min(reuse, reuse_limit)
            entries = [self.index.get(k) for k in keys]
            # Past the reused prefix, a device page another request holds is not computed
            # over: this request computes into a page of its own.
            shared = {
                i for i in range(reuse, len(keys))
                if entries[i].device is not None and entries[i].pins > 0
            }  # fmt: skip
            need = sum(e.device is None for e in entries) + len(shared)
            for e in entries:
                e.pins += 1
            pages = self._device_pages(need)
            if pages is not None:
                break
            self._unpin(entries)  # others hold the pool: wait for a release
            left = deadline - time.monotonic()
            if left <= 0 or not self._ready.wait(left):
                raise BackendError(
                    f"the device pool stayed full for {wait} s (a prompt of "
                    f"{len(keys)} pages waits for pages other requests hold)"
                )
        fill = _Fill(entries, reuse, min(match.device_pages, reuse))
        it = iter(pages)
        for i, e in enumerate(entries):
            if i in shared:
                page = next(it)
                fill.scratch.append(page)
                fill.private.append((i, page))
                fill.lease_pages.append(page)
                continue
            device = e.device
            if i >= reuse or device is None:
                if device is None:
                    device = next(it)
                    self.index.set_device(e, device)
                if i < reuse:
                    assert e.host is not None  # (reused: held on the host, and pinned)
                    fill.loads.append((i, device, e.host))
                else:
                    fill.computed.append((i, device))
                e.ready = False
            fill.lease_pages.append(device)
        for e in reversed(entries):  # the head most recent: eviction takes tails first
            self.index.touch(e)
        for e in entries[:reuse]:
            e.hits += 1
        self._count(
            lookup_tokens=len(keys) * self.page_size,
            device_hit_tokens=fill.on_device * self.page_size,
            host_hit_tokens=(reuse - fill.on_device) * self.page_size,
            computed_tokens=(len(keys) - reuse) * self.page_size,
        )
        return fill

    def _fill(self, fill: _Fill, compute: Callable[[int, int], None]) -> LayerProgress | None:
        """Load and compute the pages :meth:`_pin_prompt` chose (outside the lock).

        If a load or ``compute`` raises, every page being filled is dropped (never left
        looking filled), the pins are released, and the exception propagates.
        """
        entries = fill.entries
        progress = None
        try:
            if fill.loads:
                progress = self.device.load(
                    [page for _, page, _ in fill.loads], [host for _, _, host in fill.loads]
                )
                self._count(bytes_loaded=len(fill.loads) * self.host.page_bytes)
            for i, page in fill.computed:
                compute(i, page)
            for i, page in fill.private:
                compute(i, page)
        except BaseException:
            with self._lock:
                for i in fill.filling():
                    e = entries[i]
                    own = e.device
                    self.index.set_device(e, None)
                    if own is not None:
                        self.device.free([own])
                    e.ready = True
                self.device.free(fill.scratch)
                self._unpin(entries)
            raise
        return progress

    def release_prefetch(self, op: PrefetchOp) -> None:
        """Let go of the pages :meth:`finish_prefetch` held for a request.

        For a request that will not :meth:`acquire` them (``acquire(prefetched=op)``
        does this itself).
        """
        with self._lock:
            self._let_go(op)

    def _let_go(self, op: PrefetchOp) -> None:
        held, op.held = op.held, []
        self._unpin(held)

    def _all_ready(self, keys: list[str]) -> bool:
        entries = self.index.entries
        return all(e.ready for e in (entries.get(k) for k in keys) if e is not None)

    def _unpin(self, entries: list[PageEntry]) -> None:
        """Release a request's pins (lock held); entries left with nothing are forgotten."""
        for e in entries:
            e.pins -= 1
            self.index._forget_if_empty(e)
        self._ready.notify_all()

    def release(self, lease: Lease) -> None:
        """The request is done with its pages: they may be evicted again (once per lease)."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            self.device.free(lease.scratch)
            self._unpin([self.index.get(k) for k in lease.keys])

    # ------------------------------------------------------------------ write policy, backup

    def _write_policy(self, entries: list[PageEntry]) -> None:
        """Back up pages as the write policy says (lock held)."""
        policy = self.config.write_policy
        if policy == "write_back":
            return
        need = 1 if policy == "write_through" else self.config.selective_hits
        todo = [e for e in entries if e.hits >= need and e.host is None and e.device is not None]
        if todo:
            self._offload(todo)
        due = [e for e in entries if e.hits >= need and e.host is not None and not e.stored]
        if self.admission.on and due:
            due = [
                e
                for e, ok in zip(due, self.admission.admitted([e.key for e in due]), strict=True)
                if ok
            ]
        self._backup(due)

    def _offload(self, entries: list[PageEntry]) -> list[PageEntry]:
        """Copy device pages to new host pages (lock held); returns those copied."""
        pages = self._host_pages(len(entries))
        if pages is None:
            return []
        self.device.store([e.device for e in entries], pages)  # type: ignore[misc]
        for e, page in zip(entries, pages, strict=True):
            self.index.set_host(e, page)
        self._count(bytes_offloaded=len(pages) * self.host.page_bytes)
        return entries

    def _backup(self, entries: list[PageEntry]) -> None:
        """Queue host pages not yet stored for the backup thread (lock held)."""
        todo = [
            e for e in entries if not e.stored and e.host is not None and e.key not in self._queued
        ]
        if not todo:
            return
        if self._closed:  # no backup thread any more
            self._backup_failed([e.key for e in todo])
            return
        for e in todo:
            e.host_pins += 1  # the host page stays until the backup ran
            self._queued.add(e.key)
        self._backup_pending += 1
        self._backups.put(([e.key for e in todo], [e.host for e in todo]))  # type: ignore[misc]

    def _backup_loop(self) -> None:
        while True:
            item = self._backups.get()
            if item is None:
                return
            keys, pages = item
            try:
                self._backup_batches(keys, pages)
            except Exception:  # noqa: BLE001 - logged (rate limited); the loop goes on
                self._log("backup", "backup failed", exc_info=True)
            finally:
                with self._lock:
                    self._backup_done(keys)

    def _backup_done(self, keys: list[str]) -> None:
        """A queued backup is over (run or dropped): its host pages may go (lock held)."""
        for key in keys:
            self._queued.discard(key)
            entry = self.index.entries.get(key)
            if entry is not None:
                entry.host_pins -= 1
        self._backup_pending -= 1
        self._backup_idle.notify_all()

    def _backup_batches(self, keys: list[str], pages: list[int]) -> None:
        step = self.config.batch_pages
        for at in range(0, len(keys), step):
            part_keys, part_pages = keys[at : at + step], pages[at : at + step]
            left = list(range(len(part_keys)))
            for attempt in range(self.config.backup_retries + 1):
                if attempt:
                    self._count(backup_retries=1)
                try:
                    ok = self.backend.batch_set_v1(
                        [part_keys[i] for i in left],
                        self._host_indices([part_pages[i] for i in left]),
                    )
                except Exception:  # noqa: BLE001 - counted as a failed attempt
                    self._count(storage_errors=1)
                    ok = [False] * len(left)
                done = [i for i, good in zip(left, ok, strict=False) if good is True]
                with self._lock:
                    for i in done:
                        self._failed.discard(part_keys[i])
                        entry = self.index.entries.get(part_keys[i])
                        if entry is not None:
                            entry.stored = True
                self._count(backup_tokens=len(done) * self.page_size)
                self._count(bytes_written=len(done) * self.host.page_bytes)
                left = [i for i in left if i not in set(done)]
                if not left:
                    break
            with self._lock:
                self._backup_failed([part_keys[i] for i in left])

    def _backup_failed(self, keys: list[str]) -> None:
        """Count pages whose backup failed, once each (lock held)."""
        new = [k for k in keys if k not in self._failed]
        self._failed.update(new)
        self._count(backup_failed_tokens=len(new) * self.page_size)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued backup ran; False on timeout."""
        with self._lock:
            return self._backup_idle.wait_for(lambda: self._backup_pending == 0, timeout)

    # ------------------------------------------------------------------ pools and eviction

    def _count(self, **counters: float) -> None:
        """Add to the stats (from any thread)."""
        with self._stats_lock:
            for name, value in counters.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _host_indices(self, pages: Sequence[int]) -> torch.Tensor:
        ps = self.page_size
        t = torch.tensor(list(pages), dtype=torch.int64)
        return (t[:, None] * ps + torch.arange(ps)).reshape(-1)

    def _free_host(self, pages: Sequence[int]) -> None:
        if pages:
            self.host.free(self._host_indices(pages))

    def _host_pages(self, n: int) -> list[int] | None:
        """``n`` host pages, evicting least-recently-used ones that are safe to drop."""
        if n == 0:
            return []
        while True:
            got = self.host.alloc(n * self.page_size)
            if got is not None:
                return (
                    got.view(-1, self.page_size)[:, 0]
                    .div(self.page_size, rounding_mode="floor")
                    .tolist()
                )
            if not self._evict_host(n - self.host.available_size() // self.page_size):
                return None

    def _evict_host(self, n: int) -> bool:
        """Free ``n`` host pages (lock held); False if not enough can go."""
        freed = 0
        for e in self.index.victims("host"):
            if freed >= n:
                break
            if not (e.stored or e.device is not None):
                if self.admission.on and not self.admission.admitted([e.key])[0]:
                    self._count(not_admitted_pages=1)  # not worth storing yet: dropped
                elif self.config.write_policy == "write_back":
                    self._backup([e])  # kept (pinned) until stored; then it can go
                    continue
                else:
                    continue
            page = e.host
            self.index.set_host(e, None)
            self._free_host([page])  # type: ignore[list-item]
            self._count(evicted_host_pages=1)
            freed += 1
        return freed >= n

    def _device_pages(self, n: int) -> list[int] | None:
        """``n`` device pages, evicting least-recently-used ones (lock held)."""
        got = self.device.alloc(n)
        if got is not None:
            return got
        victims = self.index.victims("device")
        if self.device.free_pages + len(victims) < n:
            return None  # not enough even after evicting: evict nothing
        while got is None:
            self._evict_device(victims.pop(0))
            got = self.device.alloc(n)
        return got

    def _evict_device(self, e: PageEntry) -> None:
        if e.host is None and self.config.write_policy == "write_back":
            self._offload([e])  # kept reachable from the host
        page = e.device
        self.index.set_device(e, None)
        self.device.free([page])  # type: ignore[list-item]
        self._count(evicted_device_pages=1)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish the queued backups, then stop the threads; the backend stays open.

        Backups still queued after ``close_timeout`` seconds count as failed. A thread
        stuck in the store is left to it (a daemon thread: the process can still exit).
        """
        if self._closed:
            return
        self._closed = True
        if not self.flush(self.config.close_timeout):
            dropped = []
            while True:
                try:
                    item = self._backups.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    dropped.append(item)
            with self._lock:
                for keys, _pages in dropped:
                    self._backup_failed(keys)
                    self._backup_done(keys)
            logger.warning(
                "close: backups did not finish in %s s; %d batches counted as failed",
                self.config.close_timeout,
                len(dropped),
            )
        self._backups.put(None)
        self._backup_thread.join(self.config.close_timeout)
        self._io.shutdown()
        self._exists_pool.shutdown()
