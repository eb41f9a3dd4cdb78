"""Keeping backend secrets out of everything the conformance kit shows or starts.

The secrets of a backend's options (the package's one rule, :mod:`hicache_storage.secrets`:
secret options by name or by the :func:`~hicache_storage.secrets.secret` marker, URL
passwords, at any depth) are *registered* here as soon as a
:class:`~hicache_storage.conformance.BackendSpec` holds them. From then on, in this process:

* :func:`scrub` cuts every registered value (in each form a client may print it in) out of
  a text; the kit passes failure messages, worker output and report fields through it,
  and the pytest plugin passes every test report (traceback, captured output and logs)
  through it;
* log records are scrubbed when they are created (a log record factory is installed with
  the first registered secret), so neither live logs nor captured logs show one.

Importing this module is cheap (no torch): the pytest plugin uses it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from hicache_storage.secrets import MIN_SCRUB_LEN, LogScrubber, secret_values

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["MIN_SCRUB_LEN", "options_class_of", "register", "registered", "scrub", "secret_values"]

_lock = threading.Lock()
_secrets: set[str] = set()
_scrubber = LogScrubber()  # holds every registered secret
_factory_installed = False


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


def register(options: Mapping[str, Any] | None, options_class: type | None = None) -> None:
    """Remember the secrets of ``options`` so that :func:`scrub` removes them."""
    values = secret_values(options, options_class)
    with _lock:
        values -= _secrets
        _secrets.update(values)
    if values:
        _scrubber.add(values)
        _install_log_factory()


def registered() -> bool:
    """True once any secret has been registered in this process."""
    return bool(_secrets)


def scrub(text: str) -> str:
    """``text`` without any registered secret or URL password."""
    return _scrubber.scrub(text)


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
        _scrubber.filter(record)
        return record

    logging.setLogRecordFactory(factory)
