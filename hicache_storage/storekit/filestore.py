"""One object per file under a per-namespace directory: the machinery of file-like stores.

Shared by the ``file`` backend (any POSIX filesystem) and the ``shm`` backend (``/dev/shm``),
which differ only in their options and defaults. Layout:
``<root>/<namespace digest>/<fanout>/<key>[~<shard>]``; every file is
``payload || header`` (the header as a trailer, see :mod:`hicache_storage.storekit.header`;
an object with its header first is damage), published atomically
(:mod:`hicache_storage.storekit.atomic`); capacity is tracked with
:class:`~hicache_storage.storekit.capacity.CapacityTracker`. Every directory used and every file read
passes the trust rule of :mod:`hicache_storage.storekit.pathsafety` (owned by this user or, in group
mode, the group; not writable by others; never a symlink, FIFO or other special file), and
directories that vanish while the store runs are recreated on the next write. Guarantees
are documented in ``docs/backends/file.md`` and ``docs/backends/shm.md``.

The class is put together from three modules: :mod:`~hicache_storage.storekit.filetree`
(the options, directories, trust rule and the I/O hook that reads and writes share),
:mod:`~hicache_storage.storekit.filereads` and :mod:`~hicache_storage.storekit.filewrites`;
this one adds existence, deletion, ``clear``, ``close`` and ``usage``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import threading
from typing import Any

from typing_extensions import override

from hicache_storage.breaker import Health
from hicache_storage.errors import (
    BackendError,
    ConfigError,
    from_os_error,
)
from hicache_storage.storekit.filereads import FileTreeReads
from hicache_storage.storekit.filetree import FileTreeOptions, O, PayloadMove
from hicache_storage.storekit.filewrites import FileTreeWrites
from hicache_storage.storekit.treescan import TRASH_PREFIX

__all__ = ["FileTreeOptions", "FileTreeStore", "PayloadMove"]


class FileTreeStore(FileTreeReads[O], FileTreeWrites[O]):
    """Pages as files in a directory tree (zero-copy ``writev``/``preadv``).

    Generic in its options type: ``class FileBackend(FileTreeStore[FileOptions])``.
    Subclasses set :attr:`options_class` (that :class:`FileTreeOptions` subclass) and
    implement :meth:`_location`; they may change :attr:`file_mode`, :attr:`dir_mode`,
    :attr:`group_id` (in ``_configure``) and the defaults of the capacity limits.
    """

    # ------------------------------------------------------------------ existence, delete

    @override
    def exists(self, key: str) -> bool:
        return self._exists_at(self._root_prefix + self.object_path(key))

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        # The prefetch path's hot loop (every page of every prompt). The common case is
        # inline: the path from the remembered name, one lstat, a regular file of ours
        # that nobody else can write (the trust rule for a private store). Anything else
        # (a metadata cache, a shared group, an odd file, an error) takes _exists_at.
        paths = self.object_namer().each_path(keys, self._root_prefix)  # named as reached
        exists_at = self._exists_at
        if self._meta.enabled or self.group_id is not None:
            for i, path in enumerate(paths):
                if not exists_at(path):
                    return i
            return len(keys)
        lstat, euid, is_reg = os.lstat, os.geteuid(), stat.S_ISREG
        foreign = stat.S_IWGRP | stat.S_IWOTH
        for i, path in enumerate(paths):
            try:
                st = lstat(path)
            except FileNotFoundError:
                return i
            except OSError:
                st = None
            if (
                st is None or not is_reg(st.st_mode) or st.st_uid != euid or st.st_mode & foreign
            ) and not exists_at(path):
                return i
        return len(keys)

    @override
    def delete(self, key: str) -> bool:
        name = self.object_name(key)
        path = self._path(name)
        # Forget before unlinking (see _quarantine): the accounting may briefly count a
        # deleted file, never miss a stored one.
        self._meta.discard(path)
        self._tracker.discard(name.path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if self._on_disk(path):
                self._tracker.add(name.path, os.lstat(path).st_size)
            raise from_os_error(exc, f"delete {path}") from exc
        self._removed([key])
        return True

    @override
    def clear(self) -> None:
        """Remove this namespace's directory (and only it); the backend stays usable."""
        trash = os.path.join(
            self.root, f"{TRASH_PREFIX}{self.namespace.digest}.{secrets.token_hex(6)}"
        )
        try:
            os.rename(self.directory, trash)
        except FileNotFoundError:
            trash = ""
        except OSError as exc:
            raise from_os_error(exc, f"clear {self.directory}") from exc
        self._forget_dirs()
        self._meta.clear()
        self._tracker.clear(prefix=f"{self.namespace.digest}/" if self.capacity_per_root else None)
        self._removed(None)
        try:
            self._ensure_tree()
        except ConfigError as exc:
            raise BackendError(str(exc)) from exc
        if trash:
            # The namespace is gone for every reader once renamed; its files are deleted
            # in the background, so clear() returns at once however many it held. A
            # process that dies first leaves the trash directory to the next start-up.
            reclaim = threading.Thread(
                target=shutil.rmtree,
                args=(trash,),
                kwargs={"ignore_errors": True},
                name="hicache-storage-clear",
                daemon=True,
            )
            reclaim.start()
            with self._dirs_lock:
                self._reclaims = [t for t in self._reclaims if t.is_alive()] + [reclaim]

    @override
    def close(self) -> None:
        self._io.close()
        self._scanner.save(self._tracker, self.snapshot_min_objects)
        self._wait_for_reclaims()  # the files of cleared namespaces: gone when close returns

    # ------------------------------------------------------------------ introspection

    @override
    def health(self) -> Health:
        """Whether the tree is usable: a ``stat`` and a ``statvfs``, no I/O on objects.

        ``down`` when the namespace's directory (the root while it has none) is gone or
        not writable; ``degraded``
        when the file system has less free space than ``min_free_space`` asks (or under
        1%).
        """
        base = super().health()
        if not base.usable:
            return base
        # The namespace's directory, or the root while it is missing (a write makes it).
        where = self.directory if os.path.lexists(self.directory) else self.root
        try:
            st = os.stat(where)
            if not stat.S_ISDIR(st.st_mode) or not os.access(where, os.W_OK | os.X_OK):
                return Health("down", "the store's directory is not a writable directory")
            fs = os.statvfs(where)
        except OSError as exc:
            return Health("down", f"the store's directory: {os.strerror(exc.errno or 0)}")
        free = fs.f_bavail * fs.f_frsize
        floor = max(int(self._tracker.min_free_bytes or 0), fs.f_blocks * fs.f_frsize // 100)
        if free < floor:
            return Health("degraded", f"{free} bytes free, under {floor}")
        return Health("ok")

    @override
    def usage(self) -> dict[str, int]:
        """The protocol's figures and ``reserved_bytes``, from the capacity tracker.

        With this namespace's own (:data:`~hicache_storage.protocol.NAMESPACE_USAGE_KEYS`).

        The tracker counts only with a cap, a quota or a floor set (objects and bytes
        are -1 without), each object as its file's size (payload and header). Where
        the limit covers the whole root (``shm``), the first three are the root's and
        the ``namespace_`` ones this namespace's (every shard); otherwise both are
        this namespace's and shard's.
        """
        tracker = self._tracker
        counted = tracker.enabled
        caps = [
            c
            for c in (tracker.quota_bytes, None if self.capacity_per_root else tracker.max_bytes)
            if c
        ]
        return {
            "objects": len(tracker) if counted else -1,
            "used_bytes": tracker.used_bytes if counted else -1,
            "limit_bytes": tracker.max_bytes or 0,
            "reserved_bytes": tracker.reserved_bytes if counted else -1,
            "namespace_objects": tracker.quota_objects if counted else -1,
            "namespace_used_bytes": tracker.quota_used_bytes if counted else -1,
            "namespace_limit_bytes": min(caps) if caps else 0,
        }

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, namespace={self.namespace.digest}, shard={self.config.shard})"
