"""An asyncio event loop on a thread of its own, for backends whose client is async.

The engine calls a backend from a few threads of its own (the prefetch and backup
threads, the scheduler), never from a running event loop. A backend on an async client
(s3fs's aiobotocore, say) owns one :class:`LoopThread`; each engine-facing call submits
one coroutine to it and waits for the result with a deadline. The loop never waits for
an engine thread, so the two can never deadlock each other, and a call that overruns
its deadline is cancelled on the loop and fails with :class:`BackendTimeoutError`.

A forked child has no loop thread (threads do not survive ``fork``): the first call
there starts a new loop, and ``on_fork`` lets the owner rebuild what lived on the old
one (a client session).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import TYPE_CHECKING, Any, TypeVar

from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop, run by one daemon thread, started on first use.

    Args:
        name: the thread's name (shown by debuggers and ``py-spy``).
        on_fork: called (with no arguments) in a forked child before its first call
            starts a new loop: the owner drops objects bound to the parent's loop.
    """

    def __init__(self, name: str, on_fork: Callable[[], None] | None = None) -> None:
        self._name = name
        self._on_fork = on_fork
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started if needed)."""
        with self._lock:
            if self._closed:
                raise BackendUnavailableError(f"{self._name}: the event loop is closed")
            if self._pid != os.getpid():  # a forked child: the thread is not here
                self._pid = os.getpid()
                self._loop, self._thread = None, None
                if self._on_fork is not None:
                    self._on_fork()
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name=self._name, daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def in_loop_thread(self) -> bool:
        """True when called from the loop's own thread (where :meth:`run` would deadlock)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], deadline: float | None) -> T:
        """Run ``coro`` on the loop and return its result, within ``deadline`` seconds.

        Raises what the coroutine raised, or BackendTimeoutError when the deadline
        passed first (the coroutine is then cancelled on the loop).
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"{self._name}: a blocking call from the loop's own thread")
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except BaseException:
            coro.close()
            raise
        try:
            return future.result(deadline)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BackendTimeoutError(f"the call did not finish within {deadline:g} s") from None
        except concurrent.futures.CancelledError:
            raise BackendUnavailableError(
                f"{self._name}: the call was cancelled (closed)"
            ) from None

    def close(self, final: Coroutine[Any, Any, Any] | None = None, timeout: float = 5.0) -> None:
        """Cancel what still runs, run ``final`` (closing a client session), stop the loop.

        Callers waiting on a cancelled coroutine get BackendUnavailableError at once.
        Idempotent; later calls of :meth:`run` raise BackendUnavailableError.
        """
        with self._lock:
            if self._closed:
                if final is not None:
                    final.close()
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            forked = self._pid != os.getpid()
            self._loop, self._thread = None, None
        if loop is None or thread is None or forked:
            if final is not None:
                final.close()
            return

        async def shutdown() -> None:
            running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running, timeout=timeout)
            if final is not None:
                await asyncio.wait_for(final, timeout)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(2 * timeout)
        except Exception:  # noqa: BLE001, S110 - closing: nothing left to tell
            pass
        loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join(timeout)
        if not thread.is_alive():
            loop.close()
