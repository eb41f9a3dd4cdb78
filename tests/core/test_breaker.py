"""Health and the circuit breaker (``hicache_storage.breaker``).

The state machine alone (its probe is the thing a test controls), then real stores: a
``file`` tree whose directory goes away, and a real redis-server stopped under a backend
and started again.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from hicache_storage import metrics
from hicache_storage.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, Health, report_timeout
from hicache_storage.errors import ConfigError
from hicache_storage.registry import create_backend

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from redis_server import running


def wait_for(cond: Any, what: str, limit: float = 20.0) -> None:
    """Poll ``cond`` up to ``limit`` seconds (an outcome, not a timing)."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


class Probe:
    """A health probe whose answer the test sets; counts its calls."""

    def __init__(self) -> None:
        self.answer = Health("down", "test")
        self.calls = 0
        self.called = threading.Event()

    def __call__(self) -> Health:
        self.calls += 1
        self.called.set()
        return self.answer


def test_the_breaker_opens_after_a_streak_probes_then_closes_on_a_trial() -> None:
    probe = Probe()
    seen: list[str] = []
    b = CircuitBreaker("t", failures=3, backoff=0.01, max_backoff=0.04, probe=probe,
                       on_change=seen.append)  # fmt: skip
    for failed in (True, True, False, True, True):  # a success breaks the streak
        assert b.allow()
        b.record(failed)
    assert b.state == CLOSED
    assert b.allow()
    b.record(True)
    assert b.state == OPEN and seen == [OPEN] and b.opens == 1
    assert not b.allow() and not b.allow() and b.rejections == 2
    wait_for(lambda: probe.calls >= 3, "probes while down")
    assert b.state == OPEN
    probe.answer = Health("ok")
    wait_for(lambda: b.state == HALF_OPEN, "half-open once the probe answers")
    assert b.allow() and not b.allow()  # one trial call, the others still answered at once
    b.record(True)  # the trial failed: open again (no news: not announced, not counted)
    assert b.state == OPEN and b.opens == 1
    wait_for(lambda: b.state == HALF_OPEN, "half-open again")
    assert b.allow()
    b.record(False)
    assert b.state == CLOSED and seen == [OPEN, CLOSED]
    assert b.allow()
    b.close()


def test_a_deadline_passed_counts_as_a_failure(tmp_path: Path) -> None:
    backend = create_backend("file", root=str(tmp_path), breaker_failures=2)
    report_timeout(backend)
    assert backend.circuit == CLOSED
    report_timeout(backend, write=True)
    assert backend.circuit == CLOSED  # (one of each: no streak)
    report_timeout(backend)
    assert backend.circuit == OPEN
    assert backend.batch_set(["w"], [b"x" * 64]) == [True]  # writes still go
    backend.close()


def test_breaker_options_are_checked_and_zero_turns_it_off(tmp_path: Path) -> None:
    assert create_backend("file", root=str(tmp_path), breaker_failures=0).circuit == "off"
    for bad in ({"breaker_failures": -1}, {"breaker_failures": True},
                {"breaker_backoff": 0}, {"breaker_backoff": 60, "breaker_max_backoff": 30},
                {"breaker_failures": "many"}):  # fmt: skip
        with pytest.raises(ConfigError):
            create_backend("file", root=str(tmp_path), **bad)


def test_a_file_tree_whose_directory_goes_is_down_then_back(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    b = create_backend("file", root=str(root), breaker_failures=2, breaker_backoff=0.05)
    assert b.health() == Health("ok")
    assert b.batch_set(["a"], [b"x" * 64]) == [True]
    shutil.rmtree(root)
    root.write_text("not a directory")  # (and cannot become one again by itself)
    assert b.health().status == "down"
    for _ in range(2):
        assert b.batch_set(["b"], [b"y" * 64]) == [False]
    assert b.circuit == OPEN
    before = b.get_stats(reset=False).op("batch_set").calls
    assert b.batch_set(["c"], [b"z" * 64]) == [False]  # answered at once
    stats = b.get_stats(reset=False)
    assert stats.breaker_rejections >= 1 and stats.breaker_opens == 1
    assert stats.op("batch_set").calls == before + 1
    root.unlink()
    root.mkdir()
    wait_for(lambda: b.circuit == "half_open", "the probe finds the tree back")
    wait_for(lambda: b.batch_set(["d"], [b"w" * 64]) == [True], "a trial call closes it")
    assert b.circuit == CLOSED
    b.close()
    assert b.health().status == "down"


def test_a_dead_redis_opens_the_circuit_and_a_restarted_one_closes_it(tmp_path: Path) -> None:
    metrics.enable()
    with running(tmp_path / "redis") as server:
        b = create_backend("redis", url=server.url, socket_timeout=1.0, connect_timeout=1.0,
                           breaker_failures=3, breaker_backoff=0.1)  # fmt: skip
        labels = {"backend": "redis", "namespace": b.namespace.digest[:12]}
        assert b.health() == Health("ok")
        assert b.batch_set(["k1"], [b"v" * 128]) == [True]
        assert b.usage()["connections"] >= 1  # (hicache_connections: open connections)
        server.stop()
        assert b.health().status == "down"
        for _ in range(3):
            assert b.batch_get(["k1"]) == [None]
        assert b.circuit == OPEN
        assert (
            REGISTRY.get_sample_value("hicache_circuit_open", {**labels, "direction": "read"}) == 1
        )
        # While open no call reaches the store: the engine never waits on it.
        calls = b.get_stats(reset=False).breaker_rejections
        for _ in range(20):
            assert b.batch_get(["k1"]) == [None] and b.batch_exists(["k1"]) == 0
        assert b.get_stats(reset=False).breaker_rejections == calls + 40
        server.start()  # (empty: this redis keeps nothing across a restart)
        # Writes never failed: their circuit stayed closed. Reads come back with the probe.
        wait_for(lambda: b.batch_set(["k2"], [b"w" * 128]) == [True], "stores once redis is back")
        wait_for(lambda: b.batch_get(["k2"])[0] is not None, "hits once the probe finds it")
        assert b.circuit == CLOSED
        assert (
            REGISTRY.get_sample_value("hicache_circuit_open", {**labels, "direction": "read"}) == 0
        )
        assert REGISTRY.get_sample_value("hicache_breaker_opens_total", labels) == 1
        end = time.monotonic() + 20  # (the gauges refresh once a second)
        while (REGISTRY.get_sample_value("hicache_connections", labels) or 0) < 1:
            assert time.monotonic() < end, "no connections gauge"
            time.sleep(0.05)
        b.close()
        assert b.usage()["connections"] == 0


def test_a_trial_call_that_raises_the_callers_error_still_settles_the_breaker() -> None:
    """A half-open breaker's trial is settled by every call it lets through: an empty
    call takes no trial, and one raising a caller's error (not the store's) closes it."""
    from hicache_storage.config import StorageConfig
    from hicache_storage.errors import NotSupportedError
    from hicache_storage.protocol import HiCacheStorage

    class Refuses(HiCacheStorage):
        def get(self, key: str, target: Any = None) -> Any:
            raise NotSupportedError("no reads here")

        def set(self, key: str, value: Any) -> bool:
            return True

        def exists(self, key: str) -> bool:
            return False

    config = StorageConfig(extra_config={"breaker_failures": 2, "breaker_backoff": 0.02})
    b = Refuses(config)
    report_timeout(b)
    report_timeout(b)
    assert b.circuit == OPEN
    wait_for(lambda: b.circuit == HALF_OPEN, "half-open (no probe: default health)")
    assert b.batch_exists([]) == 0 and b.circuit == HALF_OPEN  # (no trial taken)
    with pytest.raises(NotSupportedError):
        b.get("k")
    assert b.circuit == CLOSED
    b.close()


def test_a_leading_run_query_that_fails_at_its_first_key_counts_as_failed() -> None:
    """``batch_exists`` answers a leading run: a store that fails on the first key (and
    so never asks about the rest, as s3 does) answered nothing, which opens the breaker;
    one that fails after a hit answered something, which does not."""
    from hicache_storage.config import StorageConfig
    from hicache_storage.errors import BackendError
    from hicache_storage.protocol import HiCacheStorage

    class FirstKeyFails(HiCacheStorage):
        hits = 0

        def get(self, key: str, target: Any = None) -> Any:
            return None

        def set(self, key: str, value: Any) -> bool:
            return True

        def exists(self, key: str) -> bool:
            raise BackendError("store down")

        def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
            for i, _ in enumerate(keys):
                if i >= self.hits:
                    self._log_failure("batch_exists", BackendError("store down"))
                    self._add_item_errors(1)
                    return i
            return len(keys)

    b = FirstKeyFails(StorageConfig(extra_config={"breaker_failures": 3}))
    b.hits = 1
    for _ in range(4):  # one key answered each time: not a failure of the call
        assert b.batch_exists(["a", "b", "c"]) == 1
    assert b.circuit == CLOSED
    b.hits = 0
    for _ in range(3):
        assert b.batch_exists(["a", "b", "c"]) == 0
    assert b.circuit == OPEN
    b.close()


def test_a_plain_miss_before_a_failed_key_is_not_a_failure() -> None:
    """A blob store asks a chunk of keys at once: the first key simply not stored, a
    later one failing (a cluster node down) answered 0 correctly, which is no failure of
    the call (the breaker stays closed); the first key failing is one."""
    from hicache_storage.backends import MemoryBackend
    from hicache_storage.config import StorageConfig
    from hicache_storage.errors import BackendError

    class TailFails(MemoryBackend):
        first = False

        def _exists_blobs(self, names: list[Any]) -> list[Any]:
            out: list[Any] = list(super()._exists_blobs(names))
            out[0 if self.first else -1] = BackendError("node down")
            return out

    config = StorageConfig(extra_config={"breaker_failures": 3})
    b = TailFails(config, store=f"tail-{time.time_ns()}")
    for _ in range(5):
        assert b.batch_exists(["a", "b", "c"]) == 0  # "a" is not stored
    assert b.circuit == CLOSED
    b.first = True
    for _ in range(3):
        assert b.batch_exists(["a", "b", "c"]) == 0
    assert b.circuit == OPEN
    b.close()
