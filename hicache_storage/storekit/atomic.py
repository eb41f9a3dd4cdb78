"""Atomic publication of files, written once for every file-based backend.

An object is written to a temporary name in its final directory, optionally fsynced, then
published under its final name in one step, so a reader sees either nothing or the
complete object. Publication is *first writer wins*: :func:`publish` links the temporary
to the final name (``link(2)`` fails if the name exists), so two processes writing one key
leave exactly one intact object and neither overwrites a file another process may be
reading. Filesystems without hard links fall back to ``rename(2)``, still atomic.

Temporary names are ``.tmp.<host>.<pid>.<random>``: hidden from key listings (valid keys
never start with ``.``), and attributable, so :func:`remove_stale_temporaries` can delete
the leftovers of dead writers at start-up without touching a live writer's file.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import logging
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING

from hicache_storage.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "TEMP_PREFIX",
    "commit_temp",
    "finish_temp",
    "fsync_dir",
    "is_stale_temporary",
    "is_temporary",
    "open_temp",
    "preadv_all",
    "publish",
    "remove_stale_temporaries",
    "temp_path",
    "write_atomic",
    "writer_is_dead",
    "writev_all",
]

logger = logging.getLogger(__name__)
#: Failures that repeat on every write (a directory that refuses unlinks, a filesystem
#: whose directory fsync fails) are logged rate limited: a line per kind every 5 s.
_log = RateLimitedLog(logger)

TEMP_PREFIX = ".tmp."
_HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
try:
    _IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


_WRITER_TAG: tuple[int, str] | None = None


def _writer_tag() -> str:
    """``<pid>-<start time>`` of this process (recomputed after a fork)."""
    global _WRITER_TAG
    pid = os.getpid()
    if _WRITER_TAG is None or _WRITER_TAG[0] != pid:
        _WRITER_TAG = (pid, f"{pid}-{_start_time(pid) or 0}")
    return _WRITER_TAG[1]


_SEQUENCE = itertools.count()
_RUN = secrets.token_hex(3)


def temp_path(directory: str) -> str:
    """A fresh temporary path in ``directory`` naming this host and process.

    Unique without a system call: a random tag per process run plus a counter
    (``next()`` on ``itertools.count`` is atomic under the GIL).
    """
    return os.path.join(
        directory, f"{TEMP_PREFIX}{_HOST_TAG}.{_writer_tag()}.{_RUN}{next(_SEQUENCE):x}"
    )


def is_temporary(name: str) -> bool:
    """True for a file name made by :func:`temp_path`."""
    return name.startswith(TEMP_PREFIX)


def _advance(pending: list[memoryview], n: int) -> None:
    """Consume ``n`` transferred bytes: drop finished views, trim a partial first one."""
    while n and pending:
        head = pending[0]
        if n >= head.nbytes:
            n -= head.nbytes
            pending.pop(0)
        else:
            pending[0] = head[n:]
            n = 0


def writev_all(fd: int, views: Sequence[memoryview | bytes | bytearray]) -> int:
    """Write every byte of ``views`` with ``writev``, resuming after short writes."""
    pending = [memoryview(v).cast("B") if not isinstance(v, memoryview) else v for v in views]
    pending = [v for v in pending if v.nbytes]
    total = 0
    while pending:
        batch = pending[:_IOV_MAX]
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        total += n
        _advance(pending, n)
    return total


def preadv_all(fd: int, views: Sequence[memoryview], offset: int = 0) -> int:
    """Fill ``views`` from ``fd`` at ``offset`` with ``preadv``; return the bytes read.

    Stops early only at end of file, so a short count means the file is shorter than
    the views.
    """
    pending = [v for v in views if v.nbytes]
    total = 0
    while pending:
        n = os.preadv(fd, pending[:_IOV_MAX], offset)
        if n == 0:
            break
        total += n
        offset += n
        _advance(pending, n)
    return total


def fsync_dir(directory: str) -> None:
    """Flush a directory (``fsync``) so that a rename or link in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, final: str) -> bool:
    """Publish ``tmp`` as ``final`` unless ``final`` exists; always removes ``tmp``.

    Returns True if this call published the object, False if ``final`` already existed
    (another writer won; the existing object is left untouched).
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        os.unlink(tmp)
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        # No hard links here: rename is atomic too, though it replaces a concurrent
        # winner's file with identical-by-contract bytes.
        if os.path.exists(final):
            os.unlink(tmp)
            return False
        os.rename(tmp, final)
        return True
    try:
        os.unlink(tmp)
    except OSError as exc:
        # Published all the same; the start-up sweep removes the leftover later.
        _log("temporary", "published %s but could not remove its temporary: %s", final, exc)
    return True


def open_temp(
    directory: str, *, mode: int = 0o600, gid: int | None = None, allocate: int = 0
) -> tuple[str, int]:
    """Create a fresh temporary in ``directory``; return its path and a write descriptor.

    The file gets ``mode`` exactly (not masked by the umask) and, with ``gid``, that group.
    With ``allocate``, that many bytes are allocated on the filesystem now
    (``posix_fallocate``), so that a free-space check made before this call stays true
    while the bytes are written later. On failure nothing is left behind.
    """
    tmp = temp_path(directory)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        if mode & 0o077:
            os.fchmod(fd, mode)  # open() masked group/other bits with the umask
        if allocate > 0:
            os.posix_fallocate(fd, 0, allocate)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return tmp, fd


def commit_temp(
    tmp: str,
    fd: int,
    final: str,
    views: Sequence[memoryview | bytes],
    *,
    fsync: bool = False,
    allocated: int = 0,
) -> bool:
    """Write ``views`` into the temporary ``tmp`` and publish it as ``final``; first writer wins.

    ``tmp`` is open as ``fd``; this always closes ``fd`` and removes ``tmp``.

    ``allocated``: the bytes :func:`open_temp` allocated; the file is cut to what was
    written if that is less. Returns True if this call published ``final``, False if it
    already existed; raises ``OSError`` on failure.
    """
    try:
        written = writev_all(fd, views)
    except BaseException:
        os.close(fd)
        _remove(tmp)
        raise
    return finish_temp(tmp, fd, final, written, fsync=fsync, allocated=allocated)


def finish_temp(
    tmp: str, fd: int, final: str, written: int, *, fsync: bool = False, allocated: int = 0
) -> bool:
    """Publish the temporary ``tmp`` (open as ``fd``, ``written`` bytes long) as ``final``.

    For a writer that filled the temporary by other means than :func:`commit_temp` (a
    transfer engine writing into ``fd``). First writer wins; this always closes ``fd``
    and removes ``tmp``. ``allocated`` as in :func:`commit_temp`. Returns True if this
    call published ``final``, False if it already existed; raises ``OSError`` on failure.
    """
    try:
        try:
            if allocated > written:
                os.ftruncate(fd, written)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        published = publish(tmp, final)
    except BaseException:
        _remove(tmp)
        raise
    if published and fsync:
        try:
            fsync_dir(os.path.dirname(final))
        except OSError as exc:
            # The object is visible and complete; only the durability of its name across
            # a power failure is in doubt. Reporting a failure for a visible object would
            # be worse (callers would count it as missing), so log it loudly instead.
            _log(
                "fsync",
                "published %s but fsync of its directory failed: %s",
                final,
                exc,
                level=logging.ERROR,
            )
    return published


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_atomic(
    final: str,
    views: Sequence[memoryview | bytes],
    *,
    fsync: bool = False,
    mode: int = 0o600,
    gid: int | None = None,
) -> bool:
    """Write ``views`` to ``final`` atomically; first writer wins.

    The file gets ``mode`` exactly (not masked by the umask) and, with ``gid``, that group.

    Returns True if this call published ``final``, False if it already existed. Raises
    ``OSError`` on failure (disk full, permission...), after removing its temporary; no
    partial object is ever visible under ``final``.
    """
    tmp, fd = open_temp(os.path.dirname(final), mode=mode, gid=gid)
    return commit_temp(tmp, fd, final, views, fsync=fsync)


def writer_is_dead(name: str) -> bool:
    """True if the temporary ``name`` was made on this host by a process that is gone."""
    parts = name[len(TEMP_PREFIX) :].split(".")
    if len(parts) != 3 or parts[0] != _HOST_TAG:
        return False
    pid_s, _, started = parts[1].partition("-")
    try:
        pid = int(pid_s)
    except ValueError:
        return True
    if parts[1] == _writer_tag():
        return False  # ours, possibly in flight on another thread
    current = _start_time(pid)
    if current is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False  # alive, and /proc cannot tell more: keep it
    # The pid runs, but it is a different process if it started at another time.
    return started not in ("", "0") and current != started


def is_stale_temporary(
    name: str, mtime: Callable[[], float], now: float, max_age: float | None
) -> bool:
    """True if the temporary ``name`` is stale.

    Stale: its writer (same host) no longer runs, or (unless ``max_age`` is None) it is
    older than ``max_age`` seconds, for writers on other hosts sharing the filesystem.
    ``mtime()`` is asked only when needed.
    """
    if writer_is_dead(name):
        return True
    return max_age is not None and now - mtime() > max_age


def _mtime(path: str) -> float:
    return os.stat(path).st_mtime


def remove_stale_temporaries(root: str, max_age: float = 3600.0) -> int:
    """Delete temporaries under ``root`` left by dead writers; return how many.

    A temporary is stale when its writer (same host) no longer runs, or when it is older
    than ``max_age`` seconds (writers on other hosts sharing the filesystem).
    """
    removed = 0
    now = time.time()
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if not is_temporary(name):
                continue
            path = os.path.join(dirpath, name)
            try:
                if is_stale_temporary(name, functools.partial(_mtime, path), now, max_age):
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                _log("stale", "cannot remove stale temporary %s: %s", path, exc)
    if removed:
        logger.info("removed %d stale temporaries under %s", removed, root)
    return removed
