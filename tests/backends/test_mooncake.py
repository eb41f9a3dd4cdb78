"""The ``mooncake`` backend against a real ``mooncake_master`` started by these tests.

They run inside a private network namespace (``unshare -n``): scripts/test.sh runs this
file that way; anywhere else the module fails at once (never a skip).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import BackendUnavailableError, ConfigError

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from mooncake_master import MooncakeHolder, MooncakeMaster, require_private_network, running_store
from redis_server import free_port

require_private_network()


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[MooncakeMaster, MooncakeHolder]]:
    with running_store() as pair:
        yield pair


@pytest.fixture(scope="module")
def master(store: tuple[MooncakeMaster, MooncakeHolder]) -> MooncakeMaster:
    return store[0]


def options(m: MooncakeMaster, **extra: Any) -> dict[str, Any]:
    """Pure clients: their objects live in the holder's segment."""
    return {"master_server_address": m.address, "global_segment_size": 0,
            "local_buffer_size": "64MiB", "prefix": f"t-{uuid.uuid4().hex[:8]}/", **extra}  # fmt: skip


def backend(tenant: str = "t", **opts: Any):  # -> MooncakeBackend
    from hicache_storage.backends import MooncakeBackend

    ns = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4, tenant=tenant)
    return MooncakeBackend(StorageConfig(namespace=ns), **opts)


class TestMooncakeConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, master: MooncakeMaster) -> BackendSpec:
        return BackendSpec("mooncake", options(master))


def test_round_trip_first_writer_wins_and_clear(master: MooncakeMaster) -> None:
    b = backend(**options(master))
    other = backend("o", **{**options(master), "prefix": b._prefix})
    try:
        keys = [f"k{i}" for i in range(10)]
        vals = [torch.full((5000,), i, dtype=torch.uint8) for i in range(10)]
        assert b.batch_set(keys, vals) == [True] * 10
        assert other.batch_set(keys[:3], vals[:3]) == [True] * 3
        assert b.set("k0", vals[5]) is True  # kept, not replaced
        got = b.batch_get([*keys, "absent"])
        assert got[-1] is None
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, vals, strict=False))
        assert b.batch_exists([*keys, "absent"]) == 10
        b.clear()  # under the leases the reads just took
        assert b.batch_exists(keys) == 0
        assert other.batch_exists(keys[:3]) == 3
    finally:
        b.close()
        other.close()


def test_no_master_is_a_clear_error_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="no Mooncake master"):
        backend(master_server_address=f"127.0.0.1:{free_port()}", connect_timeout=1.0)
    assert time.monotonic() - t0 < 10  # not setup's 90 s


def test_options_from_a_config_file(master: MooncakeMaster, tmp_path: Path) -> None:
    import json

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": master.address,
                                "global_segment_size": "128MiB", "replica_num": 1}))  # fmt: skip
    b = backend(config_file=str(path), local_buffer_size="16MiB")
    try:
        assert b.options.global_segment_size == 128 * 2**20
        assert b.options.local_buffer_size == 16 * 2**20
        assert b.set("k", torch.ones(100, dtype=torch.uint8)) is True
        assert b.health().status == "ok"
    finally:
        b.close()
    with pytest.raises(ConfigError, match="config_file"):
        backend(config_file=str(tmp_path / "missing.json"))


def test_pages_whose_storage_node_went_away_are_misses_never_wrong_bytes() -> None:
    """The node lending the memory dies: its pages read as misses (the tensor path here;
    the conformance kit's v1 checks run on the same store), nothing wrong comes back, and
    once a node is back pages store again."""
    with running_store() as (m, holder):
        b = backend(**options(m))
        try:
            keys = [f"k{i}" for i in range(8)]
            vals = [torch.full((4096,), i + 1, dtype=torch.uint8) for i in range(8)]
            assert all(b.batch_set(keys, vals))
            holder.stop()
            got = b.batch_get(keys)
            assert all(g is None or torch.equal(g, v) for g, v in zip(got, vals, strict=True))
            assert all(g is None for g in got)
            assert b.get_stats().corrupt_objects == 0
            # the master still listed them: the reads removed them, so that a set stores
            # them again rather than trusting a copy that is gone
            assert b.batch_exists(keys) == 0
            holder.start()
            deadline = time.monotonic() + 60  # the master drops the dead node's segment
            while not b.set("again", vals[0]):
                assert time.monotonic() < deadline, "no page stored after a node came back"
                time.sleep(1)
            back = b.get("again")
            assert back is not None and torch.equal(back, vals[0])
        finally:
            b.close()


def test_a_master_killed_under_a_live_instance_gives_failure_shapes() -> None:
    with running_store() as (m, _holder):
        b = backend(**options(m))
        try:
            assert b.set("before", torch.ones(100, dtype=torch.uint8)) is True
            m.stop()
            t0 = time.monotonic()
            assert b.batch_set(["a"], [torch.ones(100, dtype=torch.uint8)]) == [False]
            assert time.monotonic() - t0 < 60
            t1 = time.monotonic()  # the master is known down now: the next calls fail at once
            assert b.get("before") is None
            assert b.batch_exists(["x"]) == 0
            assert time.monotonic() - t1 < 1
            assert b.health().status == "down"
        finally:
            b.close()


def test_a_tensor_batch_larger_than_the_local_buffer_reads_whole(master: MooncakeMaster) -> None:
    """get_batch delivers empty bytes for objects past the local buffer: those that
    exist are read again one by one, not answered as misses."""
    b = backend(**options(master, local_buffer_size="40MiB"))
    try:
        vals = [torch.full((15 * 2**20,), i + 1, dtype=torch.uint8) for i in range(3)]
        assert b.batch_set(["a", "b", "c"], vals) == [True] * 3
        got = b.batch_get(["a", "b", "c"])
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, vals, strict=True))
    finally:
        b.clear()
        b.close()


def _write_in_another_engine(opts: dict[str, Any], keys: list[str], queue: Any) -> None:
    """A second engine process: its own client of the same master writes the pages."""
    try:
        b = backend(**opts)
        vals = [torch.full((8192,), i + 7, dtype=torch.uint8) for i in range(len(keys))]
        ok = b.batch_set(keys, vals)
        b.close()  # a pure client: the pages stay in the storage node's memory
        queue.put(ok)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


def test_two_engine_processes_share_pages_through_one_master(master: MooncakeMaster) -> None:
    """Pages one engine process stored are hits, byte-exact, for another process."""
    import multiprocessing

    opts = options(master)
    keys = [f"shared{i}" for i in range(6)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_write_in_another_engine, args=(opts, keys, queue))
    child.start()
    answer = queue.get(timeout=120)
    child.join(60)
    assert answer == [True] * len(keys)
    reader = backend(**opts)
    try:
        assert reader.batch_exists(keys) == len(keys)
        got = reader.batch_get(keys)
        for i, g in enumerate(got):
            assert g is not None and torch.equal(g, torch.full((8192,), i + 7, dtype=torch.uint8))
    finally:
        reader.clear()
        reader.close()


def test_the_tiered_workload_is_byte_exact_on_mooncake(master: MooncakeMaster) -> None:
    from tier_replay import replay_small

    result, cache = replay_small("mooncake", options(master))
    assert result.verification_errors == 0 and result.verified_pages > 0
    assert result.storage_hit_tokens > 0 and cache.stats.backup_failed_tokens == 0


@pytest.mark.parametrize("roles", [("set",) * 3, ("v1",) * 3 + ("read",)], ids=["set", "v1"])
def test_a_set_that_answers_true_reads_back_under_concurrent_writers(
    master: MooncakeMaster, roles: tuple[str, ...]
) -> None:
    """Three processes put the same keys at once, round after round, with every core
    busy: each key a set answered True for reads back byte-exact at once in that process
    and is still there at the end of the round; a reader meanwhile sees misses, never a
    store failure or wrong bytes.

    Mooncake's put answers success when another client's put of the key has begun and its
    bytes are still in flight (not readable yet, and gone if that put fails), and a read
    of such a key answers "not ready": the set must wait until the key reads (or answer
    False), and the read is a miss.
    """
    import multiprocessing

    from mooncake_writers import busy, namespace, write_rounds

    from hicache_storage.conformance.data import unique_keys

    ctx = multiprocessing.get_context("spawn")
    rounds = [ctx.Queue() for _ in roles]
    results = ctx.Queue()
    barrier = ctx.Barrier(len(roles))
    opts = options(master)
    procs = [ctx.Process(target=write_rounds, args=(opts, role, 256 << 10, q, results, barrier))
             for role, q in zip(roles, rounds, strict=True)]  # fmt: skip
    load = [ctx.Process(target=busy) for _ in range(os.cpu_count() or 2)]
    for p in [*procs, *load]:
        p.start()
    from hicache_storage.backends import MooncakeBackend

    check = MooncakeBackend(StorageConfig(namespace=namespace(roles[0])), **opts)
    try:
        for n in range(30):
            keys = unique_keys(16)
            for q in rounds:
                q.put(keys)
            answers = [results.get(timeout=300) for _ in roles]
            assert all("error" not in a for a in answers), answers
            for a in answers:
                assert not a["lost"], f"round {n}: a set answered True, the read missed: {a}"
                assert not a["wrong"] and not a["errors"], f"round {n}: {a}"
            stored = {k for a in answers for k in a["stored"]}
            assert stored == set(keys), f"round {n}: no set stored {set(keys) - stored}"
            assert check.batch_exists(keys) == 16, f"round {n}: a stored key went missing"
    finally:
        check.close()
        for q in rounds:
            q.put(None)
        for p in load:
            p.kill()
        for p in [*procs, *load]:
            p.join(60)


@pytest.mark.parametrize(
    ("option", "url"),
    [("metadata_server", "http://user:{pw}@127.0.0.1:{port}/metadata"),
     ("metadata_server", "etcd://user:{pw}@127.0.0.1:{port}"),
     ("master_server_address", "etcd://user:{pw}@127.0.0.1:{port}")],
)  # fmt: skip
def test_a_url_password_never_shows(
    master: MooncakeMaster, option: str, url: str, caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """No metadata server (or master) answers: the error names the URL, never its
    password (nor do the logs or the client's own output)."""
    import logging
    import traceback

    pw = f"Pw{uuid.uuid4().hex}"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(BackendUnavailableError) as info:
        backend(**options(master, **{option: url.format(pw=pw, port=free_port())}))
    assert "user:" in str(info.value)  # the URL is named
    shown = "".join(traceback.format_exception(info.value)) + caplog.text
    out = capfd.readouterr()
    assert pw not in shown + out.out + out.err


def test_a_local_buffer_that_holds_no_page_is_a_config_error(master: MooncakeMaster) -> None:
    """local_buffer_size=16 built a backend whose every set failed (max_object_bytes < 0)."""
    for size in (16, 48, "1023KiB"):
        with pytest.raises(ConfigError, match=r"local_buffer_size must be at least 1MiB"):
            backend(**options(master, local_buffer_size=size))
    # Mooncake's buffer allocator takes sizes of four significant bits: 1 MiB + 100 KiB
    # holds an object of 1 MiB at most, and that is what the backend claims and stores.
    b = backend(**options(master, local_buffer_size=2**20 + 100 * 2**10))
    try:
        biggest = b.capabilities.max_object_bytes
        assert biggest == 2**20 - 48
        assert b.set("biggest", torch.ones(biggest, dtype=torch.uint8)) is True
        got = b.get("biggest")
        assert got is not None and torch.equal(got, torch.ones(biggest, dtype=torch.uint8))
    finally:
        b.clear()
        b.close()


def test_rdma_without_an_rdma_device_is_a_config_error(
    master: MooncakeMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """protocol="rdma" on a host with no RDMA device (or without the one named) ran over
    TCP unsaid. The devices are those the kernel lists in /sys/class/infiniband; here a
    directory stands in for it."""
    from hicache_storage.backends import _mooncake

    sysfs = tmp_path / "infiniband"
    monkeypatch.setattr(_mooncake, "_RDMA_SYSFS", str(sysfs))
    with pytest.raises(ConfigError, match=r"needs an RDMA device and this host has none"):
        backend(**options(master, protocol="rdma"))
    sysfs.mkdir()
    with pytest.raises(ConfigError, match=r"has none"):
        backend(**options(master, protocol="rdma", device_name="mlx5_0"))
    (sysfs / "mlx5_0").mkdir()
    with pytest.raises(ConfigError, match=r"does not have: \['mlx5_1'\]; it has \['mlx5_0'\]"):
        backend(**options(master, protocol="rdma", device_name="mlx5_0, mlx5_1"))


def test_a_failed_existence_check_after_a_put_fails_the_set_with_its_code(
    master: MooncakeMaster,
) -> None:
    """The read-back check after a put fails (a negative code, here -600): the set
    fails at once with that code, not taken for a put still in flight and put again until
    put_wait. (The client stands in for the master's answer: the set's logic is tested.)"""
    b = backend(**options(master, put_wait=30.0))
    real = b._mc
    calls: dict[str, int] = {"put": 0}

    class Failing:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(real, name)
            if "put" in name:

                def counted(*args: Any) -> Any:
                    calls["put"] += 1
                    return attr(*args)

                return counted
            return attr

        def batch_is_exist(self, keys: list[str]) -> list[int]:
            return [-600] * len(keys)

    b._mc = Failing()
    try:
        assert b.set("k", torch.ones(4096, dtype=torch.uint8)) is False
        assert calls["put"] == 1  # never put again
        assert b.get_stats().op("set").errors == 1
    finally:
        b._mc = real
        b.clear()
        b.close()


def test_a_put_stalled_in_flight_makes_a_set_answer_false_after_put_wait() -> None:
    """Another client's put of the key is stuck in flight (the storage node is stopped
    under it): a set of that key answers False once put_wait has passed, never True; once
    the node runs again the set stores the page."""
    import multiprocessing
    import signal

    from mooncake_writers import put_raw

    with running_store() as (m, holder):
        assert holder.proc is not None
        b = backend(**options(m, put_wait=1.0))
        key = b._keys([b.object_name("k")])[0]
        ctx = multiprocessing.get_context("spawn")
        go, done = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=put_raw, args=(m.address, key, 8 << 20, go, done))
        child.start()
        value = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
        try:
            assert done.get(timeout=120) == "ready"
            os.kill(holder.proc.pid, signal.SIGSTOP)
            try:
                go.put(1)
                for _ in range(1000):  # until the master shows the put begun, not done
                    if b._mc.get_size(key) == -703:
                        break
                    time.sleep(0.01)
                assert b._mc.get_size(key) == -703
                assert b.set("k", value) is False
                assert b.get_stats().op("set").errors == 1
            finally:
                os.kill(holder.proc.pid, signal.SIGCONT)
            assert done.get(timeout=120) == 0  # the other put ends: bytes not of ours
            assert b.get("k") is None  # (verified: a miss, and removed)
            assert b.set("k", value) is True
            got = b.get("k")
            assert got is not None and torch.equal(got, value)
        finally:
            go.put(1)
            child.join(60)
            b.close()


def test_a_master_killed_and_restarted_under_the_main_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hicache-storage run`` on Mooncake while its ``mooncake_master`` is killed after two
    turns and started again on its port two turns later (empty: the master keeps no
    metadata over a restart; the storage node stays up). The run keeps going with every
    page byte-exact, no storage hit while the master is down, both circuits open by the
    restart, the requests' reads of the dead master under one deadline in all, and
    storage hits again after it, circuit closed and health ok at the end (the shared
    checks of ``tests/workers/main_job_outage.py``, whose helpers run the job).

    A read of a dead master blocks about 4 s in the client, and its health check still
    answers 0: a health probe that trusted it let a trial read block again every backoff.
    Requests are paced 0.25 s apart, so the job outlasts a probe under way at the restart
    and the node's segment coming back into the new master (about 2-5 s here).
    """
    from main_job_outage import check_outage, run_with_an_outage

    with running_store() as (m, _holder):
        opts = options(m, connect_timeout=1.0)
        t0 = time.monotonic()
        out = run_with_an_outage(monkeypatch, capsys, "mooncake", opts, m.stop, m.start, pace=0.25)
        check_outage(out, time.monotonic() - t0)
