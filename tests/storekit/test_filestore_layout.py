"""The object layout of the file-like stores (``file``, ``shm``, ``nixl``): ``payload ||
header``, the header a trailer. An object with its header first (development builds
wrote them; no release did) is damage: a miss, removed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend, NixlBackend, ShmBackend
from hicache_storage.buffers import PageBuffer, Segment, memoryview_at
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
            b = ShmBackend(StorageConfig(), root=shm_dir, **options)
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


def plant_header_first(b: FileTreeStore[Any], key: str, value: torch.Tensor) -> str:
    """Store ``value`` as development builds did: header first, then the payload."""
    name = b.object_name(key)
    view = value.numpy().data
    head = encode_header(value.numel(), checksum([view], 1), 1, name.path)
    path = b._path(name)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    assert write_atomic(path, [head, view])
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_an_object_with_its_header_first_is_a_miss_and_removed(
    make: Callable[..., FileTreeStore[Any]], kind: str
) -> None:
    b = make(kind)
    v = page(70000, 3)
    path = plant_header_first(b, "old", v)
    target = torch.zeros(70000, dtype=torch.uint8)
    assert b.get("old", target) is None
    assert b.get_stats().corrupt_objects == 1
    assert not os.path.exists(path)  # removed, so a set can store a good page
    # the page path too (nixl moves pages by its own transfer)
    plant_header_first(b, "old2", v)
    out = torch.zeros(70000, dtype=torch.uint8)
    buf = PageBuffer(
        [Segment(int(out.data_ptr()), 70000, memoryview_at(int(out.data_ptr()), 70000, out))]
    )
    assert b.batch_get_pages(["old2"], [buf]) == [False]
    assert b.get_stats().corrupt_objects == 1  # (the stats since the last get_stats)
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
