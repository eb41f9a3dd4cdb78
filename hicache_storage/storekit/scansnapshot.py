"""What a file-tree store scanned, left for the next instance so it need not scan again.

A store of a million files takes minutes to scan at start-up. An instance leaves a
*snapshot* in its root when it closes: for each fan-out directory that was quiet when
last scanned, its mtime then, and every object the capacity tracker holds there, least
recently used first. The next instance takes a directory from the snapshot only when its
mtime is the one recorded, so anything made or removed since (by any process, before or
after a crash) is scanned again. The snapshot only saves time: one that is not this
user's regular file, not private, or not well formed is ignored.

Format (JSON, checked with C-speed passes: a million objects load in about a second):
``version``, ``root``, ``scope`` (the shard the store serves), ``dirs`` (``[relative
directory, its mtime in ns when last scanned]`` pairs), then one entry per object, least
recently used first, in three parallel fields: ``dir_of`` (the index of its directory in
``dirs``), ``leaves`` (the file names, newline-joined) and ``sizes`` (their bytes).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache_storage.storekit.atomic import open_temp, writev_all
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    is_trusted,
    open_regular_stat,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "SCAN_QUIET_NS",
    "SNAPSHOT_PREFIX",
    "Snapshot",
    "encode_snapshot",
    "load_snapshot",
    "save_snapshot",
]

#: Hidden files in the root where an instance leaves what it scanned.
SNAPSHOT_PREFIX = ".hicache-scan."
_VERSION = 2
_MAX_BYTES = 1 << 30
#: A directory changed less than this long before it was scanned is scanned again next
#: time (timestamps are coarse: a change in the same tick would leave the mtime as seen).
SCAN_QUIET_NS = 1_000_000_000
#: The store's directory names: ``<namespace dir>/<fan-out>``.
_NAMESPACE_DIR = re.compile(r"ns\d+-[0-9a-f]+")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


@dataclass(frozen=True)
class Snapshot:
    """What the last instance left: the directories' mtimes, every object, oldest use first.

    ``dirs`` maps each directory to its mtime when scanned; ``names`` and ``sizes`` are
    the objects', and ``dir_of`` the index, in ``dirs``, of the directory each is in.
    """

    dirs: dict[str, int]
    dir_of: list[int]
    names: list[str]
    sizes: list[int]

    def columns(self, valid: set[str]) -> tuple[list[str], list[int]]:
        """Names and sizes of the objects in the ``valid`` directories, oldest first."""
        if len(valid) == len(self.dirs):
            return self.names, self.sizes
        keep = list(map([d in valid for d in self.dirs].__getitem__, self.dir_of))
        return list(itertools.compress(self.names, keep)), list(
            itertools.compress(self.sizes, keep)
        )

    def entries(self, valid: set[str]) -> Iterable[tuple[str, int, int]]:
        """``(name, bytes, rank)`` of the objects in the ``valid`` directories, oldest first.

        The rank is the position in the last instance's LRU order: a small int, older than
        any file's mtime, so the newest writes (in directories scanned again) stay newest.
        """
        rows = zip(self.names, self.sizes, range(len(self.names)), strict=True)
        if len(valid) == len(self.dirs):
            return rows
        keep = [d in valid for d in self.dirs]
        return itertools.compress(rows, map(keep.__getitem__, self.dir_of))


def _only_ints(values: object, low: int, high: int | None = None) -> bool:
    """True for a list of plain ints in ``[low, high)`` (C-speed checks, for long lists)."""
    if type(values) is not list:
        return False
    if not values:
        return True
    return (
        set(map(type, values)) == {int}
        and min(values) >= low
        and (high is None or max(values) < high)
    )


def load_snapshot(
    path: str,
    *,
    root: str,
    scope: str,
    group_id: int | None,
    owned: Callable[[str, int], bool] | None = None,
) -> Snapshot | None:
    """The snapshot at ``path``, or None where there is none this store may trust.

    ``owned(leaves, count)`` says whether ``count`` newline-joined file names are all this
    store's (None: any name). Raises :class:`ValueError` for a snapshot that is not well
    formed (the caller logs it and scans everything).
    """
    try:
        fd, st = open_regular_stat(path, os.O_RDONLY)
    except (OSError, NotRegularFileError):
        return None
    try:
        if not is_trusted(st, group_id) or st.st_size > _MAX_BYTES:
            return None
        raw = os.read(fd, st.st_size + 1)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
        if (
            data.get("version") != _VERSION
            or data.get("root") != root
            or data.get("scope") != scope  # not one copied from a shard
        ):
            return None
        dirs: dict[str, int] = {}
        for rel_dir, mtime_ns in data["dirs"]:
            ns, _, fan = str(rel_dir).partition("/")
            if (
                type(mtime_ns) is not int
                or _NAMESPACE_DIR.fullmatch(ns) is None
                or _FANOUT_DIR.fullmatch(fan) is None
                or rel_dir in dirs
            ):
                raise ValueError(f"directory {rel_dir!r}")
            dirs[rel_dir] = mtime_ns
        leaves, dir_of, sizes = data["leaves"], data["dir_of"], data["sizes"]
        # A name stays inside a directory of the store (eviction unlinks it): no leaf is
        # empty, holds a separator or starts with a dot.
        if type(leaves) is not str or any(bad in leaves for bad in ("/", "\0", "\n\n", "\n.")):
            raise ValueError("leaves")
        if leaves.startswith((".", "\n")) or leaves.endswith("\n"):
            raise ValueError("leaves")
        split = leaves.split("\n") if leaves else []
        if not _only_ints(dir_of, 0, len(dirs)) or not _only_ints(sizes, 0):
            raise ValueError("dir_of or sizes")
        if not len(split) == len(dir_of) == len(sizes):
            raise ValueError("the entries do not match")
        if owned is not None and not owned(leaves, len(split)):
            raise ValueError("objects of another shard")
        prefixes = [d + "/" for d in dirs]
        names = list(map(str.__add__, map(prefixes.__getitem__, dir_of), split))
        # (A name listed twice: the capacity tracker's load finds it, at no extra cost.)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, MemoryError) as exc:
        raise ValueError(f"a malformed scan snapshot: {exc}") from None
    return Snapshot(dirs, dir_of, names, sizes)


def encode_snapshot(
    *, root: str, scope: str, quiet: dict[str, int], objects: Iterable[tuple[str, int]]
) -> bytes | None:
    """The snapshot's bytes; None if it is too large for the next instance to load.

    ``quiet``: the directories taken from it next time (``{dir: mtime}``); ``objects``:
    ``(relative name, bytes)``, oldest use first (those outside ``quiet`` are left out).
    """
    index = {d: i for i, d in enumerate(quiet)}
    dir_of: list[int] = []
    leaves: list[str] = []
    sizes: list[int] = []
    for name, nbytes in objects:
        rel_dir, _, leaf = name.rpartition("/")
        i = index.get(rel_dir)
        if i is not None:
            dir_of.append(i)
            leaves.append(leaf)
            sizes.append(nbytes)
    data = {
        "version": _VERSION,
        "root": root,
        "scope": scope,
        "dirs": list(quiet.items()),
        "dir_of": dir_of,
        "leaves": "\n".join(leaves),
        "sizes": sizes,
    }
    payload = json.dumps(data, separators=(",", ":")).encode()
    return None if len(payload) > _MAX_BYTES else payload


def save_snapshot(
    path: str, root: str, payload: bytes | None, *, mode: int, group_id: int | None
) -> None:
    """Replace the snapshot at ``path`` with ``payload`` in one step (None: remove it).

    Raises :class:`OSError` when it cannot be written (the temporary is removed).
    """
    if payload is None:  # (the next instance would not read it: leave none)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    tmp = ""
    try:
        tmp, fd = open_temp(root, mode=mode, gid=group_id)
        try:
            writev_all(fd, [payload])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
