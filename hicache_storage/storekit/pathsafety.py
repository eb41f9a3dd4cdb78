"""Safe use of directories and files that other local users might have touched.

Every file-based store (``file``, ``shm``, ``mmap``) keeps pages in a directory tree that
often lives in a world-writable place (``/tmp``, ``/dev/shm``). Namespace digests and the
page hashes of a well-known prompt are predictable, so another local user could pre-create
a store's directory, plant pages that would be served as hits, or read what is written.
This module holds the rules, once for every backend:

* :func:`user_dir`: a per-user default location (``<base>/<name>-<euid>``).
* :func:`ensure_dir`: create a directory with an exact mode and group, or verify an
  existing one: a real directory (not a symlink), owned by this user (group mode: by this
  user or with the configured group), not writable by others (private mode: not by the
  group either). Otherwise :class:`UnsafePathError` (a
  :class:`~hicache_storage.errors.ConfigError`) names the path, what is wrong and the fix.
* :func:`check_file`: the same trust rule for an existing regular file.
* :func:`ensure_file_dir`: a directory where a store keeps a few files of its own beside
  other users' (``/dev/shm``, ``/tmp``): this user's or root's, nobody else able to
  replace its files (sticky, or not writable by group and others).
* :func:`open_regular`: open without following a symlink and without blocking on a FIFO,
  and refuse anything that is not a regular file (:class:`NotRegularFileError`).
* :func:`check_path`: a configured path is a non-empty string without NUL bytes.

Trust rule, in one place (documented in ``docs/backends/file.md``):

=============  ======================================================  ===================
mode           owner                                                   mode bits that must
                                                                       be off
=============  ======================================================  ===================
private        the effective uid                                       group and other
                                                                       write
group ``G``    the effective uid, or (with group ``G``) a current      other write
               member of ``G`` or root
=============  ======================================================  ===================

In group mode the members of ``G`` trust each other (any of them may add pages); a file
or directory that is not this user's and not of group ``G`` is never trusted, and neither
is one of group ``G`` whose owner is no longer a member (a former member who owns a
setgid directory of the store could otherwise still create files of group ``G`` in it).
Membership is read from the system's user and group databases (``pwd``/``grp``: the
owner's primary group, or the group's member list), cached for :data:`MEMBERSHIP_TTL`
seconds. A group the group database does not know (a bare numeric gid, as in some
containers) has no member list to check: then any owner of a file of group ``G`` counts
as a member, as only a member (or root) can give a file that group; this is logged once
per group.

Directories are created, checked and given to the group through a descriptor opened with
``O_DIRECTORY | O_NOFOLLOW`` (``fstat``, ``fchown``, ``fchmod``), never by path, so a
member who swaps a just-created directory for a symlink cannot redirect a ``chmod`` to a
directory elsewhere.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import pwd
import stat
import time

from hicache_storage.errors import ConfigError, CorruptObjectError

__all__ = [
    "MEMBERSHIP_TTL",
    "NotRegularFileError",
    "UnsafePathError",
    "check_file",
    "check_path",
    "ensure_dir",
    "ensure_parent",
    "is_member",
    "is_trusted",
    "open_regular",
    "open_regular_stat",
    "user_dir",
]

logger = logging.getLogger(__name__)

#: Directories of the system that may be world-writable (sticky, root-owned) parents.

#: Seconds a group-membership answer is reused (a user removed from the group stops being
#: trusted within this time; lookups stay off the per-page path).
MEMBERSHIP_TTL = 5.0
_membership: dict[tuple[int, int], tuple[float, bool]] = {}
_unlisted_groups_logged: set[int] = set()
#: ``open`` flags for a directory: never through a symlink in the last component.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(ConfigError):
    """A directory or file is not safe to use.

    It has the wrong owner, is writable by others, is a symlink, or is not of the expected
    kind. The message names the path, the problem and the fix.
    """


class NotRegularFileError(CorruptObjectError):
    """Something other than a regular file sits where a stored object should be.

    It is a FIFO, socket, symlink, directory or device. Reads treat it as a miss.
    """


def user_dir(base: str, name: str) -> str:
    """The per-user default location ``<base>/<name>-<euid>`` (e.g. ``/tmp/hicache-storage-1000``).

    Each user gets their own directory, so two users never share (or fight over) one by
    default; :func:`ensure_dir` then makes sure it really is this user's.
    """
    return f"{base.rstrip('/') or '/'}/{name}-{os.geteuid()}".replace("//", "/")


def check_path(path: object, what: str = "path") -> str:
    """``path`` as an absolute path string.

    Raises :class:`ConfigError` if it is not usable (not a string, empty, or holding a NUL
    byte).
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ConfigError(f"{what} must be a path string, got {type(path).__name__}")
    if not path:
        raise ConfigError(f"{what} must not be empty")
    if "\x00" in path:
        raise ConfigError(f"{what} {path!r} must not contain a NUL byte")
    try:
        return os.path.abspath(os.path.expanduser(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{what} {path!r} is not a valid path: {exc}") from None


def _mode_str(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def is_trusted(st: os.stat_result, gid: int | None = None) -> bool:
    """True if an object with this ``lstat``/``fstat`` result passes the trust rule.

    The rule is about the owner and the write bits (see the module docstring); the kind
    of object is not checked.
    """
    if gid is None:  # the common case, inline (a hot path: every exists() and read)
        return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return _problem(st, gid) is None


def is_member(uid: int, gid: int) -> bool:
    """True if user ``uid`` is a member of group ``gid`` now, as the system's databases say.

    A member has ``gid`` as its primary group (``pwd``) or is listed in the group's
    members (``grp``); root counts as a member (it can give itself any group). A group the
    group database does not know cannot be checked: every user counts as a member then
    (logged once per group). Answers are cached for :data:`MEMBERSHIP_TTL` seconds.
    """
    if uid == 0:
        return True
    key = (uid, gid)
    now = time.monotonic()
    cached = _membership.get(key)
    if cached is not None and cached[0] > now:
        return cached[1]
    member = _lookup_member(uid, gid)
    _membership[key] = (now + MEMBERSHIP_TTL, member)
    return member


def _lookup_member(uid: int, gid: int) -> bool:
    try:
        group = grp.getgrgid(gid)
    except (KeyError, OverflowError):
        if gid not in _unlisted_groups_logged:
            _unlisted_groups_logged.add(gid)
            logger.warning(
                "group %d has no entry in the group database, so the membership of the "
                "owners of its files cannot be checked: every file and directory of group "
                "%d is trusted as a member's. Add the group (with its members) to the "
                "group database to have former members refused",
                gid,
                gid,
            )
        return True
    try:
        user = pwd.getpwuid(uid)
    except (KeyError, OverflowError):
        return False  # a uid the user database does not know is listed in no group
    return user.pw_gid == gid or user.pw_name in group.gr_mem


def _problem(st: os.stat_result, gid: int | None) -> str | None:
    """What makes ``st`` untrusted (owner, then write bits), or None."""
    euid = os.geteuid()
    mine = st.st_uid == euid
    if gid is None:
        if not mine:
            return f"it is owned by uid {st.st_uid}, not by you (uid {euid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"its mode {_mode_str(st.st_mode)} lets other users write to it"
        return None
    if not mine:
        if st.st_gid != gid:
            return (
                f"it is owned by uid {st.st_uid} and group {st.st_gid}: neither you (uid "
                f"{euid}) nor the sharing group {gid}"
            )
        if not is_member(st.st_uid, gid):
            return (
                f"it is owned by uid {st.st_uid}, who is not a member of the sharing group "
                f"{gid} (not you, uid {euid}, either)"
            )
    if st.st_mode & stat.S_IWOTH:
        return f"its mode {_mode_str(st.st_mode)} lets every user write to it"
    return None


def _refuse(path: str, problem: str, fix: str) -> UnsafePathError:
    return UnsafePathError(f"refusing to use {path}: {problem}. Fix: {fix}")


def _dir_fix(path: str, mode: int, gid: int | None) -> str:
    owner = f"{os.geteuid()}" if gid is None else f"{os.geteuid()}:{gid}"
    return (
        f"`chown {owner} {path} && chmod {mode & 0o7777:o} {path}` (as its owner or root), "
        "remove it, or choose another directory"
    )


def _check_existing_dir(
    path: str, st: os.stat_result, mode: int, gid: int | None, adopt: bool
) -> None:
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise _refuse(
            path,
            f"it is a symbolic link (to {target}), which could be redirected",
            "configure the real directory instead, or remove the link",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it exists and is not a directory", "remove it or choose another path")
    problem = _problem(st, gid)
    if problem is not None:
        raise _refuse(path, problem, _dir_fix(path, mode, gid))
    if (
        gid is not None
        and st.st_uid == os.geteuid()
        and (st.st_gid != gid or stat.S_IMODE(st.st_mode) != mode & 0o7777)
    ):
        if not adopt:
            raise ConfigError(
                f"{path} is yours but not shared with group {gid} (group {st.st_gid}, mode "
                f"{_mode_str(st.st_mode)}), so the group's members could not use it. Fix: "
                f"`chgrp {gid} {path} && chmod {mode & 0o7777:o} {path}`, or choose another "
                "directory"
            )
        # Our own directory, asked to be shared: give it to the group (only adds access
        # for the configured group; others still cannot write). Through a descriptor of
        # the very directory just checked: a symlink or another directory swapped in
        # since is never changed.
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise _refuse(path, "it was replaced while being checked", "retry") from None
            raise
        try:
            now = os.fstat(fd)
            if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or now.st_uid != st.st_uid:
                raise _refuse(path, "it was replaced while being checked", "retry")
            _share(fd, mode, gid)
        finally:
            os.close(fd)


def _check_ancestors(path: str) -> None:
    """Refuse a path below a directory that anyone may write without the sticky bit.

    Anyone could then rename this path away and put their own in its place.
    """
    parent = os.path.dirname(path)
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise _refuse(
                path,
                f"its parent {parent} (mode {_mode_str(st.st_mode)}) lets every user replace it",
                f"`chmod o-w {parent}` or `chmod +t {parent}`, or choose another directory",
            )
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def _share(fd: int, mode: int, gid: int | None) -> None:
    """Give the directory open as ``fd`` group ``gid`` and exactly ``mode``."""
    if gid is not None:
        os.fchown(fd, -1, gid)
    os.fchmod(fd, mode)  # mkdir masks the mode with the umask and may drop setgid


def _make_dir(path: str, mode: int, gid: int | None) -> bool:
    """Make a directory with exactly ``mode`` and group ``gid``; False if ``path`` exists.

    Mode and group are set through a descriptor opened without following a symlink, and
    only if it is a directory of this user: in a directory that others may write (a
    shared store), what sits at ``path`` right after ``mkdir`` may already be something
    else (a symlink to a private directory, another user's directory). Then False: the
    caller checks what is there as an existing path.
    """
    try:
        os.mkdir(path, 0o700)  # nobody else can enter while mode and group are set
    except FileExistsError:
        return False
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return False  # replaced at once (symlink, file) or moved away
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return False  # another user's directory was put in its place
        _share(fd, mode, gid)
    finally:
        os.close(fd)
    return True


def ensure_dir(
    path: str,
    mode: int = 0o700,
    gid: int | None = None,
    parents: bool = True,
    *,
    check_ancestors: bool = True,
    adopt: bool = False,
) -> bool:
    """Make ``path`` a directory this user may safely keep pages in, or raise.

    Returns True if this call created ``path`` (the caller may fsync its parent), False if
    it existed. Guarantees, on return:

    * ``path`` is a real directory (``lstat``: not a symlink), owned by the effective uid
      (with ``gid``: owned by it, or having group ``gid``), not writable by others (and,
      without ``gid``, not group-writable);
    * if this call created it, it has exactly ``mode`` (umask ignored, setgid kept) and,
      with ``gid``, that group. Missing parents (with ``parents``) are created 0700, or,
      with ``gid``, 2750 with group ``gid`` so that members can traverse them;
    * with ``gid``, an existing directory of this user that is not shared with the group
      is given group ``gid`` and ``mode`` with ``adopt`` (the caller knows it is its own
      store's), so that sharing works without a manual step; without ``adopt`` that is a
      :class:`ConfigError` with the ``chgrp``/``chmod`` to run;
    * no ancestor is writable by every user without the sticky bit (skipped with
      ``check_ancestors=False``, for a directory whose parent was just checked).

    Raises:
        UnsafePathError: (a :class:`ConfigError`) the path exists and breaks a rule; the
            message names the path, the owner or mode found, and the fix.
        ConfigError: the path is invalid or cannot be created (the ``OSError`` is chained).
    """
    path = check_path(path)
    try:
        created = _make_dir(path, mode, gid)
    except FileNotFoundError:
        if not parents:
            raise ConfigError(f"cannot create {path}: its parent does not exist") from None
        created = False
        parent = os.path.dirname(path)
        if parent != path:
            ensure_parent(parent, gid)
        try:
            created = _make_dir(path, mode, gid)
        except OSError as exc:
            raise ConfigError(f"cannot create the directory {path}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create the directory {path}: {exc}") from exc
    try:
        st = os.lstat(path)
        if not created:
            _check_existing_dir(path, st, mode, gid, adopt)
        elif not stat.S_ISDIR(st.st_mode):  # replaced between mkdir and lstat
            raise _refuse(path, "it was replaced while being created", "retry")
    except UnsafePathError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot use the directory {path}: {exc}") from exc
    if check_ancestors:
        _check_ancestors(path)
    return created


def ensure_file_dir(directory: str) -> None:
    """Make ``directory`` a place for this user's own files beside other users', or raise.

    For a store that keeps a few files of its own (an arena and its logs) in a directory
    it may share with others, such as ``/dev/shm`` or ``/tmp``. A missing directory is
    created (mode 0700, parents too). An existing one must be a real directory (not a
    symlink) owned by this user or root in which nobody else can replace files: not
    writable by group or others, unless sticky (as ``/tmp`` is). The files themselves are
    checked with :func:`check_file` when opened. :class:`UnsafePathError` names what is
    wrong and the fix; :class:`ConfigError` when the directory cannot be created.
    """
    directory = check_path(directory)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot create the directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(directory, "it is not a directory (a symlink?)", "choose another directory")
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        raise _refuse(
            directory,
            f"it belongs to uid {st.st_uid}, not to you (uid {euid}) or root",
            "choose a directory of your own",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            directory,
            f"its mode {_mode_str(st.st_mode)} lets other users replace the files in it "
            "(it is writable by other users and not sticky)",
            f"`chmod go-w {directory}`, or choose another directory",
        )


def ensure_parent(path: str, gid: int | None = None) -> None:
    """Create ``path`` and its missing parents as traversable-only directories.

    New directories get mode 0700, or 2750 with group ``gid``; existing ones are left as
    they are. Raises :class:`ConfigError` when a directory cannot be used or created.
    """
    missing = []
    while True:
        try:
            os.lstat(path)
            break
        except FileNotFoundError:
            missing.append(path)
            up = os.path.dirname(path)
            if up == path:
                break
            path = up
        except OSError as exc:
            raise ConfigError(f"cannot use the directory {path}: {exc}") from exc
    mode = 0o700 if gid is None else 0o2750
    for p in reversed(missing):
        try:
            _make_dir(p, mode, gid)
        except OSError as exc:
            raise ConfigError(f"cannot create the directory {p}: {exc}") from exc


def check_file(path: str, st: os.stat_result, gid: int | None = None) -> None:
    """Raise :class:`UnsafePathError` unless ``st`` is that of a trusted regular file.

    ``st`` is ``path``'s, from ``lstat`` or ``fstat``. Trusted means owned by the
    effective uid (with ``gid``: owned by it or having group ``gid``) and not writable by
    others (and, without ``gid``, not group-writable).
    """
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "it is not a regular file", "remove it")
    problem = _problem(st, gid)
    if problem is not None:
        owner = f"{os.geteuid()}" if gid is None else f"{os.geteuid()}:{gid}"
        raise _refuse(
            path,
            problem,
            f"remove it, or `chown {owner} {path} && chmod go-w {path}` if you trust it",
        )


_NOT_A_FILE_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV})


def open_regular_stat(path: str, flags: int, mode: int = 0o600) -> tuple[int, os.stat_result]:
    """As :func:`open_regular`, and also return the opened file's ``fstat``."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, mode)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE_ERRNOS:
            raise NotRegularFileError(f"{path} is not a regular file ({exc.strerror})") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{path} is not a regular file (mode {st.st_mode:o})")
        # F_SETFL keeps only the status flags (O_APPEND, O_DIRECT...) of its argument.
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` as a regular file, never following a symlink, never blocking.

    ``flags`` (``os.O_RDONLY``, ``os.O_WRONLY | os.O_CREAT | os.O_EXCL``...) get
    ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY``: a symlink in the last component
    fails instead of being followed, a FIFO opens (or fails) at once instead of waiting for
    a writer. The opened file is then checked with ``fstat``; anything but a regular file
    is closed and refused. ``O_NONBLOCK`` is cleared before the descriptor is returned.

    Raises:
        NotRegularFileError: (a :class:`~hicache_storage.errors.CorruptObjectError`) a
            symlink, FIFO, socket, directory or device is at ``path``.
        OSError: any other failure (``FileNotFoundError``, ``PermissionError``...).
    """
    fd, _ = open_regular_stat(path, flags, mode)
    return fd
