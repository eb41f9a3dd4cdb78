"""``hicache-storage run``: the tiered-cache workload on a backend, every reused page checked.

A synthetic multi-turn trace (:class:`~hicache_storage.tier.workload.Workload`) goes
through device and host pools and the chosen L3 backend
(:class:`~hicache_storage.tier.controller.TieredCache`); the report gives the hit ratio
per tier against an unbounded cache's on the same trace, bytes moved, prefetch and backup
outcomes, and the verification count (pages that came back wrong: must be 0).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.cli.bench import build_backend
from hicache_storage.errors import ConfigError
from hicache_storage.host_pool import HostKVPool
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.tier.config import TierConfig
from hicache_storage.tier.controller import TieredCache
from hicache_storage.tier.device import DevicePool
from hicache_storage.tier.workload import RunResult, Workload, replay, summary

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

__all__ = ["run_workload"]


def run_workload(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Run the workload as ``args`` say; print the report; exit status."""
    from tqdm import tqdm

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--plot needs matplotlib: pip install 'hicache-storage[plot]' "
                "(in this repository: .venv/bin/pip install -e '.[plot]')"
            ) from None
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--plot: cannot write into {folder}")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            raise ConfigError(f"--device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: this torch has no CUDA device")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device_pages > args.host_pages * 4:
        raise ConfigError("--device-pages more than 4x --host-pages leaves the host no room")
    workload = Workload(
        sessions=args.sessions, turns=args.turns, system_prompts=args.system_prompts,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens, seed=args.seed,
    )  # fmt: skip
    per_request = (
        args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    ) // args.page_size + 1
    if per_request > args.device_pages:
        raise ConfigError(
            f"a request of the last turn needs {per_request} device pages; "
            f"--device-pages is {args.device_pages}"
        )
    host = HostKVPool(
        num_pages=args.host_pages, page_size=args.page_size, layer_num=args.layer_num,
        kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    ns = KVCacheNamespace.for_pool(host, model_id="hicache-storage-run", tenant=args.tenant)
    stop_metrics = _serve_metrics(args.metrics_port)
    try:
        backend = build_backend(args.backend, ns, options)
    except BaseException:
        stop_metrics()
        raise
    # The store's own removal reports (what a router would get as removal events).
    removals = {"pages": 0, "clears": 0}
    removals_lock = threading.Lock()  # (reported from the backup thread and this one)

    def removed(keys: list[str] | None) -> None:
        with removals_lock:
            if keys is None:
                removals["clears"] += 1
            else:
                removals["pages"] += len(keys)

    try:
        if args.clear and backend.capabilities.delete:
            backend.clear()
        # (Counted only from a backend that reports its own evictions: one that reports
        # deletes alone, as a remote store does, would show 0 for a store that evicts.)
        watched = "evict" in backend.reports_removals and backend.watch_removals(removed)
        config = TierConfig(
            write_policy=args.write_policy, prefetch_policy=args.prefetch_policy,
            prefetch_threshold=args.prefetch_threshold, io_workers=args.io_workers,
            admit_after=args.admit_after,
        )  # fmt: skip
        cache = TieredCache(backend, host, DevicePool(host, args.device_pages, args.device), config)
        try:
            bar = tqdm(
                total=workload.count, unit="req", desc="run", leave=False,
                disable=args.no_progress or args.json, file=sys.stderr,
            )  # fmt: skip

            def step(r: RunResult) -> None:
                bar.update(1)
                if r.requests % 8 == 0:
                    bar.set_postfix(hit=f"{r.hit_tokens / max(1, r.prompt_tokens):.2f}")

            with bar:
                result = replay(cache, workload, on_request=step)
        finally:
            cache.close()
        report = summary(result, cache)
        stored = [k for k, e in cache.index.entries.items() if e.stored]
        report["backend_get_gbps"] = _backend_get_gbps(backend, host, stored)
        report["prefetch_vs_backend_get"] = (
            report["prefetch_gbps"] / report["backend_get_gbps"]
            if report["backend_get_gbps"]
            else 0.0
        )
        stats = backend.get_stats(reset=False)
        health = backend.health()
        report.update(
            backend_health=health.status,
            backend_health_reason=health.reason,
            circuit=backend.circuit,
            breaker_opens=stats.breaker_opens,
            breaker_rejections=stats.breaker_rejections,
            corrupt_objects=stats.corrupt_objects,
            # Events a router would get: pages stored, and pages the store reports it
            # removed (-1: this backend does not report its evictions).
            events_stored_pages=cache.stats.backup_tokens // args.page_size,
            events_removed_pages=removals["pages"] if watched else -1,
        )
        report.update(
            backend=args.backend,
            device=str(cache.device.device),
            page_bytes=host.page_bytes,
            host_pages=args.host_pages,
            device_pages=args.device_pages,
            working_set_pages=_working_set(workload, args.page_size),
        )
    except BaseException:
        stop_metrics()
        raise
    finally:
        backend.close()
    try:
        if args.plot is not None:
            _plot(result, report, args.plot)
            report["plot"] = args.plot
        if args.json:
            print(json.dumps(report, indent=2), flush=True)
        else:
            _print(report)
        if args.metrics_port is not None and args.metrics_hold > 0:
            time.sleep(args.metrics_hold)  # (the report is out: a last scrape)
    finally:
        stop_metrics()
    return 0 if report["verification_errors"] == 0 else 1


def _serve_metrics(port: int | None) -> Callable[[], None]:
    """Serve the metrics on 127.0.0.1:``port`` (None: off); what stops them."""
    if port is None:
        return lambda: None
    if not 0 < port < 65536:
        raise ConfigError(f"--metrics-port must be 1-65535, got {port}")
    from hicache_storage import metrics

    try:
        stop = metrics.serve(port)
    except metrics.MetricsUnavailableError as exc:
        raise ConfigError(f"--metrics-port: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: {exc.strerror or exc}") from None
    except ValueError as exc:  # (PROMETHEUS_MULTIPROC_DIR set to a missing directory)
        raise ConfigError(f"--metrics-port: {exc}") from None
    print(f"metrics: http://127.0.0.1:{port}/metrics", file=sys.stderr)
    return stop


def _backend_get_gbps(backend: Any, like: HostKVPool, keys: list[str], pages: int = 128) -> float:
    """The backend's own ``batch_get_v1`` bandwidth on up to 256 stored pages (GB/s).

    Read in batches of ``pages`` into a pool of the run's geometry, three passes, the best
    one: what the prefetch path is compared with.
    """
    import time

    keys = keys[-256:]  # (the newest: a capped store may have evicted the oldest)
    if not keys:
        return 0.0
    probe = HostKVPool(
        num_pages=pages, page_size=like.page_size, layer_num=like.layer_num,
        kv_heads=like.kv_heads, head_dim=like.head_dim, dtype=like.dtype, layout=like.layout,
    )  # fmt: skip
    backend.register_mem_pool_host(probe)
    idx = torch.arange(pages * like.page_size)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        got = 0
        for at in range(0, len(keys), pages):
            part = keys[at : at + pages]
            got += sum(backend.batch_get_v1(part, idx[: len(part) * like.page_size]))
        best = min(best, time.perf_counter() - start)
    return got * like.page_bytes / best / 1e9


def _working_set(workload: Workload, page_size: int) -> int:
    """Distinct pages of the whole trace."""
    from hicache_storage.keys import page_hashes

    seen: set[str] = set()
    for r in workload.requests():
        seen.update(page_hashes(r.prompt + r.answer, page_size))
    return len(seen)


def _print(r: dict[str, Any]) -> None:
    gb = 1e9
    rows = [
        ("requests", f"{r['requests']} in {r['seconds']:.1f} s ({r['requests_per_second']:.1f}/s)"),
        ("backend / device", f"{r['backend']} / {r['device']}"),
        ("pools", (f"device {r['device_pages']} pages, host {r['host_pages']} pages, "
                  f"working set {r['working_set_pages']} pages of {r['page_bytes']} B")),
        ("hit ratio", (f"{r['hit_ratio']:.3f} = {r['hit_ratio_within_run']:.3f} within this "
                      f"run + {r['hit_ratio_cross_run']:.3f} from pages earlier runs stored")),
        ("  within this run vs ideal", (
            f"{r['hit_ratio_within_run']:.3f} of an ideal {r['ideal_hit_ratio']:.3f} ("
            + (f"{r['hit_ratio_vs_ideal']:.3f} of it" if r["ideal_hit_ratio"] else "n/a")
            + "; ideal: an unbounded cache, empty at the start of this run)")),
        ("  device / host / storage", (f"{r['hit_ratio_device']:.3f} / {r['hit_ratio_host']:.3f} / "
                                      f"{r['hit_ratio_storage']:.3f}")),
        ("prefill tokens saved", (f"{r['prefill_tokens_saved']} of {r['prompt_tokens']} "
                                 f"(ideal {r['prefill_tokens_saved_ideal']})")),
        ("storage read / written", (f"{r['bytes_read_from_storage'] / gb:.3f} / "
                                   f"{r['bytes_written_to_storage'] / gb:.3f} GB")),
        ("host->device / device->host", (f"{r['bytes_loaded_to_device'] / gb:.3f} / "
                                        f"{r['bytes_offloaded_to_host'] / gb:.3f} GB")),
        ("prefetch done / cut / short / dropped", (
            f"{r['prefetch_completed']} / {r['prefetch_terminated']} / "
            f"{r['prefetch_short']} / {r['prefetch_dropped']}")),
        ("backup failed tokens", f"{r['backup_failed_tokens']} (retries {r['backup_retries']})"),
        ("admission", (f"after {r['admit_after']} use(s): {r['not_admitted_pages']} host evictions "
                       "dropped a page not admitted yet")),
        ("prefetch / backend get", (f"{r['prefetch_gbps']:.2f} / {r['backend_get_gbps']:.2f} GB/s "
                                    f"({r['prefetch_vs_backend_get']:.2f}x)")),
        ("verification errors", f"{r['verification_errors']} of {r['verified_pages']} pages"),
        ("store events", (f"{r['events_stored_pages']} pages stored, "
                          + (f"{r['events_removed_pages']} removed (evicted or deleted)"
                             if r["events_removed_pages"] >= 0
                             else "evictions not reported by this backend"))),
        ("store health / circuit", (f"{r['backend_health']} / {r['circuit']} (opened "
                                    f"{r['breaker_opens']}x, {r['breaker_rejections']} calls "
                                    f"answered without it; {r['corrupt_objects']} corrupt)")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")


def _plot(result: RunResult, report: dict[str, Any], path: str) -> None:
    """Three panels over the run's time: hit ratio, storage bandwidth, the store's troubles.

    Spans where the circuit breaker was open are shaded on every panel; the ideal hit
    ratio (an unbounded cache over this run's requests) is a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line = result.timeline
    if len(line) == 1:  # (one point draws nothing: start the run's lines at 0 s)
        line = [{**line[0], "t": 0.0}, *line]
    t = [p["t"] for p in line]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    fig.suptitle(
        f"hicache-storage run on {report['backend']}: {len(line)} requests, "
        f"{report['page_bytes'] // 1024} KiB pages, admit after {report['admit_after']}"
    )
    a.stackplot(
        t,
        [p["hit_ratio_device"] for p in line],
        [p["hit_ratio_host"] for p in line],
        [p["hit_ratio_storage"] for p in line],
        labels=["device (L1)", "host (L2)", "storage (L3)"],
        alpha=0.8,
    )
    if any(p["hit_ratio_cross_run"] for p in line):
        a.plot(t, [p["hit_ratio_cross_run"] for p in line], color="black", lw=1,
               label="of which pages earlier runs stored")  # fmt: skip
    a.axhline(
        report["ideal_hit_ratio"], linestyle="--", color="grey",
        label="ideal (unbounded cache, empty at the start)",
    )  # fmt: skip
    a.set_ylabel("prompt tokens hit (cumulative)")
    a.set_ylim(0, 1.05)

    # Bandwidth over 30 equal spans of the run's time (per request it is too spiky to
    # read): the cumulative bytes at each span's ends, interpolated between requests.
    import numpy as np

    edges = np.linspace(0.0, t[-1] if t else 1.0, 31)
    mids = (edges[1:] + edges[:-1]) / 2
    for key, label in (("bytes_read", "storage read"), ("bytes_written", "storage written")):
        done = np.interp(edges, [0.0, *t], [0.0, *(p[key] for p in line)])
        b.step(mids, np.diff(done) / np.diff(edges) / 1e9, where="mid", label=label)
    b.set_ylabel("GB/s (30 spans of the run)")
    b.set_ylim(bottom=0)
    for key, label in (
        ("breaker_rejections", "calls answered without the store"),
        ("backup_failed_tokens", "backups failed (tokens)"),
        ("not_admitted_pages", "host evictions of pages not admitted"),
    ):
        c.plot(t, [p[key] for p in line], label=label)
    c.set_ylabel("count (cumulative)")
    c.set_ylim(bottom=0)
    c.set_xlabel("seconds")
    for ax in (a, b, c):  # (beside the panels: the hit stack fills its panel)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    # Shade the spans where the breaker was open (the store was bypassed).
    start = None
    for i, p in enumerate([*line, {"t": t[-1] if t else 0.0, "circuit_open": 0.0}]):
        if p["circuit_open"] and start is None:
            start = t[i - 1] if i else 0.0
        elif not p["circuit_open"] and start is not None:
            for ax in (a, b, c):
                ax.axvspan(start, p["t"], color="red", alpha=0.12, lw=0)
            start = None
    if any(p["circuit_open"] for p in line):
        a.text(0.01, 0.95, "shaded: circuit open", transform=a.transAxes, va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
