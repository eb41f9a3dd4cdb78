"""``hicache-storage``: list backends, benchmark one, run the workload or the kit on one.

Backend selection uses the reference engine's flag names, so a command line can be
copied between the two: ``--hicache-storage-backend NAME`` and
``--hicache-storage-backend-extra-config JSON`` (or ``@file``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from typing_extensions import override

from hicache_storage.config import load_extra_config, parse_options
from hicache_storage.errors import ConfigError, HiCacheStorageError
from hicache_storage.layouts import LAYOUTS
from hicache_storage.registry import available_backends
from hicache_storage.secrets import LogScrubber, is_secret_option, scrub, secret_values

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["build_parser", "main"]


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2)."""

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it has none or its help already says it."""

    @override
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False
        if unset or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


#: Cuts the run's secrets out of every log record (backends log their errors).
_REDACTOR = LogScrubber()


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options of ``args``; their secrets are cut from every later message."""
    from hicache_storage.registry import load_backend_class

    options = load_extra_config(args.extra_config)
    try:
        cls = load_backend_class(args.backend)
    except HiCacheStorageError:
        cls = None  # the name is reported when the backend is built
    options_class = getattr(cls, "options_class", None)
    args.secrets = secret_values(options, options_class)
    if isinstance(options_class, type) and dataclasses.is_dataclass(options_class):
        # and the secrets the backend will read from its environment variables
        own = {
            f.name: options[f.name] for f in dataclasses.fields(options_class) if f.name in options
        }
        with contextlib.suppress(Exception):  # bad options: reported when the backend is built
            parsed = parse_options(options_class, getattr(cls, "name", "") or args.backend, own)
            args.secrets |= secret_values(parsed)
    _REDACTOR.add(args.secrets)
    return options


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
        help="backend options as a JSON object, or @path to a JSON/TOML file (default: the "
        "backend's own; file keeps its pages under /tmp/hicache-storage-<uid>)",
    )


def _cmd_backends(args: argparse.Namespace) -> int:
    # A plugin that prints at import must not corrupt the listing (or its JSON).
    with contextlib.redirect_stdout(sys.stderr):
        infos = available_backends(load=True)
    if args.json:
        out = {
            name: [
                {
                    "distribution": i.distribution,
                    "version": i.version,
                    "value": i.value,
                    "load_error": i.load_error,
                    "capabilities": None if i.capabilities is None else i.capabilities.to_dict(),
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
                what = "LOAD ERROR: " + _one_line(i.load_error)
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
    from hicache_storage.benchkit import BenchShape
    from hicache_storage.cli.bench import run_bench

    options = _load_options(args)
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
    # The report's options are already redacted (run_bench); it holds no other text
    # from the options, so it is printed as is (a substring scrub could mangle figures).
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from hicache_storage.cli.run import run_workload

    return run_workload(args, _load_options(args))


def _preflight(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Build the backend once, as the conformance kit will, before the kit runs.

    A misspelt name or a bad option is then one error, not a failure of every check.
    """
    import secrets

    from hicache_storage.config import StorageConfig
    from hicache_storage.keys import KVCacheNamespace
    from hicache_storage.registry import create_backend

    ns = KVCacheNamespace(
        model_id="hicache-conformance",
        dtype="bfloat16",
        page_size=4,
        object_layout="page_first",
        tenant=f"conformance-preflight-{secrets.token_hex(6)}",
    )
    try:
        backend = create_backend(args.backend, StorageConfig(namespace=ns), **options)
    except HiCacheStorageError:
        raise
    except Exception as exc:
        raise HiCacheStorageError(
            f"cannot create backend {args.backend!r}: {type(exc).__name__}: {exc}"
        ) from exc
    with contextlib.suppress(Exception):  # a close that fails is the kit's to report
        backend.close()


def _check_conformance_args(args: argparse.Namespace) -> None:
    """Refuse report paths that cannot be written and a ``-k`` expression pytest cannot parse.

    Both are checked before anything runs (they used to fail only after the whole kit ran).
    """
    import os

    for flag, path in (("--report", args.report), ("--markdown", args.markdown)):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"{flag} {path}: cannot write a file there")
    if args.k:
        try:
            from _pytest.mark.expression import Expression
        except ImportError:  # pragma: no cover - pytest moved it: pytest reports it then
            return
        try:
            Expression.compile(args.k)
        except Exception as exc:  # noqa: BLE001 - its parse error type is private
            raise ConfigError(f"-k {args.k!r} is not a valid expression: {exc}") from None


def _cmd_conformance(args: argparse.Namespace) -> int:
    import os
    import tempfile

    if args.extra_config is None:  # the kit reads its environment variable then: so do we
        args.extra_config = os.environ.get("HICACHE_STORAGE_BACKEND_EXTRA_CONFIG")
    options = _load_options(args)
    _check_conformance_args(args)
    _preflight(args, options)

    try:
        import pytest
    except ImportError as exc:
        raise ConfigError(
            "the conformance kit runs on pytest, which is not installed: "
            "pip install 'hicache-storage[conformance]' (docs/vendors.md, section 3)"
        ) from exc

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
            # This process imported hicache_storage before pytest could mark the plugin's
            # package for assertion rewriting; the kit's modules are registered for it
            # by the plugin, so the warning says nothing about them.
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
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
        from hicache_storage.cli.kitprogress import KitProgress

        progress = KitProgress()
        try:
            code = int(pytest.main(argv, plugins=[progress]))
        finally:
            progress.close()
        if code == int(pytest.ExitCode.NO_TESTS_COLLECTED):
            raise ConfigError(f"-k {args.k!r} selects none of the kit's checks")
        try:
            with open(report) as f:
                summary = json.load(f)["summary"]
        except (OSError, ValueError, KeyError):
            summary = None
    print(progress.summary(args.backend, args.report, args.markdown))
    if summary is not None:
        print(
            f"conformance of {args.backend!r}: {summary.get('passed', 0)} passed, "
            f"{summary.get('failed', 0)} failed, {summary.get('not-claimed', 0)} not claimed, "
            f"{summary.get('skipped', 0)} skipped"
        )
    return code


def _fmt(value: float | None, spec: str) -> str:
    """A figure, or ``-`` where there is none (nothing succeeded, nothing was timed)."""
    return "-" if value is None else format(value, spec)


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
        print(
            f"{phase:<7}{p['ok']:>6}{_fmt(p['GBps'], '.3f'):>9}{_fmt(p['pages_per_s'], '.0f'):>10}"
            f"{_fmt(p['batch_ms_p50'], '.3f'):>14}{_fmt(p['batch_ms_p99'], '.3f'):>14}"
            f"{_fmt(p['page_us_mean'], '.1f'):>10}"
        )
    status = "OK" if r["ok"] else "FAILED"
    print(f"verified {r['verified_pages']}/{r['pages']} pages byte-exact: {status}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > 2**40:
        raise argparse.ArgumentTypeError(f"{value} is too large")
    return value


def _dtype(text: str) -> str:
    from hicache_storage.benchkit import dtype_name
    from hicache_storage.errors import ConfigError

    try:
        return dtype_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Where SGLang's ``dynamic`` storage backend finds the adapter.
SGLANG_ADAPTER = ("hicache_storage.integrations.sglang", "SGLangStorage")


def _engine_options(
    backend: str,
    options: dict[str, Any],
    adapter_keys: frozenset[str],
    reserved: set[str],
    cmd: str,
) -> tuple[str, list[str]]:
    """Check ``options`` for ``backend``; return its name and the secret options.

    The options are checked against the backend's options class (a typo fails here, not
    in the engine's worker). A secret option (by name, or a value that holds a secret
    anywhere inside it: a URL with a password, a list or dict with a secret entry) must stay
    out of an engine's configuration, which the engine logs: the backend reads it from its
    environment variable instead (JSON, for a list or a dict).
    """
    from hicache_storage.config import CONTROLLER_KEYS
    from hicache_storage.registry import load_backend_class

    clash = sorted(reserved & set(options))
    if clash:
        raise ConfigError(f"{clash} are set by {cmd} itself, not options")
    cls = load_backend_class(backend)
    name = getattr(cls, "name", "") or backend
    options_class = getattr(cls, "options_class", None)
    own = {k: v for k, v in options.items() if k not in CONTROLLER_KEYS and k not in adapter_keys}
    if options_class is not None:
        parse_options(options_class, name, own)  # unknown or bad options: ConfigError
    secrets = sorted(
        k for k in own if is_secret_option(k, options_class) or secret_values({k: own[k]})
    )
    return name, secrets


def _env_vars(name: str, secrets: list[str]) -> list[str]:
    prefix = f"HICACHE_STORAGE_{name.upper().replace('-', '_')}_"
    return [prefix + k.upper() for k in secrets]


def sglang_flags(backend: str, options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """SGLang's command-line flags for ``backend`` with ``options``, and the secret options.

    Secret options are left out of the flags (SGLang prints the extra config in its logs
    and ``/server_info``); they are returned as the environment variables
    (``HICACHE_STORAGE_<BACKEND>_<OPTION>``) the backend reads them from.
    """
    from hicache_storage.integrations import SGLANG_ADAPTER_KEYS

    name, secrets = _engine_options(
        backend, options, SGLANG_ADAPTER_KEYS,
        {"backend_name", "module_path", "class_name"}, "sglang-args",
    )  # fmt: skip
    extra = {
        "backend_name": backend,
        "module_path": SGLANG_ADAPTER[0],
        "class_name": SGLANG_ADAPTER[1],
        "interface_v1": True,
        **{k: v for k, v in options.items() if k not in secrets},
    }
    flags = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra, separators=(",", ":"), sort_keys=True),
    ]
    return flags, _env_vars(name, secrets)


#: Where vLLM finds the connector (``kv_connector_module_path``, ``kv_connector``).
VLLM_CONNECTOR = ("hicache_storage.integrations.vllm", "HiCacheKVConnector")


def vllm_kv_transfer_config(
    backend: str, options: dict[str, Any], role: str = "kv_both", policy: str = "recompute"
) -> tuple[dict[str, Any], list[str]]:
    """The vLLM ``kv_transfer_config`` for ``backend`` with ``options``, and the secret options.

    ``policy`` is vLLM's ``kv_load_failure_policy``: ``recompute`` (the default here)
    recomputes a block the store fails to deliver; vLLM's own default, ``fail``, fails
    the request. Secret options are left out (vLLM logs its configuration) and returned
    as the environment variables the backend reads them from.
    """
    from hicache_storage.integrations import VLLM_ADAPTER_KEYS

    name, secrets = _engine_options(
        backend, options, VLLM_ADAPTER_KEYS, {"backend_name"}, "vllm-args"
    )
    config = {
        "kv_connector": VLLM_CONNECTOR[1],
        "kv_connector_module_path": VLLM_CONNECTOR[0],
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "backend_name": backend,
            **{k: v for k, v in options.items() if k not in secrets},
        },
    }
    return config, _env_vars(name, secrets)


#: Where LMCache finds the plugin (``module_path``, ``class_name``).
LMCACHE_PLUGIN = ("hicache_storage.integrations.lmcache", "HiCacheConnectorAdapter")


def lmcache_extra_config(
    backend: str,
    options: dict[str, Any],
    name: str = "hicache",
    timeout: float | None = None,
    tenant: str = "",
) -> tuple[dict[str, Any], list[str]]:
    """LMCache's ``extra_config`` entries of plugin ``name`` on ``backend``, and the secrets.

    ``options`` are the backend's; ``timeout`` and ``tenant`` the plugin's own. Secret
    options are left out (LMCache logs its configuration) and returned as the
    environment variables the backend reads them from.
    """
    import re

    if re.fullmatch(r"hicache|hicache\.[A-Za-z0-9_-]+", name) is None:
        raise ConfigError(
            f"plugin name {name!r}: it must be 'hicache' or 'hicache.<letters, digits, _ or ->' "
            "(LMCache gives other names, such as fs* or redis*, to its own connectors)"
        )
    backend_name, secrets = _engine_options(backend, options, frozenset(), set(), "lmcache-args")
    prefix = f"remote_storage_plugin.{name}."
    extra: dict[str, Any] = {
        prefix + "module_path": LMCACHE_PLUGIN[0],
        prefix + "class_name": LMCACHE_PLUGIN[1],
        prefix + "backend_name": backend,
        prefix + "backend_options": {k: v for k, v in options.items() if k not in secrets},
    }
    if timeout is not None:
        extra[prefix + "timeout"] = timeout
    if tenant:
        extra[prefix + "tenant"] = tenant
    return extra, _env_vars(backend_name, secrets)


def _cmd_lmcache_args(args: argparse.Namespace) -> int:
    import shlex

    options = _load_options(args)
    extra, env_vars = lmcache_extra_config(
        args.backend, options, args.name, args.timeout, args.tenant
    )
    if args.env:
        print("LMCACHE_REMOTE_STORAGE_PLUGINS=" + shlex.quote(args.name))
        print("LMCACHE_EXTRA_CONFIG=" + shlex.quote(json.dumps(extra, sort_keys=True)))
    else:  # YAML for LMCACHE_CONFIG_FILE (JSON values are YAML)
        print(f"remote_storage_plugins: [{json.dumps(args.name)}]")
        print("extra_config:")
        for key, value in extra.items():
            print(f"  {json.dumps(key)}: {json.dumps(value, sort_keys=True)}")
    for var in env_vars:
        print(f"# set {var} in LMCache's environment (secret: not in the config)", file=sys.stderr)
    return 0


def _cmd_vllm_args(args: argparse.Namespace) -> int:
    import shlex

    options = _load_options(args)
    config, env_vars = vllm_kv_transfer_config(args.backend, options, args.role, args.policy)
    text = json.dumps(config, separators=(",", ":"), sort_keys=True)
    print(text if args.json else "--kv-transfer-config " + shlex.quote(text))
    for var in env_vars:
        print(f"# set {var} in vLLM's environment (secret: not in the config)", file=sys.stderr)
    return 0


def _cmd_sglang_args(args: argparse.Namespace) -> int:
    import shlex

    options = _load_options(args)
    flags, env_vars = sglang_flags(args.backend, options)
    print(" ".join(shlex.quote(f) for f in flags))
    for var in env_vars:
        print(
            f"# set {var} in the server's environment (secret: not in the flags)", file=sys.stderr
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hicache-storage``."""
    parser = _ArgumentParser(
        prog="hicache-storage", description=__doc__.splitlines()[0].replace("``", "")
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    p = add_parser("backends", help="list installed backends, their capabilities and load errors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends)

    p = add_parser("bench", help="v1 set/exists/get throughput of a backend, every byte verified")
    _add_backend_args(p, default="file")
    p.add_argument("--pages", type=_positive_int, default=128, help="pages to write and read")
    p.add_argument(
        "--batch",
        type=_positive_int,
        default=128,
        help="pages per batch call (128 is the engine's largest)",
    )
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page")
    p.add_argument("--layer-num", type=_positive_int, default=32, help="model layers")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="KV heads per layer")
    p.add_argument("--head-dim", type=_positive_int, default=128, help="head dimension")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="torch dtype of the KV cache")
    p.add_argument("--layout", default="page_first", choices=list(LAYOUTS), help="host pool layout")
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

    p = add_parser(
        "run",
        help="the tiered-cache workload on a backend (device, host, L3), every reused page checked",
    )
    _add_backend_args(p, default="file")
    from hicache_storage.cli.run_args import add_run_args

    add_run_args(p, _positive_int)
    p.set_defaults(func=_cmd_run)

    p = add_parser(
        "conformance", help="run the conformance kit on a backend; exit 1 if a claimed check fails"
    )
    _add_backend_args(p)
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--markdown", default=None, help="write a Markdown summary here")
    p.add_argument("-k", default=None, help="only the checks matching this pytest -k expression")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failed check")
    p.set_defaults(func=_cmd_conformance)

    p = add_parser(
        "sglang-args",
        help="print the SGLang server flags that run this backend as SGLang's HiCache L3",
    )
    _add_backend_args(p)
    p.set_defaults(func=_cmd_sglang_args)

    p = add_parser(
        "vllm-args",
        help="print the vLLM kv_transfer_config that runs this backend as vLLM's KV store",
    )
    _add_backend_args(p)
    p.add_argument(
        "--role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"],
        help="kv_both (default): store and load; kv_producer: only store; kv_consumer: only load",
    )  # fmt: skip
    p.add_argument(
        "--policy", default="recompute", choices=["recompute", "fail"],
        help="vLLM's kv_load_failure_policy (default recompute: a block the store fails to "
        "deliver is recomputed; fail: its request fails)",
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true",
        help="print only the JSON (for the kv_transfer_config argument of vLLM's Python API), "
        "not the vllm serve flag",
    )  # fmt: skip
    p.set_defaults(func=_cmd_vllm_args)

    p = add_parser(
        "lmcache-args",
        help="print the LMCache config that makes this backend an LMCache remote storage plugin",
    )
    _add_backend_args(p)
    p.add_argument(
        "--name", default="hicache",
        help="the plugin's name in LMCache ('hicache' or 'hicache.<anything>')",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=float, default=None,
        help="seconds an existence query may take before it is a miss (the plugin's: 5)",
    )  # fmt: skip
    p.add_argument("--tenant", default="", help="keep these objects apart from other tenants'")
    p.add_argument(
        "--env", action="store_true",
        help="print LMCACHE_* environment variables instead of YAML for LMCACHE_CONFIG_FILE",
    )  # fmt: skip
    p.set_defaults(func=_cmd_lmcache_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hicache-storage`` console script.

    Exit status: 0 success, 1 a failed benchmark or conformance check (or an unexpected
    error), 2 bad arguments, options or backend (one line on stderr, never a traceback
    unless ``-vv``), 130 interrupted.
    """
    args = build_parser().parse_args(argv)
    args.secrets = set()
    level = (
        logging.WARNING
        if args.verbose == 0
        else logging.INFO
        if args.verbose == 1
        else logging.DEBUG
    )
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if _REDACTOR not in handler.filters:
            handler.addFilter(_REDACTOR)
    try:
        code: int = args.func(args)
    except HiCacheStorageError as exc:
        _report_error(args, exc)
        return 2
    except KeyboardInterrupt:
        print("hicache-storage: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, the traceback with -vv
        _report_error(args, exc, unexpected=True)
        return 1
    return code


def _report_error(args: argparse.Namespace, exc: BaseException, unexpected: bool = False) -> None:
    """One line on stderr (the traceback too with ``-vv``), secrets cut out."""
    secrets: set[str] = getattr(args, "secrets", set())
    if args.verbose >= 2:
        import traceback

        print(scrub("".join(traceback.format_exception(exc)), secrets), file=sys.stderr, end="")
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        text = "<unprintable message>"
    what = f"{type(exc).__name__}: {text}" if unexpected else text
    hint = " (run with -vv for the traceback)" if unexpected and args.verbose < 2 else ""
    print(f"hicache-storage: error: {scrub(_one_line(what), secrets)}{hint}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
