"""The tier's worker threads, and the agreement of the TP ranks.

:class:`Workers` runs the tier's I/O (prefetch batches, existence queries) on daemon
threads, so that one stuck in a hung store never keeps the process from exiting;
:func:`agree` makes every rank act on the same figure.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    _Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]  # (future, fn, args)

__all__ = ["Workers", "agree"]


class Workers:
    """``n`` daemon threads running submitted calls, each with its :class:`Future`.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so one stuck
    in a store that never answers would keep the process alive for good.
    """

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._n, self._closed, self._lock = n, False, threading.Lock()
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a worker; RuntimeError after :meth:`shutdown`."""
        future: Future[Any] = Future()
        with self._lock:  # (never behind the threads' stop marks)
            if self._closed:
                raise RuntimeError("the workers are shut down")
            self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the future's to report
                    future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel the calls not started; each thread ends when its running call returns."""
        with self._lock:
            self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(self._n):
            self._jobs.put(None)


def agree(value: int) -> int:
    """``value`` MIN-reduced over the ranks when ``torch.distributed`` is initialised."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
