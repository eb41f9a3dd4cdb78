"""What each backend detects under its default options: the table in docs/concepts.md.

Each row is damage done to a stored page on disk (or in tmpfs / the arena), then a read
through the backend with default integrity options. "miss" rows must read as a miss;
"served" rows document damage a backend does not detect (with ``checksum="none"``, the
explicit opt-out), so the docs say so honestly: if a default changes, this test and the
table change together.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import pytest

from hicache_storage import StorageConfig, backends
from hicache_storage.backends import FileBackend, MmapBackend, NixlBackend, ShmBackend
from hicache_storage.storekit.header import HEADER_SIZE

PAGE = bytes(range(256)) * 64  # 16 KiB


@pytest.mark.parametrize(
    "name", ["File", "Shm", "Mmap", "Memory", "Redis", "S3", "Mooncake", "Nixl"]
)
def test_every_backend_verifies_payloads_by_default(name: str) -> None:
    """Each built-in backend's defaults write an xxh3 checksum and verify it on read."""
    defaults = {f.name: f.default for f in dataclasses.fields(getattr(backends, name + "Options"))}
    assert defaults["checksum"] == "xxh3"
    assert defaults["verify_checksum"] in (True, None)  # None (mmap): as checksum says


def only_file(root: str) -> str:
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".")]
    assert len(files) == 1, files
    return files[0]


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# damage -> expected outcome with default options
FILE_LIKE = {
    "payload-bit-flip": {"file": "miss", "shm": "miss", "nixl": "miss"},
    "header-bit-flip": {"file": "miss", "shm": "miss", "nixl": "miss"},
    "truncated": {"file": "miss", "shm": "miss", "nixl": "miss"},
    "extended": {"file": "miss", "shm": "miss", "nixl": "miss"},
}


@pytest.mark.parametrize("damage", sorted(FILE_LIKE))
@pytest.mark.parametrize("kind", ["file", "shm", "nixl"])
def test_file_like_defaults(kind: str, damage: str, tmp_path: Path, shm_dir: str) -> None:
    b: FileBackend | ShmBackend | NixlBackend
    if kind == "file":
        b = FileBackend(StorageConfig(), root=str(tmp_path / "r"))
    elif kind == "nixl":
        b = NixlBackend(StorageConfig(), root=str(tmp_path / "r"))
    else:
        b = ShmBackend(StorageConfig(), root=shm_dir)
    try:
        assert b.set("k", PAGE)
        path = only_file(b.directory)
        size = os.path.getsize(path)
        assert size == len(PAGE) + HEADER_SIZE
        if damage == "payload-bit-flip":
            flip(path, 1000)
        elif damage == "header-bit-flip":  # the header is a trailer: payload_len
            flip(path, size - HEADER_SIZE + 9)
        elif damage == "truncated":
            os.truncate(path, os.path.getsize(path) - 100)
        else:
            with open(path, "ab") as f:
                f.write(b"x" * 100)
        got = b.get("k")
        expected = FILE_LIKE[damage][kind]
        if expected == "miss":
            assert got is None, f"{kind}: {damage} served as a hit"
        else:
            assert got is not None and bytes(got.numpy()) != PAGE  # documented as undetected
    finally:
        b.close()


MMAP = {
    "payload-bit-flip": {"default": "miss", "none": "served"},
    "slot-row-damage": {"default": "miss", "none": "miss"},
    "log-record-damage": {"default": "miss", "none": "miss"},
}


@pytest.mark.parametrize("damage", sorted(MMAP))
@pytest.mark.parametrize("opts", ["default", "none"])
def test_mmap_defaults(opts: str, damage: str, tmp_path: Path) -> None:
    path = str(tmp_path / "arena")
    extra = {"checksum": "none"} if opts == "none" else {}
    b = MmapBackend(StorageConfig(), path=path, max_size="1MiB", slot_size="64KiB", **extra)
    assert b.set("k", PAGE)
    b.close()
    head = Path(path).read_bytes()[:4096]
    table_off, data_off = struct.unpack_from("<QQ", head, 32)
    if damage == "payload-bit-flip":
        flip(path, data_off + 1000)  # slot 0
    elif damage == "slot-row-damage":
        flip(path, table_off)  # slot 0's generation
    else:
        index = path + ".index"
        raw = Path(index).read_bytes()
        flip(index, raw.index(b"/k") + 1)  # the record's name
    again = MmapBackend(StorageConfig(), path=path, **extra)
    try:
        got = again.get("k")
        expected = MMAP[damage][opts]
        if expected == "miss":
            assert got is None or bytes(got.numpy()) == PAGE, f"mmap: {damage} served wrong bytes"
            if damage != "slot-row-damage":
                assert got is None
        else:
            assert got is not None and bytes(got.numpy()) != PAGE
    finally:
        again.close()
