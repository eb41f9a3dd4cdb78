"""Configuration: :class:`StorageConfig`, backend options, sizes, extra-config parsing.

A backend is built from a :class:`StorageConfig` (namespace and rank facts, the same for
every rank) plus options (a dict, as the reference's
``--hicache-storage-backend-extra-config``). Each backend declares its options as a
dataclass; :func:`parse_options` fills it from the dict, then from environment variables
``HICACHE_STORAGE_<BACKEND>_<OPTION>``, then from the defaults, and rejects unknown keys.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from hicache_storage.errors import ConfigError
from hicache_storage.keys import DEFAULT_NAMESPACE, KVCacheNamespace

# The redaction rule lives in hicache_storage.secrets; its names stay importable from here.
from hicache_storage.secrets import (
    REDACTED,
    is_secret_option,
    redact_options,
    redact_text,
    redact_value,
    scrub,
    secret,
    secret_values,
)

__all__ = [
    "CONTROLLER_KEYS",
    "MAX_SIZE",
    "REDACTED",
    "RENAMED_OPTIONS",
    "Size",
    "StorageConfig",
    "is_secret_option",
    "load_extra_config",
    "parse_options",
    "parse_size",
    "redact_options",
    "redact_text",
    "redacting_repr",
    "scrub",
    "secret",
    "secret_values",
]

#: Keys of the extra config that belong to the engine's controller or to the reference
#: factory, never to a backend. They are dropped before a backend sees its options.
CONTROLLER_KEYS = frozenset(
    {
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "interface_v1",
        "backend_name",
        "module_path",
        "class_name",
        "allocator",  # SGLang's host-memory allocator of the dynamic backend ("shm")
        "head_groups",  # pages as head-group objects (hicache_storage.headgroups)
        "breaker_failures",  # the circuit breaker (hicache_storage.breaker)
        "breaker_backoff",
        "breaker_max_backoff",
        "writer_id",
        "writer_scope",
    }
)

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3,
    "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10,
    "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30,
    "ti": 2**40, "tib": 2**40,
}  # fmt: skip


#: Largest size accepted (bytes): a signed 64-bit offset, what every OS call takes.
MAX_SIZE = 2**63 - 1
#: Digits a size string may have before and after the point (bounds the work done on
#: hostile input; 2**63 has 19 digits).
_MAX_SIZE_DIGITS = 40

_SIZE_HELP = "use a number with an optional suffix such as 4096, 512MiB, 1.5G, 200GB or 1Ti"


def _bounded_size(exact: Fraction, value: object) -> int:
    if exact < 0:
        raise ConfigError(f"size must be >= 0, got {value!r}")
    if exact > MAX_SIZE:
        raise ConfigError(f"size {value!r} is too large: the limit is {MAX_SIZE} bytes (2**63-1)")
    return int(exact)  # whole bytes, rounded down


def parse_size(value: object) -> int:
    """Parse a byte size: an int, or a string with an SI or IEC suffix.

    ``"512MiB"`` -> 536870912, ``"1.5G"`` -> 1500000000, ``"4096"`` -> 4096. Fractions of
    a byte are dropped. Invalid values (negative, infinite, NaN, over :data:`MAX_SIZE`,
    garbage) raise :class:`ConfigError`; they never silently disable a limit.
    """
    if isinstance(value, bool):
        raise ConfigError(f"invalid size {value!r}: {_SIZE_HELP}")
    if isinstance(value, int):
        return _bounded_size(Fraction(value), value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"invalid size {value!r}: a size must be a finite number of bytes")
        return _bounded_size(Fraction(value), value)
    if not isinstance(value, str):
        try:  # other integers (numpy.int64...)
            index = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"invalid size of type {type(value).__name__}: {_SIZE_HELP}"
            ) from None
        return _bounded_size(Fraction(index), value)
    m = _SIZE_RE.fullmatch(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"invalid size {_short(value)}: {_SIZE_HELP}")
    number = m.group(1)
    whole, _, frac = number.partition(".")
    if len(whole.lstrip("0")) > _MAX_SIZE_DIGITS or len(frac) > _MAX_SIZE_DIGITS:
        raise ConfigError(
            f"size {_short(value)} is too large: the limit is {MAX_SIZE} bytes (2**63-1)"
            if len(whole.lstrip("0")) > _MAX_SIZE_DIGITS
            else f"invalid size {_short(value)}: at most {_MAX_SIZE_DIGITS} decimals"
        )
    return _bounded_size(Fraction(number) * _UNITS[unit], _short(value, quote=False))


def _short(text: str, limit: int = 40, quote: bool = True) -> str:
    """``text`` for an error message, cut to ``limit`` characters (a 401-digit size)."""
    shown = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
    return repr(shown) if quote else shown


class Size(int):
    """Marker type for option fields that accept size strings (``"512MiB"``)."""


@dataclass(frozen=True)
class StorageConfig:
    """What every rank's backend is built from.

    Attributes:
        namespace: the KV identity; pages of different namespaces never mix.
        tp_rank, tp_size: attention tensor-parallel rank and size.
        pp_rank, pp_size: pipeline stage and number of stages.
        extra_config: backend options (the parsed ``--hicache-storage-backend-extra-config``).
    """

    namespace: KVCacheNamespace = DEFAULT_NAMESPACE
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check the namespace and the ranks, and copy ``extra_config`` into a plain dict."""
        if not isinstance(self.namespace, KVCacheNamespace):
            raise ConfigError(
                f"namespace must be a KVCacheNamespace, got {type(self.namespace).__name__}"
            )
        for rank, size, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.pp_rank, self.pp_size, "pp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{what}_rank={rank} must be in [0, {what}_size={size})")
        object.__setattr__(self, "extra_config", dict(self.extra_config or {}))

    @property
    def is_rank_replicated(self) -> bool:
        """True when every TP rank holds the same bytes (MLA)."""
        return self.namespace.rank_replicated

    @property
    def is_storage_writer(self) -> bool:
        """False for the ranks that skip writes of rank-replicated pages (all but rank 0)."""
        return not self.is_rank_replicated or self.tp_rank == 0

    @property
    def shard(self) -> str | None:
        """The shard coordinate of this rank's objects, ``None`` when rank-replicated.

        With ``total_kv_heads`` in the namespace it names the KV heads this rank holds
        (``"h0-3"``), so deployments that hold the same heads share objects whatever their
        TP size; otherwise it names the rank (``"tp1of4"``). A pipeline stage whose layer
        range is not in the namespace adds ``"-pp<r>of<n>"``.
        """
        ns = self.namespace
        parts: list[str] = []
        if not ns.rank_replicated and self.tp_size > 1:
            if ns.total_kv_heads:
                if ns.total_kv_heads >= self.tp_size:
                    per = ns.total_kv_heads // self.tp_size
                    first = self.tp_rank * per
                    parts.append(f"h{first}-{first + per - 1}")
                else:  # fewer heads than ranks: ranks replicate heads
                    head = self.tp_rank * ns.total_kv_heads // self.tp_size
                    parts.append(f"h{head}-{head}")
            else:
                parts.append(f"tp{self.tp_rank}of{self.tp_size}")
        if self.pp_size > 1 and ns.layer_range is None:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        return "-".join(parts) if parts else None

    def backend_options(self) -> dict[str, Any]:
        """The extra config minus the controller's and the reference factory's keys."""
        return {k: v for k, v in self.extra_config.items() if k not in CONTROLLER_KEYS}


def load_extra_config(text: str | None) -> dict[str, Any]:
    """Parse ``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` to one.

    ``@path`` files may be JSON, or TOML when they end in ``.toml``.
    """
    if text is None or not text.strip():
        return {}
    source = "the extra config"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = str(path)
        try:
            body = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read extra config file {path}: {exc}") from exc
        if path.suffix == ".toml":
            import tomllib

            try:
                return dict(tomllib.loads(body))
            except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
                raise ConfigError(f"{path} is not valid TOML: {_error_text(exc)}") from None
        text = body
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # a JSONDecodeError, 5000 digits, [[[[...
        raise ConfigError(f"{source} is not valid JSON: {_error_text(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(data).__name__}")
    return data


def _error_text(exc: BaseException) -> str:
    """A parser's error, without the advice to raise Python's limits."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split("; use sys.set_int_max_str_digits")[0]


T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(value: Any, annotation: Any, name: str, hidden: bool = False) -> Any:
    """``value`` as ``annotation``; a ConfigError never shows a ``hidden`` (secret) value."""
    shown = _shown(value, hidden)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, str) and str in inner and any(_kind(a) in _containers for a in inner):
            return value  # a string where one is accepted: the options class reads it
        return _coerce(value, inner[0], name, hidden)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"option {name}={shown} must be one of {list(args)}")
        return value
    if annotation is Size:
        try:
            return parse_size(value)
        except ConfigError as exc:
            if hidden:
                raise ConfigError(f"option {name}={shown} is not a valid size") from None
            raise ConfigError(f"option {name}: {exc}") from None
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"option {name}={shown} must be a boolean")
    if annotation is int:
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number_i = int(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"option {name}={shown} must be an integer") from (
                None if hidden else exc
            )
        if not -(2**63) <= number_i <= 2**63 - 1:
            raise ConfigError(f"option {name}={shown} is out of range (a 64-bit integer)")
        return number_i
    if annotation is float:
        try:
            if isinstance(value, bool):
                raise ValueError  # noqa: TRY004 - caught below and raised as ConfigError
            number = float(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"option {name}={shown} must be a number") from (
                None if hidden else exc
            )
        if not math.isfinite(number):
            raise ConfigError(f"option {name}={shown} must be a finite number")
        return number
    if annotation is str:
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"option {name}={shown} must be a string")
        text = os.fspath(value)
        if not isinstance(text, str):  # a bytes path
            raise ConfigError(f"option {name}={shown} must be a string")
        if "\x00" in text:
            raise ConfigError(f"option {name}={shown} must not contain a NUL byte")
        return text
    kind = _kind(annotation)
    if kind in _containers and isinstance(value, str):  # (from the environment: JSON text)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, kind):
            raise ConfigError(f"option {name}={shown} must be a JSON {_containers[kind]}")
    return value


#: Option types given as JSON text in the environment, and what JSON calls them.
_containers: dict[Any, str] = {dict: "object", list: "array"}


def _kind(annotation: Any) -> Any:
    """``dict`` for ``dict[str, Any]``, ``list`` for ``list[int]``, else ``annotation``."""
    return typing.get_origin(annotation) or annotation


def _shown(value: Any, hidden: bool) -> str:
    """``value`` as an error message shows it: redacted when secret, cut when long."""
    if hidden:
        return REDACTED
    if isinstance(value, str):
        return _short(redact_text(value))
    text = redact_text(repr(redact_value(value)))
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


#: Option names of development builds and the glossary's name for the same idea
#: (docs/concepts.md, "Option names"). Nothing was released under the old names, so they
#: are not aliases: an old name is an unknown option whose error names the new one.
RENAMED_OPTIONS = {
    "directory": "root",
    "capacity": "max_size",
    "io_threads": "max_concurrency",
    "max_connections": "max_concurrency",
}


def parse_options(cls: type[T], backend: str, options: Mapping[str, Any]) -> T:
    """Build the options dataclass ``cls`` of ``backend`` from ``options``.

    Precedence: ``options`` > environment ``HICACHE_STORAGE_<BACKEND>_<NAME>`` > default.
    Unknown option names raise :class:`ConfigError` that lists the valid ones.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(options) - set(known) - CONTROLLER_KEYS
    if unknown:
        renamed = [
            f"{old!r} is now {RENAMED_OPTIONS[old]!r}"
            for old in sorted(unknown)
            if RENAMED_OPTIONS.get(old) in known
        ]
        hint = f" ({'; '.join(renamed)})" if renamed else ""
        raise ConfigError(
            f"unknown option(s) {sorted(unknown)} for backend {backend!r}{hint}; "
            f"valid options: {sorted(known)}"
        )
    kwargs: dict[str, Any] = {}
    env_prefix = f"HICACHE_STORAGE_{backend.upper().replace('-', '_')}_"
    for old, new in RENAMED_OPTIONS.items():
        if new in known and env_prefix + old.upper() in os.environ:
            raise ConfigError(
                f"{env_prefix}{old.upper()} is set, and {old!r} is now {new!r}: set "
                f"{env_prefix}{new.upper()} instead"
            )
    for name in known:
        if name in options:
            raw = options[name]
        elif (env := os.environ.get(env_prefix + name.upper())) is not None:
            raw = env
        else:
            continue
        try:
            kwargs[name] = _coerce(raw, hints[name], name, is_secret_option(name, cls))
        except ConfigError as exc:  # (a parser's message may quote a value nested in raw)
            raise ConfigError(scrub(str(exc), secret_values({name: raw}, cls))) from None
    _redact_repr(cls)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        # An options class's own check (a ConfigError included): still a bad option, and
        # its message may hold a value, so secrets are cut out of it.
        msg = scrub(f"{exc}", secret_values(kwargs, cls))
        if not isinstance(exc, ConfigError):
            msg = f"{type(exc).__name__}: {msg}"
        raise ConfigError(f"invalid options for backend {backend!r}: {msg}") from None


def redacting_repr(cls: type[T]) -> type[T]:
    """Class decorator (above ``@dataclass``): the options' ``repr`` hides their secrets.

    :func:`parse_options` gives every options class such a ``repr``; the decorator gives
    it from the start, to instances built directly.
    """
    _redact_repr(cls)
    return cls


def _redact_repr(cls: type) -> None:
    """Give an options dataclass a ``repr`` that hides its secrets, once per class.

    Secret fields are shown redacted and URL passwords cut out, where the generated
    ``repr`` would print them.
    """
    if cls.__dict__.get("_hicache_redacting_repr"):
        return
    fields = [f for f in dataclasses.fields(cls) if f.repr or is_secret_option(f.name, cls)]
    hidden = {f.name for f in fields if is_secret_option(f.name, cls)}

    def shown(self: Any, name: str) -> str:
        value = getattr(self, name)
        if name in hidden and value is not None:
            return REDACTED
        return redact_text(repr(redact_value(value)))

    def __repr__(self: Any) -> str:
        body = ", ".join(f"{f.name}={shown(self, f.name)}" for f in fields)
        return f"{type(self).__qualname__}({body})"

    cls.__repr__ = __repr__  # type: ignore[method-assign, assignment]
    cls._hicache_redacting_repr = True  # type: ignore[attr-defined]
