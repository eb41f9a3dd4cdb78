"""The ``redis`` backend against real ``redis-server`` processes started by these tests."""

from __future__ import annotations

import contextlib
import itertools
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.buffers import PageBuffer, Segment
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import BackendUnavailableError, ConfigError
from hicache_storage.storekit.blobstore import FOREIGN

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from redis_server import (
    RedisClusterServers,
    RedisServer,
    TlsFiles,
    free_port,
    make_tls_files,
    running,
    running_cluster,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


def backend(url: str, tenant: str = "t", **options: object):  # -> RedisBackend
    from hicache_storage.backends import RedisBackend

    ns = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4, tenant=tenant)
    options.setdefault("prefix", f"test-{uuid.uuid4().hex[:8]}:")
    return RedisBackend(StorageConfig(namespace=ns), url=url, **options)


def raw(url: str):  # -> redis.Redis
    import redis

    return redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, server: RedisServer) -> BackendSpec:
        return BackendSpec("redis", {"url": server.url, "prefix": f"kit-{uuid.uuid4().hex[:8]}:"})

    @pytest.fixture
    def break_store(self, server: RedisServer) -> Callable[[object], Any]:
        """The server killed, then started again on its port (empty: no persistence)."""

        @contextlib.contextmanager
        def broken(_backend: object) -> Iterator[None]:
            server.stop()
            try:
                yield
            finally:
                server.start()

        return broken


def test_pages_round_trip_and_first_writer_wins(server: RedisServer) -> None:
    b = backend(server.url)
    try:
        a, c = torch.full((1000,), 1, dtype=torch.uint8), torch.full((1000,), 2, dtype=torch.uint8)
        assert b.batch_set(["k1", "k2"], [a, c]) == [True, True]
        assert b.set("k1", c) is True  # already stored: kept, not replaced
        got = b.get("k1")
        assert got is not None
        assert torch.equal(got, a)
        assert b.batch_exists(["k1", "k2", "nope", "k1"]) == 2
    finally:
        b.close()


def test_clear_removes_this_namespace_only(server: RedisServer) -> None:
    prefix = f"clr-{uuid.uuid4().hex[:6]}:"
    mine = backend(server.url, "a", prefix=prefix, clear_batch=7)
    other = backend(server.url, "b", prefix=prefix)
    r = raw(server.url)
    try:
        keys = [f"k{i}" for i in range(50)]
        value = [torch.full((64,), 9, dtype=torch.uint8)] * 50
        assert all(mine.batch_set(keys, value))
        assert all(other.batch_set(keys, value))
        # Keys that only look alike: another prefix, and a glob character in ours.
        r.set(prefix[:-1] + "X" + mine.namespace.digest + "/00/k", b"foreign")
        r.set("unrelated", b"x")
        mine.clear()
        assert mine.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 50
        assert r.get(prefix[:-1] + "X" + mine.namespace.digest + "/00/k") == b"foreign"
        assert r.get("unrelated") == b"x"
        assert all(mine.batch_set(keys, value))  # usable again
    finally:
        r.delete("unrelated", prefix[:-1] + "X" + mine.namespace.digest + "/00/k")
        mine.close()
        other.close()
        r.close()


@pytest.mark.parametrize("tenant", ["a", "b"])
def test_clear_leaves_a_prefix_nested_in_its_namespace(server: RedisServer, tenant: str) -> None:
    """B's prefix is A's prefix plus A's namespace digest and "/": A.clear() removes A's
    pages only, whether B is in A's namespace or another."""
    a = backend(server.url, "a", clear_batch=7)
    b = backend(server.url, tenant, prefix=a._prefix + a.namespace_prefix)
    try:
        keys = [f"k{i}" for i in range(30)]
        value = [torch.full((64,), 3, dtype=torch.uint8)] * 30
        assert all(a.batch_set(keys, value))
        assert all(b.batch_set(keys, value))
        a.clear()
        assert a.batch_exists(keys) == 0
        assert b.batch_exists(keys) == 30
        got = b.get("k7")
        assert got is not None and torch.equal(got, value[0])
        b.clear()
        assert b.batch_exists(keys) == 0
    finally:
        a.close()
        b.close()


def test_a_foreign_or_truncated_value_is_a_miss(server: RedisServer) -> None:
    b = backend(server.url)
    r = raw(server.url)
    try:
        assert b.set("good", torch.full((256,), 5, dtype=torch.uint8))
        key = b._prefix + b.object_path("good")
        stored = r.get(key)
        assert stored is not None
        r.set(key, stored[:-10])  # truncated behind the backend's back
        assert b.get("good") is None
        r.set(b._prefix + b.object_path("planted"), b"\x00" * 300)  # not our format
        assert b.get("planted") is None
        assert b.get_stats().corrupt_objects >= 2
    finally:
        b.close()
        r.close()


def _framed(b: Any, key: str, payload: bytes) -> bytes:
    """A well-formed value (header and payload) for ``key`` in ``b``'s namespace."""
    from hicache_storage.storekit.header import algorithm_id, checksum, encode_header

    path, alg = b.object_path(key), algorithm_id("xxh3")
    return encode_header(len(payload), checksum([memoryview(payload)], alg), alg, path) + payload


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_planted_value_that_is_not_a_page_never_holds_its_key(
    request: pytest.FixtureRequest, where: str
) -> None:
    """A well-formed value of the wrong length is a miss and removed by the first read; a
    hash, an empty or a short value is never counted by exists and never makes set answer
    True without storing the page; a hash met by a read is removed too; a well-formed
    value of the wrong length, shorter or longer, that no read has met never makes set
    answer True either."""
    import redis

    cluster = where == "cluster"
    url = request.getfixturevalue(where if cluster else "server").url
    b = backend(url, cluster=cluster)
    r = redis.RedisCluster.from_url(url) if cluster else raw(url)
    ours = torch.full((4096,), 7, dtype=torch.uint8)
    keys = [
        f"{kind}{i}"
        for kind in ("short", "hash", "hashread", "empty", "tiny", "unread", "unreadlong")
        for i in range(4)
    ]
    try:
        for key in keys:
            where_ = b._prefix + b.object_path(key)
            if key.startswith(("short", "unread")):  # a valid value, not a page's size
                size = 8192 if key.startswith("unreadlong") else 100
                r.set(where_, _framed(b, key, b"x" * size))
            elif key.startswith("hash"):
                r.hset(where_, "field", "value")
            else:
                r.set(where_, b"" if key.startswith("empty") else b"x" * 10)
        short = [k for k in keys if k.startswith("short")]
        others = [k for k in keys if not k.startswith(("short", "hashread", "unread"))]
        # wrong length: counted (a read must tell), read once (a miss), removed
        assert all(b.exists(k) for k in short)
        targets = [torch.zeros(4096, dtype=torch.uint8) for _ in short]
        assert b.batch_get(short, targets) == [None] * len(short)
        assert all(not t.any() for t in targets)
        assert not any(r.exists(b._prefix + b.object_path(k)) for k in short)
        assert b.get_stats().size_mismatches == len(short)
        # a hash met by a read: a miss, counted corrupt, removed
        hashread = [k for k in keys if k.startswith("hashread")]
        assert b.batch_get(hashread, [torch.zeros(4096, dtype=torch.uint8)] * 4) == [None] * 4
        assert b.get_stats().corrupt_objects == 4
        assert not any(r.exists(b._prefix + b.object_path(k)) for k in hashread)
        # never a page: not counted, and set stores the page over it
        assert not any(b.exists(k) for k in others)
        assert b.batch_exists(others) == 0
        assert b.batch_set(keys, [ours] * len(keys)) == [True] * len(keys)
        assert b.get_stats().bytes_written == len(keys) * 4096  # each one stored, none "present"
        for key in keys:
            got = b.get(key, torch.zeros(4096, dtype=torch.uint8))
            assert got is not None and torch.equal(got, ours)
        assert b.batch_exists(keys) == len(keys)
    finally:
        b.clear()
        b.close()
        r.close()


def test_a_bad_value_is_removed_only_while_it_is_still_there(server: RedisServer) -> None:
    """The removal compares and deletes in one step: a good page another writer stored
    after the bad value was read is kept."""
    b = backend(server.url)
    r = raw(server.url)
    try:
        name = b.object_name("k")
        key = b._prefix + name.path
        bad, good = _framed(b, "k", b"x" * 100), _framed(b, "k", b"y" * 4096)
        limit = len(good)
        cut = b"z" * (limit + 1)  # what a bounded read of an oversized value returns
        for seen, now, removed in [
            (bad, bad, True),
            (bad, good, False),  # replaced meanwhile: kept
            (bad, _framed(b, "k", b"w" * 100), False),  # as long, other bytes: kept
            (cut, b"z" * (limit + 5000), True),  # still over the limit
            (cut, good, False),
            (FOREIGN, None, True),  # still a hash
            (FOREIGN, good, False),
        ]:
            r.delete(key)
            if now is None:
                r.hset(key, "f", "v")
            else:
                r.set(key, now)
            assert b._delete_blobs_if_bad([name], [seen], [limit]) == [removed]
            assert r.exists(key) == (not removed)
            if not removed:
                assert r.get(key) == now
    finally:
        r.delete(b._prefix + b.object_path("k"))
        b.close()
        r.close()


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_huge_planted_value_is_never_read_whole(
    request: pytest.FixtureRequest, where: str
) -> None:
    """8 values of 4 MiB under the keys of 4 KiB pages: a batch read is 8 misses, counted
    corrupt and removed, and the server sends about the pages' size, not 32 MiB (its own
    count of bytes sent, before and after)."""
    import redis

    cluster = where == "cluster"
    url = request.getfixturevalue(where if cluster else "server").url
    b = backend(url, cluster=cluster)
    r = redis.RedisCluster.from_url(url) if cluster else raw(url)
    nodes = request.getfixturevalue("cluster").nodes if cluster else []
    counters = [raw(n.url) for n in nodes] if cluster else [r]  # the servers' own counts
    keys = [f"huge{i}" for i in range(8)]
    try:
        for key in keys:
            r.set(b._prefix + b.object_path(key), _framed(b, key, bytes(4 << 20)))
        tensors = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        pages = [
            PageBuffer([Segment(t.data_ptr(), 4096, memoryview(t.numpy().data))]) for t in tensors
        ]

        def sent() -> int:  # (the INFO answers themselves are a few KiB)
            return sum(int(c.info("stats")["total_net_output_bytes"]) for c in counters)

        before = sent()
        assert b.batch_get_pages(keys, pages) == [False] * len(keys)
        cost = sent() - before
        assert cost < 8 * (4096 + 49) + 256 * 1024, f"{cost} bytes sent for 8 pages of 4 KiB"
        assert all(not t.any() for t in tensors)
        assert b.get_stats().corrupt_objects == len(keys)
        assert not any(r.exists(b._prefix + b.object_path(k)) for k in keys)
        assert b.batch_set(keys, [torch.ones(4096, dtype=torch.uint8)] * 8) == [True] * 8
    finally:
        b.clear()
        b.close()
        for c in {*counters, r}:
            c.close()


def test_nothing_listening_is_a_clear_error_at_construction() -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="no redis server answers"):
        backend(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=1.0)
    assert time.monotonic() - t0 < 10


def test_a_wrong_password_is_a_config_error_and_never_shown(tmp_path: Path) -> None:
    with running(tmp_path, "--requirepass", "s3cret-pass-1") as srv:
        url = f"redis://:wrong-pass-2@127.0.0.1:{srv.port}/0"
        with pytest.raises(ConfigError) as err:
            backend(url)
        assert "wrong-pass-2" not in str(err.value)
        with pytest.raises(ConfigError) as err:
            backend(srv.url, password="wrong-pass-3")
        assert "wrong-pass-3" not in str(err.value)
        ok = backend(srv.url, password="s3cret-pass-1")
        try:
            assert ok.set("k", torch.ones(10, dtype=torch.uint8))
            assert "s3cret-pass-1" not in repr(ok)
            assert "s3cret" not in repr(ok.options)
        finally:
            ok.close()
        inline = backend(f"redis://:s3cret-pass-1@127.0.0.1:{srv.port}/0")
        try:
            assert "s3cret-pass-1" not in repr(inline)
            assert inline.set("k2", torch.ones(10, dtype=torch.uint8)) is True
            assert inline.get("k2") is not None
        finally:
            inline.close()
        # The password option wins over the URL's (a stale one there must not matter).
        over = backend(f"redis://:stale-pass-4@127.0.0.1:{srv.port}/0", password="s3cret-pass-1")
        try:
            assert over.set("k3", torch.ones(10, dtype=torch.uint8)) is True
        finally:
            over.close()


@pytest.mark.parametrize("password", ["Hunter2#Secret", "a/b?c d@e", "p%40ss:w"])
def test_a_password_with_url_characters_never_shows(tmp_path: Path, password: str) -> None:
    from urllib.parse import quote

    with running(tmp_path, "--requirepass", "the-right-one") as srv:
        for url in (
            f"redis://:{password}@127.0.0.1:{srv.port}/0",  # as typed: not even a valid URL
            f"redis://:{quote(password, safe='')}@127.0.0.1:{srv.port}/0",
        ):
            with pytest.raises((ConfigError, BackendUnavailableError)) as err:
                backend(url)
            text = f"{err.value!r} {err.value} {err.value.__cause__!r}"
            for part in (password, quote(password, safe=""), password.split("#")[0]):
                assert part not in text


def test_the_db_option_wins_over_the_url(server: RedisServer) -> None:
    b = backend(server.url, db=5)  # the URL says /0
    r0, r5 = raw(server.url), raw(server.url.rsplit("/", 1)[0] + "/5")
    try:
        assert b.set("k", torch.ones(10, dtype=torch.uint8))
        key = b._prefix + b.object_path("k")
        assert r5.exists(key) == 1
        assert r0.exists(key) == 0
    finally:
        b.clear()
        b.close()
        r0.close()
        r5.close()


def test_more_threads_than_connections_wait_for_one(server: RedisServer) -> None:
    import threading

    b = backend(server.url, max_concurrency=2)
    failures: list[object] = []
    value = [torch.full((4096,), 1, dtype=torch.uint8)] * 16

    def work(t: int) -> None:
        for i in range(10):
            keys = [f"t{t}-{i}-{j}" for j in range(16)]
            if not all(b.batch_set(keys, value)) or b.batch_exists(keys) != 16:
                failures.append((t, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert failures == []
        assert b.get_stats().ops["batch_set"].errors == 0
    finally:
        b.clear()
        b.close()


def test_a_full_server_fails_only_the_pages_it_refused(tmp_path: Path) -> None:
    """maxmemory with noeviction: the pages that fit are stored and reported so, the
    others fail alone (not the whole batch), and nothing reported stored is missing."""
    with running(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as srv:
        b = backend(srv.url)
        try:
            keys = [f"k{i}" for i in range(40)]
            got = b.batch_set(
                keys, [torch.full((100_000,), i, dtype=torch.uint8) for i in range(40)]
            )
            assert any(got)
            assert not all(got)
            for key, ok in zip(keys, got, strict=True):
                assert b.exists(key) is ok
            assert b.set("one-more", torch.ones(100_000, dtype=torch.uint8)) is False
        finally:
            b.close()


def test_a_server_killed_mid_use_gives_failure_shapes_then_recovers(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)
    srv.start()
    b = backend(srv.url, socket_timeout=1.0, connect_timeout=0.5)
    try:
        value = torch.full((128,), 3, dtype=torch.uint8)
        assert b.set("before", value)
        srv.stop()
        t0 = time.monotonic()
        assert b.batch_set(["a", "b"], [value, value]) == [False, False]
        assert b.batch_exists(["before"]) == 0
        assert b.get("before") is None
        assert time.monotonic() - t0 < 15  # bounded by the timeouts, no hang
        assert b.get_stats().ops["batch_set"].errors >= 1
        srv.start()  # same port, empty (no persistence)
        assert b.set("after", value) is True  # the same instance recovers
        got = b.get("after")
        assert got is not None
        assert torch.equal(got, value)
    finally:
        b.close()
        srv.stop()


def test_pages_the_server_evicted_are_misses(tmp_path: Path) -> None:
    """maxmemory with allkeys-lru: the server drops pages to make room; a dropped page is
    a miss (never another page's bytes), the leading run stops at it, the rest read back."""
    with running(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru") as srv:
        b = backend(srv.url)
        try:
            keys = [f"k{i}" for i in range(60)]
            for i, key in enumerate(keys):
                assert b.set(key, torch.full((100_000,), i, dtype=torch.uint8))
            present = [b.exists(k) for k in keys]
            assert not all(present)  # some were evicted
            assert any(present)
            assert b.batch_exists(keys) == present.index(False)
            for i, key in enumerate(keys):
                got = b.get(key)  # reads add nothing: the server evicts no more now
                assert (got is not None) == present[i]
                if got is not None:
                    assert torch.equal(got, torch.full((100_000,), i, dtype=torch.uint8))
        finally:
            b.close()


class TestRedisClusterConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, cluster: RedisClusterServers) -> BackendSpec:
        opts = {"url": cluster.url, "cluster": True, "prefix": f"kit-{uuid.uuid4().hex[:8]}:",
                "socket_timeout": 2.0, "connect_timeout": 1.0}  # fmt: skip
        return BackendSpec("redis", opts)

    @pytest.fixture
    def break_store(self, cluster: RedisClusterServers) -> Callable[[object], Any]:
        """Every node killed, then started again (same ports and node ids, no data)."""

        @contextlib.contextmanager
        def broken(_backend: object) -> Iterator[None]:
            cluster.stop()
            try:
                yield
            finally:
                for node in cluster.nodes:
                    node.start()
                cluster.wait_settled()

        return broken


def test_a_cluster_spreads_pages_over_its_nodes_and_clear_reaches_every_one(
    cluster: RedisClusterServers,
) -> None:
    nodes = [raw(n.url) for n in cluster.nodes]
    start = sum(len(n.client_list()) for n in nodes)  # ours, and what other tests left
    b = backend(cluster.url, "a", cluster=True)
    other = backend(cluster.url, "b", cluster=True, prefix=b._prefix)
    try:
        keys = [f"k{i}" for i in range(200)]
        values = [torch.full((512,), i % 251, dtype=torch.uint8) for i in range(200)]
        assert all(b.batch_set(keys, values))
        assert all(other.batch_set(keys[:20], values[:20]))
        pattern = b._prefix + b.namespace.digest + "/*"
        per_node = [len(list(n.scan_iter(match=pattern))) for n in nodes]
        assert sum(per_node) == 200
        assert min(per_node) > 0  # every primary holds some of them
        assert b.batch_exists(keys) == 200
        for i in (0, 57, 199):
            got = b.get(keys[i])
            assert got is not None
            assert torch.equal(got, values[i])
        b.clear()
        assert [len(list(n.scan_iter(match=pattern))) for n in nodes] == [0, 0, 0]
        assert b.batch_exists(keys) == 0
        assert other.batch_exists(keys[:20]) == 20
        other.clear()
        assert sum(len(n.client_list()) for n in nodes) > start
        b.close()  # closes its connections to every node
        other.close()
        assert sum(len(n.client_list()) for n in nodes) == start
    finally:
        b.close()
        other.close()
        for n in nodes:
            n.close()


def test_a_cluster_has_one_database(cluster: RedisClusterServers) -> None:
    with pytest.raises(ConfigError, match="only db 0"):
        backend(cluster.url, cluster=True, db=1)


def test_cluster_mode_must_match_the_server(
    cluster: RedisClusterServers, server: RedisServer
) -> None:
    """A cluster node without cluster=true (every batch would miss) and a standalone
    server with it are errors at construction, not failures of every later call."""
    with pytest.raises(ConfigError, match="cluster to true"):
        backend(cluster.url)
    with pytest.raises(BackendUnavailableError):
        backend(server.url, cluster=True)
    with pytest.raises(BackendUnavailableError):
        backend(f"redis://127.0.0.1:{free_port()}/0", cluster=True, connect_timeout=0.5)


def test_large_page_parts_go_to_the_socket_as_views_of_the_page(server: RedisServer) -> None:
    """A page over the inline size is sent as a view of the caller's memory: neither
    joined with its header nor copied into one command string by the packer."""
    import numpy as np

    b = backend(server.url)
    sent: list[bytes | memoryview] = []
    try:
        conn = b._client.connection_pool.get_connection()
        packed = conn.pack_commands
        b._client.connection_pool.release(conn)

        def spy(commands: object) -> list[bytes | memoryview]:
            out: list[bytes | memoryview] = packed(commands)
            sent.extend(out)
            return out

        conn.pack_commands = spy
        k, v = torch.arange(100_000, dtype=torch.int32), torch.arange(50_000, dtype=torch.int16)
        kv = PageBuffer([Segment(t.data_ptr(), t.nbytes, memoryview(t.numpy().data).cast("B"))
                         for t in (k, v)])  # fmt: skip
        assert b.batch_set(["kv"], [kv]) == [True]
        addresses = {np.frombuffer(c, dtype=np.uint8).ctypes.data for c in sent
                     if isinstance(c, memoryview)}  # fmt: skip
        assert {k.data_ptr(), v.data_ptr()} <= addresses
        # nothing as large as a segment went as a copy
        assert all(len(c) < v.nbytes for c in sent if not isinstance(c, memoryview))
        got = b.get("kv")
        assert got is not None
        assert bytes(got.numpy()) == bytes(k.numpy()) + bytes(v.numpy())
    finally:
        b.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_tls_with_the_test_ca(tmp_path: Path, tls_files: TlsFiles) -> None:
    """rediss:// verifies the server against the CA given (a certificate the client cannot
    verify is a ConfigError at construction), and pages cross TLS byte-exact."""
    with running(tmp_path, tls=tls_files) as srv:
        b = backend(srv.url, ssl_ca_certs=str(tls_files.ca))
        try:
            page = torch.arange(2 << 20, dtype=torch.uint8)  # over the inline size: views
            small = torch.full((100,), 7, dtype=torch.uint8)
            assert b.batch_set(["big", "small"], [page, small]) == [True, True]
            assert b.batch_exists(["big", "small", "none"]) == 2
            got = b.get("big")
            assert got is not None
            assert torch.equal(got, page)
        finally:
            b.close()
        with pytest.raises(ConfigError, match="TLS handshake failed"):
            backend(srv.url)  # the system's CAs do not know the test CA
        plain = srv.url.replace("rediss://", "redis://")
        with pytest.raises(BackendUnavailableError):
            backend(plain, socket_timeout=1.0, connect_timeout=1.0)
        unchecked = backend(srv.url, ssl_cert_reqs="none")
        try:
            assert unchecked.set("k", small) is True
        finally:
            unchecked.close()


def test_tls_options_are_checked_at_construction(tmp_path: Path, tls_files: TlsFiles) -> None:
    with pytest.raises(ConfigError, match="need a rediss:// url"):
        backend("redis://127.0.0.1:1/0", ssl_ca_certs=str(tls_files.ca))
    with pytest.raises(ConfigError, match="not a file"):
        backend("rediss://127.0.0.1:1/0", ssl_ca_certs=str(tmp_path / "missing.crt"))
    with pytest.raises(ConfigError, match="needs ssl_certfile"):
        backend("rediss://127.0.0.1:1/0", ssl_keyfile=str(tls_files.client_key))


#: Each TLS option (and the URL's own ssl_* parameters), as options given with a plaintext url.
_TLS_OPTIONS: dict[str, Callable[[TlsFiles], dict[str, Any]]] = {
    "ssl_cert_reqs": lambda _: {"ssl_cert_reqs": "required"},
    "ssl_check_hostname": lambda _: {"ssl_check_hostname": True},
    "ssl_ca_certs": lambda f: {"ssl_ca_certs": str(f.ca)},
    "ssl_certfile": lambda f: {"ssl_certfile": str(f.client_cert)},
    "ssl_keyfile": lambda f: {"ssl_keyfile": str(f.client_key), "ssl_certfile": str(f.client_cert)},
    "ssl_cert_reqs (in the url)": lambda _: {"query": "?ssl_cert_reqs=required"},
    "ssl_check_hostname (in the url)": lambda _: {"query": "?ssl_check_hostname=true"},
}


@pytest.mark.parametrize("option", list(_TLS_OPTIONS))
@pytest.mark.parametrize("scheme", ["redis", "unix"])
def test_a_tls_option_with_a_plaintext_url_is_a_config_error(
    server: RedisServer, tls_files: TlsFiles, option: str, scheme: str
) -> None:
    """A TLS option with redis:// (a live server that would take plaintext) or unix:// is
    refused by name, not ignored."""
    options = _TLS_OPTIONS[option](tls_files)
    url = server.url if scheme == "redis" else "unix:///nonexistent/r.sock"
    url += str(options.pop("query", ""))
    with pytest.raises(ConfigError, match=re.escape(option)) as caught:
        backend(url, **options).close()
    assert "need a rediss:// url" in str(caught.value)
    assert "use rediss://" in str(caught.value)


def test_tls_with_a_client_certificate(tmp_path: Path, tls_files: TlsFiles) -> None:
    """A server that asks for client certificates takes ours and refuses a client without."""
    with running(tmp_path, tls=tls_files, client_auth=True) as srv:
        ca = str(tls_files.ca)
        b = backend(srv.url, ssl_ca_certs=ca, ssl_certfile=str(tls_files.client_cert),
                    ssl_keyfile=str(tls_files.client_key))  # fmt: skip
        try:
            assert b.set("k", torch.ones(10, dtype=torch.uint8)) is True
            assert b.exists("k") is True
        finally:
            b.close()
        with pytest.raises((ConfigError, BackendUnavailableError)):
            backend(srv.url, ssl_ca_certs=ca)


def test_a_unix_socket_server() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rds") as d:  # short: socket paths are limited
        sock = Path(d) / "r.sock"
        with running(Path(d), unix_socket=sock) as srv:
            b = backend(srv.url)
            other = backend(f"unix://{sock}", db=3)
            try:
                page = torch.arange(300_000, dtype=torch.int32)
                assert b.set("k", page) is True
                got = b.get("k")
                assert got is not None
                assert got.view(torch.int32).equal(page)
                assert other.exists("k") is False  # db 3, not 0
                assert "unix:" in repr(b)
                b.clear()
                assert b.exists("k") is False
            finally:
                b.close()
                other.close()


def _slot_owner(cluster: RedisClusterServers, key: str) -> tuple[int, RedisServer]:
    import redis
    from redis.crc import key_slot

    slot = key_slot(key.encode())
    for node in cluster.nodes:
        r = redis.Redis(port=node.port)
        try:
            for start, end, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end and _[0][1] == node.port:
                    return slot, node
        finally:
            r.close()
    raise AssertionError(f"no node owns slot {slot}")


def test_a_cluster_node_killed_mid_use_fails_its_pages_then_recovers(tmp_path: Path) -> None:
    """Pages on a killed node give failure shapes within the timeouts while the other
    nodes' pages are still served; once it is back (empty: no persistence) the same
    instance stores and reads there again."""
    with running_cluster(tmp_path) as cluster:
        b = backend(cluster.url, cluster=True, socket_timeout=1.0, connect_timeout=0.5)
        try:
            keys = [f"k{i}" for i in range(60)]
            values = [torch.full((1000,), i, dtype=torch.uint8) for i in range(60)]
            assert all(b.batch_set(keys, values))
            owners = [_slot_owner(cluster, b._prefix + b.object_path(k))[1] for k in keys]
            victim = cluster.nodes[1]
            on_victim = [k for k, o in zip(keys, owners, strict=True) if o is victim]
            assert on_victim
            victim.stop()
            t0 = time.monotonic()
            got = b.batch_set(on_victim, values[: len(on_victim)])  # stored there before
            assert got == [False] * len(on_victim)
            assert b.batch_exists(on_victim) == 0
            assert b.get(on_victim[0]) is None
            # the other nodes' pages still come back, and still take writes
            for key, value, got_one in zip(keys, values, b.batch_get(keys), strict=True):
                if key in on_victim:
                    assert got_one is None
                else:
                    assert got_one is not None and torch.equal(got_one, value)
            more = b.batch_set(["more" + k for k in keys], values)
            assert 0 < more.count(True) < len(keys)
            assert time.monotonic() - t0 < 20  # bounded by the timeouts, no hang
            assert b.get_stats().ops["batch_set"].errors >= 1
            victim.start()  # same port and node id (its nodes.conf): empty slots back
            cluster.wait_settled()
            assert b.set(on_victim[0], values[0]) is True  # the same instance recovers
            got_back = b.get(on_victim[0])
            assert got_back is not None
            assert torch.equal(got_back, values[0])
            kept = [k for k, o in zip(keys, owners, strict=True) if o is not victim]
            assert b.batch_exists(kept) == len(kept)  # the other nodes kept theirs
        finally:
            b.close()


def test_pages_stay_right_while_their_slot_migrates(tmp_path: Path) -> None:
    """A slot moved live (MIGRATING/IMPORTING, MIGRATE of some keys, then the new owner):
    ASK and MOVED redirections are followed, no page is lost or wrong, clear() finds all."""
    import redis
    from redis.crc import key_slot

    with running_cluster(tmp_path) as cluster:
        b = backend(cluster.url, cluster=True)
        try:

            def full(name: str) -> str:
                return str(b._prefix + b.object_path(name))

            slot, source = _slot_owner(cluster, full("k0"))
            target = next(n for n in cluster.nodes if n is not source)
            # names whose keys share the slot of k0
            matches = (
                f"s{i}" for i in itertools.count() if key_slot(full(f"s{i}").encode()) == slot
            )
            same = ["k0", *itertools.islice(matches, 5)]  # (1 name in 16384 on average)
            assert len(same) == 6
            values = {k: torch.full((20_000,), i + 1, dtype=torch.uint8)
                      for i, k in enumerate(same)}  # fmt: skip
            assert all(b.batch_set(same[:4], [values[k] for k in same[:4]]))
            src, tgt = redis.Redis(port=source.port), redis.Redis(port=target.port)
            src_id, tgt_id = (
                src.execute_command("CLUSTER MYID"),
                tgt.execute_command("CLUSTER MYID"),
            )
            tgt.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", tgt_id)
            moved = [full(k) for k in same[:2]]
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *moved)
            # mid-migration: two pages on each node, ASK for those moved; an MGET of the
            # slot's keys is refused (TRYAGAIN): every page must still come back
            assert b.batch_exists(same[:4]) == 4
            for k, got_one in zip(same[:4], b.batch_get(same[:4]), strict=True):
                assert got_one is not None and torch.equal(got_one, values[k])
            for k in same[:4]:
                got = b.get(k)
                assert got is not None and torch.equal(got, values[k])
            assert b.set(same[4], values[same[4]]) is True  # a new key of a migrating slot
            got = b.get(same[4])
            assert got is not None and torch.equal(got, values[same[4]])
            # finish: move the rest, then every node learns the new owner (MOVED)
            rest = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            if rest:
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *rest)
            for node in cluster.nodes:
                r = redis.Redis(port=node.port)
                r.execute_command("CLUSTER SETSLOT", slot, "NODE", tgt_id)
                r.close()
            assert b.set(same[5], values[same[5]]) is True
            assert b.batch_exists(same) == 6
            for k in same:
                got = b.get(k)
                assert got is not None and torch.equal(got, values[k])
            assert tgt.dbsize() >= 6
            b.clear()
            assert b.batch_exists(same) == 0
            assert not list(tgt.scan_iter(match=b._prefix + "*"))
            src.close()
            tgt.close()
        finally:
            b.close()


def test_a_frozen_cluster_node_costs_one_timeout_not_one_per_key(tmp_path: Path) -> None:
    """A node that stops answering without closing its sockets (SIGSTOP): its pages fail
    after about one socket_timeout (redis-py alone re-sends each slot's command, one
    timeout each), the other nodes' pages still come back, and after SIGCONT all is well."""
    import signal

    with running_cluster(tmp_path) as cluster:
        b = backend(cluster.url, cluster=True, socket_timeout=1.0, connect_timeout=1.0)
        victim = cluster.nodes[2]
        try:
            keys = [f"k{i}" for i in range(90)]
            values = [torch.full((2000,), i, dtype=torch.uint8) for i in range(90)]
            assert all(b.batch_set(keys, values))
            frozen = {
                k for k in keys if _slot_owner(cluster, b._prefix + b.object_path(k))[1] is victim
            }
            assert len(frozen) > 10
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGSTOP)
            for _ in range(3):  # the first batch meets the node; the next ones skip it
                t0 = time.monotonic()
                got = b.batch_get(keys)
                took = time.monotonic() - t0
                for k, v, g in zip(keys, values, got, strict=True):
                    if k in frozen:
                        assert g is None
                    else:
                        assert g is not None and torch.equal(g, v)
                assert took < 8, took  # one timeout (1 s) plus slack; per key it was > 25 s
            t0 = time.monotonic()
            on_frozen = sorted(frozen)
            assert b.batch_set(on_frozen, values[: len(on_frozen)]) == [False] * len(on_frozen)
            assert 0 < b.batch_set(["n" + k for k in keys], values).count(True) < 90
            assert b.batch_exists(on_frozen) == 0
            assert time.monotonic() - t0 < 16
            victim.proc.send_signal(signal.SIGCONT)
            cluster.wait_settled()
            time.sleep(b._pause())  # the node is left alone for a while after it failed
            assert b.batch_exists(keys) == 90  # then its pages are back (never lost)
        finally:
            if victim.proc is not None:
                victim.proc.send_signal(signal.SIGCONT)
            b.close()


def test_pages_survive_a_killed_server_with_an_fsynced_append_only_file(tmp_path: Path) -> None:
    """With ``appendonly yes`` and ``appendfsync always``, every page whose set returned
    True is there, byte-exact and readable by the same instance, after SIGKILL and a
    restart (without persistence the restarted server is empty: the kill test above)."""
    srv = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    srv.start()
    b = backend(srv.url, socket_timeout=2.0, connect_timeout=1.0)
    try:
        keys = [f"k{i}" for i in range(40)]
        values = [torch.full((50_000,), i, dtype=torch.uint8) for i in range(40)]
        assert all(b.batch_set(keys, values))
        srv.stop()  # SIGKILL: no shutdown save
        srv.start()
        assert b.batch_exists(keys) == 40
        for key, value in zip(keys, values, strict=True):
            got = b.get(key)
            assert got is not None and torch.equal(got, value)
        assert b.get_stats().corrupt_objects == 0
    finally:
        b.close()
        srv.stop()


def test_only_tls_failures_of_configuration_are_config_errors() -> None:
    """A certificate that does not verify is the configuration's fault; a handshake cut
    short (a server at maxclients drops the connection) is the server's state."""
    import ssl

    from hicache_storage.backends._redis.backend import _tls_refused

    def wrapped(inner: BaseException) -> Exception:
        outer = ConnectionError("Error connecting")
        outer.__cause__ = inner
        return outer

    assert _tls_refused(wrapped(ssl.SSLCertVerificationError(1, "certificate verify failed")))
    assert not _tls_refused(wrapped(ssl.SSLEOFError(8, "EOF occurred in violation of protocol")))
    assert not _tls_refused(
        wrapped(ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed"))
    )
    assert not _tls_refused(wrapped(OSError("Connection refused")))


def test_the_tiered_workload_is_byte_exact_on_redis(server: RedisServer) -> None:
    from tier_replay import replay_small

    result, cache = replay_small(
        "redis", {"url": server.url, "prefix": f"tier-{uuid.uuid4().hex[:8]}:"}
    )
    assert result.verification_errors == 0 and result.verified_pages > 0
    assert result.storage_hit_tokens > 0 and cache.stats.backup_failed_tokens == 0
