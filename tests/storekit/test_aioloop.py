"""storekit.aioloop.LoopThread: an event loop on its own thread, with deadlines."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest

from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError
from hicache_storage.storekit.aioloop import LoopThread


def test_runs_coroutines_from_many_threads_on_one_loop() -> None:
    lt = LoopThread("test-loop")
    seen: set[int] = set()

    async def work(i: int) -> int:
        seen.add(threading.get_ident())
        await asyncio.sleep(0.01)
        return i * 2

    results: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(lt.run(work(i), 5))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [i * 2 for i in range(8)]
    assert len(seen) == 1  # one loop thread ran them all
    assert threading.get_ident() not in seen
    lt.close()


def test_a_deadline_cancels_the_coroutine_on_the_loop() -> None:
    lt = LoopThread("test-loop")
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(BackendTimeoutError, match=r"0\.2 s"):
        lt.run(forever(), 0.2)
    assert cancelled.wait(5)
    assert lt.run(asyncio.sleep(0, result="still works"), 5) == "still works"
    lt.close()


def test_errors_of_the_coroutine_reach_the_caller() -> None:
    lt = LoopThread("test-loop")

    async def fail() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        lt.run(fail(), 5)
    lt.close()


def test_a_blocking_call_from_the_loop_thread_is_refused_not_a_deadlock() -> None:
    lt = LoopThread("test-loop")

    async def nested() -> str:
        try:
            lt.run(asyncio.sleep(0), 1)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert "own thread" in lt.run(nested(), 5)
    lt.close()


def test_close_runs_the_final_coroutine_and_is_idempotent() -> None:
    lt = LoopThread("test-loop")
    closed = threading.Event()

    async def final() -> None:
        closed.set()

    lt.run(asyncio.sleep(0), 5)
    lt.close(final())
    assert closed.is_set()
    lt.close()
    with pytest.raises(BackendUnavailableError, match="closed"):
        lt.run(asyncio.sleep(0), 5)


def _in_child(lt: LoopThread, forked: list[bool], queue: multiprocessing.Queue) -> None:
    try:
        queue.put((lt.run(asyncio.sleep(0, result=41), 5), forked == [True]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put((repr(exc), False))


def test_a_forked_child_starts_a_loop_of_its_own() -> None:
    forked: list[bool] = []
    lt = LoopThread("test-loop", on_fork=lambda: forked.append(True))
    assert lt.run(asyncio.sleep(0, result=1), 5) == 1
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(lt, forked, queue))
    child.start()
    assert queue.get(timeout=30) == (41, True)
    child.join(30)
    assert forked == []  # the hook ran in the child only
    assert lt.run(asyncio.sleep(0, result=2), 5) == 2
    lt.close()
