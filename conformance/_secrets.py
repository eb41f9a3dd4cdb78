"""Keeping backend secrets out of everything the conformance kit shows or starts.

Options that are secrets (see :func:`hicache_storage.config.is_secret_option`: a name such
as ``password``/``token``/``secret_key``, a field the backend's options class marks with
:func:`hicache_storage.config.secret`, or the password of a ``scheme://user:pw@host``
URL) are *registered* here as soon as a :class:`~hicache_storage.conformance.BackendSpec`
holds them. From then on, in this process:

* :func:`scrub` replaces every registered value (and its JSON and ``repr`` escapes) in a
  text by :data:`~hicache_storage.config.REDACTED`; the kit passes failure messages,
  worker output and report fields through it, and the pytest plugin passes every test
  report (traceback, captured output and logs) through it;
* log records are scrubbed when they are created (a log record factory is installed with
  the first registered secret), so neither live logs nor captured logs show one.

Values shorter than :data:`MIN_SCRUB_LEN` characters are not searched for in free text
(replacing every ``"ab"`` would garble messages); they are still redacted wherever options
are shown, since that is by option name.

Importing this module is cheap (no torch): the pytest plugin uses it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

from hicache_storage.config import REDACTED, is_secret_option, redact_text

__all__ = ["MIN_SCRUB_LEN", "options_class_of", "register", "registered", "scrub", "secret_values"]

#: Shortest secret value searched for (and replaced) in free text.
MIN_SCRUB_LEN = 4

_lock = threading.Lock()
_secrets: set[str] = set()
_needles: tuple[str, ...] = ()  # every registered value and its escapes, longest first
_factory_installed = False
#: The password part of ``scheme://user:password@host`` (as :func:`redact_text` sees it).
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*:([^@/\s]+)(?=@)")


def options_class_of(obj: Any) -> type | None:
    """The options dataclass of a backend class or instance, if it has one.

    ``obj.options_class`` when that is a dataclass, else the type of ``obj.options``
    when that is a dataclass instance; ``None`` otherwise.
    """
    cls = getattr(obj, "options_class", None)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return cls
    opts = getattr(obj, "options", None)
    if opts is not None and dataclasses.is_dataclass(opts) and not isinstance(opts, type):
        return type(opts)
    return None


def _leaves(value: Any) -> Iterable[str]:
    if value is None:
        return
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _leaves(v)
    else:
        yield str(value)


def _url_passwords(value: Any) -> Iterable[str]:
    """The passwords of the ``scheme://user:pw@host`` URLs in ``value`` (any nesting)."""
    for text in _leaves(value):
        if redact_text(text) != text:
            yield from _URL_PASSWORD.findall(text)


def secret_values(options: Mapping[str, Any] | None, options_class: type | None = None) -> set[str]:
    """Every secret string held by ``options`` (secret options' values, URL passwords)."""
    found: set[str] = set()
    for name, value in (options or {}).items():
        if is_secret_option(str(name), options_class):
            found.update(_leaves(value))
        elif isinstance(value, Mapping):
            found |= secret_values(value)
        else:
            found.update(_url_passwords(value))
    return {s for s in found if s}


def register(options: Mapping[str, Any] | None, options_class: type | None = None) -> None:
    """Remember the secrets of ``options`` so that :func:`scrub` removes them."""
    values = secret_values(options, options_class)
    if not values:
        return
    global _needles
    with _lock:
        if values <= _secrets:
            return
        _secrets.update(values)
        needles: set[str] = set()
        for s in _secrets:
            if len(s) < MIN_SCRUB_LEN:
                continue
            needles.add(s)
            needles.add(json.dumps(s)[1:-1])
            needles.add(repr(s)[1:-1])
        _needles = tuple(sorted(needles, key=len, reverse=True))
    _install_log_factory()


def registered() -> bool:
    """True once any secret has been registered in this process."""
    return bool(_secrets)


def scrub(text: str) -> str:
    """``text`` without any registered secret or URL password."""
    text = redact_text(text)
    for needle in _needles:
        if needle in text:
            text = text.replace(needle, REDACTED)
    return text


def _install_log_factory() -> None:
    """Scrub every log record of this process when it is created."""
    global _factory_installed
    with _lock:
        if _factory_installed:
            return
        _factory_installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the logger's problem
            return record
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[0] is not None:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = scrub(text)
            if clean != text:
                record.exc_text = clean  # Formatter uses the cached text, not exc_info
        return record

    logging.setLogRecordFactory(factory)
