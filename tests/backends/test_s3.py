"""The ``s3`` backend against a real S3 server (moto's, started by these tests), and over
other fsspec filesystems (``memory://``, ``file://``)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import BackendUnavailableError, ConfigError

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from fault_proxy import FaultProxy
from moto_server import MotoServer, running_moto
from redis_server import free_port

BUCKET = "hicache-test"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with running_moto() as srv:
        srv.make_bucket(BUCKET)
        yield srv


def options(srv: MotoServer, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "bucket": BUCKET, "prefix": f"t-{uuid.uuid4().hex[:8]}", "endpoint_url": srv.endpoint,
        "region": "us-east-1", "key": srv.key, "secret": srv.secret,
    }  # fmt: skip
    opts.update(extra)
    return opts


def backend(tenant: str = "t", **opts: Any):  # -> S3Backend
    from hicache_storage.backends import S3Backend

    ns = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4, tenant=tenant)
    return S3Backend(StorageConfig(namespace=ns), **opts)


def page(value: int, n: int = 4096) -> torch.Tensor:
    return torch.full((n,), value % 256, dtype=torch.uint8)


class TestS3Conformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, moto: MotoServer) -> BackendSpec:
        return BackendSpec("s3", options(moto, deadline=20.0))

    @pytest.fixture
    def break_store(self, moto: MotoServer) -> Callable[[object], Any]:
        """The server killed, then started again on its port (empty: the bucket is made
        again, as an operator would)."""

        @contextlib.contextmanager
        def broken(_backend: object) -> Iterator[None]:
            moto.stop()
            try:
                yield
            finally:
                moto.start()
                moto.make_bucket(BUCKET)

        return broken


class TestFsspecMemoryConformance(BackendConformance):
    """The same backend over fsspec's in-process ``memory://`` filesystem."""

    @pytest.fixture
    def backend_spec(self) -> BackendSpec:
        return BackendSpec("s3", {"url": f"memory://hicache-kit-{uuid.uuid4().hex[:8]}"})


class TestFsspecLocalConformance(BackendConformance):
    """The same backend over fsspec's ``file://`` filesystem (temporary name, then rename)."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec("s3", {"url": f"file://{tmp_path}/kit"})


def test_round_trip_first_writer_wins_and_misses(moto: MotoServer) -> None:
    b = backend(**options(moto))
    try:
        keys = [f"k{i}" for i in range(20)]
        assert b.batch_set(keys, [page(i) for i in range(20)]) == [True] * 20
        assert b.set("k0", page(99)) is True  # already stored: kept, not replaced
        got = b.batch_get([*keys, "absent"])
        assert got[-1] is None
        for i, g in enumerate(got[:-1]):
            assert g is not None and torch.equal(g, page(i))
        assert b.batch_exists([*keys[:5], "absent", *keys[5:]]) == 5
        assert b.delete("k3") is True
        assert b.delete("k3") is False
        assert b.batch_exists(keys) == 3
    finally:
        b.clear()
        b.close()


@pytest.mark.parametrize("where", ["s3", "memory", "file"])
def test_two_writers_racing_on_one_key_leave_one_whole_value(
    moto: MotoServer, where: str, tmp_path: Path
) -> None:
    """First writer wins under a race: on S3 by conditional writes (If-None-Match: *),
    on memory:// by one step in this process, on file:// by a link of a whole temporary
    file. One value is stored, whole, and every later read of every instance returns it."""
    opts = {
        "s3": options(moto),
        "memory": {"url": f"memory://race-{uuid.uuid4().hex[:8]}"},
        "file": {"url": f"file://{tmp_path}/race"},
    }[where]
    writers = [backend(**opts) for _ in range(4)]
    try:
        keys = [f"race{i}" for i in range(10)]
        start = threading.Barrier(len(writers))
        results: list[list[bool]] = []

        def write(w: int) -> None:
            start.wait()
            results.append(writers[w].batch_set(keys, [page(w, 70_000)] * len(keys)))

        threads = [threading.Thread(target=write, args=(w,)) for w in range(len(writers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(all(r) for r in results)  # each is told the key holds a value
        written = sum(w.get_stats().bytes_written for w in writers)
        assert written == len(keys) * 70_000  # one value stored per key, not one per writer
        for key in keys:
            seen = {bytes(w.get(key).numpy()) for w in writers}
            assert len(seen) == 1
            (value,) = seen
            assert value in {bytes(page(w, 70_000).numpy()) for w in range(len(writers))}
    finally:
        writers[0].clear()
        for w in writers:
            w.close()


def test_clear_removes_this_namespace_only(moto: MotoServer) -> None:
    opts = options(moto)
    mine, other = backend("a", **opts), backend("b", **opts)
    s3 = moto.client()
    try:
        keys = [f"k{i}" for i in range(30)]
        assert all(mine.batch_set(keys, [page(1)] * 30))
        assert all(other.batch_set(keys, [page(2)] * 30))
        lookalike = f"{opts['prefix']}/{mine.namespace.digest}x/00/k"  # same start, not ours
        s3.put_object(Bucket=BUCKET, Key=lookalike, Body=b"foreign")
        mine.clear()
        assert mine.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 30
        assert s3.get_object(Bucket=BUCKET, Key=lookalike)["Body"].read() == b"foreign"
        assert all(mine.batch_set(keys, [page(1)] * 30))  # usable again
    finally:
        mine.clear()
        other.clear()
        mine.close()
        other.close()


@pytest.mark.parametrize("where", ["s3", "memory", "file"])
@pytest.mark.parametrize("tenant", ["a", "b"])
def test_clear_leaves_a_prefix_nested_in_its_namespace(
    moto: MotoServer, where: str, tenant: str, tmp_path: Path
) -> None:
    """B's prefix is A's prefix plus A's namespace digest: A.clear() removes A's pages only
    (B in A's own namespace, and in another), and B's unfinished multipart upload stays."""
    opts = {
        "s3": options(moto),
        "memory": {"url": f"memory://nest-{uuid.uuid4().hex[:8]}", "prefix": "p"},
        "file": {"url": f"file://{tmp_path}/nest", "prefix": "p"},
    }[where]
    a = backend("a", **opts)
    b = backend(tenant, **{**opts, "prefix": f"{opts['prefix']}/{a.namespace.digest}"})
    try:
        keys = [f"k{i}" for i in range(20)]
        assert all(a.batch_set(keys, [page(1, 64)] * 20))
        assert all(b.batch_set(keys, [page(2, 64)] * 20))
        upload = None
        if where == "s3":
            key = b._key_prefix() + b.object_path("unfinished")
            upload = moto.client().create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        a.clear()
        assert a.batch_exists(keys) == 0
        assert b.batch_exists(keys) == 20
        got = b.get("k3")
        assert got is not None and torch.equal(got, page(2, 64))
        if upload is not None:
            listed = moto.client().list_multipart_uploads(Bucket=BUCKET, Prefix=b._key_prefix())
            assert [u["UploadId"] for u in listed.get("Uploads", [])] == [upload]
            moto.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload)
        b.clear()
        assert b.batch_exists(keys) == 0
    finally:
        a.close()
        b.close()


def test_clear_pages_through_more_than_one_listing(moto: MotoServer) -> None:
    b = backend(**options(moto, max_concurrency=16))
    try:
        keys = [f"k{i}" for i in range(1100)]  # over 1000: two listings, two deletes
        for i in range(0, 1100, 100):
            assert all(b.batch_set(keys[i : i + 100], [page(j, 64) for j in range(i, i + 100)]))
        b.clear()
        assert b.batch_exists(keys[:1]) == 0
        assert b.batch_exists(keys[-1:]) == 0
        assert (
            not moto.client().list_objects_v2(Bucket=BUCKET, Prefix=b._key_prefix()).get("Contents")
        )
    finally:
        b.close()


def test_short_truncated_and_foreign_objects_are_misses(moto: MotoServer) -> None:
    b = backend(**options(moto))
    s3 = moto.client()
    try:
        assert b.set("good", page(5, 1000))
        key = b._key_prefix() + b.object_path("good")
        stored = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=key, Body=stored[:-10])  # truncated behind our back
        assert b.get("good") is None
        s3.put_object(Bucket=BUCKET, Key=b._key_prefix() + b.object_path("short"), Body=b"x" * 10)
        assert b.exists("short") is False  # shorter than any header: not ours
        assert b.get("short") is None  # ...and removed, so that a good one can be stored
        assert b.set("short", page(6, 500)) is True
        got = b.get("short")
        assert got is not None and torch.equal(got, page(6, 500))
        s3.put_object(Bucket=BUCKET, Key=b._key_prefix() + b.object_path("empty"), Body=b"")
        assert b.get("empty") is None
        assert b.set("empty", page(8)) is True
        assert b.exists("empty") is True
        s3.put_object(Bucket=BUCKET, Key=b._key_prefix() + b.object_path("planted"),
                      Body=b"\x00" * 300)  # fmt: skip
        assert b.get("planted") is None
        assert b.get_stats().corrupt_objects >= 3
        assert b.set("good", page(5, 1000)) is True  # the bad value was removed: stored again
        got = b.get("good")
        assert got is not None and torch.equal(got, page(5, 1000))
    finally:
        b.clear()
        b.close()


def _framed(b: Any, key: str, payload: bytes) -> bytes:
    """A well-formed object (header and payload) for ``key`` in ``b``'s namespace."""
    from hicache_storage.storekit.header import algorithm_id, checksum, encode_header

    path, alg = b.object_path(key), algorithm_id("xxh3")
    return encode_header(len(payload), checksum([memoryview(payload)], alg), alg, path) + payload


def _plant(moto: MotoServer, b: Any, key: str, data: bytes) -> None:
    """``data`` as the object of ``key``, written behind the backend's back."""
    path = b._path(b.object_name(key))
    if b._s3:
        moto.client().put_object(Bucket=BUCKET, Key=path.split("/", 1)[1], Body=data)
    elif b._protocol == "memory":
        import fsspec

        fsspec.filesystem("memory").pipe_file(path, data)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)


@pytest.mark.parametrize("where", ["s3", "memory", "file"])
def test_a_planted_object_that_is_not_a_page_never_holds_its_key(
    moto: MotoServer, where: str, tmp_path: Path
) -> None:
    """A well-formed object of the wrong length is a miss removed by the first read; an
    empty or short one is not counted by exists, and set stores the page over it (it
    never answers True for a page it did not store), as over a well-formed object of the
    wrong length, shorter or longer, that no read has met."""
    opts = {
        "s3": options(moto),
        "memory": {"url": f"memory://planted-{uuid.uuid4().hex[:8]}"},
        "file": {"url": f"file://{tmp_path}/planted"},
    }[where]
    b = backend(**opts)
    try:
        for i in range(3):
            _plant(moto, b, f"short{i}", _framed(b, f"short{i}", b"x" * 100))
            _plant(moto, b, f"empty{i}", b"")
            _plant(moto, b, f"tiny{i}", b"x" * 10)
            _plant(moto, b, f"unread{i}", _framed(b, f"unread{i}", b"x" * (100 + 8000 * i)))
        short = [f"short{i}" for i in range(3)]
        others = [f"{kind}{i}" for kind in ("empty", "tiny") for i in range(3)]
        assert b.batch_exists(short) == 3  # (only a read can tell)
        targets = [torch.zeros(4096, dtype=torch.uint8) for _ in short]
        assert b.batch_get(short, targets) == [None] * 3
        assert all(not t.any() for t in targets)
        assert b.get_stats().size_mismatches == 3
        assert b.batch_exists(short[:1]) == 0  # removed by the read
        assert not any(b.exists(k) for k in others)
        keys = short + others + [f"unread{i}" for i in range(3)]
        assert b.batch_set(keys, [page(7)] * len(keys)) == [True] * len(keys)
        assert b.get_stats().bytes_written == len(keys) * 4096  # each stored, none "present"
        for key in keys:
            got = b.get(key, torch.zeros(4096, dtype=torch.uint8))
            assert got is not None and torch.equal(got, page(7))
    finally:
        b.clear()
        b.close()


def test_a_bad_object_is_removed_only_while_it_is_still_there(moto: MotoServer) -> None:
    """The removal is a DELETE with If-Match (the ETag of the object read): a good page
    that another writer stored after the bad object was read is kept."""
    from hicache_storage.backends._s3.objects import Read as _Read

    b = backend(**options(moto))
    s3 = moto.client()
    try:
        name = b.object_name("k")
        key = b._key_prefix() + name.path
        bad, good = _framed(b, "k", b"x" * 100), _framed(b, "k", b"y" * 4096)
        s3.put_object(Bucket=BUCKET, Key=key, Body=bad)
        seen = _Read(bad, s3.head_object(Bucket=BUCKET, Key=key)["ETag"])
        s3.put_object(Bucket=BUCKET, Key=key, Body=good)  # replaced meanwhile
        assert b._delete_blobs_if_bad([name], [seen], [len(good)]) == [False]
        assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == good
        s3.put_object(Bucket=BUCKET, Key=key, Body=bad)
        assert b.get("k", torch.zeros(4096, dtype=torch.uint8)) is None  # read, then removed
        assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=key)
    finally:
        b.clear()
        b.close()


def test_a_huge_planted_object_is_never_read_whole(moto: MotoServer) -> None:
    """4 objects of 4 MiB under the keys of 4 KiB pages: a batch read is 4 misses,
    counted corrupt and removed, and about the pages' size crosses the wire (Range), not
    16 MiB (the bytes of answers a proxy in front of the server sent)."""
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint))
    keys = [f"huge{i}" for i in range(4)]
    try:
        for key in keys:
            _plant(moto, b, key, _framed(b, key, bytes(4 << 20)))
        targets = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        before = proxy.bytes_out
        assert b.batch_get(keys, targets) == [None] * 4
        cost = proxy.bytes_out - before
        assert cost < 4 * (4096 + 49) + 64 * 1024, f"{cost} bytes sent for 4 pages of 4 KiB"
        assert all(not t.any() for t in targets)
        assert b.get_stats().corrupt_objects == 4
        assert b.batch_exists(keys[:1]) == 0  # removed
        assert b.batch_set(keys, [page(1)] * 4) == [True] * 4
    finally:
        b.clear()
        b.close()
        proxy.close()


def test_a_server_that_ignores_range_still_costs_only_the_page(moto: MotoServer) -> None:
    """The whole 4 MiB objects are sent, but no more than a page (and one byte) of each
    is read into memory: the objects are refused and removed all the same. (The proxy
    streams the answers, so what tracemalloc sees at the peak is the client's.)"""
    import tracemalloc

    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint))
    keys = [f"whole{i}" for i in range(4)]
    try:
        for key in keys:
            _plant(moto, b, key, _framed(b, key, bytes(4 << 20)))
        targets = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        proxy.ignore_range = True
        tracemalloc.start()
        try:
            assert b.batch_get(keys, targets) == [None] * 4
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"{peak} bytes at the peak for 4 pages of 4 KiB"
        assert proxy.ranges_ignored >= 4  # the answers were whole objects
        assert b.get_stats().corrupt_objects == 4
        assert b.batch_exists(keys[:1]) == 0  # removed
    finally:
        proxy.ignore_range = False
        b.clear()
        b.close()
        proxy.close()


def test_a_missing_bucket_is_a_config_error(moto: MotoServer) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        backend(**options(moto, bucket="no-such-bucket"))
    with pytest.raises(ConfigError, match="bad bucket name"):
        backend(**options(moto, bucket="Bad_Bucket"))


def test_nothing_listening_is_unavailable_at_construction() -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        backend(bucket=BUCKET, endpoint_url=f"http://127.0.0.1:{free_port()}", key="k",
                secret="s", region="us-east-1", connect_timeout=1.0, retries=1)  # fmt: skip
    assert time.monotonic() - t0 < 15


def test_wrong_credentials_are_a_config_error_and_never_shown() -> None:
    with running_moto(enforce_auth=True) as srv:
        srv.make_bucket(BUCKET)
        good = backend(**options(srv))
        try:
            assert good.set("k", page(1)) is True
            assert srv.secret not in repr(good)
            assert srv.secret not in repr(good.options)
        finally:
            good.clear()
            good.close()
        with pytest.raises(ConfigError, match="refused the credentials") as err:
            backend(**options(srv, secret="wrong-secret-value-7"))
        assert "wrong-secret-value-7" not in f"{err.value} {err.value!r}"
        with pytest.raises(ConfigError, match="refused the credentials"):
            backend(**options(srv, key="AKIAUNKNOWNKEY000000"))


def test_object_keys_at_the_s3_length_limit(moto: MotoServer) -> None:
    """The longest key (200 characters) with a prefix that brings its object key to
    exactly 1024 bytes works; one byte more is refused at construction."""
    probe = backend(**options(moto, prefix="p"))
    fixed = len(probe._key_prefix()) - 1 + len(probe.object_path("x" * 200))  # all but the "p"
    probe.close()
    prefix = "p" * (1024 - fixed)
    b = backend(**options(moto, prefix=prefix))
    try:
        key = "k" * 200
        assert len((b._key_prefix() + b.object_path(key)).encode()) == 1024
        assert b.set(key, page(3)) is True
        got = b.get(key)
        assert got is not None and torch.equal(got, page(3))
    finally:
        b.clear()
        b.close()
    with pytest.raises(ConfigError, match="too long"):
        backend(**options(moto, prefix=prefix + "p"))


def test_large_pages_go_as_multipart_uploads(moto: MotoServer) -> None:
    """From multipart_threshold up a page is a multipart upload (parts of half the
    threshold), still first writer wins, and reads back byte-exact."""
    b = backend(**options(moto, multipart_threshold=10 * 2**20))
    try:
        big = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
        assert b.set("big", big) is True
        head = moto.client().head_object(Bucket=BUCKET, Key=b._key_prefix() + b.object_path("big"))
        assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB (+ the header)
        assert b.set("big", torch.zeros(12 * 2**20, dtype=torch.uint8)) is True  # kept
        got = b.get("big")
        assert got is not None and torch.equal(got, big)
        odd = backend(**options(moto, multipart_threshold=6 * 2**20))  # parts of 5 MiB (S3's least)
        try:
            six = torch.randint(0, 256, (6 * 2**20,), dtype=torch.uint8)
            assert odd.set("six", six) is True
            key = odd._key_prefix() + odd.object_path("six")
            assert (
                moto.client().head_object(Bucket=BUCKET, Key=key)["ETag"].strip('"').endswith("-2")
            )
            got = odd.get("six")
            assert got is not None and torch.equal(got, six)
        finally:
            odd.clear()
            odd.close()
        small = page(7, 100_000)
        assert b.set("small", small) is True
        head = moto.client().head_object(
            Bucket=BUCKET, Key=b._key_prefix() + b.object_path("small")
        )
        assert "-" not in head["ETag"]  # one PutObject
    finally:
        b.clear()
        b.close()


def test_batch_exists_asks_nothing_past_the_first_miss(moto: MotoServer) -> None:
    b = backend(**options(moto, exists_lookahead=4))
    asked: list[str] = []
    head = b._head_one

    async def counting(path: str) -> bool:
        asked.append(path)
        return await head(path)

    b._head_one = counting
    try:
        keys = [f"k{i}" for i in range(100)]
        assert all(b.batch_set(keys[:5], [page(i) for i in range(5)]))
        assert b.batch_exists(keys) == 5
        assert len(asked) <= 5 + 8  # the run, then at most the window (4, doubled after 4 hits)
        asked.clear()
        assert b.batch_exists(keys[5:]) == 0
        assert len(asked) <= 4  # a miss first: at most the first window
        asked.clear()
        assert all(b.batch_set(keys, [page(i) for i in range(100)]))
        assert b.batch_exists(keys) == 100
        assert len(asked) == 100
    finally:
        b.clear()
        b.close()


def test_the_negative_cache_answers_absent_for_its_ttl(moto: MotoServer) -> None:
    opts = options(moto)
    cached = backend(**opts, negative_cache_ttl=1.0)
    writer = backend(**opts)
    try:
        assert cached.exists("k") is False
        assert writer.set("k", page(1)) is True
        assert cached.exists("k") is False  # remembered absent (another writer's page)
        time.sleep(1.1)
        assert cached.exists("k") is True
        assert cached.exists("k2") is False
        assert cached.set("k2", page(2)) is True  # its own write forgets the absence
        assert cached.exists("k2") is True
    finally:
        writer.clear()
        cached.close()
        writer.close()


def test_throttling_is_retried_with_backoff(moto: MotoServer) -> None:
    """503 SlowDown answers are retried (the caller sees successes); a store that keeps
    throttling past the retries gives failure shapes, not exceptions."""
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, retries=4))
    try:
        proxy.slowdowns_left = 6  # spread over the first requests of the batch
        assert b.batch_set([f"k{i}" for i in range(8)], [page(i) for i in range(8)]) == [True] * 8
        assert proxy.slowdowns_left == 0
        proxy.slowdowns_left = 3
        got = b.batch_get([f"k{i}" for i in range(8)])
        assert all(g is not None and torch.equal(g, page(i)) for i, g in enumerate(got))
        proxy.slowdowns_left = 10_000  # throttled for good
        assert b.batch_set(["x1", "x2"], [page(1), page(2)]) == [False, False]
        assert b.get("k0") is None
        assert b.get_stats().ops["batch_set"].errors >= 2
        proxy.slowdowns_left = 0
        assert b.set("x1", page(1)) is True
    finally:
        proxy.slowdowns_left = 0
        b.clear()
        b.close()
        proxy.close()


def test_a_call_that_hangs_ends_at_its_deadline(moto: MotoServer) -> None:
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, deadline=2.0, read_timeout=30.0))
    try:
        assert b.set("k", page(1)) is True
        proxy.stalled.set()
        t0 = time.monotonic()
        assert b.batch_get(["k"]) == [None]
        assert b.batch_exists(["k"]) == 0
        assert b.set("k2", page(2)) is False
        assert time.monotonic() - t0 < 12  # three calls, a 2 s deadline each
        proxy.stalled.clear()
        got = b.get("k")  # the same instance goes on
        assert got is not None and torch.equal(got, page(1))
    finally:
        proxy.stalled.clear()
        b.clear()
        b.close()
        proxy.close()


def test_a_server_stopped_mid_use_gives_failure_shapes_then_recovers() -> None:
    srv = MotoServer()
    srv.start()
    srv.make_bucket(BUCKET)
    b = backend(**options(srv, deadline=5.0, connect_timeout=1.0, retries=2))
    try:
        assert b.set("before", page(1)) is True
        srv.stop()
        t0 = time.monotonic()
        assert b.batch_set(["a", "b"], [page(2), page(3)]) == [False, False]
        assert b.batch_exists(["before"]) == 0
        assert b.get("before") is None
        assert time.monotonic() - t0 < 20
        assert b.get_stats().ops["batch_set"].errors >= 1
        srv.start()  # same port, empty (moto keeps nothing)
        srv.make_bucket(BUCKET)
        assert b.set("after", page(4)) is True  # the same instance recovers
        got = b.get("after")
        assert got is not None and torch.equal(got, page(4))
    finally:
        b.close()
        srv.stop()


def test_engine_threads_share_the_loop(moto: MotoServer) -> None:
    b = backend(**options(moto, max_concurrency=4))
    failures: list[object] = []

    def work(t: int) -> None:
        for i in range(5):
            keys = [f"t{t}-{i}-{j}" for j in range(8)]
            values = [page(t * 100 + i * 10 + j, 2048) for j in range(8)]
            if not all(b.batch_set(keys, values)):
                failures.append(("set", t, i))
            got = b.batch_get(keys)
            if not all(
                g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True)
            ):
                failures.append(("get", t, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert failures == []
    finally:
        b.clear()
        b.close()


def _child_round_trip(opts: dict[str, Any], queue: Any) -> None:
    b = _CHILD_BACKEND[0]
    try:
        ok = b.set("from-child", page(42)) is True
        got = b.get("from-parent")
        queue.put(ok and got is not None and bool(torch.equal(got, page(41))))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


_CHILD_BACKEND: list[Any] = []


def test_a_forked_child_gets_a_loop_of_its_own(moto: MotoServer) -> None:
    """Threads do not survive fork: a child using the parent's instance starts a new
    event loop and client, and works."""
    opts = options(moto)
    b = backend(**opts)
    _CHILD_BACKEND[:] = [b]
    try:
        assert b.set("from-parent", page(41)) is True
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_round_trip, args=(opts, queue))
        child.start()
        answer = queue.get(timeout=60)
        child.join(30)
        assert answer is True
        got = b.get("from-child")  # and the parent's loop still works
        assert got is not None and torch.equal(got, page(42))
    finally:
        _CHILD_BACKEND.clear()
        b.clear()
        b.close()


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="either url"):
        backend()
    with pytest.raises(ConfigError, match="either url"):
        backend(url="s3://abc/x", bucket="abc")
    with pytest.raises(ConfigError, match="no fsspec filesystem"):
        backend(url="nosuchproto://x")
    with pytest.raises(ConfigError):
        backend(url="memory://x", max_concurrency=0)
    with pytest.raises(ConfigError, match="JSON object"):
        backend(url="memory://x", storage_options="[1]")


def test_an_s3_url_names_bucket_and_prefix(moto: MotoServer) -> None:
    b = backend(url=f"s3://{BUCKET}/from-url/deeper", endpoint_url=moto.endpoint,
                region="us-east-1", key=moto.key, secret=moto.secret)  # fmt: skip
    try:
        assert b.set("k", page(1)) is True
        listed = moto.client().list_objects_v2(Bucket=BUCKET, Prefix="from-url/deeper/")
        assert [o["Key"] for o in listed["Contents"]] == [b._key_prefix() + b.object_path("k")]
    finally:
        b.clear()
        b.close()


def test_a_412_without_its_condition_is_still_already_there(moto: MotoServer) -> None:
    """Some servers answer a failed If-None-Match without naming the condition: the page
    is there all the same, and its set is a success, not a failure."""
    proxy = FaultProxy(moto.port)
    proxy.strip_condition = True
    b = backend(**options(moto, endpoint_url=proxy.endpoint))
    try:
        assert b.set("k", page(1)) is True
        assert b.set("k", page(2)) is True
        assert b.get_stats().ops["set"].errors == 0
        got = b.get("k")
        assert got is not None and torch.equal(got, page(1))
    finally:
        b.clear()
        b.close()
        proxy.close()


def test_a_multipart_upload_cut_short_is_aborted(moto: MotoServer) -> None:
    """A multipart upload that the deadline cuts (its parts held by the proxy) is
    aborted, and clear() aborts those a dead writer left: no parts stay in the bucket."""
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, multipart_threshold=10 * 2**20,
                          deadline=3.0))  # fmt: skip
    s3 = moto.client()
    try:
        proxy.stall_if = lambda method, path: method == "PUT" and "partNumber=" in path
        big = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
        assert b.set("big", big) is False
        proxy.stall_if = None
        prefix = b._key_prefix()
        deadline = time.monotonic() + 30  # (a bound for a hang on a loaded machine)
        while s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads"):
            assert time.monotonic() < deadline, "the upload was not aborted"
            time.sleep(0.1)
        left = s3.create_multipart_upload(Bucket=BUCKET, Key=prefix + b.object_path("left"))
        assert s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
        b.clear()
        assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
        assert left["UploadId"]
    finally:
        proxy.stall_if = None
        b.clear()
        b.close()
        proxy.close()


def test_an_upload_made_after_its_create_was_cut_is_aborted(moto: MotoServer) -> None:
    """The deadline cuts the request that creates a multipart upload while the server
    still makes it (the proxy holds it, then passes it on): once the answer names the
    upload, it is aborted, so no parts can be left behind by a cut create either."""
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, multipart_threshold=10 * 2**20,
                          deadline=1.0))  # fmt: skip
    s3 = moto.client()
    try:
        proxy.stall_if = lambda method, path: method == "POST" and "uploads" in path
        big = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
        assert b.set("big", big) is False  # cut by the deadline while the create is held
        prefix = b._key_prefix()
        assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
        seen = proxy.requests
        proxy.stall_if = None  # the held create reaches the server, which makes the upload
        deadline = time.monotonic() + 30  # (a bound for a hang on a loaded machine)
        while proxy.requests < seen + 1 or s3.list_multipart_uploads(
            Bucket=BUCKET, Prefix=prefix
        ).get("Uploads"):
            assert time.monotonic() < deadline, "the upload was not aborted"
            time.sleep(0.1)
        assert b.exists("big") is False
    finally:
        proxy.stall_if = None
        b.clear()
        b.close()
        proxy.close()


def test_close_during_a_multipart_put_aborts_it(moto: MotoServer) -> None:
    """close() while a multipart upload has a part on the wire (held by the proxy): the
    put is cut, and its abort still goes out before the loop ends: no parts are left."""
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, multipart_threshold=10 * 2**20,
                          deadline=30.0))  # fmt: skip
    s3 = moto.client()
    prefix = b._key_prefix()
    try:
        proxy.stall_if = lambda method, path: method == "PUT" and "partNumber=2" in path
        big = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
        out: list[Any] = []
        writer = threading.Thread(target=lambda: out.append(b.set("big", big)))
        writer.start()
        deadline = time.monotonic() + 30  # (a bound for a hang)
        while not any(
            s3.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
            for u in s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        ):  # part 1 stored, part 2 held
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.05)
        b.close()
        writer.join(30)
        assert out == [False]
        proxy.stall_if = None
        assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
    finally:
        proxy.stall_if = None
        b.close()
        proxy.close()


def test_a_failed_part_stops_the_others_before_the_abort(moto: MotoServer) -> None:
    """One part fails outright: the parts still running are stopped before the abort is
    sent, so none of them lands (or is retried) after it."""
    b = backend(**options(moto, multipart_threshold=10 * 2**20, deadline=30.0))
    events: list[str] = []
    real = b._s3_call

    def spy(method: str, **kw: Any) -> Any:
        request = real(method, **kw)

        async def wrapped() -> Any:
            part = kw.get("PartNumber")
            if method == "upload_part" and part == 1:
                raise PermissionError("part 1 refused")
            if method == "upload_part":
                try:
                    await asyncio.sleep(1.0)  # a slow part
                except asyncio.CancelledError:
                    events.append(f"part {part} stopped")
                    raise
                events.append(f"part {part} sent")
            if method == "abort_multipart_upload":
                events.append("abort")
            return await request()

        return wrapped

    b._s3_call = spy
    try:
        assert b.set("big", torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)) is False
        deadline = time.monotonic() + 30
        while "abort" not in events:
            assert time.monotonic() < deadline, f"no abort: {events}"
            time.sleep(0.05)
        time.sleep(1.5)  # (a part left running would be sent by now)
        assert events[-1] == "abort" and "stopped" in " ".join(events), events
        assert not any(e.endswith("sent") for e in events), events
        assert (
            not moto.client()
            .list_multipart_uploads(Bucket=BUCKET, Prefix=b._key_prefix())
            .get("Uploads")
        )
    finally:
        b.close()


def test_secrets_never_reach_the_client_logs(
    moto: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    """botocore logs request headers at DEBUG (the access key, the session token): the
    backend's secrets are scrubbed from them."""
    import logging

    token = "session-token-value-" + uuid.uuid4().hex
    with caplog.at_level(logging.DEBUG):
        b = backend(**options(moto, token=token))
        try:
            assert b.set("k", page(1)) is True
            assert b.get("k") is not None
        finally:
            b.clear()
            b.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "botocore" in " ".join(r.name for r in caplog.records)  # the client did log
    assert token not in text
    assert moto.secret not in text
    assert moto.key not in text


def test_storage_options_values_are_secrets() -> None:
    b = backend(url=f"memory://so-{uuid.uuid4().hex[:6]}", storage_options={"api_token": "tok-7a1"})
    try:
        assert "tok-7a1" in b._secret_values()
        assert "tok-7a1" not in repr(b)
        assert "tok-7a1" not in repr(b.options)
    finally:
        b.close()


def test_close_while_a_call_waits_ends_that_call_at_once(moto: MotoServer) -> None:
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, deadline=30.0))
    got: list[object] = []
    try:
        assert b.set("k", page(1)) is True
        proxy.stalled.set()
        caller = threading.Thread(target=lambda: got.append(b.batch_get(["k"])))
        caller.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        b.close()
        caller.join(15)
        assert not caller.is_alive()
        assert got == [[None]]
        assert time.monotonic() - t0 < 15  # not the 30 s deadline
    finally:
        proxy.stalled.clear()
        b.close()
        proxy.close()


def test_batch_exists_at_its_deadline_answers_the_run_so_far(moto: MotoServer) -> None:
    proxy = FaultProxy(moto.port)
    b = backend(**options(moto, endpoint_url=proxy.endpoint, deadline=2.0, exists_lookahead=2,
                          max_concurrency=2))  # fmt: skip
    try:
        keys = [f"k{i}" for i in range(60)]
        assert all(b.batch_set(keys, [page(i, 64) for i in range(60)]))
        proxy.delay = 0.1  # two in flight, 0.1 s each: about 36 answers in 1.8 s
        count = b.batch_exists(keys)
        assert 0 < count < 60
        proxy.delay = 0.0
        assert b.batch_exists(keys) == 60
    finally:
        proxy.delay = 0.0
        b.clear()
        b.close()
        proxy.close()


def test_a_bucket_deleted_under_a_live_instance_is_a_failure_not_a_miss(moto: MotoServer) -> None:
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    moto.make_bucket(bucket)
    b = backend(**options(moto, bucket=bucket))
    s3 = moto.client()
    try:
        assert b.set("k", page(1)) is True
        for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])
        s3.delete_bucket(Bucket=bucket)
        assert b.get("k") is None
        assert b.get_stats().ops["get"].errors == 1  # counted as the store's failure
    finally:
        b.close()


def test_a_location_with_glob_characters_is_refused() -> None:
    with pytest.raises(ConfigError, match="glob"):
        backend(url="memory://c[12]")


def test_a_server_killed_mid_batch_gives_failure_shapes_then_recovers() -> None:
    """The server dies while a batch is on the wire: the call returns within its
    deadline with a bool per page (those not stored are False), nothing raises, and the
    same instance works once the server is back. path_style addressing, too."""
    srv = MotoServer()
    srv.start()
    srv.make_bucket(BUCKET)
    b = backend(**options(srv, deadline=10.0, connect_timeout=1.0, retries=1, path_style=True,
                          max_concurrency=4))  # fmt: skip
    out: list[list[bool]] = []
    try:
        keys = [f"k{i}" for i in range(150)]
        worker = threading.Thread(target=lambda: out.append(b.batch_set(keys, [page(i, 65536)
                                                                          for i in range(150)])))  # fmt: skip
        worker.start()
        time.sleep(0.3)
        srv.stop()
        worker.join(30)
        assert not worker.is_alive()
        (got,) = out
        assert len(got) == 150 and all(type(x) is bool for x in got)
        assert not all(got)  # the pages after the kill failed
        srv.start()
        srv.make_bucket(BUCKET)
        assert b.set("after", page(4)) is True
        back = b.get("after")
        assert back is not None and torch.equal(back, page(4))
    finally:
        b.close()
        srv.stop()


def test_the_tiered_workload_is_byte_exact_on_s3(moto: MotoServer) -> None:
    from tier_replay import replay_small

    result, cache = replay_small("s3", options(moto))
    assert result.verification_errors == 0 and result.verified_pages > 0
    assert result.storage_hit_tokens > 0 and cache.stats.backup_failed_tokens == 0
