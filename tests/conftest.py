"""Shared fixtures: host pools, namespaces, file-backend roots, a small real tmpfs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hicache_storage import HiCacheStorage, HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend


def make_pool(
    layout: str = "page_first", mla: bool = False, num_pages: int = 16, page_size: int = 4
) -> HostKVPool:
    """A small pool filled with random bytes."""
    pool = HostKVPool(
        num_pages=num_pages,
        page_size=page_size,
        layer_num=3,
        kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        layout=layout,
        mla=mla,
    )
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    return pool


def pool_namespace(
    pool: HostKVPool, model_id: str = "test-model", **extra: object
) -> KVCacheNamespace:
    """The namespace that matches ``pool``."""
    return KVCacheNamespace(
        model_id=model_id,
        dtype=str(pool.dtype),
        page_size=pool.page_size,
        object_layout=pool.layout,
        rank_replicated=pool.mla,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A fresh directory for a file backend."""
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


@pytest.fixture
def file_backend(root: str) -> Iterator[FileBackend]:
    """A file backend in the default namespace."""
    b = FileBackend(StorageConfig(), root=root)
    yield b
    b.close()


@pytest.fixture
def make_file_backend(root: str) -> Iterator[Callable[..., FileBackend]]:
    """Factory of file backends on the shared ``root``; closes them all at the end."""
    made: list[FileBackend] = []

    def make(namespace: KVCacheNamespace | None = None, **options: object) -> FileBackend:
        options.setdefault("root", root)
        cfg = StorageConfig(namespace=namespace) if namespace is not None else StorageConfig()
        b = FileBackend(cfg, **options)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A real 2 MiB tmpfs mounted for the test (needs root, as CI has): a disk that fills."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], check=True
    )
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def tree_files(path: str) -> list[str]:
    """Every regular file under ``path``."""
    out = []
    for dirpath, _dirs, files in os.walk(path):
        out.extend(os.path.join(dirpath, f) for f in files)
    return out


@contextlib.contextmanager
def broken_directory(backend: HiCacheStorage) -> Iterator[None]:
    """A real fault: the namespace directory is replaced by a regular file, so every open,
    stat and write below it fails with ENOTDIR; then it is put back."""
    directory = backend.directory  # type: ignore[attr-defined]
    aside = directory + ".aside"
    os.rename(directory, aside)
    Path(directory).write_bytes(b"not a directory")
    try:
        yield
    finally:
        os.unlink(directory)
        os.rename(aside, directory)


@pytest.fixture
def make_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Mount real tmpfs filesystems of a given size (``"8m"``) for the test (needs root)."""
    mounted: list[str] = []

    def mount(size: str) -> str:
        mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
            check=True,
        )
        mounted.append(str(mnt))
        return str(mnt)

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", mnt], check=False)


@pytest.fixture
def shared_dirs() -> Iterator[dict[str, str]]:
    """Fresh world-writable sticky directories (as ``/tmp`` itself) directly under ``/tmp``
    and ``/dev/shm``, keyed by backend name, that other uids can reach; removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    dirs = {"file": f"/tmp/hicache-shared-{tag}", "shm": f"/dev/shm/hicache-shared-{tag}"}
    for d in dirs.values():
        os.mkdir(d)
        os.chmod(d, 0o1777)
    yield dirs
    for d in dirs.values():
        subprocess.run(["rm", "-rf", d], check=False)
