"""The conformance kit: the checks a storage vendor runs against their own backend.

Three ways to run it:

* subclass :class:`BackendConformance` in your tests and override the ``backend_spec``
  fixture (see :mod:`hicache_storage.conformance.suite`);
* ``pytest --pyargs hicache_storage.conformance --hicache-storage-backend NAME
  --hicache-storage-backend-extra-config JSON`` (or the environment variables
  ``HICACHE_STORAGE_BACKEND`` / ``HICACHE_STORAGE_BACKEND_EXTRA_CONFIG``);
* ``hicache-storage conformance --hicache-storage-backend NAME ... --report out.json
  --markdown out.md``.

Importing this package is cheap (the pytest plugin imports it in every session); the
suite, which needs torch, is imported on first use of its names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_storage.conformance.data import BackendSpec
    from hicache_storage.conformance.suite import BackendConformance, requires
    from hicache_storage.conformance.wrappers import FaultyBackend, LatencyBackend

__all__ = ["BackendConformance", "BackendSpec", "FaultyBackend", "LatencyBackend", "requires"]

_LAZY = {
    "BackendConformance": "hicache_storage.conformance.suite",
    "requires": "hicache_storage.conformance.suite",
    "BackendSpec": "hicache_storage.conformance.data",
    "FaultyBackend": "hicache_storage.conformance.wrappers",
    "LatencyBackend": "hicache_storage.conformance.wrappers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
