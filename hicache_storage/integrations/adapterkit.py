"""What every engine adapter does the same way (no engine import).

* :func:`backend_name_of` -- the ``backend_name`` of an engine's extra config, checked
  and its backend class loaded, so a deployment with a bad name fails at start;
* :func:`failsafe` -- an engine hook that logs (and counts) what it raises and returns
  its failure result instead: an engine's thread never sees the store's exceptions;
* :func:`failure_text` -- an exception as adapters log it, scrubbed of the options'
  secrets.

Used by :mod:`hicache_storage.integrations.sglang` and the vLLM connector
(:mod:`hicache_storage.integrations.vllm`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from hicache_storage.errors import ConfigError
from hicache_storage.registry import available_backends, load_backend_class
from hicache_storage.secrets import scrub, secret_values

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["HookOwner", "backend_name_of", "failsafe", "failure_text"]

F = TypeVar("F", bound="Callable[..., Any]")


def backend_name_of(extra: Mapping[str, Any], where: str) -> str:
    """The backend named by ``extra["backend_name"]``, its class loaded to check it.

    :class:`ConfigError` (listing the installed backends) when the key is missing or not
    a string; the registry's errors for an unknown name, ``NAME@DIST`` or
    ``module:Class``. ``where`` names the config in the message.
    """
    name = extra.get("backend_name")
    if not name or not isinstance(name, str):
        raise ConfigError(
            f"{where} needs backend_name: the hicache-storage backend to use "
            f"(installed: {sorted(available_backends())})"
        )
    load_backend_class(name)
    return name


def failure_text(exc: BaseException, extra: Mapping[str, Any] | None) -> str:
    """``"Type: message"`` of ``exc``, without the secrets of the options ``extra``."""
    return f"{type(exc).__name__}: {scrub(str(exc), secret_values(extra))}"


class HookOwner(Protocol):
    """What :func:`failsafe` needs of the object whose hooks it guards."""

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        """Log (and count) that ``hook`` raised ``exc``; the hook returns its failure."""


def failsafe(failure: Callable[[Any, tuple[Any, ...]], Any]) -> Callable[[F], F]:
    """Make an engine hook return ``failure(self, args)`` instead of raising.

    The backend already turns store failures into failure results; what is left (an
    argument the SDK refuses, a request of an unexpected shape, a bug) is handed to the
    owner's ``_hook_failed`` (see :class:`HookOwner`), and the engine goes on.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: HookOwner, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the engine's thread must not see it
                self._hook_failed(fn.__name__, exc)
                return failure(self, args)

        return cast("F", guarded)

    return wrap
