"""hicache_storage.storekit.pathsafety: per-user locations, directory and file trust, safe opens."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.errors import ConfigError, CorruptObjectError
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    UnsafePathError,
    check_file,
    check_path,
    ensure_dir,
    open_regular,
    user_dir,
)

OTHER = 65534  # nobody
GID = 4242


def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_user_dir_names_the_effective_uid() -> None:
    assert user_dir("/tmp", "hicache-storage") == f"/tmp/hicache-storage-{os.geteuid()}"
    assert user_dir("/dev/shm/", "x") == f"/dev/shm/x-{os.geteuid()}"


def test_check_path_refuses_nul_and_empty() -> None:
    with pytest.raises(ConfigError, match="NUL"):
        check_path("/tmp/a\x00b")
    with pytest.raises(ConfigError, match="empty"):
        check_path("")
    assert check_path("rel") == os.path.abspath("rel")


def test_ensure_dir_creates_with_the_exact_mode_despite_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        d = tmp_path / "a" / "b" / "c"
        ensure_dir(str(d), 0o2770, gid=GID)
    finally:
        os.umask(old)
    assert mode_of(d) == 0o2770 and os.stat(d).st_gid == GID
    # missing parents: traversable by the group, writable by nobody else
    assert mode_of(d.parent) == 0o2750 and os.stat(d.parent).st_gid == GID
    p = tmp_path / "private" / "x"
    ensure_dir(str(p))
    assert mode_of(p) == 0o700 and mode_of(p.parent) == 0o700
    ensure_dir(str(p))  # existing and fine: no error


def test_ensure_dir_refuses_a_directory_of_another_user(tmp_path: Path) -> None:
    d = tmp_path / "planted"
    d.mkdir(mode=0o755)
    os.chown(d, OTHER, OTHER)
    with pytest.raises(UnsafePathError, match=rf"{d}.*owned by uid {OTHER}.*Fix: `chown"):
        ensure_dir(str(d))
    with pytest.raises(UnsafePathError, match="owned by uid"):
        ensure_dir(str(d), 0o2770, gid=GID)  # not the sharing group either
    os.chown(d, OTHER, GID)
    os.chmod(d, 0o2770)
    ensure_dir(str(d), 0o2770, gid=GID)  # a member's directory: trusted in group mode
    with pytest.raises(UnsafePathError):
        ensure_dir(str(d))  # but never in private mode


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720])
def test_ensure_dir_refuses_a_directory_others_may_write(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(UnsafePathError, match=f"mode {mode:04o}.*chmod 700"):
        ensure_dir(str(d))
    if not mode & 0o002:
        ensure_dir(str(d), 0o2770, gid=GID, adopt=True)  # group-writable: the point of it


def test_ensure_dir_gives_an_own_directory_to_the_group_only_when_adopting(
    tmp_path: Path,
) -> None:
    d = tmp_path / "mine"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=f"not shared with group {GID}.*chgrp {GID}"):
        ensure_dir(str(d), 0o2770, gid=GID)
    assert mode_of(d) == 0o700  # left alone
    ensure_dir(str(d), 0o2770, gid=GID, adopt=True)
    assert mode_of(d) == 0o2770 and os.stat(d).st_gid == GID


def test_ensure_dir_refuses_symlinks_and_files(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        ensure_dir(str(link))
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(UnsafePathError, match="not a directory"):
        ensure_dir(str(f))
    with pytest.raises(ConfigError, match="NUL"):
        ensure_dir(str(tmp_path / "a\x00b"))
    with pytest.raises(ConfigError, match="parent does not exist"):
        ensure_dir(str(tmp_path / "no" / "such"), parents=False)


def test_ensure_dir_refuses_a_world_writable_parent_without_sticky_bit(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(UnsafePathError, match="lets every user replace it"):
        ensure_dir(str(parent / "store"))
    os.chmod(parent, 0o1777)  # sticky, as /tmp: others cannot rename what is ours
    ensure_dir(str(parent / "store"))


def test_check_file(tmp_path: Path) -> None:
    f = tmp_path / "page"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    check_file(str(f), os.lstat(f))
    os.chmod(f, 0o620)
    with pytest.raises(UnsafePathError, match="write"):
        check_file(str(f), os.lstat(f))
    os.chmod(f, 0o640)
    os.chown(f, OTHER, OTHER)
    with pytest.raises(UnsafePathError, match=f"uid {OTHER}"):
        check_file(str(f), os.lstat(f))
    with pytest.raises(UnsafePathError):
        check_file(str(f), os.lstat(f), gid=GID)
    os.chown(f, OTHER, GID)
    check_file(str(f), os.lstat(f), gid=GID)  # a member's page, group mode
    os.chmod(f, 0o646)
    with pytest.raises(UnsafePathError, match="every user"):
        check_file(str(f), os.lstat(f), gid=GID)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        check_file(str(tmp_path), os.lstat(tmp_path))


@pytest.mark.timeout(20)
def test_open_regular_never_blocks_or_follows(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target"
    target.write_bytes(b"data")
    link = tmp_path / "link"
    link.symlink_to(target)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    results: dict[str, object] = {}

    def attempt() -> None:
        for name in ("fifo", "link", "sock", "."):
            for flags in (os.O_RDONLY, os.O_WRONLY):
                try:
                    fd = open_regular(str(tmp_path / name), flags)
                    os.close(fd)
                    results[f"{name}{flags}"] = "opened"
                except NotRegularFileError as exc:
                    results[f"{name}{flags}"] = exc
                except OSError as exc:
                    results[f"{name}{flags}"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    sock.close()
    assert not t.is_alive(), "open_regular blocked"
    assert len(results) == 8
    assert all(isinstance(r, NotRegularFileError) for r in results.values()), results
    assert isinstance(NotRegularFileError("x"), CorruptObjectError)
    fd = open_regular(str(target), os.O_RDONLY)
    try:
        assert os.read(fd, 10) == b"data"
        import fcntl

        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(fd)


def test_a_symlinked_parent_is_fine(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "nvme")
    ensure_dir(str(tmp_path / "data" / "kv"))
    assert (tmp_path / "nvme" / "kv").is_dir()
    ensure_dir(str(tmp_path / "data" / "kv"))  # and when it exists


# ------------------------------------------------------------------ symlink races (group mode)


def victim_dir(tmp_path: Path) -> Path:
    """A private directory elsewhere (the attacker wants it given to the group)."""
    victim = tmp_path / "victim-private"
    victim.mkdir(mode=0o700)
    (victim / "id_rsa").write_text("PRIVATE")
    return victim


def swap_for_symlink(path: str, target: Path) -> None:
    """What a member who may write the parent does: move the new directory away, leave a
    symlink to ``target`` in its place."""
    os.rename(path, path + ".moved")
    os.symlink(target, path)


def test_a_directory_swapped_for_a_symlink_right_after_mkdir_is_never_chmodded_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group mode, second attack D2: the swap lands between ``mkdir`` and the chown/chmod
    that make the directory the group's; the link's target must stay as it was."""
    victim = victim_dir(tmp_path)
    before = os.stat(victim)
    store = tmp_path / "store"
    store.mkdir(mode=0o2770)
    target = str(store / "a7")
    real_mkdir = os.mkdir

    def racing_mkdir(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        real_mkdir(path, *args, **kwargs)
        if os.fspath(path) == target:
            swap_for_symlink(target, victim)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(UnsafePathError) as refused:
        ensure_dir(target, 0o2770, gid=GID)
    after = os.stat(victim)
    assert (after.st_gid, stat.S_IMODE(after.st_mode)) == (before.st_gid, 0o700)
    assert "symbolic link" in str(refused.value)


def test_a_directory_swapped_for_a_symlink_while_being_adopted_is_never_chmodded_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race against an existing directory that is being given to the group."""
    victim = victim_dir(tmp_path)
    before = os.stat(victim)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    target = str(mine)
    real_lstat = os.lstat
    swapped: list[bool] = []

    def racing_lstat(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> os.stat_result:
        st = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == target and not swapped:
            swapped.append(True)
            swap_for_symlink(target, victim)
        return st

    monkeypatch.setattr(os, "lstat", racing_lstat)
    with pytest.raises(UnsafePathError, match="replaced"):
        ensure_dir(target, 0o2770, gid=GID, adopt=True)
    after = os.stat(victim)
    assert (after.st_gid, stat.S_IMODE(after.st_mode)) == (before.st_gid, 0o700)


# ------------------------------------------------------------------ group membership


def test_group_mode_trusts_only_current_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second attack D3 (the rule; tests/backends/test_file_safety.py has it with real users and a
    real group database): a file of the sharing group is trusted only if its owner is a
    member now, by primary group or member list; root always; a group the database does
    not know cannot be checked, and then the group alone decides (as before)."""
    import grp
    import pwd

    from hicache_storage.storekit import pathsafety

    users = {
        4243: pwd.struct_passwd(("former", "x", 4243, 4243, "", "/", "/bin/false")),
        4244: pwd.struct_passwd(("listed", "x", 4244, 4244, "", "/", "/bin/false")),
        4245: pwd.struct_passwd(("primary", "x", 4245, GID, "", "/", "/bin/false")),
    }
    group = grp.struct_group(("kv", "x", GID, ["listed"]))

    def getpwuid(uid: int) -> pwd.struct_passwd:
        return users[uid]

    def getgrgid(gid: int) -> grp.struct_group:
        if gid != GID:
            raise KeyError(gid)
        return group

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(grp, "getgrgid", getgrgid)
    monkeypatch.setattr(pathsafety, "_membership", {}, raising=False)
    f = tmp_path / "page"
    f.write_bytes(b"x")
    os.chmod(f, 0o640)
    for uid, trusted in ((4243, False), (4244, True), (4245, True), (0, True), (4299, False)):
        os.chown(f, uid, GID)
        assert pathsafety.is_trusted(os.lstat(f), GID) is trusted, uid
    os.chown(f, 4243, GID)
    with pytest.raises(UnsafePathError, match="uid 4243, who is not a member"):
        check_file(str(f), os.lstat(f), gid=GID)
    d = tmp_path / "fanout"
    d.mkdir(mode=0o2770)
    os.chown(d, 4243, GID)
    with pytest.raises(UnsafePathError, match="not a member"):
        ensure_dir(str(d), 0o2770, gid=GID)
    # Answers are cached (a removal takes effect within MEMBERSHIP_TTL), then re-read.
    os.chown(f, 4244, GID)
    assert pathsafety.is_trusted(os.lstat(f), GID)
    group = grp.struct_group(("kv", "x", GID, []))  # 4244 removed from the group
    assert pathsafety.is_trusted(os.lstat(f), GID)  # still cached
    monkeypatch.setattr(pathsafety, "_membership", {})  # the TTL passed
    assert not pathsafety.is_trusted(os.lstat(f), GID)
    # A group unknown to the database: membership cannot be checked.
    os.chown(f, 4243, 4299)
    assert pathsafety.is_trusted(os.lstat(f), 4299)


def test_a_directory_for_a_stores_own_files_is_checked_like_its_neighbours(
    tmp_path: Path,
) -> None:
    """ensure_file_dir (the mmap arena's directory): created 0700 when missing; a sticky
    world-writable directory (as /tmp) is fine; a symlink, a file, or a directory others
    may replace files in is refused with the fix."""
    from hicache_storage.storekit.pathsafety import ensure_file_dir

    new = tmp_path / "a" / "b"
    ensure_file_dir(str(new))
    assert new.is_dir() and stat.S_IMODE(new.stat().st_mode) == 0o700
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    ensure_file_dir(str(sticky))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafePathError, match="chmod go-w"):
        ensure_file_dir(str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(new)
    with pytest.raises(UnsafePathError, match="not a directory"):
        ensure_file_dir(str(link))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError):
        ensure_file_dir(str(tmp_path / "file"))
