"""The ``shm`` backend: pages in /dev/shm shared by processes, bounded, private by default."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig, page_hashes
from hicache_storage.backends import ShmBackend
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.conformance.data import make_pool, pool_namespace, tree_files
from hicache_storage.errors import ConfigError
from hicache_storage.storekit.header import HEADER_SIZE

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from recycled_pages import HEAD, NS, SIZE, value_of

ROOT = Path(__file__).resolve().parents[2]


class TestShmConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, shm_dir: str) -> BackendSpec:
        return BackendSpec("shm", {"root": shm_dir})

    @pytest.fixture
    def break_store(
        self, broken_directory: Callable[[HiCacheStorage], Any]
    ) -> Callable[[HiCacheStorage], Any]:
        return broken_directory


def test_defaults_live_in_dev_shm_with_bounded_capacity() -> None:
    b = ShmBackend(StorageConfig())
    try:
        assert b.root == f"/dev/shm/hicache-storage-{os.geteuid()}"
        st = os.statvfs("/dev/shm")
        total = st.f_blocks * st.f_frsize
        assert b._tracker.max_bytes == total // 2
        assert b._tracker.min_free_bytes == total // 10
        assert b.options.checksum == "xxh3" and b.options.verify_checksum is True
    finally:
        b.clear()
        b.close()


def test_flipped_payload_bytes_are_a_miss_by_default_and_served_only_when_opted_out(
    shm_dir: str,
) -> None:
    page = bytes(range(256)) * 64
    for options, hit in (({}, False), ({"checksum": "none"}, True)):
        b = ShmBackend(StorageConfig(), root=shm_dir, **options)
        assert b.set("k", page) is True
        (path,) = tree_files(b.directory)
        with open(path, "r+b") as f:  # one payload byte; the header (a trailer) is intact
            f.seek(1000)
            byte = f.read(1)[0]
            f.seek(1000)
            f.write(bytes([byte ^ 0x5A]))
        got = b.get("k")
        assert (got is not None) is hit, options
        if not hit:
            assert b.get_stats().corrupt_objects == 1 and not b.exists("k")  # removed
        b.clear()
        b.close()


def test_it_never_fills_the_tmpfs(small_tmpfs: str) -> None:
    b = ShmBackend(StorageConfig(), root=small_tmpfs + "/kv")  # defaults: half, a tenth free
    for i in range(40):
        assert b.set(f"k{i}", bytes([i]) * 100_000), i
        st = os.statvfs(small_tmpfs)
        assert st.f_bavail * st.f_frsize >= (st.f_blocks * st.f_frsize) // 10 - 8192
        used = sum(os.path.getsize(p) for p in tree_files(b.directory))
        assert used <= (st.f_blocks * st.f_frsize) // 2
    assert b.exists("k39")
    assert not b.exists("k0")
    assert b.get_stats().evictions > 0
    b.close()


def test_private_by_default(shm_dir: str) -> None:
    b = ShmBackend(StorageConfig(), root=shm_dir)
    b.set("k", b"v")
    (path,) = tree_files(b.directory)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    b.close()


def as_nobody(cmd: list[str], groups: list[int]) -> subprocess.CompletedProcess[bytes]:
    """Run a command as uid/gid 65534 with the given supplementary groups."""
    return subprocess.run(
        cmd, user=65534, group=65534, extra_groups=groups, capture_output=True, check=False, cwd="/"
    )


def test_group_sharing_with_a_real_unprivileged_process(shm_dir: str) -> None:
    gid = 4242
    b = ShmBackend(StorageConfig(), root=shm_dir, group=str(gid))
    assert b.set("k", b"shared page")
    (path,) = tree_files(b.directory)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_gid == gid
    fan = os.path.dirname(path)
    d = os.stat(fan)
    assert stat.S_IMODE(d.st_mode) == 0o2770
    assert d.st_gid == gid
    root = os.stat(shm_dir)  # created shared: no manual step for members to use it
    assert stat.S_IMODE(root.st_mode) == 0o2770 and root.st_gid == gid
    member = as_nobody(["cat", path], [gid])
    assert member.returncode == 0, member.stderr
    assert member.stdout.startswith(b"shared page")  # the page, then its header
    assert as_nobody(["touch", os.path.join(fan, "probe")], [gid]).returncode == 0  # may write too
    outsider = as_nobody(["cat", path], [])
    assert outsider.returncode != 0
    assert b"Permission denied" in outsider.stderr
    private = ShmBackend(StorageConfig(), root=shm_dir + "-private")
    private.set("k", b"secret")
    (secret,) = tree_files(private.directory)
    os.chmod(shm_dir + "-private", 0o755)  # open the private root: the 0600 file still holds
    assert as_nobody(["cat", secret], [gid]).returncode != 0  # default: owner only
    private.clear()
    private.close()
    shutil.rmtree(shm_dir + "-private", ignore_errors=True)
    b.close()


GROUP_MEMBER = textwrap.dedent("""
    import os, sys, torch
    from hicache_storage import StorageConfig
    from hicache_storage.backends import ShmBackend
    directory = sys.argv[1] if sys.argv[1] != "-" else None
    os.setgroups([4242]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    b = ShmBackend(StorageConfig(), root=directory, group=4242)
    got = b.get("from-owner")
    print(bytes(got.numpy()).decode() if got is not None else None, b.set("from-member", b"hi owner"), b.root)
""")


@pytest.mark.parametrize("where", ["explicit", "default"])
def test_group_sharing_works_out_of_the_box_with_a_numeric_gid(shm_dir: str, where: str) -> None:
    """The owner creates the store with ``group=4242`` (an int gid); an unprivileged member
    (nobody, in group 4242) uses it at once, both ways, with no chmod by anyone. Without a
    directory, every member defaults to the same group store."""
    directory = shm_dir if where == "explicit" else None
    owner = ShmBackend(StorageConfig(), root=directory, group=4242)
    try:
        if where == "default":
            assert owner.root == "/dev/shm/hicache-storage-g4242"
        for d in (owner.root, owner.directory):
            st = os.stat(d)
            assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == 4242, d
        assert owner.set("from-owner", b"hi-member")
        r = subprocess.run(
            [sys.executable, "-c", GROUP_MEMBER, directory or "-"],
            capture_output=True,
            text=True,
            cwd="/",
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["hi-member", "True", owner.root], r.stderr
        assert bytes(owner.get("from-member").numpy()) == b"hi owner"
    finally:
        owner.close()
        if where == "default":
            shutil.rmtree(owner.root, ignore_errors=True)


def test_group_option_forms(shm_dir: str) -> None:
    for group in (4242, "4242"):
        b = ShmBackend(StorageConfig(), root=shm_dir, group=group)
        assert b.group_id == 4242
        b.close()
    for bad in (True, -1, 4.2, "no-such-group-xyz", "\u0664\u0662", "\u00b2", "4\u00b2"):
        with pytest.raises(ConfigError):  # non-ASCII digits ("٤٢", "²") are no gid
            ShmBackend(StorageConfig(), root=shm_dir, group=bad)


def test_unknown_group_is_a_config_error(shm_dir: str) -> None:
    with pytest.raises(ConfigError, match="unknown group"):
        ShmBackend(StorageConfig(), root=shm_dir, group="no-such-group-xyz")


WRITER = textwrap.dedent("""
    import sys, torch
    from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig, page_hashes
    from hicache_storage.backends import ShmBackend
    pool = HostKVPool(num_pages=4, page_size=4, layer_num=3, kv_heads=2, head_dim=8,
                      dtype=torch.bfloat16, layout="page_first")
    pool.kv_buffer.view(-1).view(torch.uint8).fill_(7)
    ns = KVCacheNamespace(model_id="test-model", dtype="bfloat16", page_size=4, object_layout="page_first")
    b = ShmBackend(StorageConfig(namespace=ns), root=sys.argv[1])
    b.register_mem_pool_host(pool)
    print(b.batch_set_v1(page_hashes(list(range(16)), 4), torch.arange(16)))
""")


def test_another_process_reads_what_one_wrote(shm_dir: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", WRITER, shm_dir], capture_output=True, text=True, check=True
    )
    assert r.stdout.strip() == "[True, True, True, True]"
    pool = make_pool(num_pages=8, head_dim=8)  # the writer's page shape
    pool.kv_buffer.zero_()
    ns = KVCacheNamespace.for_pool(pool, model_id="test-model")  # the writer's namespace
    b = ShmBackend(StorageConfig(namespace=ns), root=shm_dir)
    b.register_mem_pool_host(pool)
    keys = page_hashes(list(range(16)), 4)
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, torch.arange(16, 32)) == [True] * 4
    for page in pool.page_buffers(torch.arange(16, 32)):
        assert page.tobytes() == b"\x07" * pool.page_bytes
    b.close()


# ---------------------------------------------------------------- recycling when full


def full_store(shm_dir: str, objects: int, **opts: Any) -> ShmBackend:
    """A store capped at exactly ``objects`` values of SIZE, filled with keys k0.."""
    b = ShmBackend(
        StorageConfig(namespace=NS), root=shm_dir, max_size=objects * (HEAD + SIZE), **opts
    )
    for i in range(objects):
        assert b.set(f"k{i}", value_of(i))
    return b


def inode(b: ShmBackend, key: str) -> int:
    return os.stat(b._path(b.object_name(key))).st_ino


def test_a_full_store_recycles_the_evicted_files_in_place(shm_dir: str) -> None:
    b = full_store(shm_dir, 4)
    old = {inode(b, f"k{i}") for i in range(4)}
    b.get("k0")  # k0 becomes the most recently used: k1 is evicted first
    for i in range(4, 7):
        assert b.set(f"k{i}", value_of(i))
    assert {inode(b, f"k{i}") for i in range(4, 7)} <= old  # the same tmpfs files
    assert [b.exists(f"k{i}") for i in range(7)] == [True, False, False, False, True, True, True]
    for i in (0, 4, 5, 6):
        assert torch.equal(b.get(f"k{i}"), value_of(i))
    assert b.usage()["used_bytes"] == 4 * (HEAD + SIZE)
    assert len(tree_files(b.directory)) == 4  # no temporaries left behind
    assert b.get_stats().evictions == 3
    b.close()


def test_recycle_false_frees_and_allocates_new_files(shm_dir: str) -> None:
    b = full_store(shm_dir, 3, recycle=False)
    old = {inode(b, f"k{i}") for i in range(3)}
    assert b.set("k3", value_of(3))
    assert inode(b, "k3") not in old
    assert torch.equal(b.get("k3"), value_of(3))
    b.close()


def test_another_size_is_never_recycled(shm_dir: str) -> None:
    b = full_store(shm_dir, 2)
    old = {inode(b, "k0"), inode(b, "k1")}
    assert b.set("small", value_of(9, SIZE // 2))
    assert inode(b, "small") not in old
    assert torch.equal(b.get("small"), value_of(9, SIZE // 2))
    assert b.usage()["used_bytes"] <= 2 * (HEAD + SIZE)
    b.close()


def test_a_file_a_reader_holds_is_not_overwritten(shm_dir: str) -> None:
    """A reader in the middle of its copy holds a shared flock: the recycler leaves that
    file alone (evicts it by unlink) and writes a new one."""
    b = full_store(shm_dir, 2)
    victim = b._path(b.object_name("k0"))
    fd = os.open(victim, os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH)
        assert b.set("k2", value_of(2))
        assert not b.exists("k0")
        assert os.fstat(fd).st_ino != inode(b, "k2")
        held = os.pread(fd, SIZE, 0)  # the page, then its header
        assert held == value_of(0).numpy().tobytes()  # the reader's bytes never changed
    finally:
        os.close(fd)
    assert torch.equal(b.get("k2"), value_of(2))
    assert len(tree_files(b.directory)) == 2 and b.usage()["objects"] == 2
    b.close()


def test_a_reader_that_opened_the_file_before_it_was_recycled_misses(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving a lock alone does not cover: the reader opened k0, then the file was
    recycled for k2 and released, then the reader locks. It must see that k0's name no
    longer leads to this file and report a miss, never k2's bytes as k0."""
    import fcntl

    from hicache_storage.storekit import filereads

    writer = full_store(shm_dir, 2)
    reader = ShmBackend(StorageConfig(namespace=NS), root=shm_dir)
    real_flock = fcntl.flock
    fired: list[int] = []

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_SH and not fired:
            fired.append(os.fstat(fd).st_ino)
            assert writer.set("k2", value_of(2))  # recycles k0's file under the reader
        real_flock(fd, op)

    monkeypatch.setattr(filereads.fcntl, "flock", flock)  # type: ignore[attr-defined]
    assert reader.get("k0") is None
    assert fired and fired[0] == inode(writer, "k2")  # it really was the same file
    monkeypatch.setattr(filereads.fcntl, "flock", real_flock)  # type: ignore[attr-defined]
    assert torch.equal(reader.get("k2"), value_of(2))
    writer.close()
    reader.close()


RECYCLER = Path(__file__).parents[1] / "workers" / "shm_recycler.py"


def test_readers_never_see_another_keys_bytes_while_another_process_recycles(
    shm_dir: str,
) -> None:
    """A real race: a process cycles 64 keys through a 4-object store (every set recycles
    the file of the oldest), while two threads here read the same keys as fast as they
    can. Every hit must be exactly its key's value."""
    import threading

    proc = subprocess.Popen(
        [sys.executable, str(RECYCLER), shm_dir, "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = ShmBackend(StorageConfig(namespace=NS), root=shm_dir)
    hits, wrong = [0], []

    def read(seed: int) -> None:
        j = seed
        while proc.poll() is None:
            j = (j * 1103515245 + 12345) % 64
            got = reader.get(f"k{j}")
            if got is not None:
                hits[0] += 1
                if not torch.equal(got, value_of(j)):
                    wrong.append(j)

    threads = [threading.Thread(target=read, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    out, _ = proc.communicate(timeout=60)
    for t in threads:
        t.join()
    writes, evictions = map(int, out.split())
    assert proc.returncode == 0
    assert wrong == []
    assert writes > 200 and evictions > 100  # the race really ran
    assert hits[0] > 50
    assert len(tree_files(os.path.join(shm_dir, NS.digest))) <= 4
    reader.close()


def test_a_store_over_its_cap_shrinks_instead_of_recycling(shm_dir: str) -> None:
    """Restarted with a smaller max_size, a full store must come down to it: swapping one
    page for another (recycling) never would."""
    full_store(shm_dir, 8).close()
    b = ShmBackend(StorageConfig(namespace=NS), root=shm_dir, max_size=4 * (HEAD + SIZE))
    for i in range(8, 11):
        assert b.set(f"k{i}", value_of(i))
    assert b.usage()["used_bytes"] <= 4 * (HEAD + SIZE)
    assert len(tree_files(b.directory)) <= 4
    b.close()


def test_a_victim_gone_elsewhere_still_leaves_the_floor_in_place(small_tmpfs: str) -> None:
    """Two instances share a namespace on a 2 MiB tmpfs: B recycles the files A still counts,
    so A's victims are gone when A writes; A's new files must still keep the free-space
    floor (a tenth of the tmpfs) rather than take the reused page's place unchecked."""
    page = b"\x01" * (64 * 1024 - HEAD)
    kv = os.path.join(small_tmpfs, "kv")
    a = ShmBackend(StorageConfig(), root=kv)
    floor = a._tracker.min_free_bytes
    assert all(a.set(f"a{i}", page) for i in range(16))  # A's default cap: half the tmpfs
    b = ShmBackend(StorageConfig(), root=kv)  # loads A's pages as its own
    assert all(b.set(f"b{i}", page) for i in range(16))  # recycles them
    lowest = []
    for i in range(16):
        a.set(f"m{i}", page)
        st = os.statvfs(small_tmpfs)
        lowest.append(st.f_bavail * st.f_frsize)
    assert min(lowest) >= floor
    a.close()
    b.close()


GROUP_RECYCLER = textwrap.dedent("""
    import os, sys
    from hicache_storage import StorageConfig
    from hicache_storage.backends import ShmBackend
    from hicache_storage.storekit.header import HEADER_SIZE
    os.setgroups([4242]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    b = ShmBackend(StorageConfig(), root=sys.argv[1], group="4242", max_size=2 * 4096)
    print(b.set("k2", b"\\x02" * (4096 - HEADER_SIZE)))
""")


def test_another_users_page_is_evicted_not_recycled(shm_dir: str) -> None:
    """Group sharing: the oldest page belongs to another user, whose 0640 file this process
    may not rewrite. The write must still succeed (evict it, write a new file)."""
    owner = ShmBackend(StorageConfig(), root=shm_dir, group="4242", max_size=2 * 4096)
    page = 4096 - HEADER_SIZE
    assert owner.set("k0", b"\x00" * page) and owner.set("k1", b"\x01" * page)
    owner.close()
    r = subprocess.run(
        [sys.executable, "-c", GROUP_RECYCLER, shm_dir],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"], r.stderr
    reader = ShmBackend(StorageConfig(), root=shm_dir, group="4242")
    assert bytes(reader.get("k2").numpy()) == b"\x02" * (4096 - HEADER_SIZE)
    assert [reader.exists(k) for k in ("k0", "k1")].count(True) <= 1  # one was evicted
    reader.close()


def not_in_memory_dir(tmp_path: Path) -> str:
    """A directory on a filesystem that is not a tmpfs (skip if this machine has none)."""
    for candidate in (str(tmp_path), str(ROOT), "/var/tmp"):
        kind = subprocess.run(
            ["stat", "-f", "-c", "%T", candidate], capture_output=True, text=True, check=False
        ).stdout.strip()
        if kind and kind not in ("tmpfs", "ramfs"):
            return os.path.join(candidate, f"hicache-shm-test-{uuid.uuid4().hex[:8]}")
    pytest.skip("every candidate directory is on a tmpfs here")


def test_a_directory_not_on_a_tmpfs_is_warned_about_once(
    tmp_path: Path, shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Second attack, minor: ``directory`` on a disk works, with one warning per directory
    and process (not one per instance), and none for a tmpfs."""
    import logging

    caplog.set_level(logging.WARNING)
    on_disk = not_in_memory_dir(tmp_path)
    try:
        for _ in range(3):
            # (min_free_space 0: the host disk's own fill must not decide this test)
            b = ShmBackend(StorageConfig(), root=on_disk, max_size="1MiB", min_free_space=0)
            assert b.set("k", b"v") and b.get("k") is not None  # it works all the same
            b.close()
        ShmBackend(StorageConfig(), root=shm_dir).close()
    finally:
        shutil.rmtree(on_disk, ignore_errors=True)
    lines = [r.getMessage() for r in caplog.records if "not a tmpfs" in r.getMessage()]
    assert len(lines) == 1 and on_disk in lines[0], lines


def test_a_namespace_quota_holds_a_tenant_to_its_share_of_the_root(shm_dir: str) -> None:
    """Two tenants in one root: ``a`` with ``namespace_max_size`` of 4 pages writes 12;
    it never holds more than 4, the pages it keeps are its newest and byte-exact, and
    ``b``'s older pages all survive. ``usage()`` reports the root and each namespace."""
    page = HEAD + SIZE
    ns_b = pool_namespace(make_pool(num_pages=1), tenant="quota-b")
    b = ShmBackend(StorageConfig(namespace=ns_b), root=shm_dir, max_size=64 * page)
    for i in range(6):
        assert b.set(f"k{i}", value_of(i))
    ns_a = pool_namespace(make_pool(num_pages=1), tenant="quota-a")
    a = ShmBackend(
        StorageConfig(namespace=ns_a), root=shm_dir, max_size=64 * page,
        namespace_max_size=4 * page,
    )  # fmt: skip
    for i in range(12):
        assert a.set(f"k{i}", value_of(100 + i))
        assert a.usage()["namespace_used_bytes"] <= 4 * page
    kept = [i for i in range(12) if a.exists(f"k{i}")]
    assert 2 <= len(kept) <= 4 and kept == list(range(12 - len(kept), 12))
    assert all(torch.equal(a.get(f"k{i}"), value_of(100 + i)) for i in kept)
    assert all(torch.equal(b.get(f"k{i}"), value_of(i)) for i in range(6))
    ua, ub = a.usage(), b.usage()
    assert ua["namespace_limit_bytes"] == 4 * page and ub["namespace_limit_bytes"] == 0
    assert ua["namespace_objects"] == len(kept)
    assert ua["used_bytes"] == (len(kept) + 6) * page  # the root's
    assert ua["limit_bytes"] == 64 * page
    assert a.get_stats().evictions == 12 - len(kept)
    a.close()
    b.close()
