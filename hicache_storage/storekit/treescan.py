"""What a file-like store's tree holds, found by scanning it: :class:`TreeScan`.

The capacity tracker of :class:`~hicache_storage.storekit.filestore.FileTreeStore` is
loaded at start-up, and (with a cap shared across processes) refreshed, from
:meth:`TreeScan.scan`: the objects one instance accounts for, with their sizes and
mtimes. Only names the store makes count, and only files that pass the trust rule.
Directories that did not change since the last instance scanned them are taken from its
snapshot (:mod:`hicache_storage.storekit.scansnapshot`), and the temporaries of dead
writers found on the way are removed, as are the directories an interrupted clear() left
(:meth:`TreeScan.remove_leftovers`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import time
from operator import itemgetter
from typing import TYPE_CHECKING

from hicache_storage.keys import is_object_leaf
from hicache_storage.storekit.atomic import (
    is_stale_temporary,
    is_temporary,
    remove_stale_temporaries,
)
from hicache_storage.storekit.pathsafety import is_trusted
from hicache_storage.storekit.scansnapshot import (
    SCAN_QUIET_NS,
    SNAPSHOT_PREFIX,
    Snapshot,
    encode_snapshot,
    load_snapshot,
    save_snapshot,
)

if TYPE_CHECKING:
    from hicache_storage.ratelimit import RateLimitedLog
    from hicache_storage.storekit.capacity import CapacityTracker

__all__ = ["FANOUT_DIR", "NAMESPACE_DIR", "TRASH_PREFIX", "TreeScan", "is_object_name"]

#: What clear() renames a namespace's directory to before deleting it in the background.
TRASH_PREFIX = ".trash."
NAMESPACE_DIR = re.compile(r"ns\d+-[0-9a-f]+")
FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


def is_object_name(fanout: str, leaf: str) -> bool:
    """True if ``leaf`` in the fan-out directory ``fanout`` is a name this store makes.

    Such a name is a valid key (with an optional ``~<shard>``) whose fan-out is ``fanout``.
    Anything else in a store's directories (another program's files) is never counted or
    evicted.
    """
    if not is_object_leaf(leaf):
        return False
    return hashlib.blake2b(leaf.encode("ascii"), digest_size=1).hexdigest() == fanout


class TreeScan:
    """The scans of one store instance's tree (see the module docs).

    ``namespace`` is the instance's namespace digest and ``shard`` its shard (ranks share
    a directory); with ``per_root`` (one budget for the whole root) every namespace and
    shard under ``root`` counts. ``group_id`` is the trust rule's group, ``file_mode`` the
    mode of the snapshot file, ``stale_temp_age`` the age from which a temporary whose
    writer cannot be identified is removed at start-up.
    """

    def __init__(
        self,
        *,
        root: str,
        namespace: str,
        shard: str | None,
        per_root: bool,
        group_id: int | None,
        file_mode: int,
        stale_temp_age: float,
        log: RateLimitedLog,
    ) -> None:
        self.root, self.namespace, self.shard, self.per_root = root, namespace, shard, per_root
        self.directory = os.path.join(root, namespace)
        self.group_id, self.file_mode, self.stale_temp_age = group_id, file_mode, stale_temp_age
        self._log = log
        #: Fan-out directories as last scanned (quiet ones): their mtime then.
        self.quiet: dict[str, int] = {}
        #: Until the start-up scan has used them: those the last instance left in its
        #: snapshot (their mtime then), and the objects it recorded in them.
        self.cache: dict[str, int] = {}
        self.snapshot: Snapshot | None = None
        self.starting = False  # the start-up scan is running
        self.scope = "root" if per_root else f"{namespace}.{shard}"
        self.snapshot_path = os.path.join(root, f"{SNAPSHOT_PREFIX}{self.scope}.json")

    def remove_leftovers(self, temporaries: bool = True) -> None:
        """Delete temporaries of dead writers and directories left by an interrupted clear().

        Those of this namespace; with ``per_root`` (one budget for the root),
        the directories of an interrupted clear() of any namespace. The start-up scan
        (:meth:`scan`, when there is a cap) removes the temporaries of dead writers in
        every directory it scans (with ``per_root``, of every namespace: an
        interrupted recycle leaves its temporary in the evicted page's namespace); without
        a scan (``temporaries``), this namespace's are removed here.
        """
        if temporaries:
            remove_stale_temporaries(self.directory, self.stale_temp_age)
        now = time.time()
        with os.scandir(self.root) as entries:  # a snapshot's temporary, interrupted
            stale = [
                e.path
                for e in entries
                if is_temporary(e.name)
                and self._stale_temporary(e, e.name, now, self.stale_temp_age)
            ]
        for path in stale:
            self._remove_dead_temporary(path)
        prefix = f"{TRASH_PREFIX}{'' if self.per_root else self.namespace}"
        for entry in os.scandir(self.root):
            if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

    def owns(self, leaf: str) -> bool:
        """True for a stored object of this instance's shard (ranks share the directory)."""
        shard = self.shard
        _, sep, tail = leaf.partition("~")
        return tail == shard if shard is not None else not sep

    def scan(self) -> list[tuple[str, int, float]]:
        """The stored objects this instance accounts for, as (relative name, bytes, mtime).

        See :meth:`_scan_dirs`; the objects of directories taken from the snapshot come
        last, with their rank in the last instance's order as their time.
        """
        found, from_snapshot = self._scan_dirs()
        if from_snapshot and self.snapshot is not None:
            found.extend(self.snapshot.entries(from_snapshot))
        return found

    def scan_ordered(self) -> tuple[list[str], list[int]]:
        """What :meth:`scan` finds, as names and sizes, least recently used first.

        The snapshot's objects (older than any file scanned again: the last instance
        ordered them) come first as it lists them, then the files scanned by mtime:
        no tuple per object, no sort of a million of them.
        """
        found, from_snapshot = self._scan_dirs()
        names: list[str] = []
        sizes: list[int] = []
        if from_snapshot and self.snapshot is not None:
            names, sizes = self.snapshot.columns(from_snapshot)
        if found:
            found.sort(key=itemgetter(2))
            names = [*names, *map(itemgetter(0), found)]
            sizes = [*sizes, *map(itemgetter(1), found)]
        return names, sizes

    def _scan_dirs(self) -> tuple[list[tuple[str, int, float]], set[str]]:
        """The objects of the directories scanned, and the directories the snapshot lists.

        Those of its namespace and shard, or (``per_root``) every object of
        every namespace under the root. Only names the store makes count (namespace
        directories, two-hex fan-outs, key names of that fan-out: another program's files
        in the directory are never counted, evicted or recycled), and only regular files
        that pass the trust rule. With ``per_root``, temporaries of dead
        writers (this host) found on the way are removed: nothing else ever would.
        """
        found: list[tuple[str, int, float]] = []
        if self.per_root:
            try:
                with os.scandir(self.root) as entries:
                    namespaces = [
                        e.name
                        for e in entries
                        if NAMESPACE_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
                    ]
            except OSError:
                return found, set()
            every_shard = True
        else:
            namespaces = [self.namespace]
            every_shard = False
        max_age, now = self.stale_temp_age, time.time()
        from_snapshot: set[str] = set()  # directories whose objects the snapshot lists
        for ns in namespaces:
            try:
                with os.scandir(os.path.join(self.root, ns)) as fans:
                    fan_names = [
                        f.name
                        for f in fans
                        if FANOUT_DIR.fullmatch(f.name) and f.is_dir(follow_symlinks=False)
                    ]
            except OSError:
                continue  # removed meanwhile
            for fan in fan_names:
                rel_dir = f"{ns}/{fan}"
                try:
                    # A directory's mtime changes with every name made or removed in it:
                    # one that has not changed since it was last scanned (and was already
                    # quiet then) holds what it held. Its stat comes before the scan, so a
                    # change during the scan shows next time.
                    seen = os.stat(os.path.join(self.root, ns, fan), follow_symlinks=False)
                    if self.cache.get(rel_dir) == seen.st_mtime_ns:
                        from_snapshot.add(rel_dir)
                        self.quiet[rel_dir] = seen.st_mtime_ns
                        continue
                    quiet = seen.st_mtime_ns < time.time_ns() - SCAN_QUIET_NS
                    with os.scandir(os.path.join(self.root, ns, fan)) as files:
                        for f in files:
                            name = f.name
                            if name.startswith("."):
                                if is_temporary(name):
                                    # A writer's: swept once stale; until then the
                                    # directory is scanned again each time (when the
                                    # writer dies, nothing changes the directory).
                                    quiet = False
                                    if self._stale_temporary(
                                        f, name, now, max_age if self.starting else None
                                    ):
                                        self._remove_dead_temporary(f.path)
                                continue
                            if not every_shard and not self.owns(name):
                                continue
                            if not is_object_name(fan, name):
                                continue
                            try:
                                st = f.stat(follow_symlinks=False)
                            except OSError:
                                continue
                            if stat.S_ISREG(st.st_mode) and is_trusted(st, self.group_id):
                                found.append((f"{ns}/{fan}/{name}", st.st_size, st.st_mtime))
                    if quiet:
                        self.quiet[rel_dir] = seen.st_mtime_ns
                    else:
                        self.quiet.pop(rel_dir, None)
                except OSError:
                    self.quiet.pop(rel_dir, None)
                    continue
        return found, from_snapshot

    # ------------------------------------------------------------------ scan snapshot

    def load(self, tracker: CapacityTracker) -> None:
        """The start-up scan into ``tracker``, helped by the last instance's snapshot."""
        self._load_snapshot()
        self.starting = True
        try:
            self._load_scan(tracker)
        finally:
            self.starting = False

    def _load_scan(self, tracker: CapacityTracker) -> None:
        for attempt in (0, 1):
            try:
                if tracker.shared_cap:
                    snapshot = self.snapshot
                    if snapshot is not None and len(set(snapshot.names)) != len(snapshot.names):
                        raise ValueError("an object listed twice")  # (the re-scan would log it)
                    tracker.refresh_if_due()  # the first scan, timed: sets the schedule
                else:
                    # A name twice in a snapshot is damage (scan instead); in a directory
                    # listing (NFS, FUSE while files come and go) the later entry counts.
                    tracker.load_ordered(*self.scan_ordered(), strict=bool(self.cache))
                # Later scans (the shared cap's re-scans) read every file: they also catch
                # other processes' uses, which change files' mtimes and no directory's.
                self.cache = {}
                self.snapshot = None
                return
            except (TypeError, ValueError, IndexError):
                if attempt or not self.cache:
                    raise
                # A snapshot with bad figures in it: forget it, scan everything.
                self._log("snapshot", "ignoring a malformed scan snapshot %s", self.snapshot_path)
                self.cache = {}
                self.snapshot = None
                tracker.clear()

    def _load_snapshot(self) -> None:
        """Seed the scan cache from the snapshot the last instance left (if any, and good).

        See :mod:`hicache_storage.storekit.scansnapshot`.
        """
        try:
            snapshot = load_snapshot(
                self.snapshot_path,
                root=self.root,
                scope=self.scope,
                group_id=self.group_id,
                owned=None if self.per_root else self._all_owned,
            )
        except ValueError:
            self._log("snapshot", "ignoring a malformed scan snapshot %s", self.snapshot_path)
            return
        if snapshot is not None:
            self.cache = dict(snapshot.dirs)
            self.snapshot = snapshot

    def _all_owned(self, leaves: str, count: int) -> bool:
        """:meth:`owns` for ``count`` newline-joined file names, in whole-string passes."""
        shard = self.shard
        if shard is None:
            return "~" not in leaves
        # Every name has one "~", and it starts the suffix "~<shard>" at the name's end.
        return leaves.count("~") == count and (leaves + "\n").count(f"~{shard}\n") == count

    def save(self, tracker: CapacityTracker, min_objects: int) -> None:
        """Leave what this instance knows for the next one (best effort, atomically).

        For each directory that was quiet when last scanned: its mtime then; and every
        object the tracker holds in those directories now, in the tracker's LRU order.
        Where this instance changed a directory since, its mtime differs and the next
        instance scans it again.
        """
        if not tracker.enabled or not self.quiet or len(tracker) < min_objects:
            return
        payload = encode_snapshot(
            root=self.root,
            scope=self.scope,
            quiet=dict(self.quiet),  # (a re-scan in another thread may change it)
            objects=tracker.items_oldest_first(),
        )
        try:
            save_snapshot(
                self.snapshot_path, self.root, payload, mode=self.file_mode, group_id=self.group_id
            )
        except OSError as exc:
            self._log("snapshot", "cannot save the scan snapshot %s: %s", self.snapshot_path, exc)

    @staticmethod
    def _stale_temporary(
        entry: os.DirEntry[str], name: str, now: float, max_age: float | None
    ) -> bool:
        """:func:`is_stale_temporary` of a directory entry (not stale if it cannot be read).

        The age rule (for writers on other hosts) applies at start-up only (``max_age``
        None otherwise): a recycled page's temporary keeps the page's old mtime while a
        live writer rewrites it.
        """
        try:
            return is_stale_temporary(
                name, lambda: entry.stat(follow_symlinks=False).st_mtime, now, max_age
            )
        except OSError:
            return False

    def _remove_dead_temporary(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # another member's (group sharing), read-only...
            self._log("temporary", "cannot remove the stale temporary %s: %s", path, exc)
