"""The ``shm`` backend: pages in /dev/shm shared by processes, bounded, private by default."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HiCacheStorage, StorageConfig, page_hashes
from hicache_storage.backends import ShmBackend
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import ConfigError

from .conftest import broken_directory, make_pool, pool_namespace, tree_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory in the real /dev/shm, removed afterwards."""
    d = f"/dev/shm/hicache-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


class TestShmConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, shm_dir: str) -> BackendSpec:
        return BackendSpec("shm", {"directory": shm_dir})

    @pytest.fixture
    def break_store(self) -> Callable[[HiCacheStorage], Any]:
        return broken_directory


def test_defaults_live_in_dev_shm_with_bounded_capacity() -> None:
    b = ShmBackend(StorageConfig())
    try:
        assert b.root == "/dev/shm/hicache-storage"
        st = os.statvfs("/dev/shm")
        total = st.f_blocks * st.f_frsize
        assert b._tracker.max_bytes == total // 2
        assert b._tracker.min_free_bytes == total // 10
        assert b.options.checksum == "none"
    finally:
        b.clear()
        b.close()


def test_it_never_fills_the_tmpfs(small_tmpfs: str) -> None:
    b = ShmBackend(StorageConfig(), directory=small_tmpfs + "/kv")  # defaults: half, a tenth free
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
    b = ShmBackend(StorageConfig(), directory=shm_dir)
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
    b = ShmBackend(StorageConfig(), directory=shm_dir, group=str(gid))
    assert b.set("k", b"shared page")
    (path,) = tree_files(b.directory)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_gid == gid
    fan = os.path.dirname(path)
    d = os.stat(fan)
    assert stat.S_IMODE(d.st_mode) == 0o2770
    assert d.st_gid == gid
    os.chmod(shm_dir, 0o755)  # the root directory is this test's; let others traverse it
    member = as_nobody(["cat", path], [gid])
    assert member.returncode == 0, member.stderr
    assert member.stdout.endswith(b"shared page")  # 32-byte header, then the page
    assert as_nobody(["touch", os.path.join(fan, "probe")], [gid]).returncode == 0  # may write too
    outsider = as_nobody(["cat", path], [])
    assert outsider.returncode != 0
    assert b"Permission denied" in outsider.stderr
    private = ShmBackend(StorageConfig(), directory=shm_dir + "-private")
    private.set("k", b"secret")
    (secret,) = tree_files(private.directory)
    os.chmod(shm_dir + "-private", 0o755)
    assert as_nobody(["cat", secret], [gid]).returncode != 0  # default: owner only
    private.clear()
    private.close()
    shutil.rmtree(shm_dir + "-private", ignore_errors=True)
    b.close()


def test_unknown_group_is_a_config_error(shm_dir: str) -> None:
    with pytest.raises(ConfigError, match="unknown group"):
        ShmBackend(StorageConfig(), directory=shm_dir, group="no-such-group-xyz")


WRITER = textwrap.dedent("""
    import sys, torch
    from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig, page_hashes
    from hicache_storage.backends import ShmBackend
    pool = HostKVPool(num_pages=4, page_size=4, layer_num=3, kv_heads=2, head_dim=8,
                      dtype=torch.bfloat16, layout="page_first")
    pool.kv_buffer.view(-1).view(torch.uint8).fill_(7)
    ns = KVCacheNamespace(model_id="test-model", dtype="bfloat16", page_size=4, object_layout="page_first")
    b = ShmBackend(StorageConfig(namespace=ns), directory=sys.argv[1])
    b.register_mem_pool_host(pool)
    print(b.batch_set_v1(page_hashes(list(range(16)), 4), torch.arange(16)))
""")


def test_another_process_reads_what_one_wrote(shm_dir: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", WRITER, shm_dir], capture_output=True, text=True, check=True
    )
    assert r.stdout.strip() == "[True, True, True, True]"
    pool = make_pool(num_pages=8)
    pool.kv_buffer.zero_()
    b = ShmBackend(StorageConfig(namespace=pool_namespace(pool)), directory=shm_dir)
    b.register_mem_pool_host(pool)
    keys = page_hashes(list(range(16)), 4)
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, torch.arange(16, 32)) == [True] * 4
    for page in pool.page_buffers(torch.arange(16, 32)):
        assert page.tobytes() == b"\x07" * pool.page_bytes
    b.close()
