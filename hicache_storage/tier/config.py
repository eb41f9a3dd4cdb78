"""How the tiers behave (:class:`TierConfig`) and what they counted (:class:`TierStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hicache_storage.admission import MAX_MIN_SEEN
from hicache_storage.errors import ConfigError

__all__ = ["TierConfig", "TierStats"]


@dataclass(frozen=True)
class TierConfig:
    """How the tiers behave.

    Attributes:
        write_policy: ``write_through`` (new pages go to host and storage at once),
            ``write_through_selective`` (after ``selective_hits`` uses), or ``write_back``
            (to the host when evicted from the device, to storage when evicted from the
            host).
        selective_hits: uses before ``write_through_selective`` backs a page up.
        prefetch_threshold: tokens; a storage hit shorter than this is not prefetched.
        prefetch_policy: ``best_effort`` (take what arrived by the time the request runs),
            ``wait_complete``, or ``timeout`` (wait ``prefetch_timeout_base`` +
            ``prefetch_timeout_per_ki_token`` per 1024 tokens, then take what arrived).
        io_workers: prefetch threads.
        exists_chunk: keys per existence query (the query stops at the first miss).
        batch_pages: pages per storage read or write.
        backup_retries: retries of a failed backup batch before its pages count as failed.
        prefetch_host_fraction: prefetches are refused while the host pages they hold
            exceed this fraction of the host pool (rate limiting).
        acquire_timeout: seconds a request waits for device pages other requests hold.
        prefetch_max_wait: the longest any prefetch policy waits (``wait_complete``
            included: a store that hangs must not hang requests for good).
        exists_timeout: seconds an existence query may take (then it counts as no hit).
        close_timeout: seconds ``close()`` waits for queued backups (the rest count as
            failed).
        admit_after: store a page in L3 only once prompts have used it this many times
            (counted across evictions from device and host, in fixed memory:
            :mod:`hicache_storage.admission`); 1 stores every page the write policy
            sends. A page that leaves the host before it is admitted is dropped.
    """

    write_policy: Literal["write_through", "write_through_selective", "write_back"] = (
        "write_through"
    )
    selective_hits: int = 2
    prefetch_threshold: int = 256
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    io_workers: int = 2
    exists_chunk: int = 128
    batch_pages: int = 128
    backup_retries: int = 2
    prefetch_host_fraction: float = 0.5
    acquire_timeout: float = 10.0
    exists_timeout: float = 5.0
    close_timeout: float = 10.0
    prefetch_max_wait: float = 60.0
    admit_after: int = 1

    def __post_init__(self) -> None:
        """Check the values (:class:`ConfigError`)."""
        if self.write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ConfigError(f"unknown write_policy {self.write_policy!r}")
        if self.prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ConfigError(f"unknown prefetch_policy {self.prefetch_policy!r}")
        for name in ("selective_hits", "io_workers", "exists_chunk", "batch_pages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.backup_retries < 0 or self.prefetch_threshold < 0:
            raise ConfigError("backup_retries and prefetch_threshold must be >= 0")
        if not 1 <= self.admit_after <= MAX_MIN_SEEN:
            raise ConfigError(f"admit_after must be from 1 to {MAX_MIN_SEEN}")
        if not 0 < self.prefetch_host_fraction <= 1:
            raise ConfigError("prefetch_host_fraction must be in (0, 1]")


@dataclass
class TierStats:
    """Counters of a :class:`TieredCache` (tokens unless named otherwise)."""

    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    prefetch_completed: int = 0
    prefetch_terminated: int = 0
    prefetch_short: int = 0  # ended short by a miss or a storage failure
    prefetch_dropped: int = 0  # refused for host capacity (rate limiting) or no room
    prefetch_hung: int = 0  # refused at once: a read a request gave up on still hangs
    prefetched_tokens: int = 0
    prefetch_bytes: int = 0  # read by prefetches (taken or not)
    prefetch_seconds: float = 0.0  # wall time of prefetches, from start to their last batch
    backup_tokens: int = 0
    backup_failed_tokens: int = 0
    backup_retries: int = 0
    storage_errors: int = 0
    bytes_read: int = 0  # L3 -> L2
    bytes_written: int = 0  # L2 -> L3
    bytes_loaded: int = 0  # L2 -> L1
    bytes_offloaded: int = 0  # L1 -> L2
    evicted_device_pages: int = 0
    evicted_host_pages: int = 0
    #: Pages not backed up because they were not admitted yet (``admit_after``), counted
    #: once each when they left the host unstored.
    not_admitted_pages: int = 0
    extra: dict[str, int] = field(default_factory=dict)
