"""The tiered-cache workload: a multi-turn trace, a stand-in model, and its replay.

A synthetic trace, a deterministic stand-in for the model, and a replay of the trace
through a :class:`~hicache_storage.tier.controller.TieredCache` that checks every reused
page byte for byte.

The trace: ``sessions`` conversations, each opening with one of ``system_prompts`` shared
system prompts, then ``turns`` turns, each adding ``user_tokens`` of question to the
prompt and ``answer_tokens`` of answer after it (the next turn's prompt holds the whole
history). Sessions take turns in a shuffled order per round, so a session's history is
cold by its next turn: it comes back from the host or storage, or is computed again.

The stand-in model: the KV of a page is a function of its page hash (which chains every
token before it) and of the layer and half (K or V), so any page that comes back from
any tier can be checked against what it must be.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.errors import ConfigError
from hicache_storage.keys import page_hashes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from hicache_storage.tier.controller import TieredCache
    from hicache_storage.tier.device import DevicePool

__all__ = [
    "Request",
    "RunResult",
    "Workload",
    "fill_page",
    "ideal_hit_tokens",
    "ideal_runs",
    "page_differs",
    "replay",
]

_MUL = 0x9E3779B97F4A7C15 - 2**64  # (as an int64)


@dataclass(frozen=True)
class Workload:
    """The shape of a synthetic multi-turn trace (token counts)."""

    sessions: int = 48
    turns: int = 4
    system_prompts: int = 4
    system_tokens: int = 1024
    user_tokens: int = 128
    answer_tokens: int = 128
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        """Check the values (:class:`ConfigError`)."""
        for name, value in asdict(self).items():
            if name != "seed" and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"workload {name} must be a positive int, got {value!r}")

    def requests(self) -> Iterator[Request]:
        """The trace, in arrival order."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(self.vocab) for _ in range(n)]

        systems = [tokens(self.system_tokens) for _ in range(self.system_prompts)]
        history = [list(systems[s % self.system_prompts]) for s in range(self.sessions)]
        for turn in range(self.turns):
            order = list(range(self.sessions))
            rng.shuffle(order)
            for s in order:
                prompt = history[s] + tokens(self.user_tokens)
                answer = tokens(self.answer_tokens)
                history[s] = prompt + answer
                yield Request(s, turn, prompt, answer)

    @property
    def count(self) -> int:
        """Requests in the trace."""
        return self.sessions * self.turns


@dataclass(frozen=True)
class Request:
    """One turn: the prompt (prefill) and the answer the model gives (decode)."""

    session: int
    turn: int
    prompt: list[int]
    answer: list[int]


def ideal_runs(requests: list[Request], page_size: int) -> list[int]:
    """Per request, the prompt pages a cache that never forgets would hit.

    The cache starts empty with the first request (it knows nothing of earlier runs): a
    prompt page hits when its hash was seen before in this list (in any earlier prompt
    or answer), and the hits are the leading run of those.
    """
    seen: set[str] = set()
    runs = []
    for r in requests:
        n = len(r.prompt) // page_size
        keys = page_hashes(r.prompt + r.answer, page_size)
        run = 0
        while run < n and keys[run] in seen:
            run += 1
        runs.append(run)
        seen.update(keys)
    return runs


def ideal_hit_tokens(requests: list[Request], page_size: int) -> tuple[int, int]:
    """``(hit, total)`` prompt tokens of full pages, for a cache that never forgets.

    The hits are :func:`ideal_runs`' pages.
    """
    hit = sum(ideal_runs(requests, page_size)) * page_size
    total = sum(len(r.prompt) // page_size for r in requests) * page_size
    return hit, total


def _stream(key: str, layer: int, half: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` pseudo-random bytes determined by (key, layer, half)."""
    seed = (
        int.from_bytes(
            hashlib.blake2b(f"{key}:{layer}:{half}".encode(), digest_size=8).digest(), "little"
        )
        - 2**63
    )
    words = (nbytes + 7) // 8
    x = torch.arange(words, dtype=torch.int64) * _MUL + seed
    x = x ^ (x >> 31)
    x = x * _MUL
    x = x ^ (x >> 29)
    return x.view(torch.uint8)[:nbytes]


def fill_page(device: DevicePool, page: int, key: str) -> None:
    """Write the stand-in model's KV of the page ``key`` into device page ``page``."""
    for layer in range(device.layer_num):
        for half, t in enumerate(device.page_layer(page, layer)):
            flat = t.view(-1).view(torch.uint8)
            flat.copy_(_stream(key, layer, half, flat.numel()))


def page_differs(device: DevicePool, page: int, key: str) -> bool:
    """True if device page ``page`` does not hold the stand-in model's KV of ``key``."""
    for layer in range(device.layer_num):
        for half, t in enumerate(device.page_layer(page, layer)):
            flat = t.reshape(-1).view(torch.uint8).cpu()
            if not torch.equal(flat, _stream(key, layer, half, flat.numel())):
                return True
    return False


@dataclass
class RunResult:
    """What a replay measured (tokens are prompt tokens of full pages)."""

    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    #: hits on pages this run had not produced yet: stored by earlier runs (or processes)
    cross_run_hit_tokens: int = 0
    ideal_hit_tokens: int = 0
    verified_pages: int = 0
    verification_errors: int = 0
    seconds: float = 0.0
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from any tier."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


def replay(
    cache: TieredCache,
    workload: Workload,
    *,
    on_request: Callable[[RunResult], None] | None = None,
    verify: bool = True,
) -> RunResult:
    """Run every request of ``workload`` through ``cache`` as an engine would.

    Per request: the prompt's pages are matched (device, host, storage), the storage part
    is prefetched (as the prefetch policy says), the pages are put on the device (loaded,
    or computed by the stand-in model), every reused page is verified, and the answer's
    pages are computed and cached too. ``on_request`` is called after each request.
    """
    requests = list(workload.requests())
    ps = cache.page_size
    runs = ideal_runs(requests, ps)
    out = RunResult(ideal_hit_tokens=sum(runs) * ps)
    start = time.perf_counter()
    backend = cache.backend
    for r, ideal_run in zip(requests, runs, strict=True):
        keys = cache.keys_of(r.prompt + r.answer)
        n_prompt = len(r.prompt) // ps
        match = cache.match_prefix(keys[:n_prompt])
        taken = 0
        op = cache.prefetch(match)
        if op is not None:
            taken = cache.finish_prefetch(op)
        # (what the ranks agreed on: the host prefix and the prefetched pages)
        lease = cache.acquire(
            keys, _filler(cache, keys), reuse_limit=match.host_pages + taken, prefetched=op
        )
        try:
            if lease.progress is not None:
                lease.progress.wait(cache.device.layer_num - 1)
            reused = min(lease.reused, n_prompt)
            on_device = min(lease.on_device, reused)
            from_storage = min(taken, reused - on_device)
            out.device_hit_tokens += on_device * ps
            out.storage_hit_tokens += from_storage * ps
            out.host_hit_tokens += (reused - on_device - from_storage) * ps
            out.prompt_tokens += n_prompt * ps
            out.cross_run_hit_tokens += max(0, reused - ideal_run) * ps
            if verify:
                for i in range(lease.reused):
                    out.verified_pages += 1
                    out.verification_errors += page_differs(
                        cache.device, lease.device_pages[i], keys[i]
                    )
        finally:
            cache.release(lease)
        out.requests += 1
        out.seconds = time.perf_counter() - start
        stats = backend.get_stats(reset=False)
        out.timeline.append(
            {
                "t": out.seconds,
                "hit_ratio": out.hit_tokens / max(1, out.prompt_tokens),
                "hit_ratio_storage": out.storage_hit_tokens / max(1, out.prompt_tokens),
                "hit_ratio_device": out.device_hit_tokens / max(1, out.prompt_tokens),
                "hit_ratio_host": out.host_hit_tokens / max(1, out.prompt_tokens),
                "hit_ratio_cross_run": out.cross_run_hit_tokens / max(1, out.prompt_tokens),
                "bytes_read": float(cache.stats.bytes_read),
                "bytes_written": float(cache.stats.bytes_written),
                "circuit_open": float(backend.circuit in ("open", "half_open")),
                "breaker_rejections": float(stats.breaker_rejections),
                "backup_failed_tokens": float(cache.stats.backup_failed_tokens),
                "not_admitted_pages": float(cache.stats.not_admitted_pages),
            }
        )
        if on_request is not None:
            on_request(out)
    cache.flush()
    out.seconds = time.perf_counter() - start
    return out


def _filler(cache: TieredCache, keys: list[str]) -> Callable[[int, int], None]:
    """The stand-in model's computation of page ``i`` of ``keys`` into a device page."""

    def compute(i: int, page: int) -> None:
        fill_page(cache.device, page, keys[i])

    return compute


def summary(result: RunResult, cache: TieredCache) -> dict[str, Any]:
    """One JSON-ready object of a run's figures."""
    s, total = cache.stats, max(1, result.prompt_tokens)
    ideal = result.ideal_hit_tokens
    within = result.hit_tokens - result.cross_run_hit_tokens
    return {
        "requests": result.requests,
        "seconds": round(result.seconds, 3),
        "requests_per_second": round(result.requests / max(result.seconds, 1e-9), 2),
        "prompt_tokens": result.prompt_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_ratio": result.hit_tokens / total,
        "hit_ratio_device": result.device_hit_tokens / total,
        "hit_ratio_host": result.host_hit_tokens / total,
        "hit_ratio_storage": result.storage_hit_tokens / total,
        # Within the run: hits an unbounded cache over this run's requests alone could
        # have; across runs: hits on pages stored before this run began.
        "hit_ratio_within_run": within / total,
        "hit_ratio_cross_run": result.cross_run_hit_tokens / total,
        "ideal_hit_ratio": ideal / total,
        "hit_ratio_vs_ideal": within / ideal if ideal else None,  # (no reuse possible)
        "prefill_tokens_saved": result.hit_tokens,
        "prefill_tokens_saved_ideal": ideal,
        "verified_pages": result.verified_pages,
        "verification_errors": result.verification_errors,
        "bytes_read_from_storage": s.bytes_read,
        "bytes_written_to_storage": s.bytes_written,
        "bytes_loaded_to_device": s.bytes_loaded,
        "bytes_offloaded_to_host": s.bytes_offloaded,
        "prefetch_gbps": s.prefetch_bytes / s.prefetch_seconds / 1e9 if s.prefetch_seconds else 0.0,
        "prefetch_completed": s.prefetch_completed,
        "prefetch_terminated": s.prefetch_terminated,
        "prefetch_short": s.prefetch_short,
        "prefetch_dropped": s.prefetch_dropped,
        "backup_tokens": s.backup_tokens,
        "backup_failed_tokens": s.backup_failed_tokens,
        "backup_retries": s.backup_retries,
        "storage_errors": s.storage_errors,
        "evicted_device_pages": s.evicted_device_pages,
        "evicted_host_pages": s.evicted_host_pages,
        "admit_after": cache.config.admit_after,
        "not_admitted_pages": s.not_admitted_pages,
    }
