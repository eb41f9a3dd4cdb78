"""The main job run with an outage of its store, for the restart tests.

:func:`run_with_an_outage` runs ``hicache-storage run`` in this process, kills the
store's server between two requests and starts it again later; :func:`check_outage`
holds the assertions every server's case shares (``tests/cli/test_run_server_restarts.py``
says what they mean). Used there (redis, moto) and by ``tests/backends/test_mooncake.py``
(``mooncake_master``, in a private network namespace).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import hicache_storage.cli.run as run_module
from hicache_storage.breaker import WRITE_OPS
from hicache_storage.cli.bench import build_backend as real_build
from hicache_storage.cli.main import main
from hicache_storage.stats import StorageStats
from hicache_storage.tier.config import TierConfig
from hicache_storage.tier.workload import replay as real_replay

__all__ = ["BREAKER", "Outage", "check_outage", "run_with_an_outage"]

#: 8 sessions of 8 turns (64 requests): storage hits from the second turn on, so the
#: turns after the restart have some of their own to find.
SHAPE = ["--sessions", "8", "--turns", "8", "--system-prompts", "2", "--system-tokens", "128",
         "--user-tokens", "32", "--answer-tokens", "32", "--page-size", "16", "--layer-num", "2",
         "--kv-heads", "2", "--head-dim", "32", "--host-pages", "64", "--device-pages", "48",
         "--prefetch-threshold", "64", "--device", "cpu", "--no-progress", "--json"]  # fmt: skip
REQUESTS = 64
KILL_AFTER = 16  # requests served before the kill (two turns)
RESTART_AFTER = 32  # requests served before the restart (16 with the server dead)
#: Seconds each request is followed by (an engine's decode time): the job lasts long
#: enough after the restart for the breaker's probe (every 0.5 s at most) to find the
#: store back, however fast the machine.
PACE = 0.05
#: The breaker's options: it opens after 3 failed calls in a row, probes after 0.1 s,
#: then at most every 0.5 s.
BREAKER = {"breaker_failures": 3, "breaker_backoff": 0.1, "breaker_max_backoff": 0.5}
LONGEST_PROMPT = 128 + 8 * 32 + 7 * 32  # tokens (the last turn's)


def one_deadline() -> float:
    """The longest a request of this run may wait for a store, in seconds.

    An existence query (``exists_timeout``), then a prefetch of the longest prompt
    (``timeout`` policy: its base plus its per-token part), as the run configures them.
    """
    cfg = TierConfig()
    prefetch = cfg.prefetch_timeout_base + cfg.prefetch_timeout_per_ki_token * LONGEST_PROMPT / 1024
    return cfg.exists_timeout + min(prefetch, cfg.prefetch_max_wait)


@dataclass
class Outage:
    """What a run with an outage measured (see :func:`run_with_an_outage`)."""

    report: dict[str, Any] = field(default_factory=dict)
    code: int = -1
    seconds: list[float] = field(default_factory=list)  # each request's own time
    storage_hits: list[int] = field(default_factory=list)  # cumulative, after each request
    #: The reads' and the writes' circuits when the server came back.
    circuits_at_restart: dict[str, str] = field(default_factory=dict)
    #: Seconds the reads the requests made (existence queries, prefetches) spent in the
    #: store while it was down: the store's own wait, calls the breaker answered excluded.
    read_seconds_down: float = -1.0
    #: The same from the first request after which the reads' circuit was open: none
    #: reaches the store any more, so 0.0 (-1: it never was).
    read_seconds_open: float = -1.0

    def hits(self, first: int, last: int) -> int:
        """Storage hit tokens of requests ``first`` to ``last`` (1-based, inclusive)."""
        before = self.storage_hits[first - 2] if first > 1 else 0
        return self.storage_hits[last - 1] - before

    def longest(self, first: int, last: int) -> float:
        """The longest time one of requests ``first`` to ``last`` took."""
        return max(self.seconds[first - 1 : last])


def read_seconds(stats: StorageStats) -> float:
    """Seconds the backend's read calls spent in the store (rejected calls add none)."""
    return sum(op.seconds for name, op in stats.ops.items() if name not in WRITE_OPS)


def run_with_an_outage(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    backend: str,
    options: dict[str, Any],
    kill: Callable[[], None],
    restart: Callable[[], None],
    pace: float = PACE,
) -> Outage:
    """Run the main job; ``kill()`` after request :data:`KILL_AFTER`, ``restart()`` after
    :data:`RESTART_AFTER`, both between requests on the job's own thread (the backup
    thread may be writing meanwhile); each request is followed by ``pace`` seconds.

    The job is the command's own code; the test wraps two of its names: the replay, to
    time each request and count its storage hits (a request's time leaves out the kill,
    the restart and the pace, which are the test's), and the backend's construction, to
    read the backend's stats and its two circuits (the guard's state: the report and
    ``circuit`` give the worse of the two only) at the kill and at the restart.
    """
    built: list[Any] = []
    out = Outage()

    def build(*args: Any, **kwargs: Any) -> Any:
        built.append(real_build(*args, **kwargs))
        return built[-1]

    def replay(cache: Any, workload: Any, *, on_request: Any = None, **kwargs: Any) -> Any:
        last = time.monotonic()
        at_kill = at_open = -1.0

        def step(r: Any) -> None:
            nonlocal last, at_kill, at_open
            out.seconds.append(time.monotonic() - last)
            out.storage_hits.append(r.storage_hit_tokens)
            if on_request is not None:
                on_request(r)
            (b,) = built
            breakers = b._hicache_state().breaker
            # The state first: a call records its time before it tells the breaker how it
            # went, so the call that opened the circuit is in ``spent`` already.
            reads = breakers.read.state
            spent = read_seconds(b.get_stats(reset=False))
            if r.requests == KILL_AFTER:
                at_kill = spent
                kill()
            elif KILL_AFTER < r.requests <= RESTART_AFTER:
                if at_open < 0 and reads == "open":
                    at_open = spent
                if r.requests == RESTART_AFTER:
                    out.read_seconds_down = spent - at_kill
                    if at_open >= 0:
                        out.read_seconds_open = spent - at_open
                    out.circuits_at_restart = {"read": breakers.read.state,
                                               "write": breakers.write.state}  # fmt: skip
                    restart()
            time.sleep(pace)
            last = time.monotonic()

        return real_replay(cache, workload, on_request=step, **kwargs)

    monkeypatch.setattr(run_module, "build_backend", build)
    monkeypatch.setattr(run_module, "replay", replay)
    config = json.dumps({**options, **BREAKER})
    out.code = main(["run", "--hicache-storage-backend", backend,
                     "--hicache-storage-backend-extra-config", config,
                     "--tenant", uuid.uuid4().hex[:8], *SHAPE])  # fmt: skip
    out.report = json.loads(capsys.readouterr().out)
    return out


def check_outage(out: Outage, wall: float) -> None:
    """The assertions every server's case shares (the module docstring says why)."""
    r = out.report
    # The run kept going, and nothing wrong came back from any tier.
    assert out.code == 0
    assert r["requests"] == len(out.seconds) == REQUESTS
    assert r["verification_errors"] == 0 and r["verified_pages"] > 0
    assert r["corrupt_objects"] == 0
    # The store answered before the kill (this shape has storage hits), and not while down.
    assert out.hits(1, KILL_AFTER) > 0
    assert out.hits(KILL_AFTER + 1, RESTART_AFTER) == 0
    assert r["backup_failed_tokens"] > 0  # pages written while it was down
    # The breaker saw it: both circuits open when the server came back (the reads' is the
    # one the requests wait behind), calls answered without the store.
    assert out.circuits_at_restart == {"read": "open", "write": "open"}
    assert r["breaker_opens"] >= 2 and r["breaker_rejections"] > 0
    # No request waited on the dead store past one deadline; all the reads of the outage
    # together spent less than one in it (a few failed calls, then none reached it).
    deadline = one_deadline()
    longest = out.longest(KILL_AFTER + 1, RESTART_AFTER)
    assert longest < deadline + 5.0, f"a request took {longest:.1f} s with the store down"
    assert 0 <= out.read_seconds_down < deadline, f"{out.read_seconds_down:.1f} s in the store"
    # Once the reads' circuit was open, no read went to the store while it was still down
    # (a health probe that called a dead store usable would send a trial read, and a
    # request would wait on it): no time at all, not a short one.
    assert out.read_seconds_open == 0.0, f"{out.read_seconds_open:.3f} s in a store known down"
    # Hits came back after recovery (pages written since: the server restarted empty),
    # and the store is healthy and its circuit closed at the end.
    assert out.hits(RESTART_AFTER + 1, REQUESTS) > 0, "no storage hit after the restart"
    assert (r["backend_health"], r["circuit"]) == ("ok", "closed")
    assert wall < 120, f"the run took {wall:.0f} s"
