"""``hicache-storage``: list backends, benchmark one, run the conformance kit on one.

Backend selection uses the reference engine's flag names, so a command line can be
copied between the two: ``--hicache-storage-backend NAME`` and
``--hicache-storage-backend-extra-config JSON`` (or ``@file``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from hicache_storage.config import load_extra_config
from hicache_storage.errors import HiCacheStorageError
from hicache_storage.registry import available_backends

__all__ = ["main"]


def _add_backend_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument(
        "--hicache-storage-backend",
        dest="backend",
        default=default,
        required=default is None,
        help="backend name (any installed entry point, NAME@DISTRIBUTION, or module:Class)",
    )
    p.add_argument(
        "--hicache-storage-backend-extra-config",
        dest="extra_config",
        default=None,
        help="backend options as a JSON object, or @path to a JSON/TOML file",
    )


def _cmd_backends(args: argparse.Namespace) -> int:
    infos = available_backends(load=True)
    if args.json:
        out = {
            name: [
                {
                    "distribution": i.distribution,
                    "version": i.version,
                    "value": i.value,
                    "load_error": i.load_error,
                    "capabilities": None
                    if i.capabilities is None
                    else {
                        "zero_copy": i.capabilities.zero_copy,
                        "delete": i.capabilities.delete,
                        "persistent": i.capabilities.persistent,
                        "shared": i.capabilities.shared,
                        "max_object_bytes": i.capabilities.max_object_bytes,
                        "layouts": sorted(i.capabilities.layouts),
                        "mla": i.capabilities.mla,
                    },
                }
                for i in entries
            ]
            for name, entries in infos.items()
        }
        print(json.dumps(out, indent=2))
        return 0
    rows = [("NAME", "DISTRIBUTION", "VERSION", "CAPABILITIES / LOAD ERROR")]
    for name, entries in infos.items():
        for i in entries:
            if i.load_error:
                what = "LOAD ERROR: " + i.load_error
            elif i.capabilities is not None:
                what = ", ".join(i.capabilities.claimed()) or "-"
            else:
                what = "-"
            rows.append((name, i.distribution or "?", i.version or "?", what))
        if len(entries) > 1:
            rows.append(("", "", "", f"ambiguous: select with {name}@<distribution>"))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3])
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hicache_storage.cli.bench import BenchShape, run_bench

    options = load_extra_config(args.extra_config)
    shape = BenchShape(
        pages=args.pages,
        batch=args.batch,
        page_size=args.page_size,
        layer_num=args.layer_num,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        layout=args.layout,
        mla=args.mla,
    )
    report = run_bench(args.backend, options, shape, progress=not args.no_progress, keep=args.keep)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def _cmd_conformance(args: argparse.Namespace) -> int:
    import tempfile

    import pytest

    with tempfile.TemporaryDirectory(prefix="hicache-conformance-") as tmp:
        ini = f"{tmp}/pytest.ini"
        with open(ini, "w") as f:  # isolate the run from any pytest config in the cwd
            f.write("[pytest]\n")
        report = args.report or f"{tmp}/report.json"
        argv = [
            "--pyargs",
            "hicache_storage.conformance",
            "-c",
            ini,
            "--rootdir",
            tmp,
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfE",
            "--hicache-storage-backend",
            args.backend,
            "--hicache-conformance-report",
            report,
        ]
        if args.extra_config:
            argv += ["--hicache-storage-backend-extra-config", args.extra_config]
        if args.markdown:
            argv += ["--hicache-conformance-markdown", args.markdown]
        if args.k:
            argv += ["-k", args.k]
        if args.exitfirst:
            argv.append("-x")
        code = int(pytest.main(argv))
        try:
            with open(report) as f:
                summary = json.load(f)["summary"]
        except (OSError, ValueError, KeyError):
            summary = None
    if summary is not None:
        print(
            f"conformance of {args.backend!r}: {summary.get('passed', 0)} passed, "
            f"{summary.get('failed', 0)} failed, {summary.get('not-claimed', 0)} not claimed, "
            f"{summary.get('skipped', 0)} skipped"
        )
    return code


def _print_report(r: dict[str, Any]) -> None:
    pool = r["pool"]
    print(
        f"backend {r['backend']}  pages {r['pages']} x {r['page_bytes'] / 2**20:.2f} MiB "
        f"({pool['layout']}, {'MLA' if pool['mla'] else 'MHA'}, {pool['dtype']}, "
        f"{pool['segments_per_page']} segments/page)  batch {r['batch']}"
    )
    print(
        f"{'phase':<7}{'ok':>6}{'GB/s':>9}{'pages/s':>10}{'batch p50 ms':>14}{'batch p99 ms':>14}{'us/page':>10}"
    )
    for phase in ("set", "exists", "get"):
        p = r[phase]
        gbps = "-" if p["GBps"] is None else f"{p['GBps']:.3f}"
        print(
            f"{phase:<7}{p['ok']:>6}{gbps:>9}{p['pages_per_s'] or 0:>10.0f}"
            f"{p['batch_ms_p50']:>14.3f}{p['batch_ms_p99']:>14.3f}{p['page_us_mean'] or 0:>10.1f}"
        )
    status = "OK" if r["ok"] else "FAILED"
    print(f"verified {r['verified_pages']}/{r['pages']} pages byte-exact: {status}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hicache-storage``."""
    parser = argparse.ArgumentParser(prog="hicache-storage", description=__doc__.splitlines()[0])
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "backends", help="list installed backends, their capabilities and load errors"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser(
        "bench", help="v1 set/exists/get throughput of a backend, every byte verified"
    )
    _add_backend_args(p, default="file")
    p.add_argument("--pages", type=int, default=128, help="pages to write and read (default 128)")
    p.add_argument(
        "--batch",
        type=int,
        default=128,
        help="pages per batch call (default 128, the engine's largest)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--layer-num", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--layout", default="page_first", choices=["layer_first", "page_first", "page_first_direct"]
    )
    p.add_argument(
        "--mla", action="store_true", help="MLA pool (one latent vector per token and layer)"
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the written pages (default: clear the run's namespace)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "conformance", help="run the conformance kit on a backend; exit 1 if a claimed check fails"
    )
    _add_backend_args(p)
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--markdown", default=None, help="write a Markdown summary here")
    p.add_argument("-k", default=None, help="only the checks matching this pytest -k expression")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failed check")
    p.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hicache-storage`` console script."""
    args = build_parser().parse_args(argv)
    level = (
        logging.WARNING
        if args.verbose == 0
        else logging.INFO
        if args.verbose == 1
        else logging.DEBUG
    )
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except HiCacheStorageError as exc:
        print(f"hicache-storage: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
