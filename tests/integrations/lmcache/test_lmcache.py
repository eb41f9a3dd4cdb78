"""The hicache plugin inside the real LMCacheEngine (CPU; LMCache's mock GPU connector).

Every built-in backend serves LMCache: chunks stored by ``store`` come back byte for byte
through ``lookup`` and ``retrieve``, across engines and processes; a damaged object, a
foreign deployment, a dead or hung store cost misses within the deadline, never a wrong
chunk or a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from lmcache_engine import (
    CHUNK,
    all_tokens,
    engine,
    mask,
    plugin_config,
    remote_connector,
)

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.lmcache import PluginOptions, object_key, plugin_options

BACKENDS = ["file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl"]
WORKERS = Path(__file__).parents[2] / "workers"


def wait_until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Stores are asynchronous in LMCache: poll until ``check()`` holds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def store_and_wait(eng: Any, tokens: torch.Tensor, n_chunks: int) -> None:
    eng.store(tokens, mask=mask(tokens))
    assert wait_until(lambda: eng.lookup(tokens) == n_chunks * CHUNK), eng.lookup(tokens)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_serves_lmcache_chunks_byte_exact(name: str, tmp_path: Path) -> None:
    extra = plugin_config(name, backend_options(name, tmp_path))
    tokens = all_tokens(3)
    with engine(extra) as (eng, gpu):
        conn = remote_connector(eng)
        assert type(conn).__name__ == "HiCacheRemoteConnector"
        store_and_wait(eng, tokens, 3)
        got = eng.retrieve(tokens, mask=mask(tokens))
        assert int(got.sum()) == 3 * CHUNK
        assert sorted(gpu.retrieved) == [0, CHUNK, 2 * CHUNK]
        assert gpu.wrong_chunks() == []
        # The chunks went through the backend (not a cache of LMCache's own).
        stats = [b.get_stats(reset=False) for b in conn._backends.values()]
        assert sum(s.bytes_written for s in stats) >= 3 * conn.full_chunk_size_bytes
        assert sum(s.bytes_read for s in stats) >= 3 * conn.full_chunk_size_bytes
    # Another engine on the same store (a restart) finds and serves them.
    with engine(extra) as (eng, gpu):
        assert eng.lookup(tokens) == 3 * CHUNK
        assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == 3 * CHUNK
        assert gpu.wrong_chunks() == []


def test_a_damaged_object_is_a_miss_never_a_wrong_chunk(tmp_path: Path) -> None:
    extra = plugin_config("file", backend_options("file", tmp_path))
    tokens = all_tokens(3)
    with engine(extra) as (eng, gpu):
        store_and_wait(eng, tokens, 3)
        files = sorted(p for p in (tmp_path / "file").rglob("*") if p.is_file() and
                       p.stat().st_size >= remote_connector(eng).full_chunk_size_bytes)  # fmt: skip
        assert len(files) == 3
        for f in files:  # flip one payload byte of every chunk but one
            data = bytearray(f.read_bytes())
            data[100] ^= 0xFF
            f.write_bytes(bytes(data))
        got = eng.retrieve(tokens, mask=mask(tokens))
        assert gpu.wrong_chunks() == []  # whatever came back is right
        assert int(got.sum()) < 3 * CHUNK
        assert remote_connector(eng)._backends  # (and the store counted the damage)
        corrupt = sum(b.get_stats(reset=False).corrupt_objects
                      for b in remote_connector(eng)._backends.values())  # fmt: skip
        assert corrupt >= 1


@pytest.mark.parametrize(
    "other",
    [{"model": "acme/another-model"}, {"dtype": torch.float16}, {"tenant": "b"}],
    ids=["model", "dtype", "tenant"],
)
def test_another_deployment_never_sees_the_chunks(other: dict[str, Any], tmp_path: Path) -> None:
    options = backend_options("file", tmp_path)
    tokens = all_tokens(2)
    with engine(plugin_config("file", options)) as (eng, _):
        store_and_wait(eng, tokens, 2)
    tenant = other.pop("tenant", "")
    extra = plugin_config("file", options, **({"tenant": tenant} if tenant else {}))
    with engine(extra, **other) as (eng, gpu):
        assert eng.lookup(tokens) == 0
        assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == 0
        assert gpu.retrieved == {}


def test_a_dead_store_costs_misses_within_the_deadline(tmp_path: Path) -> None:
    from redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    extra = plugin_config("redis", {"url": server.url, "socket_timeout": 1.0}, timeout=1.0)
    tokens = all_tokens(2)
    try:
        with engine(extra, timeout=2.0) as (eng, gpu):
            store_and_wait(eng, tokens, 2)
            server.stop()  # killed mid-run
            t0 = time.monotonic()
            assert eng.lookup(tokens) == 0
            got = eng.retrieve(tokens, mask=mask(tokens))
            assert time.monotonic() - t0 < 10
            assert int(got.sum()) == 0 and gpu.wrong_chunks() == []
            eng.store(all_tokens(2, offset=999), mask=mask(all_tokens(2)))  # no raise
            # The server comes back (empty: it kept nothing): stores and hits again.
            server.start()

            def recovered() -> bool:
                eng.store(tokens, mask=mask(tokens))
                return wait_until(lambda: eng.lookup(tokens) == 2 * CHUNK, timeout=2)

            assert wait_until(recovered, timeout=60)
            assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == 2 * CHUNK
            assert gpu.wrong_chunks() == []
    finally:
        server.stop()


def test_a_hung_store_costs_a_miss_within_the_plugin_timeout(tmp_path: Path) -> None:
    extra = plugin_config("lmcache_hang:HangingFile", {"root": str(tmp_path / "hang")},
                          timeout=0.5)  # fmt: skip
    tokens = all_tokens(2)
    with engine(extra) as (eng, _):
        t0 = time.monotonic()
        assert eng.lookup(tokens) == 0
        assert time.monotonic() - t0 < 3


def test_two_engines_in_two_processes_share_one_store(tmp_path: Path) -> None:
    options = backend_options("file", tmp_path)
    tokens = all_tokens(4)
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(WORKERS)}
    script = f"""
import json, time, torch
from lmcache_engine import engine, mask, plugin_config, all_tokens, CHUNK
tokens = all_tokens(4)
with engine(plugin_config("file", {options!r})) as (eng, _):
    eng.store(tokens, mask=mask(tokens))
    end = time.monotonic() + 20
    while eng.lookup(tokens) < 4 * CHUNK and time.monotonic() < end:
        time.sleep(0.05)
    print(eng.lookup(tokens))
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(4 * CHUNK)
    with engine(plugin_config("file", options)) as (eng, gpu):
        assert eng.lookup(tokens) == 4 * CHUNK
        assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == 4 * CHUNK
        assert gpu.wrong_chunks() == []


def test_partial_chunks_round_trip_when_lmcache_stores_them(tmp_path: Path) -> None:
    extra = plugin_config("file", backend_options("file", tmp_path))
    tokens = all_tokens(2)  # 2 chunks and 5 tokens
    with engine(extra, save_unfull_chunk=True) as (eng, gpu):
        eng.store(tokens, mask=mask(tokens))
        assert wait_until(lambda: eng.lookup(tokens) == len(tokens))
        assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == len(tokens)
        assert sorted(gpu.retrieved) == [0, CHUNK, 2 * CHUNK]
        assert gpu.retrieved[2 * CHUNK].shape[2] == 5
        assert gpu.wrong_chunks() == []


def test_the_plugins_options_are_checked() -> None:
    class Config:
        extra_config = {
            "remote_storage_plugin.hicache.backend_name": "file",
            "remote_storage_plugin.hicache.backend_options": '{"root": "/tmp/x"}',
        }

    opts = plugin_options(Config(), "hicache")
    assert opts.backend_kwargs() == {"root": "/tmp/x"}
    Config.extra_config["remote_storage_plugin.hicache.root"] = "/tmp/y"
    with pytest.raises(ConfigError, match="backend_options"):
        plugin_options(Config(), "hicache")
    with pytest.raises(ConfigError, match="backend_name"):
        PluginOptions()
    with pytest.raises(ConfigError, match="JSON"):
        PluginOptions(backend_name="file", backend_options="{not json").backend_kwargs()


def test_the_config_lmcache_args_prints_runs_a_real_engine(tmp_path: Path) -> None:
    import yaml  # type: ignore[import-untyped]

    root = str(tmp_path / "kv")
    done = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli.main", "lmcache-args",
         "--hicache-storage-backend", "file", "--name", "hicache.disk",
         "--hicache-storage-backend-extra-config", json.dumps({"root": root}),
         "--timeout", "2"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    config = yaml.safe_load(done.stdout)
    assert config["remote_storage_plugins"] == ["hicache.disk"]
    tokens = all_tokens(2)
    with engine(config["extra_config"], plugins=config["remote_storage_plugins"]) as (eng, gpu):
        assert type(remote_connector(eng, "hicache.disk")).__name__ == "HiCacheRemoteConnector"
        store_and_wait(eng, tokens, 2)
        assert int(eng.retrieve(tokens, mask=mask(tokens)).sum()) == 2 * CHUNK
        assert gpu.wrong_chunks() == []
    assert any(Path(root).rglob("*"))


def test_the_non_blocking_batch_gives_the_leading_run_and_releases_the_rest(
    tmp_path: Path,
) -> None:
    import asyncio

    extra = plugin_config("file", backend_options("file", tmp_path))
    tokens = all_tokens(4)
    with engine(extra) as (eng, _):
        store_and_wait(eng, tokens, 4)
        conn = remote_connector(eng)
        keys = [key for _, _, key in eng.token_database.process_tokens(tokens)][:4]
        # Chunk 1 goes missing: the run is chunk 0 only.
        conn._backend(keys[1]).delete(object_key(keys[1]))
        fut = asyncio.run_coroutine_threadsafe(conn.batched_get_non_blocking("l", keys), conn.loop)
        got = fut.result(timeout=30)
        assert len(got) == 1
        assert bytes(got[0].byte_array) != bytes(len(got[0].byte_array))
        got[0].ref_count_down()  # (the releases: the stand-in test below)


def test_the_non_blocking_batch_releases_every_object_past_the_first_miss(
    tmp_path: Path,
) -> None:
    """The caller's logic alone (what batched_get returned is a stand-in here)."""
    import asyncio

    class Obj:
        def __init__(self) -> None:
            self.released = 0

        def ref_count_down(self) -> None:
            self.released += 1

    extra = plugin_config("file", backend_options("file", tmp_path))
    with engine(extra) as (eng, _):
        conn = remote_connector(eng)
        held, later = Obj(), [Obj(), Obj()]
        objs = [held, None, *later]

        async def batched_get(keys: list[Any]) -> list[Any]:
            return list(objs)

        conn.batched_get = batched_get
        got = asyncio.run(conn.batched_get_non_blocking("l", ["a", "b", "c", "d"]))
        assert got == [held]
        assert [o.released for o in (held, *later)] == [0, 1, 1]
