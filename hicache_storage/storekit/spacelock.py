"""The cross-process free-space lock of a file-like store's root.

Writers near the free-space floor check the floor, reserve and allocate their file under
this lock, so that concurrent writers (threads of one store and other processes on the
node) cannot all pass the check and then fill the filesystem together. The lock is a
``flock`` on :data:`SPACE_LOCK` in the root. It is polled, never waited on blindly: a
stuck holder (a stopped process, a debugger) delays writes by at most
:data:`SPACE_LOCK_TIMEOUT` and then fails them, while a lock that merely changes hands
often (contention) is waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from typing import TYPE_CHECKING

from hicache_storage.errors import BackendTimeoutError, from_os_error
from hicache_storage.storekit.pathsafety import open_regular_stat

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "SPACE_LOCK",
    "SPACE_LOCK_BUSY_LIMIT",
    "SPACE_LOCK_COOLDOWN",
    "SPACE_LOCK_RETRY",
    "SPACE_LOCK_TIMEOUT",
    "SpaceLock",
]

#: The lock file (in the root) that serializes free-space checks between processes.
SPACE_LOCK = ".hicache-space.lock"
#: How long a write waits for another process's free-space check before giving up. The
#: lock is held for a statvfs, a reservation and an fallocate (a re-scan at most), so a
#: longer wait means a stuck holder.
SPACE_LOCK_TIMEOUT = 2.0
#: After a write gave up waiting, writes through the same :class:`SpaceLock` try it only
#: briefly (:data:`SPACE_LOCK_RETRY` seconds) for this many seconds: a stuck holder fails
#: the pages of a batch at once instead of costing every page the full timeout.
SPACE_LOCK_COOLDOWN = 10.0
SPACE_LOCK_RETRY = 0.05
#: A wait that timed out while the lock changed hands (``/proc/locks``: other writers take
#: and release it, so it is contended, not stuck) goes on, up to this many seconds in all.
SPACE_LOCK_BUSY_LIMIT = 30.0


def flock_holders(st: os.stat_result) -> frozenset[int] | None:
    """Pids holding a ``flock`` on the file of ``st``, or None when that cannot be told.

    They are read from ``/proc/locks``.
    """
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 27370 fe:00:2147144 0 EOF"; waiters carry "->".
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == dev:
            try:
                pids.add(int(fields[4]))
            except ValueError:
                return None
    return frozenset(pids)


class SpaceLock:
    """The free-space lock of one root, for one store instance (its threads share it).

    ``file_mode`` and ``group_id`` are the store's: the lock file is made (or repaired, when
    this user owns it) with them, so that group members can take it too.
    """

    def __init__(self, root: str, file_mode: int, group_id: int | None) -> None:
        self.path = os.path.join(root, SPACE_LOCK)
        self._file_mode = file_mode
        self._group_id = group_id
        self._mutex = threading.Lock()  # one holder per instance: flock is per open file
        self._stuck_until = 0.0  # monotonic; see SPACE_LOCK_COOLDOWN

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock (threads and processes) for the ``with`` body.

        The lock file is opened anew each time, so a root that was removed and recreated is
        locked through its new file; a root that is gone raises ``FileNotFoundError`` (the
        caller recreates its directories). Past :data:`SPACE_LOCK_TIMEOUT` without the lock,
        :class:`~hicache_storage.errors.BackendTimeoutError`.
        """
        path = self.path
        with self._mutex:
            try:
                fd, st = open_regular_stat(path, os.O_RDONLY | os.O_CREAT, self._file_mode)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise from_os_error(exc, f"open {path}") from exc
            try:
                self._repair_mode(fd, st)
                self._acquire(fd, st)
                yield
            finally:
                os.close(fd)  # releases the lock

    def _repair_mode(self, fd: int, st: os.stat_result) -> None:
        if st.st_uid == os.geteuid() and (
            stat.S_IMODE(st.st_mode) != self._file_mode
            or (self._group_id is not None and st.st_gid != self._group_id)
        ):
            if self._group_id is not None:
                os.fchown(fd, -1, self._group_id)
            os.fchmod(fd, self._file_mode)  # the umask masked it; members need it

    def _acquire(self, fd: int, st: os.stat_result) -> None:
        now = time.monotonic()
        stuck = now < self._stuck_until
        wait = SPACE_LOCK_RETRY if stuck else SPACE_LOCK_TIMEOUT
        deadline = now + wait
        limit = now + SPACE_LOCK_BUSY_LIMIT
        holders = flock_holders(st) if not stuck else None
        changed = False  # the lock changed hands since the deadline was set
        sampled = now
        pause = 0.0002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if holders is not None and now - sampled > 0.02:
                    sampled = now  # who holds it, sampled every 20 ms at most
                    current = flock_holders(st)
                    if current is not None and current != holders:
                        holders, changed = current, True
                if now > deadline and changed and now < limit:
                    # Contended rather than stuck: the lock changed hands while this write
                    # waited (a stuck holder keeps it). Wait on.
                    deadline, changed = now + wait, False
                if now > deadline:
                    if not stuck:
                        self._stuck_until = now + SPACE_LOCK_COOLDOWN
                    raise BackendTimeoutError(
                        f"the free-space lock {self.path} was held for over {wait:g} s"
                        + (" (held by a stuck process: not waiting)" if stuck else "")
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.002)  # short: pollers must not lose every race
        self._stuck_until = 0.0
