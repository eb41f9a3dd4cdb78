"""Finding backends: Python entry points for everyone, built-ins included.

A distribution registers a backend in the entry-point group ``hicache_storage.backends``::

    [project.entry-points."hicache_storage.backends"]
    acme = "acme_kv.hicache:AcmeBackend"

and ``--hicache-storage-backend acme`` works, with no change to this project. Names are
resolved lazily (a backend's module is imported only when it is used). Other spellings:

* ``module.path:ClassName``: any importable :class:`HiCacheStorage` subclass;
* ``NAME@DISTRIBUTION``: pick one when several distributions register ``NAME``
  (otherwise that is an :class:`AmbiguousBackendError` naming both; a name is never
  silently hijacked).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from hicache_storage.breaker import BREAKER_KEYS
from hicache_storage.config import StorageConfig
from hicache_storage.errors import AmbiguousBackendError, BackendLoadError, UnknownBackendError
from hicache_storage.protocol import Capabilities, HiCacheStorage

__all__ = [
    "ENTRY_POINT_GROUP",
    "INSTALL_HINTS",
    "BackendInfo",
    "available_backends",
    "create_backend",
    "load_backend_class",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache_storage.backends"

#: Built-in backends and how to get their client libraries.
INSTALL_HINTS: dict[str, str] = {
    "file": "pip install hicache-storage",
    "shm": "pip install hicache-storage",
    "mmap": "pip install hicache-storage",
    "memory": "pip install hicache-storage",
    "redis": "pip install 'hicache-storage[redis]' (and a redis-server to talk to)",
    "s3": "pip install 'hicache-storage[s3]'",
    "mooncake": "pip install 'hicache-storage[mooncake]' (and apt-get install libibverbs1)",
    "nixl": "pip install 'hicache-storage[nixl]'",
}


@dataclass
class BackendInfo:
    """One registered backend.

    Attributes:
        name: the registry name.
        value: ``module:attribute`` of its class.
        distribution: the distribution that registers it (``None`` if unknown).
        version: that distribution's version.
        load_error: why the class cannot be loaded, ``None`` if it loads (or was not tried).
        capabilities: the class's declared capabilities, once loaded.
    """

    name: str
    value: str
    distribution: str | None = None
    version: str | None = None
    load_error: str | None = None
    capabilities: Capabilities | None = field(default=None, repr=False)


def _entry_points() -> dict[str, list[metadata.EntryPoint]]:
    """Entry points of the group by name, duplicates of one distribution folded."""
    by_name: dict[str, list[metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found = by_name.setdefault(ep.name, [])
        dist = _safe_dist_name(ep)
        # The same distribution seen twice (e.g. on two sys.path entries): keep one.
        if any(_safe_dist_name(o) == dist and o.value == ep.value for o in found):
            continue
        found.append(ep)
    return by_name


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.metadata["Name"])


def _dist_version(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.version)


def _safe_dist_name(ep: metadata.EntryPoint) -> str | None:
    """:func:`_dist_name`, or ``None`` when the distribution's metadata is unreadable."""
    try:
        return _dist_name(ep)
    except Exception:  # noqa: BLE001 - unreadable metadata: no name
        return None


def _safe_dist_version(ep: metadata.EntryPoint) -> str | None:
    try:
        return _dist_version(ep)
    except Exception:  # noqa: BLE001 - unreadable metadata: no version
        return None


def _check_class(obj: Any, where: str) -> type[HiCacheStorage]:
    if not isinstance(obj, type) or not issubclass(obj, HiCacheStorage):
        raise BackendLoadError(f"{where} is {obj!r}, not a HiCacheStorage subclass")
    return obj


def _describe_import_error(exc: BaseException) -> str:
    """One line on why an import failed, whatever it raised."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the module called sys.exit({exc.code!r}) at import"
    try:
        text = " ".join(str(exc).split())  # one line, whatever the message
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        text = "<unprintable message>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_entry_point(ep: metadata.EntryPoint) -> type[HiCacheStorage]:
    try:
        obj = ep.load()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit... at import: still a load error
        hint = INSTALL_HINTS.get(ep.name)
        extra = f"; install with: {hint}" if hint else ""
        raise BackendLoadError(
            f"backend {ep.name!r} ({ep.value}, from {_safe_dist_name(ep) or 'unknown distribution'}) "
            f"failed to load: {_describe_import_error(exc)}{extra}"
        ) from exc
    return _check_class(obj, f"backend {ep.name!r} ({ep.value})")


def _load_path(spec: str) -> type[HiCacheStorage]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise BackendLoadError(
            f"cannot import {module_name!r} for backend {spec!r}: {_describe_import_error(exc)}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise BackendLoadError(f"{module_name!r} has no attribute {attr!r}") from exc
    return _check_class(obj, spec)


def available_backends(load: bool = True) -> dict[str, list[BackendInfo]]:
    """Return every registered backend: name -> one :class:`BackendInfo` per distribution.

    With ``load`` (the default), each class is imported to report its load error or its
    capabilities; a list with more than one entry means the name is ambiguous.
    """
    out: dict[str, list[BackendInfo]] = {}
    for name, eps in sorted(_entry_points().items()):
        infos = []
        for ep in eps:
            info = BackendInfo(name, ep.value, _safe_dist_name(ep), _safe_dist_version(ep))
            if load:
                # One broken plugin costs its own row, never the listing: whatever its
                # import raises (but Ctrl-C) becomes its load error.
                try:
                    caps = _load_entry_point(ep).capabilities
                    if not isinstance(caps, Capabilities):
                        raise BackendLoadError(
                            f"backend {name!r} ({ep.value}) declares capabilities {caps!r}, "
                            "not a Capabilities"
                        )
                    info.capabilities = caps
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # noqa: BLE001 - shown on the plugin's row
                    info.load_error = (
                        str(exc)
                        if isinstance(exc, BackendLoadError)
                        else _describe_import_error(exc)
                    )
            infos.append(info)
        out[name] = infos
    return out


def load_backend_class(name: str) -> type[HiCacheStorage]:
    """Resolve a backend name (``NAME``, ``NAME@DISTRIBUTION`` or ``module:Class``) to its class."""
    if not isinstance(name, str) or not name:
        raise UnknownBackendError(f"backend name must be a non-empty string, got {name!r}")
    base, _, wanted_dist = name.partition("@")
    if ":" in base and not wanted_dist:
        return _load_path(base)
    eps = _entry_points()
    candidates = eps.get(base, [])
    if wanted_dist:
        candidates = [
            ep for ep in candidates if (_safe_dist_name(ep) or "").lower() == wanted_dist.lower()
        ]
    if not candidates:
        installed = ", ".join(sorted(eps)) or "none"
        msg = f"unknown storage backend {name!r}; installed: {installed}"
        close = difflib.get_close_matches(base, sorted(set(eps) | set(INSTALL_HINTS)), n=1)
        if close and not wanted_dist:
            msg += f". Did you mean {close[0]!r}?"
        hint = INSTALL_HINTS.get(base)
        if hint and not wanted_dist:
            msg += f". {base!r} is a known backend: {hint}"
        missing = sorted(set(INSTALL_HINTS) - set(eps))
        if missing:
            msg += f". Known but not installed: {', '.join(missing)}"
        raise UnknownBackendError(msg)
    if len(candidates) > 1:
        who = ", ".join(f"{_safe_dist_name(ep)} ({ep.value})" for ep in candidates)
        raise AmbiguousBackendError(
            f"backend {base!r} is registered by several distributions: {who}. "
            f"Pick one with '{base}@<distribution>'"
        )
    return _load_entry_point(candidates[0])


def create_backend(
    name: str, config: StorageConfig | None = None, **options: Any
) -> HiCacheStorage:
    """Build backend ``name`` for ``config``.

    Options come from ``config.extra_config`` (minus the engine controller's keys),
    overridden by ``options``. The class is called as ``cls(config, **options)``; the
    circuit breaker's options (:data:`~hicache_storage.breaker.BREAKER_KEYS`) go to the
    extra config, where the protocol layer reads them.
    With ``head_groups`` in the extra config, the backend holds the rank's pages as
    head-group objects that every TP size reads
    (:class:`~hicache_storage.headgroups.HeadGroupStore`, ``writer_id`` naming the writer).
    """
    cls = load_backend_class(name)
    config = config if config is not None else StorageConfig()
    # The circuit breaker's options are the protocol layer's (it reads the extra config).
    breaker = {k: options.pop(k) for k in list(options) if k in BREAKER_KEYS}
    if breaker:
        config = dataclasses.replace(config, extra_config={**config.extra_config, **breaker})
    merged = {**config.backend_options(), **options}
    logger.debug("creating backend %s (%s) with options %s", name, cls.__qualname__, sorted(merged))
    try:
        if config.extra_config.get("head_groups") and not config.namespace.rank_replicated:
            # (MLA pages are the same on every rank already: nothing to split.)
            from hicache_storage.headgroups import HeadGroupStore, head_group_options

            groups, writer, scope = head_group_options(config.extra_config)
            assert groups is not None
            return HeadGroupStore(config, lambda inner: cls(inner, **merged), groups, writer, scope)
        return cls(config, **merged)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(name.partition("@")[0])
        raise BackendLoadError(
            f"backend {name!r} needs a library that is not installed: {exc}"
            + (f"; install with: {hint}" if hint else "")
        ) from exc
