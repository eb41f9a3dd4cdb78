"""A paged engine's KV as whole-block pages (hicache_storage.integrations.kvblocks).

No engine here: the layers are torch tensors shaped the way vLLM 0.32 hands them to a
connector (``[blocks, heads, block_size, 2 * head_dim]`` per layer, in several memory
layouts), and the pages move through the real ``file`` backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_storage.config import StorageConfig
from hicache_storage.errors import ConfigError, HostIndicesError
from hicache_storage.integrations.kvblocks import (
    KVBlockMover,
    PagedKVBlocks,
    StagedKVBlocks,
    block_slots,
    kv_blocks,
)
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.registry import create_backend

NB, H, BS, C, L = 12, 2, 32, 64, 3  # blocks, heads, block size, 2 * head_dim, layers


def _layers(kind: str, seed: int = 0) -> list[torch.Tensor]:
    """``L`` layers of random bf16 KV in memory layout ``kind``, as [NB, H, BS, C] views."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    if kind == "layer_outer":  # vLLM's CPU layout (LBHNC): one allocation, layer outermost
        big = rand(L, NB, H, BS, C)
        return [big[i] for i in range(L)]
    if kind == "block_outer":  # block outermost (BLHNC): a block of every layer is one run
        big = rand(NB, L, H, BS, C)
        return [big[:, i] for i in range(L)]
    if kind == "head_outer":  # heads outside blocks (LHBNC): a block is H runs
        return [rand(H, NB, BS, C).permute(1, 0, 2, 3) for _ in range(L)]
    raise AssertionError(kind)


def _page_bytes(layers: list[torch.Tensor], b: int) -> bytes:
    """The page of block ``b``: each layer's block, in logical order, layer after layer."""
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in layers)


def _backend(root: Path, page_size: int = BS) -> HiCacheStorage:
    ns = KVCacheNamespace(model_id="tiny", dtype="bfloat16", page_size=page_size,
                          object_layout="vllm-test")  # fmt: skip
    return create_backend("file", StorageConfig(namespace=ns), root=str(root))


@pytest.mark.parametrize("kind", ["layer_outer", "block_outer"])
def test_direct_pages_are_views_of_the_engine_blocks(kind: str) -> None:
    layers = _layers(kind)
    pool = kv_blocks(layers, BS)
    assert isinstance(pool, PagedKVBlocks)
    assert pool.page_bytes == L * H * BS * C * 2 and pool.page_size == BS
    assert len(pool.kv_buffer) == 1  # one allocation, registered once
    pages = pool.page_buffers(block_slots([3, 0, 11], BS), expected_pages=3)
    for b, page in zip([3, 0, 11], pages, strict=True):
        assert page.tobytes() == _page_bytes(layers, b)
    # Block-outermost: a block of every layer is one run, so one segment.
    assert len(pages[0].segments) == (1 if kind == "block_outer" else L)
    # Writes through the page land in the engine's tensor (no copy in between).
    pages[0].views[0][:4] = b"\x01\x02\x03\x04"
    assert layers[0][3].contiguous().view(torch.uint8).reshape(-1)[:4].tolist() == [1, 2, 3, 4]


def test_non_contiguous_blocks_go_through_staging() -> None:
    layers = _layers("head_outer")
    with pytest.raises(ConfigError, match="contiguous"):
        PagedKVBlocks(layers, BS)
    with pytest.raises(ConfigError, match="contiguous"):
        kv_blocks(layers, BS, staged=False)
    pool = kv_blocks(layers, BS, staging_rows=4)
    assert isinstance(pool, StagedKVBlocks) and pool.rows == 4
    pool.gather([5, 2])
    rows = pool.page_buffers(block_slots([0, 1], BS))
    assert rows[0].tobytes() == _page_bytes(layers, 5)
    assert rows[1].tobytes() == _page_bytes(layers, 2)


@pytest.mark.parametrize(
    ("kind", "staged"),
    [("layer_outer", False), ("layer_outer", True), ("block_outer", False),
     ("block_outer", True), ("head_outer", True)],
)  # fmt: skip
def test_blocks_round_trip_through_a_backend(kind: str, staged: bool, tmp_path: Path) -> None:
    src = _layers(kind, seed=1)
    backend = _backend(tmp_path)
    mover = KVBlockMover.attach(backend, kv_blocks(src, BS, staging_rows=2, staged=staged))
    keys = [f"{i:064x}" for i in range(1, 6)]
    assert mover.save(keys, [4, 0, 9, 7, 1]) == [True] * 5  # 5 blocks, 2 staging rows
    want = {k: _page_bytes(src, b) for k, b in zip(keys, [4, 0, 9, 7, 1], strict=True)}

    dst = [torch.zeros_like(t) for t in src]
    mover2 = KVBlockMover.attach(_backend(tmp_path), kv_blocks(dst, BS, 2, staged=staged))
    assert mover2.load(keys, [11, 3, 2, 6, 8]) == [True] * 5
    for k, b in zip(keys, [11, 3, 2, 6, 8], strict=True):
        assert _page_bytes(dst, b) == want[k]
    untouched = [0, 1, 4, 5, 7, 9, 10]
    assert all(not bool(t[untouched].any()) for t in dst)


def test_staged_and_direct_pages_are_the_same_bytes(tmp_path: Path) -> None:
    """A block stored through staging reads back through the direct pool, and back."""
    staged_layers = _layers("head_outer", seed=2)
    direct_layers = [t.contiguous() for t in staged_layers]  # same KV, contiguous blocks
    staged = KVBlockMover.attach(_backend(tmp_path), kv_blocks(staged_layers, BS, 3))
    direct = KVBlockMover.attach(_backend(tmp_path), kv_blocks(direct_layers, BS))
    assert staged.save(["a" * 64], [6]) == [True]
    assert direct.save(["b" * 64], [8]) == [True]
    for t in direct_layers:
        t.zero_()
    for t in staged_layers:
        t.zero_()
    assert direct.load(["a" * 64], [1]) == [True]
    assert staged.load(["b" * 64], [2]) == [True]
    fresh = _layers("head_outer", seed=2)
    assert _page_bytes(direct_layers, 1) == _page_bytes(fresh, 6)
    assert _page_bytes(staged_layers, 2) == _page_bytes(fresh, 8)


@pytest.mark.parametrize("staged", [False, True])
def test_missing_pages_fail_and_leave_their_blocks_alone(staged: bool, tmp_path: Path) -> None:
    src = _layers("layer_outer", seed=3)
    mover = KVBlockMover.attach(_backend(tmp_path), kv_blocks(src, BS, 4, staged=staged))
    assert mover.save(["c" * 64], [0]) == [True]
    before = [t.clone() for t in src]
    assert mover.load(["d" * 64, "c" * 64, "e" * 64], [5, 6, 7]) == [False, True, False]
    for t, old in zip(src, before, strict=True):
        assert torch.equal(t[6], old[0])
        if staged:  # a failed page is never copied into its block
            assert torch.equal(t[5], old[5]) and torch.equal(t[7], old[7])


@pytest.mark.parametrize("staged", [False, True])
def test_bad_block_numbers_fail_every_page(staged: bool, tmp_path: Path) -> None:
    src = _layers("layer_outer")
    mover = KVBlockMover.attach(_backend(tmp_path), kv_blocks(src, BS, 4, staged=staged))
    assert mover.save(["f" * 64, "0" * 64], [1, NB]) == [False, False]  # NB is out of range
    assert mover.save(["f" * 64], [-1]) == [False]
    with pytest.raises(HostIndicesError, match="2 keys for 1 blocks"):
        mover.save(["f" * 64, "0" * 64], [1])
    assert mover.save([], []) == []


def test_pool_checks_slots() -> None:
    pool = PagedKVBlocks(_layers("layer_outer"), BS)
    with pytest.raises(HostIndicesError, match="whole blocks"):
        pool.page_buffers(torch.arange(1, BS + 1))  # not block aligned
    with pytest.raises(HostIndicesError, match="not 2"):
        pool.page_buffers(block_slots([1], BS), expected_pages=2)
    with pytest.raises(HostIndicesError, match="outside"):
        pool.page_buffers(block_slots([NB], BS))
    with pytest.raises(HostIndicesError):
        pool.page_buffers(torch.arange(0, BS - 1))
    assert pool.page_buffers([]) == []


def test_layers_must_agree() -> None:
    a, b = _layers("layer_outer")[:2]
    with pytest.raises(ConfigError, match="differ"):
        kv_blocks([a, b[:-1]], BS)
    with pytest.raises(ConfigError, match="differ"):
        kv_blocks([a, b.float()], BS)
    with pytest.raises(ConfigError, match="no layers"):
        kv_blocks([], BS)
    with pytest.raises(ConfigError, match="block_size"):
        PagedKVBlocks([a], 0)
    with pytest.raises(ConfigError, match="rows"):
        StagedKVBlocks([a], BS, rows=0)


@pytest.mark.parametrize(("heads", "width"), [(2, 64), (8, 128)])  # 8 KiB, 64 KiB a layer
def test_staged_copies_of_runs_and_scattered_blocks_land_in_place(
    heads: int, width: int, tmp_path: Path
) -> None:
    """Blocks in runs and scattered ones, in one chunk: small layer blocks are copied
    with one indexed copy per layer, large ones one copy per run; both land in place."""
    from hicache_storage.integrations.kvblocks import _by_index, _runs

    g = torch.Generator().manual_seed(7)
    src = [torch.randn(NB, heads, BS, width, generator=g).to(torch.bfloat16) for _ in range(L)]
    dst = [torch.zeros_like(t) for t in src]
    ns = KVCacheNamespace(model_id="tiny", dtype="bfloat16", page_size=BS,
                          object_layout=f"vllm-test-{heads}x{width}")  # fmt: skip

    def mover(layers: list[torch.Tensor]) -> KVBlockMover:
        backend = create_backend("file", StorageConfig(namespace=ns), root=str(tmp_path))
        return KVBlockMover.attach(backend, kv_blocks(layers, BS, 6, staged=True))

    saved, loaded = [3, 4, 5, 9, 1, 0], [7, 8, 2, 11, 10, 6]
    assert _by_index(src[0], _runs(saved, range(6))) is (heads * width * BS * 2 < 64 << 10)
    keys = [f"{i:064x}" for i in range(40, 46)]
    assert mover(src).save(keys, saved) == [True] * 6
    assert mover(dst).load(keys, loaded) == [True] * 6
    for s, d in zip(saved, loaded, strict=True):
        assert _page_bytes(dst, d) == _page_bytes(src, s)
    untouched = [b for b in range(NB) if b not in loaded]
    assert all(not bool(t[untouched].any()) for t in dst)
    # A missing page in the middle: its row is skipped while the blocks around it run on.
    again = [torch.zeros_like(t) for t in src]
    gap = [*keys[:2], "e" * 64, *keys[3:]]
    assert mover(again).load(gap, [2, 3, 9, 4, 5, 6]) == [True, True, False, True, True, True]
    for k, d in zip([0, 1, 3, 4, 5], [2, 3, 4, 5, 6], strict=True):
        assert _page_bytes(again, d) == _page_bytes(src, saved[k])
    assert all(not bool(t[9].any()) for t in again)
