"""The LMCache plugin when the store is slow, hangs or is misconfigured, and at close.

Each case here once went wrong (a review with fresh eyes found them): a read LMCache gave
up on leaked its chunks; the health check's second write was refused; a close with a
write in flight freed the memory the write read; a hung store's writes held LMCache's
whole buffer and its reads; every query to a hung store left a thread behind.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmcache_hang
import pytest
from engine_servers import backend_options
from lmcache_engine import CHUNK, all_tokens, engine, mask, plugin_config, remote_connector

WORKERS = Path(__file__).parents[2] / "workers"


@pytest.fixture(autouse=True)
def calm_store() -> Iterator[None]:
    yield
    lmcache_hang.WRITES_HANG.clear()
    lmcache_hang.READ_DELAY[0] = lmcache_hang.WRITE_DELAY[0] = 0.0


def cue(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return plugin_config("lmcache_hang:CueFile", {"root": str(tmp_path / "cue")}, **extra)


def in_use(conn: Any) -> int:
    return int(conn.local_cpu_backend.memory_allocator.pin_allocator.total_allocated_size)


def wait_until(check: Any, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def test_a_read_lmcache_gives_up_on_releases_its_chunks(tmp_path: Path) -> None:
    tokens = all_tokens(3)
    with engine(cue(tmp_path), timeout=1.0) as (eng, gpu):
        conn = remote_connector(eng)
        eng.store(tokens, mask=mask(tokens))
        assert wait_until(lambda: eng.lookup(tokens) == 3 * CHUNK)
        before = in_use(conn)
        lmcache_hang.READ_DELAY[0] = 2.0  # past blocking_timeout_secs (1 s)
        got = eng.retrieve(tokens, mask=mask(tokens))
        assert int(got.sum()) == 0 and gpu.retrieved == {}
        # When the late read returns, what it read goes back to LMCache's allocator.
        assert wait_until(lambda: in_use(conn) == before, timeout=10)


def test_the_health_checks_write_and_read_pass_every_time(tmp_path: Path) -> None:
    from lmcache.utils import CacheEngineKey

    with engine(plugin_config("file", backend_options("file", tmp_path))) as (eng, _):
        conn = remote_connector(eng)
        key = CacheEngineKey.from_string("test@1@0@0@bfloat16")
        for fill in (1, 2, 3):
            obj = conn._allocate()
            obj.byte_array.cast("B")[:] = bytes([fill]) * len(obj.byte_array)
            asyncio.run_coroutine_threadsafe(conn.put(key, obj), conn.loop).result(30)
            obj.ref_count_down()
            got = asyncio.run_coroutine_threadsafe(conn.get(key), conn.loop).result(30)
            assert got is not None and bytes(got.byte_array)[:4] == bytes([fill]) * 4
            got.ref_count_down()


def test_close_waits_for_the_writes_in_flight(tmp_path: Path) -> None:
    """The plugin's close returns only once its running writes returned (they read
    LMCache's buffers), and refuses calls after it. (Destroying a whole engine frees
    LMCache's CPU buffer before it closes its remote backends: see docs/lmcache.md.)"""
    with engine(cue(tmp_path)) as (eng, _):
        conn = remote_connector(eng)
        lmcache_hang.WRITE_DELAY[0] = 1.0
        objs = [conn._allocate() for _ in range(2)]
        keys = [k for _, _, k in eng.token_database.process_tokens(all_tokens(2))][:2]
        put = asyncio.run_coroutine_threadsafe(conn.batched_put(keys, objs), conn.loop)
        assert wait_until(lambda: conn._writes.pending == 1, timeout=5)
        t0 = time.monotonic()
        asyncio.run_coroutine_threadsafe(conn.close(), conn.loop).result(30)
        assert time.monotonic() - t0 > 0.5  # (it waited for the write)
        assert conn._writes.pending == 0
        put.result(30)
        for o in objs:
            o.ref_count_down()
        later = asyncio.run_coroutine_threadsafe(conn.batched_get(keys), conn.loop).result(30)
        assert later == [None, None]


def test_a_hung_stores_writes_drop_instead_of_holding_lmcaches_buffer(tmp_path: Path) -> None:
    early = all_tokens(2, offset=50_000)
    with engine(cue(tmp_path, io_threads=2)) as (eng, gpu):
        conn = remote_connector(eng)
        eng.store(early, mask=mask(early))
        assert wait_until(lambda: eng.lookup(early) == 2 * CHUNK)
        lmcache_hang.WRITES_HANG.set()
        for i in range(30):
            t = all_tokens(2, offset=1000 * i)
            eng.store(t, mask=mask(t))
        assert wait_until(lambda: conn.dropped_puts > 0)
        # Reads go on, on threads of their own.
        assert int(eng.retrieve(early, mask=mask(early)).sum()) == 2 * CHUNK
        assert gpu.wrong_chunks() == []
        lmcache_hang.WRITES_HANG.clear()


def test_queries_to_a_hung_store_leave_one_thread_behind_at_most(tmp_path: Path) -> None:
    extra = plugin_config("lmcache_hang:HangingFile", {"root": str(tmp_path / "hang")},
                          timeout=0.2)  # fmt: skip
    with engine(extra) as (eng, _):
        before = threading.active_count()
        t0 = time.monotonic()
        for i in range(20):
            assert eng.lookup(all_tokens(1, offset=i)) == 0
        assert threading.active_count() <= before + 1
        assert time.monotonic() - t0 < 5  # (a busy lane answers at once)


def test_a_process_with_a_hung_store_still_closes_and_exits(tmp_path: Path) -> None:
    """Its write never returns: the plugin's close waits twice its timeout, no more, and
    its threads do not keep the process alive."""
    script = f"""
import lmcache_hang
from lmcache_engine import engine, mask, all_tokens
lmcache_hang.WRITES_HANG.set()
with engine({cue(tmp_path, timeout=1.0)!r}) as (eng, _):
    t = all_tokens(2)
    eng.store(t, mask=mask(t))
print("leaving")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env={"PYTHONPATH": str(WORKERS), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "leaving" in done.stdout, done.stderr[-2000:]


def test_options_the_backend_refuses_stop_the_plugin_at_start(tmp_path: Path) -> None:
    extra = plugin_config("file", {"rooot": str(tmp_path)})
    with engine(extra) as (eng, _):
        backend = eng.storage_manager.storage_backends["RemoteBackend-hicache"]
        assert backend.connection is None  # (LMCache logs the error; no plugin runs)


def test_two_plugins_hicache_and_hicache_dot_b_side_by_side(tmp_path: Path) -> None:
    extra = {**plugin_config("file", {"root": str(tmp_path / "a")}),
             **plugin_config("file", {"root": str(tmp_path / "b")}, name="hicache.b")}  # fmt: skip
    with engine(extra, plugins=["hicache", "hicache.b"]) as (eng, _):
        for name in ("hicache", "hicache.b"):
            assert type(remote_connector(eng, name)).__name__ == "HiCacheRemoteConnector"
