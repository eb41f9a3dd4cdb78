"""Fixtures of the backend tests: file backends, shm directories, mmap arenas, a small
real tmpfs, a real directory fault, directories other users can reach. Server fixtures (redis, moto) belong here too,
so the core tests never load them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, MmapBackend
from hicache_storage.storekit.filestore import FileTreeStore


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
def arena(tmp_path: Path) -> Iterator[Callable[..., MmapBackend]]:
    """Factory of mmap backends on one arena file in ``tmp_path``; closes them all."""
    made: list[MmapBackend] = []

    def make(config: StorageConfig | None = None, **options: object) -> MmapBackend:
        options.setdefault("path", str(tmp_path / "arena"))
        b = MmapBackend(config or StorageConfig(), **options)
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


@contextlib.contextmanager
def _broken_directory(backend: FileTreeStore) -> Iterator[None]:
    directory = backend.directory
    aside = directory + ".aside"
    os.rename(directory, aside)
    Path(directory).write_bytes(b"not a directory")
    try:
        yield
    finally:
        os.unlink(directory)
        os.rename(aside, directory)


@pytest.fixture
def broken_directory() -> Callable[[FileTreeStore], contextlib.AbstractContextManager[None]]:
    """A real fault for file-tree stores: ``with broken_directory(backend):`` replaces the
    namespace directory by a regular file, so every open, stat and write below it fails
    with ENOTDIR; on exit it is put back. Suits the kit's ``break_store`` fixture."""
    return _broken_directory


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
