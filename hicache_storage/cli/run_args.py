"""The options of ``hicache-storage run`` (no torch here: ``--help`` must answer at once)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

__all__ = ["add_run_args"]


def add_run_args(p: argparse.ArgumentParser, positive: Any) -> None:
    """The options of ``hicache-storage run`` (``positive``: the int parser)."""
    w = p.add_argument_group("workload")
    w.add_argument("--sessions", type=positive, default=48, help="chat sessions in the trace")
    w.add_argument(
        "--turns",
        type=positive,
        default=4,
        help="turns per session (each turn re-sends the whole conversation)",
    )
    w.add_argument(
        "--system-prompts", type=positive, default=4, help="system prompts the sessions share"
    )
    w.add_argument("--system-tokens", type=positive, default=1024, help="tokens per system prompt")
    w.add_argument("--user-tokens", type=positive, default=128, help="tokens per user message")
    w.add_argument(
        "--answer-tokens", type=positive, default=128, help="tokens per generated answer"
    )
    w.add_argument("--seed", type=int, default=0, help="seed of the trace")
    m = p.add_argument_group("model and pools")
    m.add_argument("--page-size", type=positive, default=16, help="tokens per KV page")
    m.add_argument("--layer-num", type=positive, default=8, help="model layers")
    m.add_argument("--kv-heads", type=positive, default=4, help="KV heads per layer")
    m.add_argument("--head-dim", type=positive, default=64, help="head dimension")
    m.add_argument("--host-pages", type=positive, default=512, help="host (L2) pool pages")
    m.add_argument("--device-pages", type=positive, default=256, help="device (L1) pool pages")
    m.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    t = p.add_argument_group("tiering")
    t.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
        help="when pages go to L3: at once, once used again, or on eviction from the host",
    )
    t.add_argument(
        "--prefetch-policy",
        default="timeout",
        choices=["best_effort", "wait_complete", "timeout"],
        help="how long a request waits for L3 pages",
    )
    t.add_argument(
        "--prefetch-threshold",
        type=int,
        default=256,
        help="fewest tokens of L3 hits worth a prefetch",
    )
    t.add_argument(
        "--io-workers", type=positive, default=2, help="threads moving pages between host and L3"
    )
    t.add_argument(
        "--admit-after",
        type=positive,
        default=1,
        metavar="N",
        help="store a page in L3 only once prompts have used it N times (default 1: every "
        "page the write policy sends)",
    )
    t.add_argument(
        "--tenant",
        default="run",
        help="namespace tenant: runs with the same one share the store (default 'run'); on a "
        "store warm from an earlier run the hit ratio can exceed the cold ideal's",
    )
    t.add_argument("--clear", action="store_true", help="clear the namespace before the run")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument(
        "--plot", default=None, metavar="FILE.png", help="hit ratio and bandwidth over time"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on 127.0.0.1:N/metrics while the job runs "
        "(needs the metrics extra)",
    )
    o.add_argument(
        "--metrics-hold",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --metrics-port: keep serving this long after the run (for a last scrape)",
    )
