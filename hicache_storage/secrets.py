"""Secrets: which option values are secret, and keeping them out of everything shown.

One rule for the whole package (config, backends, the kit, the CLI, both engine adapters):

* An option is a **secret option** when its name says so (a part of it is ``password``,
  ``token``, ``secret``, ``key``, ``credentials``...; see :func:`is_secret_option`) or when
  the backend's options class marks the field with :func:`secret`. Its whole value is
  secret, every string and number nested in it included.
* Inside any other option value, at any depth (mappings, lists, tuples, sets), an entry of
  a mapping whose name says so is a secret option too, and every string may carry one:
  the password of a ``scheme://user:password@host`` URL and the value of a secret query
  parameter (``?password=``, ``&token=``...).

Options are *shown* redacted (:func:`redact_options`, :func:`redact_value`: by name, the
value replaced by :data:`REDACTED`). Free text (error messages, log records, reports) is
*scrubbed* (:func:`scrub`, :class:`LogScrubber`): URL passwords are cut out wherever they
appear, and so is every value :func:`secret_values` finds in the options, in each form a
client may print it: as is, JSON- and ``repr``-escaped, percent-encoded, base64-encoded
(HTTP headers such as S3's SSE-C customer key) and as the base64 of its MD5 digest (the
key's checksum header, which identifies the key and lets a weak one be guessed offline).
Values shorter than :data:`MIN_SCRUB_LEN` characters are not searched for in free text
(replacing every ``"ab"`` would garble it); they are still redacted where options are
shown, since that goes by name.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import field
from typing import Any
from urllib.parse import quote, unquote

from typing_extensions import override

__all__ = [
    "MIN_SCRUB_LEN",
    "REDACTED",
    "LogScrubber",
    "is_secret_option",
    "redact_options",
    "redact_text",
    "redact_value",
    "scrub",
    "secret",
    "secret_values",
]

#: What a secret value is replaced by wherever options or messages are shown.
REDACTED = "<redacted>"
#: Shortest secret value searched for (and replaced) in free text.
MIN_SCRUB_LEN = 4
#: Words that make an option name a secret, as a whole part of the name (``_``/``-``
#: separated): ``password``, ``redis_password``, ``aws_secret_access_key``, ``token``...
_SECRET_WORDS = frozenset(
    {
        "password", "passwd", "pass", "passphrase", "pwd", "secret", "token", "key", "auth",
        "authorization", "credential", "credentials", "cookie", "signature", "apikey",
        "privatekey",
    }
)  # fmt: skip
#: ``scheme://user:password@host``: the password part of a URL.
# (The password runs to the authority's last ``@``, so one holding ``@`` is cut whole.)
_URL_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*:)(?P<pw>[^/?#\s]+)(?=@[^@/?#\s]*(?:[/?#\s]|$))"
)
#: ``?password=...`` / ``&X-Amz-Security-Token=...``: secret query parameters of a URL.
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&;][\w.-]*(?:password|passwd|pwd|token|secret|key|auth|signature|credential)[\w.-]*=)"
    r"(?P<pw>[^&#\s]+)",
    re.IGNORECASE,
)
#: Nesting shown by :func:`redact_value`; anything deeper is shown as :data:`REDACTED`.
_SHOWN_DEPTH = 32


def secret(default: Any = None) -> Any:
    """A dataclass field marked as a secret (shown redacted wherever options are shown).

    Use in a backend's options class for a secret whose name does not say so::

        auth: str | None = secret()
    """
    return field(default=default, metadata={"secret": True}, repr=False)


def is_secret_option(name: str, options_class: type | None = None) -> bool:
    """True if option ``name`` holds a secret.

    It does when its name says so (a part of it is ``password``, ``secret``, ``token``,
    ``key``, ``credentials``...; ``camelCase`` names are split too) or when the backend's
    options class marks the field with :func:`secret`.
    """
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)  # camelCase: apiKey, accessKeyId
    parts = re.split(r"[_\-.\s]+", spaced.lower())
    if any(p in _SECRET_WORDS for p in parts):
        return True
    if options_class is not None and dataclasses.is_dataclass(options_class):
        for f in dataclasses.fields(options_class):
            if f.name == name and f.metadata.get("secret"):
                return True
    return False


def redact_text(text: str) -> str:
    """``text`` with URL passwords and secret query parameters redacted.

    The password of every ``scheme://user:password@`` URL is redacted, and so is the value
    of every secret query parameter (``?password=``, ``&token=``...).
    """
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, text)
    return _QUERY_SECRET.sub(lambda m: m.group("head") + REDACTED, text)


def redact_value(value: Any, _depth: int = 0) -> Any:
    """A copy of an option value that is safe to show, at any depth.

    Strings lose their URL passwords, mappings are redacted as :func:`redact_options`
    does, lists, tuples and sets item by item (as lists). Deeper than 32 levels, the
    rest is shown as :data:`REDACTED`.
    """
    if _depth > _SHOWN_DEPTH:
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            k: REDACTED
            if is_secret_option(str(k)) and v is not None
            else redact_value(v, _depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        return [redact_value(v, _depth + 1) for v in value]
    return value


def redact_options(
    options: Mapping[str, Any] | None, options_class: type | None = None
) -> dict[str, Any]:
    """A copy of ``options`` that is safe to print, log or report.

    Secret options (see :func:`is_secret_option`) become :data:`REDACTED`; other values
    are shown by :func:`redact_value` (URL passwords cut out, nested secrets redacted).
    """
    return {
        name: REDACTED
        if is_secret_option(str(name), options_class) and value is not None
        else redact_value(value)
        for name, value in (options or {}).items()
    }


def secret_values(options: Any, options_class: type | None = None) -> set[str]:
    """Every secret that ``options`` holds, as text: what :func:`scrub` cuts out.

    ``options`` is a mapping of option names to values, or an options dataclass instance
    (whose class is then ``options_class``), or ``None``. The secrets are every string or
    number inside a secret option, and the URL passwords and secret query parameters of
    every other string, at any depth (bytes count as UTF-8 text; cycles are followed once).
    """
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        options_class = type(options)
    found: set[str] = set()
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(options, False)]
    while stack:
        value, hidden = stack.pop()
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, (Mapping, list, tuple, set, frozenset)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            if id(value) in seen:
                continue
            seen.add(id(value))
            cls = options_class if value is options else type(value)  # (its secret() fields)
            stack.extend((v, hidden or is_secret_option(str(k), cls)) for k, v in _items(value))
        elif hidden:
            text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
            found.add(str(text))
        elif isinstance(value, str):
            for m in (*_URL_PASSWORD.finditer(value), *_QUERY_SECRET.finditer(value)):
                found.update((m["pw"], unquote(m["pw"])))
    found.discard("")
    return found


def _items(value: Any) -> Iterator[tuple[Any, Any]]:
    """(name, value) of a mapping's or a dataclass's entries; ("", item) of a collection."""
    if isinstance(value, Mapping):
        yield from value.items()
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from (("", v) for v in value)
    else:
        yield from ((f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value))


def _forms(value: str) -> set[str]:
    """``value`` as clients print it: as is, escaped, percent- and base64-encoded, its MD5."""
    raw = value.encode("utf-8", "surrogateescape")
    md5 = hashlib.md5(raw, usedforsecurity=False).digest()
    return {
        value,
        json.dumps(value)[1:-1],
        repr(value)[1:-1],
        repr(raw)[2:-1],
        quote(raw, safe=""),
        base64.b64encode(raw).decode(),
        base64.b64encode(md5).decode(),
    }


def _needles(secrets: Iterable[str]) -> tuple[str, ...]:
    """Every form of every long enough secret, longest first (a prefix never cuts one)."""
    forms = {f for s in secrets if len(s) >= MIN_SCRUB_LEN for f in _forms(s)}
    return tuple(sorted(forms, key=len, reverse=True))


def _cut(text: str, needles: tuple[str, ...]) -> str:
    text = redact_text(text)
    for needle in needles:
        if needle in text:
            text = text.replace(needle, REDACTED)
    return text


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without URL passwords, secret query parameters and any of ``secrets``.

    ``secrets`` are values as :func:`secret_values` finds them; each is cut out in every
    form a client may print it in (see the module's docstring).
    """
    return _cut(text, _needles(secrets))


class LogScrubber(logging.Filter):
    """A logging filter that scrubs every record it sees (it never drops one).

    It cuts URL passwords always, and the secrets it holds: :meth:`add` them when a
    holder (a backend, a command) starts and :meth:`forget` them when it is done; a value
    added by several holders stays until each has forgotten it. The message, the
    traceback and the stack of a record are scrubbed. Put it on the loggers that may see
    a secret (:meth:`attach`; a logger's filter applies to the records logged through that
    logger, not to its children's) or on handlers (``handler.addFilter``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, int] = {}
        self._needles: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def add(self, secrets: Iterable[str]) -> None:
        """Cut ``secrets`` (values as :func:`secret_values` finds them) from now on."""
        with self._lock:
            for value in secrets:
                self._counts[value] = self._counts.get(value, 0) + 1
            self._needles = _needles(self._counts)

    def forget(self, secrets: Iterable[str]) -> None:
        """Undo one :meth:`add` of ``secrets``."""
        with self._lock:
            for value in secrets:
                left = self._counts.pop(value, 0) - 1
                if left > 0:
                    self._counts[value] = left
            self._needles = _needles(self._counts)

    def attach(self, *loggers: str) -> None:
        """Scrub the records logged through the loggers named ``loggers``."""
        for name in loggers:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)

    def scrub(self, text: str) -> str:
        """``text`` without URL passwords and without the secrets held now."""
        return _cut(text, self._needles)

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it itself
            return True
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        # (the traceback as formatters print it; another filter or a record factory may
        # have formatted it already, with secrets of its own only: scrub it all the same)
        text = record.exc_text
        if not text and record.exc_info and record.exc_info[0] is not None:
            text = _FORMATTER.formatException(record.exc_info)
        if text:
            record.exc_text = self.scrub(text)
            if record.exc_text != text:
                record.exc_info = None  # (a handler that formats it itself would leak)
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)
        return True


_FORMATTER = logging.Formatter()
