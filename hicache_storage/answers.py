"""What counts as a yes/no answer from a store, for the guard and the building blocks."""

from __future__ import annotations

import numbers

__all__ = ["as_bool"]


def as_bool(value: object) -> bool | None:
    """``value`` as a yes/no answer, or None when it is not one.

    Booleans (Python's, and numpy's: ``numpy.bool`` in numpy 2, ``numpy.bool_`` in 1) and
    the integers 0 and 1 (numpy's too) are answers. Anything else (2, -1, a string, a
    float, None) is not: taking it as True would report a page present or stored that is
    not. Shared by the protocol's guard and
    :class:`~hicache_storage.storekit.blobstore.BlobStore`.
    """
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    return None
