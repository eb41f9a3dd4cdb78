"""HostKVPool: shapes, page buffers and pointer metadata per layout, the allocator."""

from __future__ import annotations

import pytest
import torch

from hicache_storage import HostKVPool
from hicache_storage.conformance.data import make_pool
from hicache_storage.errors import ConfigError, HostIndicesError, InvalidTypeError
from hicache_storage.layouts import POOL_KIND_IDS, POOL_KINDS

L, H, D, PS, P = 3, 2, 16, 4, 16  # the kit's pool shape (conformance.data.POOL_SHAPE)
ITEM = 2  # bfloat16


def expected_segments(layout: str, mla: bool) -> int:
    if layout == "layer_first":
        return L if mla else 2 * L
    return 1 if mla else 2


@pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
def test_shapes_and_segments(layout: str, mla: bool) -> None:
    pool = make_pool(layout, mla, num_pages=P, page_size=PS)
    heads = 1 if mla else H
    shapes = {
        ("layer_first", False): (2, L, P * PS, H, D),
        ("page_first", False): (2, P * PS, L, H, D),
        ("page_first_direct", False): (2, P, L, PS, H, D),
        ("page_head", False): (2, P, H, PS, L, D),
        ("layer_first", True): (L, P * PS, 1, D),
        ("page_first", True): (P * PS, L, 1, D),
        ("page_first_direct", True): (P, L, PS, 1, D),
    }
    assert tuple(pool.kv_buffer.shape) == shapes[(layout, mla)]
    halves = 1 if mla else 2
    assert pool.page_bytes == halves * L * PS * heads * D * ITEM
    assert pool.segments_per_page == expected_segments(layout, mla)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * PS, 4 * PS))
    assert len(ptrs) == len(sizes) == 2 * expected_segments(layout, mla)
    assert sum(sizes) == 2 * pool.page_bytes


@pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
def test_page_buffers_cover_exactly_the_tokens_of_the_page(layout: str, mla: bool) -> None:
    """Each page's segments hold exactly that page's elements, found by independent indexing."""
    pool = make_pool(layout, mla, num_pages=P, page_size=PS)
    kv = pool.kv_buffer
    page = 5
    tok = slice(page * PS, (page + 1) * PS)
    if mla:
        pieces = {
            "layer_first": lambda: [kv[layer, tok] for layer in range(L)],
            "page_first": lambda: [kv[tok]],
            "page_first_direct": lambda: [kv[page]],
        }[layout]()
    else:
        pieces = {
            "layer_first": lambda: [kv[h, layer, tok] for h in range(2) for layer in range(L)],
            "page_first": lambda: [kv[h, tok] for h in range(2)],
            "page_first_direct": lambda: [kv[h, page] for h in range(2)],
            "page_head": lambda: [kv[h, page] for h in range(2)],
        }[layout]()
    expected = b"".join(p.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for p in pieces)
    (buf,) = pool.page_buffers(torch.arange(page * PS, (page + 1) * PS))
    assert buf.tobytes() == expected
    assert [s.ptr for s in buf.segments] == [p.data_ptr() for p in pieces]
    # Writing through a segment's memoryview changes the pool (no copy).
    buf.segments[0].memoryview[0] ^= 0xFF
    assert buf.tobytes() != expected


def test_alloc_free_and_double_free() -> None:
    pool = make_pool(num_pages=4, page_size=PS)
    a = pool.alloc(2 * PS)
    assert a is not None
    assert a.tolist() == list(range(2 * PS))
    b = pool.alloc(2 * PS)
    assert b is not None
    assert pool.alloc(PS) is None
    assert pool.available_size() == 0
    assert pool.free(a) == 2 * PS
    with pytest.raises(HostIndicesError, match="double free"):
        pool.free(a)
    assert pool.available_size() == 2 * PS
    c = pool.alloc(2 * PS)  # deferred merge brings the freed pages back
    assert c is not None
    assert sorted(c.tolist()) == sorted(a.tolist())
    with pytest.raises(HostIndicesError):
        pool.alloc(3)  # not a multiple of page_size


def test_double_allocation_is_detected() -> None:
    pool = make_pool(num_pages=4, page_size=PS)
    pool._free.append(0)  # corrupt the free list: page 0 listed twice
    first = pool.alloc(PS)
    assert first is not None
    assert first[0].item() == 0
    with pytest.raises(HostIndicesError, match="double allocation"):
        pool.alloc(PS)


@pytest.mark.parametrize(
    "indices",
    [
        list(range(1, PS + 1)),  # does not start on a page boundary
        [0, 1, 3, 2],  # not consecutive
        list(range(PS + 1)),  # not a multiple of page_size
        [P * PS, P * PS + 1, P * PS + 2, P * PS + 3],  # out of range
    ],
)
def test_misaligned_indices_raise(indices: list[int]) -> None:
    pool = make_pool(num_pages=P, page_size=PS)
    with pytest.raises(HostIndicesError):
        pool.page_buffers(indices)


def test_wrong_index_types_raise() -> None:
    pool = make_pool(num_pages=P, page_size=PS)
    with pytest.raises(InvalidTypeError):
        pool.page_buffers(torch.zeros(PS, dtype=torch.float32))
    with pytest.raises(InvalidTypeError):
        pool.page_buffers(["a", "b", "c", "d"])  # type: ignore[list-item]
    with pytest.raises(HostIndicesError, match="expected"):
        pool.page_buffers(torch.arange(PS), expected_pages=2)


def test_invalid_geometry_raises() -> None:
    with pytest.raises(ConfigError):
        HostKVPool(num_pages=0, page_size=4, layer_num=1, kv_heads=1, head_dim=1)
    with pytest.raises(ConfigError, match="choose one of"):
        HostKVPool(
            num_pages=1, page_size=4, layer_num=1, kv_heads=1, head_dim=1, layout="page_tail"
        )
    with pytest.raises(ConfigError, match="MLA pool has no 'page_head'"):
        HostKVPool(
            num_pages=1,
            page_size=4,
            layer_num=1,
            kv_heads=1,
            head_dim=1,
            layout="page_head",
            mla=True,
        )
