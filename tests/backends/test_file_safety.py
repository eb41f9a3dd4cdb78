"""``file`` and ``shm`` against other local users, planted special files, removed roots, bad paths.

Issue 8, items 6 (other users), 7 (FIFOs and other special files), 12 (a removed root),
17 (bad paths are ConfigErrors). Other users are real: subprocesses run as uid 65534
(nobody) and 4243, with and without the sharing group 4242.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HiCacheStorage, StorageConfig, page_hashes
from hicache_storage.backends import FileBackend, ShmBackend
from hicache_storage.errors import ConfigError

KINDS = ["file", "shm"]
sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from file_safety_pages import NS, POOL, page_file_bytes  # shared with the other users' processes

NOBODY = 65534
MEMBER = 4243  # a second unprivileged user, member of GROUP
GROUP = 4242


def make(kind: str, location: str, **options: Any) -> HiCacheStorage:
    cfg = StorageConfig(namespace=NS)
    if kind == "file":
        return FileBackend(cfg, root=location, **options)
    return ShmBackend(cfg, root=location, **options)


@pytest.fixture
def location(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, not yet existing store location for the backend kind under test."""
    kind = request.node.callspec.params["kind"]
    base = "/tmp" if kind == "file" else "/dev/shm"
    d = f"{base}/hicache-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def object_path(kind: str, root: str, key: str) -> str:
    """Where a backend of ``kind`` rooted at ``root`` stores ``key`` in NS (no backend made)."""
    from hicache_storage.keys import object_name

    name = object_name(NS.digest, key, None)
    return os.path.join(root, name.namespace, name.fanout, name.leaf)


#: Python cannot be started as another user here (its installation is under /root, 0700),
#: so a script starts as root, imports what it needs, then drops to the user for good.
PRELUDE = textwrap.dedent("""
    import os, sys
    def drop():
        uid, gid, groups = (sys.argv[1], sys.argv[2], sys.argv[3])
        os.setgroups([int(g) for g in groups.split(",") if g])
        os.setresgid(int(gid), int(gid), int(gid))
        os.setresuid(int(uid), int(uid), int(uid))
    args = sys.argv[4:]
""")

PLANT = textwrap.dedent("""
    drop()
    src, dst, mode, gid, dirmode = args
    data = open(src, "rb").read()
    d = os.path.dirname(dst)
    os.makedirs(d, exist_ok=True)
    for p in (d, os.path.dirname(d), os.path.dirname(os.path.dirname(d))):
        if os.stat(p).st_uid == os.geteuid() and dirmode != "-":
            os.chmod(p, int(dirmode, 8))
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    if gid != "-":
        os.fchown(fd, -1, int(gid))
    os.fchmod(fd, int(mode, 8))
    os.close(fd)
""")


def run_as(
    uid: int, gid: int, groups: list[int], script: str, *args: str, wrap: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (which calls ``drop()`` once it has imported what it needs) as
    ``uid``/``gid`` with supplementary ``groups``; ``args`` are its ``args``. ``wrap``:
    a command line the interpreter runs under (see :func:`with_user_db`)."""
    return subprocess.run(
        [
            *wrap,
            sys.executable,
            "-c",
            PRELUDE + script,
            str(uid),
            str(gid),
            ",".join(map(str, groups)),
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )


def plant(
    uid: int,
    dst: str,
    data: bytes,
    tmp_path: Path,
    mode: str = "644",
    gid: str = "-",
    dirmode: str = "-",
    groups: list[int] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Another user writes ``data`` at ``dst`` (creating the directories it needs)."""
    src = tmp_path / f"plant-{uuid.uuid4().hex[:6]}"
    src.write_bytes(data)
    os.chmod(src, 0o644)
    os.chmod(tmp_path, 0o755)
    for p in tmp_path.parents:  # let the other user read the source file
        if str(p).startswith("/tmp/pytest-of-"):
            os.chmod(p, os.stat(p).st_mode | 0o755)
    return run_as(
        uid, uid if gid == "-" else int(gid), groups or [], PLANT, str(src), dst, mode, gid, dirmode
    )


# ------------------------------------------------------------------ item 17: bad paths


@pytest.mark.parametrize("kind", KINDS)
def test_bad_locations_are_config_errors(kind: str, location: str, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    for bad in (
        location + "\x00evil",
        str(a_file),
        str(a_file / "below"),
        "/" + "x" * 5000,
        "",
    ):
        with pytest.raises(ConfigError):
            make(kind, bad)


# ------------------------------------------------------------------ item 7: special files


def plant_special(kind: str, b: HiCacheStorage, path: str, what: str) -> Any:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if what == "fifo":
        os.mkfifo(path, 0o600)
    elif what == "socket":
        sock = socket.socket(socket.AF_UNIX)
        short = f"{os.path.dirname(os.path.dirname(path))}/s{uuid.uuid4().hex[:6]}"
        if len(short) > 100:
            short = f"/tmp/s{uuid.uuid4().hex[:6]}"
        sock.bind(short)  # page paths are longer than a socket address may be
        os.rename(short, path)
        return sock
    elif what == "symlink":
        assert b.set("real", b"\x55" * POOL.page_bytes)
        os.symlink(b._path(b.object_name("real")), path)  # type: ignore[attr-defined]
    elif what == "directory":
        os.mkdir(path, 0o700)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["fifo", "socket", "symlink", "directory"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_under_a_page_name_is_a_counted_miss_and_never_blocks(
    kind: str, location: str, what: str
) -> None:
    b = make(kind, location)
    b.register_mem_pool_host(POOL)
    key = page_hashes(list(range(POOL.page_size)), POOL.page_size)[0]
    path = b._path(b.object_name(key))  # type: ignore[attr-defined]
    held = plant_special(kind, b, path, what)
    results: dict[str, Any] = {}

    def engine_calls() -> None:
        results["get"] = b.get(key)
        results["get_into"] = b.get(key, bytearray(POOL.page_bytes))
        results["exists"] = b.exists(key)
        results["batch_exists"] = b.batch_exists([key])
        results["v1"] = b.batch_get_v1([key], torch.arange(0, POOL.page_size))

    t = threading.Thread(target=engine_calls, daemon=True)
    try:
        t.start()
        t.join(20)
        assert not t.is_alive(), f"a {what} under a page name blocked the engine's read"
    finally:
        if t.is_alive() and what == "fifo":  # unblock today's reader: give it an EOF
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
        if held is not None:
            held.close()
    assert results == {
        "get": None,
        "get_into": None,
        "exists": False,
        "batch_exists": 0,
        "v1": [False],
    }
    stats = b.get_stats()
    assert stats.corrupt_objects >= 1  # counted
    # The key can be stored afterwards: the planted object does not block it forever.
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)  # (a read removes it; be independent of which call did)
    value = b"\x33" * POOL.page_bytes
    assert b.set(key, value)
    assert bytes(b.get(key).numpy()) == value
    if what == "symlink":  # the link's target was never touched
        assert bytes(b.get("real").numpy()) == b"\x55" * POOL.page_bytes
    b.close()


# ------------------------------------------------------------------ item 6: other users


@pytest.mark.parametrize("kind", KINDS)
def test_default_locations_are_per_user_and_private(kind: str) -> None:
    b = FileBackend(StorageConfig()) if kind == "file" else ShmBackend(StorageConfig())
    try:
        base = "/tmp" if kind == "file" else "/dev/shm"
        assert b.root == f"{base}/hicache-storage-{os.geteuid()}"
        st = os.lstat(b.root)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(b.directory).st_mode) == 0o700
    finally:
        b.clear()
        b.close()


DEFAULT_VICTIM = textwrap.dedent("""
    import torch
    from hicache_storage import StorageConfig
    from hicache_storage.backends import FileBackend, ShmBackend
    from hicache_storage.errors import ConfigError
    sys.path.insert(0, args[1] + "/tests/workers")
    from file_safety_pages import NS
    drop()
    cls = FileBackend if args[0] == "file" else ShmBackend
    try:
        b = cls(StorageConfig(namespace=NS))
    except ConfigError as exc:
        print("ConfigError", exc)
    else:
        got = b.get("victim-key")
        print("HIT" if got is not None else "MISS", b.root)
""")


@pytest.mark.parametrize("kind", KINDS)
def test_another_user_cannot_pre_create_a_users_default_location(kind: str, tmp_path: Path) -> None:
    """nobody pre-creates uid 4243's default root (a predictable name) and plants a page
    under the key's predictable name; 4243's backend must refuse the root, never serve it."""
    base = "/tmp" if kind == "file" else "/dev/shm"
    victim_root = f"{base}/hicache-storage-{MEMBER}"
    shutil.rmtree(victim_root, ignore_errors=True)
    try:
        dst = object_path(kind, victim_root, "victim-key")
        planted = plant(NOBODY, dst, page_file_bytes(b"\x66" * 64, "none"), tmp_path, dirmode="777")
        assert planted.returncode == 0, planted.stderr
        r = run_as(MEMBER, MEMBER, [], DEFAULT_VICTIM, kind, str(Path(__file__).parents[2]))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("ConfigError"), r.stdout
        assert victim_root in r.stdout and f"uid {NOBODY}" in r.stdout
        assert "Fix:" in r.stdout
    finally:
        shutil.rmtree(victim_root, ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_root_or_namespace_another_user_prepared_is_refused(
    kind: str, shared_dirs: dict[str, str], tmp_path: Path
) -> None:
    root = os.path.join(shared_dirs[kind], "store")
    dst = object_path(kind, root, "k")
    algorithm = "xxh3" if kind == "file" else "none"
    planted = plant(
        NOBODY, dst, page_file_bytes(b"\x66" * 64, algorithm, key="k"), tmp_path, dirmode="755"
    )
    assert planted.returncode == 0, planted.stderr
    # 1. The root itself is another user's.
    with pytest.raises(ConfigError, match=rf"{root}.*owned by uid {NOBODY}.*Fix"):
        make(kind, root)
    # 2. The root is ours but others may write it (a careless chmod 777).
    os.chown(root, os.geteuid(), os.getegid())
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match=rf"{root}.*mode 0777"):
        make(kind, root)
    # 3. The root is fixed, but the namespace directory is still the other user's.
    os.chmod(root, 0o755)
    ns_dir = os.path.join(root, NS.digest)
    with pytest.raises(ConfigError, match=rf"{ns_dir}.*owned by uid {NOBODY}"):
        make(kind, root)


@pytest.mark.parametrize("kind", KINDS)
def test_a_name_held_by_a_non_empty_directory_fails_the_write(kind: str, location: str) -> None:
    """A write never reports stored a page that a read would not return."""
    b = make(kind, location)
    path = b._path(b.object_name("k"))  # type: ignore[attr-defined]
    os.makedirs(os.path.join(path, "inside"))
    assert b.set("k", b"v") is False
    assert b.get("k") is None and not b.exists("k")
    b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_page_file_of_another_user_is_never_a_hit(kind: str, location: str) -> None:
    """Our own, private directory; a page file in it belongs to another uid (or may be
    written by others): a miss, counted, and the key can be stored again."""
    b = make(kind, location)
    value = b"\x11" * 64
    for key, (uid, mode) in {"theirs": (NOBODY, 0o644), "open": (os.geteuid(), 0o666)}.items():
        assert b.set(key, value)
        path = b._path(b.object_name(key))  # type: ignore[attr-defined]
        os.chown(path, uid, -1)
        os.chmod(path, mode)
        assert b.get(key) is None
        assert not b.exists(key)
        assert b.set(key, b"\x22" * 64)
        assert bytes(b.get(key).numpy()) == b"\x22" * 64
    assert b.get_stats().corrupt_objects >= 2
    b.close()


MEMBER_WRITER = textwrap.dedent("""
    import torch
    from hicache_storage import StorageConfig
    from hicache_storage.backends import ShmBackend
    sys.path.insert(0, args[1] + "/tests/workers")
    from file_safety_pages import NS
    drop()
    b = ShmBackend(StorageConfig(namespace=NS), root=args[0], group=4242)
    print(b.set("shared", b"\\x44" * 64), b.get("mine") is not None)
""")


def test_group_mode_trusts_members_and_nobody_else(shm_dir: str, tmp_path: Path) -> None:
    """Three users: this one (root, the store's creator), 4243 (a member of the sharing
    group 4242) and nobody (not a member). A member's pages are shared; a member's file
    that leaves the group (its own primary group) or that anyone may write is not trusted;
    nobody cannot add anything at all."""
    b = ShmBackend(StorageConfig(namespace=NS), root=shm_dir, group=GROUP)
    assert b.set("mine", b"\x01" * 64)
    repo = str(Path(__file__).parents[2])
    member = run_as(MEMBER, MEMBER, [GROUP], MEMBER_WRITER, shm_dir, repo)
    assert member.returncode == 0, member.stderr
    assert member.stdout.split() == ["True", "True"]  # the member writes and reads ours
    assert bytes(b.get("shared").numpy()) == b"\x44" * 64  # and we read the member's
    for key, mode, gid in (("own-group", "644", str(MEMBER)), ("world-writable", "666", "-")):
        forged = page_file_bytes(b"\x66" * 64, "none", key=key)
        dst = b._path(b.object_name(key))
        r = plant(MEMBER, dst, forged, tmp_path, mode=mode, groups=[GROUP])
        assert r.returncode == 0, r.stderr
        if gid != "-":
            os.chown(dst, MEMBER, int(gid))  # the member's own primary group
        assert b.get(key) is None, key
        assert not b.exists(key), key
    outsider = plant(NOBODY, b._path(b.object_name("outsider")), forged, tmp_path)
    assert outsider.returncode != 0  # cannot even create the file
    assert b.get("outsider") is None
    assert b.get_stats().corrupt_objects >= 2
    b.close()


FORMER = MEMBER  # 4243: a member once, no longer listed in the group database
LISTED = 4244  # a current member: listed in the group's member list


@pytest.fixture
def with_user_db(tmp_path: Path) -> list[str]:
    """A command prefix that runs a program in a private mount namespace whose
    /etc/passwd and /etc/group know the test users and group 4242, with only LISTED as a
    member (FORMER was removed). Nothing outside that namespace sees these files."""
    db = tmp_path / "db"
    db.mkdir()
    os.chmod(tmp_path, 0o755)
    passwd = db / "passwd"
    passwd.write_text(
        Path("/etc/passwd").read_text()
        + f"former:x:{FORMER}:{FORMER}::/:/bin/false\nlisted:x:{LISTED}:{LISTED}::/:/bin/false\n"
    )
    group = db / "group"
    group.write_text(Path("/etc/group").read_text() + f"kvshare:x:{GROUP}:listed\n")
    for f in (passwd, group):
        os.chmod(f, 0o644)
    script = f'mount --bind {passwd} /etc/passwd && mount --bind {group} /etc/group && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


FORMER_PREPARES = textwrap.dedent("""
    import torch
    from hicache_storage import StorageConfig
    from hicache_storage.backends import ShmBackend
    from hicache_storage.keys import object_name
    sys.path.insert(0, args[2] + "/tests/workers")
    from file_safety_pages import NS, page_file_bytes
    root, step = args[0], args[1]
    name = object_name(NS.digest, "victim-key", None)
    fan = os.path.join(root, name.namespace, name.fanout)
    if step == "former":  # a descriptor it kept from its member days (any process of it)
        held = os.open(fan, os.O_RDONLY | os.O_DIRECTORY)
    drop()
    if step == "member":  # still holding the group: a page, and the fan-out directory
        b = ShmBackend(StorageConfig(namespace=NS), root=root, group=4242)
        print(b.set("old-page", b"\x01" * 64), end=" ")
        if not os.path.isdir(fan):
            os.mkdir(fan)
        os.chmod(fan, 0o2770)
        print(os.stat(fan).st_uid == os.getuid() and os.stat(fan).st_gid == 4242)
    else:  # out of the group: the setgid directory it owns still gives its files the group
        fd = os.open(name.leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640, dir_fd=held)
        os.write(fd, page_file_bytes(b"EVIL" * 16, "none"))
        print(os.fstat(fd).st_gid, os.getgroups())
        os.close(fd)
""")

LISTED_READS = textwrap.dedent("""
    import torch
    from hicache_storage import StorageConfig
    from hicache_storage.backends import ShmBackend
    from hicache_storage.errors import ConfigError
    sys.path.insert(0, args[1] + "/tests/workers")
    from file_safety_pages import NS
    drop()
    try:
        b = ShmBackend(StorageConfig(namespace=NS), root=args[0], group=4242)
    except ConfigError as exc:
        print("ConfigError", exc)
        raise SystemExit(0)
    def show(key):
        got = b.get(key)
        return "miss" if got is None else bytes(got.numpy())[:4].decode(errors="replace")
    print(show("victim-key"), show("old-page"), show("from-root"), b.set("listed", b"L" * 64))
""")


def test_a_former_member_cannot_plant_pages_members_serve(
    shm_dir: str, with_user_db: list[str]
) -> None:
    """Second attack D3, with real users and a real group database (in a private mount
    namespace): FORMER, a member once, made a fan-out directory of the store (setgid, of
    group 4242) and a page; removed from the group, it can still create files there, which
    get group 4242. A current member must miss them all: the owner is no longer a member.
    A store root a former member owns is refused outright."""
    repo = str(Path(__file__).parents[2])
    owner = ShmBackend(StorageConfig(namespace=NS), root=shm_dir, group=GROUP)
    assert owner.set("from-root", b"ROOT" * 16)
    r = run_as(FORMER, FORMER, [GROUP], FORMER_PREPARES, shm_dir, "member", repo, wrap=with_user_db)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], (r.stdout, r.stderr)
    r = run_as(FORMER, FORMER, [], FORMER_PREPARES, shm_dir, "former", repo, wrap=with_user_db)
    assert r.returncode == 0 and r.stdout.split()[0] == str(GROUP), (r.stdout, r.stderr)
    r = run_as(LISTED, LISTED, [GROUP], LISTED_READS, shm_dir, repo, wrap=with_user_db)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["miss", "miss", "ROOT", "True"], (r.stdout, r.stderr)
    assert bytes(owner.get("listed").numpy()) == b"L" * 64  # a current member's page is shared
    owner.close()
    # A whole store created by the former member while it was one.
    theirs = shm_dir + "-former"
    try:
        r = run_as(
            FORMER, FORMER, [GROUP], FORMER_PREPARES, theirs, "member", repo, wrap=with_user_db
        )
        assert r.returncode == 0, r.stderr
        r = run_as(LISTED, LISTED, [GROUP], LISTED_READS, theirs, repo, wrap=with_user_db)
        assert r.returncode == 0, r.stderr
        assert (
            r.stdout.startswith("ConfigError") and f"uid {FORMER}, who is not a member" in r.stdout
        )
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


# ------------------------------------------------------------------ item 12: removed root


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("removed", ["root", "namespace"])
def test_a_removed_root_is_recreated_on_the_next_write(
    kind: str, location: str, removed: str
) -> None:
    b = make(kind, location)
    b.register_mem_pool_host(POOL)
    assert b.set("before", b"\x01" * 100)
    shutil.rmtree(b.root if removed == "root" else b.directory)  # type: ignore[attr-defined]
    assert b.get("before") is None
    assert b.set("after", b"\x02" * 100)
    assert bytes(b.get("after").numpy()) == b"\x02" * 100
    keys = page_hashes(list(range(2 * POOL.page_size)), POOL.page_size)
    assert b.batch_set_v1(keys, torch.arange(0, 2 * POOL.page_size)) == [True, True]
    assert b.batch_get_v1(keys, torch.arange(0, 2 * POOL.page_size)) == [True, True]
    for d in (b.root, b.directory):  # type: ignore[attr-defined]
        st = os.lstat(d)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, d
    other = make(kind, location)  # a new instance finds what the recreated store holds
    assert bytes(other.get("after").numpy()) == b"\x02" * 100
    other.close()
    b.close()


def test_a_removed_shm_root_near_its_free_space_floor_is_recreated(small_tmpfs: str) -> None:
    """Second attack D5: near the floor every write first takes the free-space lock, whose
    file is in the removed root; that must lead to the same recovery (forget the
    directories, recreate them), not to a failure of every later write."""
    b = ShmBackend(StorageConfig(namespace=NS), root=os.path.join(small_tmpfs, "kv"))
    value = b"\x05" * 8192
    assert b._serialize and b._near_floor(len(value))  # the locked path
    assert b.set("before", value)
    for i in range(20_000):  # every fan-out directory known to exist (no re-check)
        if len(b._dirs) == 256:
            break
        b.set(f"warm{i}", b"w" * 64)
    assert len(b._dirs) == 256
    shutil.rmtree(b.root)
    assert [b.set(f"after{i}", value) for i in range(5)] == [True] * 5
    assert bytes(b.get("after4").numpy()) == value
    assert b.get("before") is None
    b.close()


def test_a_removed_group_root_is_recreated_shared(shm_dir: str) -> None:
    b = ShmBackend(StorageConfig(namespace=NS), root=shm_dir, group=GROUP)
    shutil.rmtree(shm_dir)
    assert b.set("after", b"\x02" * 100)
    for d in (b.root, b.directory):
        st = os.lstat(d)
        assert st.st_gid == GROUP and stat.S_IMODE(st.st_mode) == 0o2770, d
    b.close()


def test_a_private_store_reopened_shared_is_given_to_the_group(shm_dir: str) -> None:
    """A store first used privately, then with ``group``: its own directories are given to
    the group (members can use it at once); a directory that holds anything else is
    never chmod-ed behind the user's back (ConfigError with the command to run)."""
    private = ShmBackend(StorageConfig(namespace=NS), root=shm_dir)
    assert private.set("k", b"v")
    private.close()
    shared = ShmBackend(StorageConfig(namespace=NS), root=shm_dir, group=GROUP)
    for d in (shared.root, shared.directory):
        st = os.lstat(d)
        assert st.st_gid == GROUP and stat.S_IMODE(st.st_mode) == 0o2770, d
    shared.close()
    other = shm_dir + "-home"
    os.mkdir(other, 0o700)
    try:
        Path(other, "notes.txt").write_text("not a store")
        with pytest.raises(ConfigError, match=f"chgrp {GROUP} {other}"):
            ShmBackend(StorageConfig(namespace=NS), root=other, group=GROUP)
        assert stat.S_IMODE(os.lstat(other).st_mode) == 0o700
    finally:
        shutil.rmtree(other)
