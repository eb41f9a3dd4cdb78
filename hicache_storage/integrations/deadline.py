"""Engine threads that never wait on a store past a deadline.

An engine calls a store from threads that must keep moving: vLLM's scheduler and its
forward pass, SGLang's scheduler. A store that hangs (a frozen server, a dead NFS mount, a
vendor's client stuck in a lock) must cost misses there, not a hung engine. Python cannot
stop a thread inside a call, so the call runs on a thread of its own and the engine waits
for it only until its deadline: :class:`Lane` does that, and
:func:`call_with_deadline` for one-off calls (connecting, closing).

**Late bytes.** A call cut at its deadline goes on in the background: its reads may still
land and its writes may still read their sources. Whatever it touches must not be the
engine's memory by then, which the engine is about to reuse. So a lane's job moves bytes
between the store and a staging area of its own, and copies between that area and the
engine's memory only inside :meth:`Job.commit`, which a job cut at its deadline can no
longer enter: after :meth:`Lane.run` returns, the job never touches the engine's memory
again.

**One job at a time.** While a lane's job is still running (cut at its deadline, the
store still hung), the lane refuses new jobs at once: an engine that asks again is
answered ``"busy"`` (a miss, a failed load, a dropped store) without waiting, and the
lane takes jobs again when the hung call returns. Lane threads are daemon threads: a
call that never returns never keeps the process from exiting.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["Background", "Job", "Lane", "Outcome", "call_with_deadline"]

T = TypeVar("T")

#: How :meth:`Lane.run` ended: the job finished in time, was cut at its deadline, or was
#: refused because the lane's previous job is still running.
Outcome = Literal["done", "timeout", "busy"]


class Job(Generic[T]):
    """One call on a lane: what it returns, and the gate to the engine's memory."""

    def __init__(self, fn: Callable[[Job[T]], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._cut = False
        self._done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    @property
    def cut(self) -> bool:
        """True once the caller stopped waiting (checked between steps, to stop early)."""
        return self._cut

    @contextlib.contextmanager
    def commit(self) -> Iterator[bool]:
        """Hold the gate to the engine's memory; yields False once the job was cut.

        Copy between the staging area and the engine's memory only when it yields True:
        the caller cannot stop waiting while the gate is held, and a job that was cut
        never gets it again.
        """
        with self._lock:
            yield not self._cut

    @property
    def finished(self) -> bool:
        """True once the call returned (or raised)."""
        return self._done.is_set()

    def cancel(self) -> None:
        """Cut the job now: once this returns it never enters :meth:`commit` again.

        Waits only for a copy inside the gate to end (never for the store's call).
        """
        with self._lock:
            self._cut = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the call to return, at most ``timeout`` seconds; True if it did."""
        return self._done.wait(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))

    def _run(self, before_done: Callable[[], None] | None = None) -> None:
        """Run the call; ``before_done`` runs after it and before a waiter wakes."""
        try:
            self.result = self._fn(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, if it waits
            self.error = exc
        finally:
            try:
                if before_done is not None:
                    before_done()
            except Exception:  # the job still ends, and its thread goes on
                logging.getLogger(__name__).exception("a job's completion step failed")
            self._done.set()

    def _wait(self, timeout: float) -> bool:
        """True if the job finished within ``timeout``; else it is cut (see :meth:`commit`)."""
        if self._done.wait(min(timeout, threading.TIMEOUT_MAX)):
            return True
        with self._lock:
            self._cut = True
        # It may have finished between the wait and the cut: then its result stands.
        return self._done.is_set()


class Lane:
    """A daemon thread that runs one job at a time for callers that wait with a deadline.

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Job[object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def busy(self) -> bool:
        """True while a job runs (a job cut at its deadline keeps its lane busy)."""
        return self._busy

    def run(self, fn: Callable[[Job[T]], T], timeout: float) -> tuple[Outcome, Job[T]]:
        """Run ``fn(job)`` on the lane; wait at most ``timeout`` seconds for it.

        Returns the outcome and the job: its ``result`` (or ``error``, re-raised here when
        it finished in time) is complete only when the outcome is ``"done"``. A job cut at
        its deadline keeps running to its end; only its :meth:`Job.commit` steps stop.
        """
        job: Job[T] = Job(fn)
        with self._lock:
            if self._busy or self._closed:
                job._cut = True
                return "busy", job
            self._busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put(job)  # type: ignore[arg-type]
        if not job._wait(timeout):
            return "timeout", job
        if job.error is not None:
            raise job.error
        return "done", job

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            # (the lane is free before the caller wakes: a caller that got "done" and
            # asks again at once is never told "busy")
            job._run(before_done=self._free)

    def _free(self) -> None:
        with self._lock:
            self._busy = False

    def close(self) -> None:
        """Stop the thread once its job (if any) returns; later jobs are refused."""
        with self._lock:
            self._closed = True
        self._jobs.put(None)


class Background:
    """A daemon thread that runs submitted jobs in order; nobody waits for them.

    For transfers off the engine's critical path: :meth:`submit` queues a job and
    returns it at once. The engine learns of its end through :attr:`Job.finished`
    (or its ``on_done`` callback), and keeps its memory safe by cutting a job
    (:meth:`Job.cancel`) before it reuses what the job reads or writes: the job copies
    to or from the engine's memory only inside :meth:`Job.commit`.

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Job[Any], Callable[[], None] | None] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(
        self, fn: Callable[[Job[T]], T], on_done: Callable[[Job[T]], None] | None = None
    ) -> Job[T]:
        """Queue ``fn(job)``; ``on_done(job)`` runs on the thread after it, before waiters wake.

        After :meth:`close` the job is returned cut and finished, never run (``on_done``
        still runs, on this thread).
        """
        job: Job[T] = Job(fn)
        after = (lambda: on_done(job)) if on_done is not None else None
        with self._lock:
            closed = self._closed
            if not closed and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            if not closed:
                self._jobs.put((job, after))
        if closed:
            job._cut = True
            if after is not None:
                after()
            job._done.set()
        return job

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, after = item
            job._run(before_done=after)

    def close(self) -> None:
        """Stop the thread after the queued jobs; later jobs are not run."""
        with self._lock:
            self._closed = True
        self._jobs.put(None)


def call_with_deadline(fn: Callable[[], T], timeout: float, name: str) -> tuple[bool, T | None]:
    """``(True, fn())`` if ``fn`` returns within ``timeout`` seconds, else ``(False, None)``.

    ``fn`` runs on a daemon thread of its own and goes on after the deadline (give it
    nothing the caller will reuse). An exception it raises in time is raised here.
    """
    job: Job[T] = Job(lambda _job: fn())
    threading.Thread(target=job._run, name=name, daemon=True).start()
    if not job._wait(timeout):
        return False, None
    if job.error is not None:
        raise job.error
    return True, job.result
