"""``hicache-storage run`` while its store's server is killed and started again: redis, moto.

The main job runs in this process (``main(["run", ...])``, as the command does) against a
real server these tests start. Part way through, between two requests, the server is
killed; some requests later it is started again on the same port, empty (neither keeps
data over a restart). The job is never told. What is checked, from the job's ``--json``
report and from the time each request took (:func:`run_with_an_outage`):

* the run keeps going: rc 0, every request served, every page that came back from any
  tier byte-exact (``verification_errors`` 0);
* the store was down for the job: no storage hit while it was, the backups of that time
  failed, both circuits (reads and writes) open when the server came back, calls
  answered without the store (``breaker_rejections``);
* no request waited on the dead store past one deadline (the tier's longest wait for a
  store: an existence query's ``exists_timeout`` plus a prefetch's timeout); the reads
  the requests made of the dead store spent less than one deadline in it all together,
  and none at all once the reads' circuit was open (no engine thread waits on a store
  the breaker knows is down: a health probe that called the dead store usable would
  send it trial reads);
* hits come back after recovery: storage hits among the requests after the restart (of
  pages written after it: the restarted server started empty), and the circuit closed,
  the store healthy, at the end.

The Mooncake case (``mooncake_master`` killed and restarted) is in
``tests/backends/test_mooncake.py``, which runs in a private network namespace; both use
``tests/workers/main_job_outage.py``.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from main_job_outage import check_outage, run_with_an_outage
from moto_server import MotoServer
from redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def moto_server() -> Iterator[MotoServer]:
    srv = MotoServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_redis_server_killed_and_restarted_under_the_main_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], redis_server: RedisServer
) -> None:
    """redis-server killed (SIGKILL) after two turns, started again on its port two turns
    later; see the module docstring for what is asserted."""
    options = {"url": redis_server.url, "prefix": f"run-{uuid.uuid4().hex[:8]}:",
               "socket_timeout": 2.0, "connect_timeout": 1.0}  # fmt: skip
    t0 = time.monotonic()
    out = run_with_an_outage(monkeypatch, capsys, "redis", options, redis_server.stop,
                             redis_server.start)  # fmt: skip
    check_outage(out, time.monotonic() - t0)


def test_moto_killed_and_restarted_under_the_main_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], moto_server: MotoServer
) -> None:
    """The S3 server (moto) killed after two turns, started again on its port two turns
    later with its bucket made again (moto keeps nothing over a restart: an operator
    makes the bucket); see the module docstring for what is asserted."""
    bucket = "hicache-run"
    moto_server.make_bucket(bucket)

    def restart() -> None:
        moto_server.start()
        moto_server.make_bucket(bucket)

    # A call's deadline under the tier's exists_timeout: a query of the dead server ends
    # (failed, retries included) before its request stops waiting for it, so each query
    # reaches the breaker, however slowly a loaded machine retries.
    options = {"bucket": bucket, "prefix": f"run-{uuid.uuid4().hex[:8]}",
               "endpoint_url": moto_server.endpoint, "region": "us-east-1",
               "key": moto_server.key, "secret": moto_server.secret, "deadline": 3.0,
               "connect_timeout": 1.0, "read_timeout": 2.0}  # fmt: skip
    t0 = time.monotonic()
    out = run_with_an_outage(monkeypatch, capsys, "s3", options, moto_server.stop, restart)
    check_outage(out, time.monotonic() - t0)
