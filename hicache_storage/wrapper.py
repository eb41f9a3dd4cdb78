"""The public base of backends that wrap another backend: :class:`WrapperBackend`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.protocol import HiCacheStorage

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.buffers import PageBuffer

__all__ = ["WrapperBackend"]


class WrapperBackend(HiCacheStorage):
    """A backend that forwards every operation to another one, ``inner``.

    Subclass it to add behaviour around a store without touching the store: latency or
    faults for tests (:mod:`hicache_storage.conformance.wrappers`), a tier in front of it,
    logging. Override :meth:`_before` to run code before each forwarded operation, or
    override single methods (call ``super()`` to forward).

    The wrapper takes ``inner``'s config, namespace, capabilities and registered host
    pool, and registers a later host pool with ``inner`` as well as itself. Being a :class:`HiCacheStorage` subclass,
    it is guarded like any backend: a failure inside ``inner`` that escapes it, or one
    raised by the wrapper's own code, becomes the call's failure shape and is counted in
    the wrapper's stats (``inner`` keeps its own). Closing the wrapper closes ``inner``.
    """

    def __init__(self, inner: HiCacheStorage) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.name = f"{type(self).__name__}({inner.name or type(inner).__name__})"
        self.capabilities = inner.capabilities
        # A pool already attached to ``inner`` serves the wrapper's v1 calls too.
        self.mem_pool_host = inner.mem_pool_host

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
    def close(self) -> None:
        self.inner.close()
