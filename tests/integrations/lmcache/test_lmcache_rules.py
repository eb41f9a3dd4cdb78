"""The conformance kit's rules that apply to an LMCache connector, through the plugin.

The kit itself qualifies backends (their ``get``/``set``/``exists``); here its rules are
checked one level up, on the connector LMCache calls, in a real engine on the ``file``
backend. Each test names the rule it enforces (``conformance/rules.py``). Rules about
host pools, the v1 pair, head groups and engine batches do not apply to LMCache's chunks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from lmcache_engine import all_tokens, engine, plugin_config, remote_connector

from hicache_storage.conformance.rules import RULES
from hicache_storage.integrations.lmcache import object_key


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[Any]:
    with engine(plugin_config("file", backend_options("file", tmp_path))) as (eng, _):
        conn = remote_connector(eng)
        conn.test_keys = [k for _, _, k in eng.token_database.process_tokens(all_tokens(6))][:6]
        yield conn


def run(conn: Any, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, conn.loop).result(timeout=60)


def chunk(conn: Any, value: int) -> Any:
    """A full chunk in LMCache's allocator, every byte ``value``."""
    obj = conn._allocate()
    obj.byte_array.cast("B")[:] = bytes([value]) * len(obj.byte_array)
    return obj


def data(obj: Any) -> bytes:
    return bytes(obj.byte_array.cast("B"))


def put(conn: Any, keys: list[Any], values: list[int]) -> None:
    objs = [chunk(conn, v) for v in values]
    try:
        run(conn, conn.batched_put(keys, objs))
    finally:
        for o in objs:
            o.ref_count_down()


def test_rules_named_here_exist() -> None:
    for rule in ("read-your-writes", "get-miss", "set-existing", "batch-exists-leading-run",
                 "exact-length", "namespace-isolation", "threads", "miss-not-error",
                 "delete", "no-false-success"):  # fmt: skip
        assert rule in RULES


def test_read_your_writes_and_get_miss(conn: Any) -> None:
    keys = conn.test_keys
    put(conn, keys[:2], [1, 2])
    got = run(conn, conn.batched_get(keys[:3]))
    assert len(got) == 3  # exact-length
    assert data(got[0]) == bytes([1]) * len(got[0].byte_array)  # read-your-writes
    assert data(got[1]) == bytes([2]) * len(got[1].byte_array)
    assert got[2] is None  # get-miss
    for g in got[:2]:
        g.ref_count_down()
    assert run(conn, conn.get(keys[4])) is None  # miss-not-error: a None, no exception
    assert run(conn, conn.exists(keys[4])) is False


def test_set_existing_keeps_the_first_value(conn: Any) -> None:
    key = conn.test_keys[0]
    put(conn, [key], [7])
    put(conn, [key], [9])  # set-existing: a no-op, never a torn or replaced object
    got = run(conn, conn.get(key))
    assert data(got) == bytes([7]) * len(got.byte_array)
    got.ref_count_down()


def test_batch_contains_counts_the_leading_run(conn: Any) -> None:
    keys = conn.test_keys
    put(conn, [keys[0], keys[1], keys[3]], [1, 2, 4])
    assert conn.batched_contains(keys[:5]) == 2  # batch-exists-leading-run
    assert conn.batched_contains([keys[2], keys[0]]) == 0
    assert run(conn, conn.batched_async_contains("l", keys[:5])) == 2
    assert conn.batched_contains([]) == 0  # exact-length: an int for an empty batch


def test_delete_then_miss(conn: Any) -> None:
    key = conn.test_keys[0]
    put(conn, [key], [3])
    assert conn.remove_sync(key) is True  # delete
    assert conn.exists_sync(key) is False
    assert run(conn, conn.get(key)) is None


def test_another_namespace_never_sees_the_objects(conn: Any, tmp_path: Path) -> None:
    key = conn.test_keys[0]
    put(conn, [key], [5])
    # The same store and key, another tenant (namespace-isolation).
    extra = plugin_config("file", backend_options("file", tmp_path), tenant="other")
    with engine(extra) as (eng, _):
        other = remote_connector(eng)
        assert other.batched_contains([key]) == 0
        assert run(other, other.get(key)) is None


def test_threads_reading_and_writing_at_once_get_only_their_bytes(conn: Any) -> None:
    keys = conn.test_keys
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(5):
            put(conn, [keys[i]], [i + 1])
            got = run(conn, conn.get(keys[i]))
            if got is None or data(got) != bytes([i + 1]) * len(got.byte_array):
                errors.append(f"key {i}")  # threads / no-false-success
            if got is not None:
                got.ref_count_down()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_a_value_of_another_size_is_a_miss(conn: Any) -> None:
    """An object of this key that holds another size (planted through the backend) is a
    miss (get-size-mismatch), never a partly filled chunk."""
    key = conn.test_keys[0]
    conn._backend(key).set(object_key(key), torch.ones(100, dtype=torch.uint8))
    assert run(conn, conn.get(key)) is None
