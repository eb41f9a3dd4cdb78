"""The ``nixl`` backend: the real NIXL agent with its POSIX plugin, on real files.

NIXL needs no server; these tests load only the POSIX plugin (UCX crashes the interpreter
at exit on CPU hosts: the one test that names it runs in a child that leaves with
``os._exit``).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, NixlBackend
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.conformance.data import make_pool, pool_namespace, tree_files
from hicache_storage.errors import BackendClosedError, ConfigError
from hicache_storage.keys import page_hashes
from hicache_storage.layouts import LAYOUTS
from hicache_storage.storekit.header import HEADER_SIZE

NS = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4, tenant="nixl")


class TestNixlConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec("nixl", {"root": str(tmp_path / "store")})

    @pytest.fixture
    def break_store(self, broken_directory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return broken_directory


class TestNixlConformanceSmallBatches(TestNixlConformance):
    """Transfers of two pages, fsync, one I/O thread and a capacity limit."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        opts = {"root": str(tmp_path / "store"), "batch_pages": 2, "fsync": True,
                "max_concurrency": 1, "max_size": "1GiB"}  # fmt: skip
        return BackendSpec("nixl", opts)


@pytest.fixture
def make(root: str) -> Iterator[Callable[..., NixlBackend]]:
    made: list[NixlBackend] = []

    def build(namespace: KVCacheNamespace = NS, **options: Any) -> NixlBackend:
        options.setdefault("root", root)
        b = NixlBackend(StorageConfig(namespace=namespace), **options)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


class TransferSpy:
    """Counts the backend's NIXL transfers and their ranges (the real ones still run)."""

    def __init__(self, b: NixlBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (op, ranges, DRAM ranges registered)
        real, agent = b._transfer, b._agent()
        self.registered: list[str] = []
        real_register = agent.register_memory

        def register(reg_list: Any, mem_type: Any = None, backends: Any = ()) -> Any:
            self.registered.append(mem_type or "tensor")
            return real_register(reg_list, mem_type)

        def transfer(op: str, spans: Any, places: Any, files: Any) -> None:
            self.calls.append((op, len(places), len(b._unregistered(spans))))
            real(op, spans, places, files)

        monkeypatch.setattr(b, "_transfer", transfer)
        monkeypatch.setattr(agent, "register_memory", register)


def values(n: int, size: int = 5000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_pages_move_in_one_transfer_from_the_registered_pool(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    pool = make_pool(layout, num_pages=16)
    b = make(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    spy = TransferSpy(b, monkeypatch)
    ps = pool.page_size
    keys = page_hashes(list(range(6 * ps)), ps)
    src, dst = pool.alloc(6 * ps), pool.alloc(6 * ps)
    assert src is not None and dst is not None
    assert b.batch_set_v1(keys, src) == [True] * 6
    assert b.batch_get_v1(keys, dst) == [True] * 6
    assert [p.tobytes() for p in pool.page_buffers(src)] == [
        p.tobytes() for p in pool.page_buffers(dst)
    ]
    segments = len(pool.page_buffers(src)[0].segments)
    # One transfer each way, every segment of every page in it, all in registered memory:
    # the pool was registered once, nothing is registered per call but the files.
    assert spy.calls == [("WRITE", 6 * segments, 0), ("READ", 6 * segments, 0)]
    assert spy.registered == ["FILE", "FILE"]
    files = [p for p in tree_files(b.directory) if not os.path.basename(p).startswith(".")]
    assert len(files) == 6
    assert all(os.path.getsize(p) == HEADER_SIZE + pool.page_bytes for p in files)
    # Stored pages are not sent again.
    assert b.batch_set_v1(keys, src) == [True] * 6
    assert len(spy.calls) == 2


def test_big_batches_go_in_parts_and_a_duplicate_key_is_written_once(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make(batch_pages=3)
    spy = TransferSpy(b, monkeypatch)
    keys = [f"k{i}" for i in range(10)]
    vals = values(11)
    assert b.batch_set([*keys, "k0"], [*vals[:10], vals[10]]) == [True] * 11
    assert [c[:2] for c in spy.calls] == [("WRITE", 3)] * 3 + [("WRITE", 1)]
    got = b.batch_get([*keys, "absent"])
    assert got[-1] is None
    assert all(
        torch.equal(g, v) for g, v in zip(got[:10], vals[:10], strict=True)
    )  # k0: first value
    assert [c[:2] for c in spy.calls[4:]] == [("READ", 3)] * 3 + [("READ", 1)]
    # Tensors outside the host pool are registered for the call.
    assert all(c[2] == c[1] for c in spy.calls)


def test_the_files_are_the_file_backends(make: Callable[..., NixlBackend], root: str) -> None:
    b = make()
    f = FileBackend(StorageConfig(namespace=NS), root=root)
    try:
        vals = values(4, seed=1)
        assert b.batch_set(["a", "b"], vals[:2]) == [True, True]
        assert f.batch_set(["c", "d"], vals[2:]) == [True, True]
        for key, v in zip("abcd", vals, strict=True):
            got_f, got_b = f.get(key), b.get(key)
            assert torch.equal(got_f, v) and torch.equal(got_b, v)
    finally:
        f.close()


def test_reads_into_targets_and_size_mismatches(make: Callable[..., NixlBackend]) -> None:
    b = make()
    v = values(1, 70000)[0]
    assert b.set("k", v) is True
    t = torch.zeros(70000, dtype=torch.uint8)
    assert b.get("k", t) is t and torch.equal(t, v)
    buf = bytearray(70000)
    assert b.get("k", buf) is buf and bytes(buf) == bytes(v.numpy())
    small = torch.zeros(10, dtype=torch.uint8)
    assert b.get("k", small) is None and not small.any()
    assert b.get_stats().size_mismatches == 1
    assert b.set("empty", b"") is True and b.get("empty").numel() == 0
    assert b.set("bytes", b"\x01\x02\x03") is True
    assert bytes(b.get("bytes").numpy()) == b"\x01\x02\x03"


def _stored(b: NixlBackend) -> list[str]:
    return [p for p in tree_files(b.directory) if not os.path.basename(p).startswith(".")]


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_damaged_objects_read_as_misses_and_are_replaced(
    make: Callable[..., NixlBackend], damage: str
) -> None:
    b = make()
    vals = values(2, 8000, seed=2)
    assert b.batch_set(["a", "b"], vals) == [True, True]
    path_a, path_b = b._path(b.object_name("a")), b._path(b.object_name("b"))
    if damage == "flip":
        with open(path_a, "r+b") as f:
            f.seek(HEADER_SIZE + 4000)
            byte = f.read(1)
            f.seek(HEADER_SIZE + 4000)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate":
        os.truncate(path_a, HEADER_SIZE + 100)
    else:  # b's bytes under a's name: the header names b
        os.unlink(path_a)
        os.link(path_b, path_a)
    target = torch.zeros(8000, dtype=torch.uint8)
    assert b.batch_get(["a", "b"], [target, torch.zeros(8000, dtype=torch.uint8)])[0] is None
    if damage != "flip":  # the header is checked first: a foreign object is never moved in
        assert not target.any()
    assert b.get("a") is None
    assert b.get_stats().corrupt_objects >= 1 or damage == "truncate"
    assert not os.path.exists(path_a) or damage == "truncate"
    if damage == "truncate":  # a size mismatch for a target; corrupt for a new tensor
        assert b.get_stats(reset=False).corrupt_objects >= 0
    assert b.set("a", vals[0]) is True
    assert torch.equal(b.get("a"), vals[0])
    assert torch.equal(b.get("b"), vals[1])


def test_a_full_disk_fails_the_batch_and_leaves_no_object(small_tmpfs: str) -> None:
    """A real 2 MiB tmpfs: the NIXL write hits ENOSPC. Pages fail cleanly, nothing is
    published, no temporary stays, and the store works again once there is room."""
    b = NixlBackend(StorageConfig(namespace=NS), root=small_tmpfs)
    try:
        vals = values(6, 512 * 1024, seed=3)  # 3 MiB in all
        keys = [f"k{i}" for i in range(6)]
        done = b.batch_set(keys, vals)
        assert done == [False] * 6  # one transfer: its pages fail together
        assert b.get_stats().ops["batch_set"].errors == 6
        assert tree_files(b.directory) == []  # no object, no temporary
        assert b.batch_exists(keys) == 0 and b.batch_get(keys) == [None] * 6
        assert b.batch_set(keys[:2], vals[:2]) == [True, True]
        assert all(torch.equal(g, v) for g, v in zip(b.batch_get(keys[:2]), vals, strict=False))
    finally:
        b.close()


def test_concurrent_writers_and_readers_of_one_instance(make: Callable[..., NixlBackend]) -> None:
    b = make()
    vals = values(40, 20000, seed=4)
    errors: list[str] = []

    def writer(lo: int) -> None:
        keys = [f"k{i}" for i in range(lo, lo + 20)]
        if b.batch_set(keys, vals[lo : lo + 20]) != [True] * 20:
            errors.append(f"write {lo}")

    def reader() -> None:
        for _ in range(30):
            for i, got in enumerate(b.batch_get([f"k{i}" for i in range(40)])):
                if got is not None and not torch.equal(got, vals[i]):
                    errors.append(f"wrong bytes for k{i}")

    threads = [threading.Thread(target=writer, args=(lo,)) for lo in (0, 20)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = b.batch_get([f"k{i}" for i in range(40)])
    assert all(torch.equal(g, v) for g, v in zip(got, vals, strict=True))


def _child_round_trip(b: NixlBackend, pool: Any, q: Any) -> None:
    vals = values(3, 9000, seed=5)
    ok = b.batch_set(["c0", "c1", "c2"], vals) == [True] * 3
    got = b.batch_get(["p0", "c0", "c1", "c2"])
    ok = (
        ok
        and got[0] is not None
        and all(torch.equal(g, v) for g, v in zip(got[1:], vals, strict=True))
    )
    # v1 pages from the pool: the child's agent must have the pool registered too.
    ps = pool.page_size
    keys = page_hashes(list(range(2 * ps)), ps)
    src, dst = torch.arange(0, 2 * ps), torch.arange(2 * ps, 4 * ps)
    ok = (
        ok
        and b.batch_set_v1(keys, src) == [True, True]
        and b.batch_get_v1(keys, dst) == [True, True]
    )
    same = [p.tobytes() for p in pool.page_buffers(src)] == [
        p.tobytes() for p in pool.page_buffers(dst)
    ]
    q.put(ok and same)


def test_a_forked_child_gets_an_agent_of_its_own(make: Callable[..., NixlBackend]) -> None:
    pool = make_pool(num_pages=4)
    b = make(pool_namespace(pool))
    b.register_mem_pool_host(pool)  # registered again in the child's agent
    assert b.set("p0", values(1)[0]) is True
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_round_trip, args=(b, pool, q))
    p.start()
    assert q.get(timeout=60) is True
    p.join(30)
    assert p.exitcode == 0
    got = b.batch_get(["c0", "c1", "c2"])
    assert all(torch.equal(g, v) for g, v in zip(got, values(3, 9000, seed=5), strict=True))
    ps = pool.page_size
    assert b.batch_exists(page_hashes(list(range(2 * ps)), ps)) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"plugin": "OBJ"}, "cannot move files"),  # its library is missing here: no types
        ({"plugin": "NOPE"}, "has no plugin"),
        ({"plugin": "POSIX; rm"}, "NIXL plugin name"),
        ({"plugin_params": "use_aio"}, "name=value"),
        ({"plugin_params": "use_aoi=true"}, "no parameters ['use_aoi']"),
        ({"batch_pages": 0}, "batch_pages"),
        ({"root": ""}, "root"),
    ],
)
def test_bad_options_are_config_errors(root: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NixlBackend(StorageConfig(namespace=NS), **{"root": root, **options})


def test_plugin_params_reach_the_plugin(make: Callable[..., NixlBackend]) -> None:
    b = make(plugin_params="use_aio=true, kernel_queue_size=64")
    vals = values(3, seed=6)
    assert b.batch_set(["a", "b", "c"], vals) == [True] * 3
    assert all(torch.equal(g, v) for g, v in zip(b.batch_get(["a", "b", "c"]), vals, strict=True))


def test_ucx_is_refused_without_being_started(tmp_path: Path) -> None:
    """UCX moves no files. It is refused from its memory types, never instantiated: a
    process that made a UCX agent dies at exit (rc 139), this one exits 0."""
    code = textwrap.dedent(
        f"""
        from hicache_storage.backends import NixlBackend
        from hicache_storage.errors import BackendClosedError, ConfigError
        try:
            NixlBackend(root={str(tmp_path)!r}, plugin="UCX")
        except ConfigError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "cannot move files" in out.stdout


def test_transfers_never_overflow_the_plugins_io_queue(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL's POSIX plugin queues every I/O of every transfer in one pool
    (``ios_pool_size``); a transfer that finds it full fails after queueing part of itself,
    and the agent's next transfer would run that part. Here the queue holds 64 I/Os and
    two threads write and read pages of 16 segments, 40 pages a batch (640 I/Os): the
    transfers are cut to fit, and every page is right."""
    pool = make_pool("layer_first", num_pages=160, layer_num=8)
    b = make(pool_namespace(pool), plugin_params="ios_pool_size=64")
    b.register_mem_pool_host(pool)
    spy = TransferSpy(b, monkeypatch)
    ps = pool.page_size
    assert len(pool.page_buffers(torch.arange(ps))[0].segments) == 16
    errors: list[str] = []

    def worker(w: int) -> None:
        keys = page_hashes(list(range(w * 10**6, w * 10**6 + 40 * ps)), ps)
        src = torch.arange(w * 80 * ps, (w * 80 + 40) * ps)
        dst = torch.arange((w * 80 + 40) * ps, (w * 80 + 80) * ps)
        if b.batch_set_v1(keys, src) != [True] * 40 or b.batch_get_v1(keys, dst) != [True] * 40:
            errors.append(f"worker {w}: a page failed")
        elif [p.tobytes() for p in pool.page_buffers(src)] != [
            p.tobytes() for p in pool.page_buffers(dst)
        ]:
            errors.append(f"worker {w}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert spy.calls and max(ranges for _, ranges, _ in spy.calls) <= 16 * 40
    assert b._retired == []  # no transfer failed


def test_a_failed_post_retires_the_agent(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failed post may have queued in its agent never runs: the agent is set aside
    (and let go once no transfer uses it) and the next call gets a new one, with the pool
    registered again. The post's failure is injected: NIXL fails a post that finds its
    queue full, which the backend's sizing of transfers prevents."""
    pool = make_pool(num_pages=8)
    b = make(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    first = b._agent()

    def refuse(handle: Any, notif_msg: bytes = b"") -> str:
        raise RuntimeError("NIXL_ERR_NOT_ALLOWED (injected)")

    monkeypatch.setattr(first, "transfer", refuse)
    assert b.batch_set(["a"], values(1)) == [False]
    assert b._agent_obj is None and b._retired == []  # retired, then let go
    ps = pool.page_size
    keys = page_hashes(list(range(2 * ps)), ps)
    assert b.batch_set_v1(keys, torch.arange(2 * ps)) == [True, True]
    assert b._agent() is not first
    assert b.batch_get_v1(keys, torch.arange(2 * ps, 4 * ps)) == [True, True]
    assert [p.tobytes() for p in pool.page_buffers(torch.arange(2 * ps))] == [
        p.tobytes() for p in pool.page_buffers(torch.arange(2 * ps, 4 * ps))
    ]


def test_a_failure_on_completion_keeps_the_agent(small_tmpfs: str) -> None:
    """ENOSPC is found when the transfer completes, after all of its I/O ended: nothing
    is left queued, the agent stays (a full disk must not pile up agents), and the store
    writes again once there is room."""
    b = NixlBackend(StorageConfig(namespace=NS), root=small_tmpfs)
    try:
        first = b._agent()
        for _ in range(3):
            assert b.batch_set(["big"], [torch.ones(3 << 20, dtype=torch.uint8)]) == [False]
        assert b._agent() is first and b._retired == []
        assert b.set("small", values(1)[0]) is True
        assert torch.equal(b.get("small"), values(1)[0])
    finally:
        b.close()


def test_a_write_reported_done_but_short_is_not_published(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin that reports success after writing only part of a page (NIXL's POSIX
    plugin checks lengths itself; others may not): with checksum="none" nothing else
    would notice, so the size and hole check before the trailer must fail the page."""
    b = make(checksum="none")
    real = b._transfer

    def half(op: str, spans: Any, places: Any, files: Any) -> None:
        # Only the second half of each range: the first half stays a hole.
        cut = [(off + n // 2, n - n // 2, fd) for off, n, fd in places]
        real(op, [(a + n // 2, n - n // 2) for a, n in spans], cut, files)

    monkeypatch.setattr(b, "_transfer", half)
    assert b.set("k", values(1, 1 << 20)[0]) is False
    monkeypatch.undo()
    assert b.get("k") is None and _stored(b) == []
    assert [p for p in tree_files(b.root) if ".tmp." in p] == []


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_agent_for_the_call_fails_its_pages_cleanly(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child whose agent cannot start (or a close() racing the call): the pages
    fail, nothing is left open or half-written, nothing raises to the engine."""
    b = make()
    assert b.set("kept", values(1)[0]) is True
    before = _fds()

    def no_agent() -> Any:
        raise ConfigError("the NIXL plugin 'POSIX' did not load (injected)")

    monkeypatch.setattr(b, "_agent_pid", -1)  # as in a forked child
    monkeypatch.setattr(b, "_new_agent", no_agent)
    assert b.batch_set(["a", "b"], values(2, seed=8)) == [False, False]
    assert b.batch_get(["kept", "a"]) == [None, None]
    assert _fds() == before
    assert [p for p in tree_files(b.root) if ".tmp." in p] == []
    assert b.get_stats().ops["batch_set"].errors == 2


def test_close_during_a_write_leaves_no_temporary(
    make: Callable[..., NixlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make()
    real = b.move_payloads
    before = _fds()

    def then_close(*args: Any) -> None:
        real(*args)
        b.close()  # the I/O threads stop: publication cannot run

    monkeypatch.setattr(b, "move_payloads", then_close)
    done = b.batch_set([f"k{i}" for i in range(8)], values(8, 200_000, seed=9))
    assert done == [False] * 8
    assert [p for p in tree_files(b.root) if ".tmp." in p] == []
    assert _fds() == before
    with pytest.raises(BackendClosedError):
        b._agent()  # a closed backend makes no new agent


def test_files_open_at_once_follow_the_descriptor_limit(tmp_path: Path) -> None:
    """Under a low RLIMIT_NOFILE (128), a batch of 300 pages still stores every page: the
    backend opens at most an eighth of the limit per call (the file backend's one at a
    time never ran out; ours must not either)."""
    code = textwrap.dedent(
        f"""
        import resource, torch
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        from hicache_storage.backends import NixlBackend
        b = NixlBackend(root={str(tmp_path)!r})
        vals = [torch.full((4096,), i % 256, dtype=torch.uint8) for i in range(300)]
        keys = [f"k{{i}}" for i in range(300)]
        print("set", sum(b.batch_set(keys, vals)), "part", b.payload_batch)
        got = b.batch_get(keys)
        print("get", sum(g is not None and torch.equal(g, v) for g, v in zip(got, vals)))
        b.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "set 300 part 16" in out.stdout and "get 300" in out.stdout
