"""The object layout of the file-like stores (``file``, ``shm``, ``nixl``): ``payload ||
header``, the header a trailer; objects of earlier releases (``header || payload``) are
still read, byte-exact, and damage to either layout reads as a miss."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend, NixlBackend, ShmBackend
from hicache_storage.storekit.atomic import write_atomic
from hicache_storage.storekit.filestore import FileTreeStore
from hicache_storage.storekit.header import (
    FLAG_TRAILER,
    HEADER_SIZE,
    checksum,
    decode_header,
    encode_header,
)

KINDS = ["file", "shm", "nixl"]


@pytest.fixture
def make(tmp_path: Path, shm_dir: str) -> Iterator[Callable[[str], FileTreeStore[Any]]]:
    made: list[FileTreeStore[Any]] = []

    def build(kind: str, **options: Any) -> FileTreeStore[Any]:
        b: FileTreeStore[Any]
        if kind == "file":
            b = FileBackend(StorageConfig(), root=str(tmp_path / "file"), **options)
        elif kind == "nixl":
            b = NixlBackend(StorageConfig(), root=str(tmp_path / "nixl"), **options)
        else:
            b = ShmBackend(StorageConfig(), directory=shm_dir, **options)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


def page(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("kind", KINDS)
def test_the_payload_comes_first_and_the_header_is_a_trailer(
    make: Callable[..., FileTreeStore[Any]], kind: str
) -> None:
    b = make(kind)
    v = page(3 * 4096 + 5, 1)
    assert b.set("k", v) is True
    raw = Path(b._path(b.object_name("k"))).read_bytes()
    assert len(raw) == v.numel() + HEADER_SIZE
    assert raw[: v.numel()] == bytes(v.numpy())  # at offset 0: aligned as the page is
    header = decode_header(raw[-HEADER_SIZE:], b.object_name("k").path, trailer=True)
    assert header.payload_len == v.numel()
    assert raw[-HEADER_SIZE + 6] & FLAG_TRAILER


def plant_legacy(b: FileTreeStore[Any], key: str, value: torch.Tensor) -> str:
    """Store ``value`` as an earlier release did: header first, then the payload."""
    name = b.object_name(key)
    view = value.numpy().data
    head = encode_header(value.numel(), checksum([view], 1), 1, name.path)
    path = b._path(name)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    assert write_atomic(path, [head, view])
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_objects_of_earlier_releases_read_byte_exact(
    make: Callable[..., FileTreeStore[Any]], kind: str
) -> None:
    b = make(kind)
    vals = [page(70000, s) for s in range(3)]
    for i, v in enumerate(vals):
        plant_legacy(b, f"old{i}", v)
    assert b.set("new", vals[0]) is True  # the two layouts side by side
    assert b.batch_exists(["old0", "old1", "old2", "new"]) == 4
    got = b.batch_get(["old0", "new", "old1", "old2"])
    assert [torch.equal(g, v) for g, v in zip(got, [vals[0], vals[0], *vals[1:]], strict=True)] == [
        True
    ] * 4
    target = torch.zeros(70000, dtype=torch.uint8)
    assert b.get("old1", target) is target and torch.equal(target, vals[1])
    assert b.get_stats().corrupt_objects == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["header", "payload"])
def test_damage_to_an_object_of_an_earlier_release_is_a_miss(
    make: Callable[..., FileTreeStore[Any]], kind: str, where: str
) -> None:
    b = make(kind, checksum="xxh3") if kind == "shm" else make(kind)
    v = page(20000, 7)
    path = plant_legacy(b, "old", v)
    offset = 9 if where == "header" else HEADER_SIZE + 1234
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x21]))
    assert b.get("old", torch.zeros(20000, dtype=torch.uint8)) is None
    assert not os.path.exists(path)  # removed, so a set can store a good page
    assert b.set("old", v) is True
    assert torch.equal(b.get("old"), v)


def test_a_header_in_the_wrong_place_is_damage() -> None:
    head = encode_header(10, 0, 0, "ns/ab/k", trailer=True)
    assert decode_header(head, "ns/ab/k", trailer=True).payload_len == 10
    with pytest.raises(Exception, match="other side"):
        decode_header(head, "ns/ab/k", trailer=False)
    first = encode_header(10, 0, 0, "ns/ab/k")
    with pytest.raises(Exception, match="other side"):
        decode_header(first, "ns/ab/k", trailer=True)
