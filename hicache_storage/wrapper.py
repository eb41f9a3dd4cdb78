"""The public base of backends that wrap another backend: :class:`WrapperBackend`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.breaker import Health
from hicache_storage.protocol import Capabilities, HiCacheStorage

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from hicache_storage.buffers import PageBuffer
    from hicache_storage.protocol import HostPool

__all__ = ["WrapperBackend"]


class _InnerCapabilities:
    """The descriptor behind :attr:`WrapperBackend.capabilities`."""

    def __get__(self, obj: WrapperBackend | None, owner: type | None = None) -> Capabilities:
        if obj is None:
            return Capabilities()
        own: Capabilities | None = obj.__dict__.get("_own_capabilities")
        return own if own is not None else obj.inner.capabilities

    def __set__(self, obj: WrapperBackend, value: Capabilities) -> None:
        obj.__dict__["_own_capabilities"] = value


class WrapperBackend(HiCacheStorage):
    """A backend that forwards every operation to another one, ``inner``.

    Subclass it to add behaviour around a store without touching the store: latency or
    faults for tests (:mod:`hicache_storage.conformance.wrappers`), a tier in front of it,
    logging. Override :meth:`_before` to run code before each forwarded operation, or
    override single methods (call ``super()`` to forward).

    The wrapper takes ``inner``'s config and namespace. Its capabilities and host pool are
    ``inner``'s, read at each use (a backend may refine its capabilities or get a pool
    after it was wrapped), unless set on the wrapper itself; a pool registered through
    the wrapper is registered with ``inner`` too. Being a :class:`HiCacheStorage`
    subclass, it is guarded like any backend: a failure inside ``inner`` that escapes it, or one
    raised by the wrapper's own code, becomes the call's failure shape and is counted in
    the wrapper's stats (``inner`` keeps its own). Closing the wrapper closes ``inner``.
    """

    #: Calls reach the store through ``inner``, which the metrics count (not twice).
    wraps_backend = True

    def __init__(self, inner: HiCacheStorage) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.name = f"{type(self).__name__}({inner.name or type(inner).__name__})"

    #: ``inner``'s capabilities as they are now, unless set on the wrapper; on the class
    #: itself (what the registry reads), the default ``Capabilities()``.
    capabilities = _InnerCapabilities()

    # A property over the base's attribute: mypy does not take @override on properties.
    @property  # type: ignore[explicit-override]
    def mem_pool_host(self) -> HostPool | None:
        """The pool registered through the wrapper, else ``inner``'s (read at each use)."""
        own: HostPool | None = self.__dict__.get("_own_pool")
        if own is not None:
            return own
        inner = self.__dict__.get("inner")
        return inner.mem_pool_host if inner is not None else None

    @mem_pool_host.setter
    def mem_pool_host(self, value: HostPool | None) -> None:
        self.__dict__["_own_pool"] = value

    def _before(self, op: str) -> None:
        """Hook run before each forwarded operation."""

    @override
    def get(self, key: str, target: Any = None) -> Any:
        self._before("get")
        return self.inner.get(key, target)

    @override
    def set(self, key: str, value: Any) -> bool:
        self._before("set")
        return self.inner.set(key, value)

    @override
    def exists(self, key: str) -> bool:
        self._before("exists")
        return self.inner.exists(key)

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        self._before("batch_exists")
        return self.inner.batch_exists(keys, extra_info)

    @override
    def batch_exists_each(self, keys: list[str]) -> list[bool]:
        self._before("batch_exists_each")
        return self.inner.batch_exists_each(keys)

    @override
    def batch_get(self, keys: list[str], targets: Sequence[Any] | None = None) -> list[Any]:
        self._before("batch_get")
        return self.inner.batch_get(keys, targets)

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        self._before("batch_set")
        return self.inner.batch_set(keys, values)

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        self._before("batch_get_pages")
        return self.inner.batch_get_pages(keys, pages)

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        self._before("batch_set_pages")
        return self.inner.batch_set_pages(keys, pages)

    @override
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.inner.register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host

    @override
    def delete(self, key: str) -> bool:
        self._before("delete")
        return self.inner.delete(key)

    @override
    def clear(self) -> None:
        self.inner.clear()

    @override
    def usage(self) -> dict[str, int]:
        return self.inner.usage()

    @property
    @override
    def reports_removals(self) -> frozenset[str]:  # type: ignore[override]
        """What the inner backend reports."""
        return self.inner.reports_removals

    @override
    def watch_removals(self, listener: Callable[[list[str] | None], None]) -> bool:
        """The inner backend's removals (the keys are the same)."""
        return self.inner.watch_removals(listener)

    @override
    def health(self) -> Health:
        """The inner backend's health (closed: ``down``)."""
        if self._hicache_state().closed:
            return Health("down", "closed")
        return self.inner.health()

    @override
    def close(self) -> None:
        self.inner.close()
