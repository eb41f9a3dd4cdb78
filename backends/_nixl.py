"""The ``nixl`` backend: pages as files, moved by NIXL's storage plugins (POSIX by default).

NIXL is the transfer library behind several distributed KV stores; its file plugins
(``POSIX`` here, ``GDS``/``GDS_MT`` on GPU hosts with GPUDirect Storage) move bytes between
registered memory and files in batches. This backend keeps the store of the ``file``
backend (the same directory tree, object format, trust rules, capacity accounting and
atomic publication, from :class:`~hicache_storage.storekit.filestore.FileTreeStore`) and
moves the payloads through one NIXL transfer per batch:

* a write opens a temporary per page, writes the core header, then one NIXL ``WRITE``
  carries every page's segments from the host pool into their temporaries; each is then
  published (``link``: first writer wins) only if the transfer completed and the file has
  its full length. A reader never sees a page being written (the reference writes in
  place, so ``exists`` can see partial files).
* a read opens each published page, checks its size and header, then one NIXL ``READ``
  fills the host-pool pages; the checksum is verified as for ``file``. A transfer that
  fails fails its pages (a short read is an error in NIXL, never stale bytes).

The host pool is registered with the agent once (``register_mem_pool_host``); memory
outside it (tensors given to ``get``/``set``) is registered for the call. The agent loads
only the chosen plugin (never UCX, which crashes the interpreter at exit on CPU hosts)
and opens no socket. Options and guarantees: ``docs/backends/nixl.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import importlib
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from typing_extensions import override

from hicache_storage.buffers import is_tensor
from hicache_storage.errors import BackendClosedError, BackendError, ConfigError, from_os_error
from hicache_storage.protocol import Capabilities
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.storekit.filestore import FileTreeOptions, FileTreeStore, PayloadMove
from hicache_storage.storekit.header import HEADER_SIZE
from hicache_storage.storekit.pathsafety import user_dir

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.config import StorageConfig
    from hicache_storage.protocol import HostPool

__all__ = ["NixlBackend", "NixlOptions"]

logger = logging.getLogger(__name__)

#: The NIXL Python API, in the order tried: the meta package (it picks the build for the
#: host's CUDA), then either build installed on its own.
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
#: Polls of a transfer's state before the poller starts to sleep between polls.
_SPINS = 64
_MAX_NAP = 0.001
#: The plugin's I/O queue when it does not say (POSIX's default ``ios_pool_size``).
_DEFAULT_QUEUE = 65536
_agent_ids = itertools.count()


@dataclass(frozen=True)
class NixlOptions(FileTreeOptions):
    """Options of the ``nixl`` backend (environment: ``HICACHE_STORAGE_NIXL_<NAME>``).

    Attributes:
        root: directory under which every namespace gets its own subdirectory; default
            ``/tmp/hicache-storage-nixl-<uid>``, private to the user. The files are those of
            the ``file`` backend: both backends can share one root.
        plugin: the NIXL plugin that moves the bytes: ``POSIX`` (default; any host), or
            another plugin of files and host memory (``GDS_MT``, ``GDS`` on hosts with
            GPUDirect Storage). A plugin that does not load, or that does not move files,
            is a ``ConfigError``.
        plugin_params: the plugin's own parameters, ``"name=value,name=value"`` (POSIX:
            ``use_aio``, ``use_uring``, ``use_posix_aio``, ``kernel_queue_size``...).
        batch_pages: pages per transfer (and files open at once per call).
        (and every option of :class:`~hicache_storage.storekit.filestore.FileTreeOptions`.)
    """

    root: str | None = None
    plugin: str = "POSIX"
    plugin_params: str = ""
    batch_pages: int = 256

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.root is not None and not self.root:
            raise ConfigError("root must not be empty")
        if not self.plugin or not self.plugin.replace("_", "").isalnum():
            raise ConfigError(f"plugin must be a NIXL plugin name, got {self.plugin!r}")
        if self.batch_pages < 1:
            raise ConfigError(f"batch_pages must be >= 1, got {self.batch_pages}")
        _parse_params(self.plugin_params)


def _parse_params(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` as ``{"a": "1", "b": "2"}`` (ConfigError when malformed)."""
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"plugin_params must be name=value pairs, got {item!r}")
        params[name.strip()] = value.strip()
    return params


def _nixl_api() -> Any:
    """The NIXL Python API module (ConfigError naming the package when none is installed)."""
    errors = []
    for name in _API_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL's Python logger prints INFO lines (one per agent and plugin) to stdout,
            # which an engine may use: only its warnings and errors, unless the user asks.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ConfigError(
        "the nixl backend needs NIXL: pip install 'hicache-storage[nixl]' ("
        + "; ".join(errors)
        + ")"
    )


def _spans(views: Sequence[memoryview]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each non-empty view."""
    return [(_address(v), v.nbytes) for v in views if v.nbytes]


def _address(view: memoryview) -> int:
    """The address of ``view``'s first byte (a C-contiguous byte view)."""
    obj = view.obj
    if isinstance(obj, ctypes.Array) and ctypes.sizeof(obj) == view.nbytes:
        return ctypes.addressof(obj)  # a whole host-pool segment (buffers.memoryview_at)
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlBackend(FileTreeStore[NixlOptions]):
    """Pages as files of the ``file`` format, moved by one NIXL transfer per batch."""

    name = "nixl"
    capabilities = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)
    options_class = NixlOptions

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._api = None
        self._nixl_log = RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._agent_obj: Any = None
        self._agent_pid = -1
        # Registered host memory: sorted starts and ends, and the tensors held (so that
        # registered memory is never freed and reused while the agent has it).
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._pool_tensors: list[Any] = []
        self._pool_regs: list[Any] = []
        self._closing_agent = False
        # Agents a failed transfer left (see _retire): kept, never used again.
        self._retired: list[Any] = []
        self._users: dict[int, int] = {}  # transfers in progress per agent (by id)
        # Descriptors in flight on the agent, and the most a transfer may carry: NIXL's
        # POSIX plugin queues every I/O of every transfer in one pool of ios_pool_size
        # entries, and a transfer that finds it full fails after queueing part of itself.
        self._post_lock = threading.Lock()
        self._room = threading.Condition()
        self._in_flight = 0
        self._queue = _DEFAULT_QUEUE
        try:
            self._api = _nixl_api()
            self._agent()  # ConfigError now for a plugin that does not load
        except BaseException:
            super().close()
            raise

    # ------------------------------------------------------------------ the agent

    @override
    def _location(self, opts: NixlOptions) -> str:
        return opts.root if opts.root is not None else user_dir("/tmp", "hicache-storage-nixl")

    def _agent(self) -> Any:
        """This process's NIXL agent (a forked child makes its own: threads do not survive).

        A new one is made after a failed transfer retired the last (:meth:`_retire`).
        """
        agent = self._agent_obj
        if agent is not None and self._agent_pid == os.getpid():
            return agent
        with self._lock:
            if self._closing_agent:
                raise BackendClosedError("the nixl backend is closed")
            if self._agent_obj is None or self._agent_pid != os.getpid():
                self._agent_obj = self._new_agent()
                self._agent_pid = os.getpid()
                self._pool_regs = [self._agent_obj.register_memory(t) for t in self._pool_tensors]
            return self._agent_obj

    def _new_agent(self) -> Any:
        api, opts = self._api, self.options
        assert api is not None
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],  # only the chosen plugin is loaded, below (never UCX)
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # several threads
        )
        agent = api.nixl_agent(f"hicache-{os.getpid()}-{next(_agent_ids)}", config)
        # The plugin's memory types are read before it is made: making one that moves no
        # files (UCX) would be useless, and UCX crashes the interpreter at exit here.
        plugins = sorted(agent.get_plugin_list())
        if opts.plugin not in plugins:
            raise ConfigError(f"NIXL has no plugin {opts.plugin!r}; its plugins: {plugins}")
        mems = set(agent.get_plugin_mem_types(opts.plugin))
        if not {"FILE_SEG", "DRAM_SEG"} <= mems:
            raise ConfigError(
                f"the NIXL plugin {opts.plugin!r} cannot move files to and from host memory "
                f"here (its memory types: {sorted(mems)}; none when it did not load)"
            )
        params = _parse_params(opts.plugin_params)
        unknown = sorted(set(params) - set(agent.get_plugin_params(opts.plugin)))
        if unknown:
            raise ConfigError(
                f"the NIXL plugin {opts.plugin!r} has no parameters {unknown}; its "
                f"parameters: {sorted(agent.get_plugin_params(opts.plugin))}"
            )
        queue = params.get(
            "ios_pool_size", agent.get_plugin_params(opts.plugin).get("ios_pool_size")
        )
        try:
            self._queue = max(16, int(queue)) if queue else _DEFAULT_QUEUE
        except ValueError:
            raise ConfigError(f"ios_pool_size must be a number, got {queue!r}") from None
        try:
            agent.create_backend(opts.plugin, params)
        except Exception as exc:  # noqa: BLE001 - the bindings' error types
            raise ConfigError(
                f"the NIXL plugin {opts.plugin!r} did not start with plugin_params "
                f"{opts.plugin_params!r}: {type(exc).__name__}: {exc}"
            ) from None
        return agent

    @override
    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        buffers: Any = getattr(mem_pool_host, "kv_buffer", None)
        tensors: list[Any] = [
            t
            for t in (buffers if isinstance(buffers, (list, tuple)) else [buffers])
            if is_tensor(t) and t.device.type == "cpu" and t.numel()
        ]
        agent = self._agent()
        with self._lock:
            for reg in self._pool_regs:  # a pool registered before is let go
                agent.deregister_memory(reg)
            self._pool_regs = [agent.register_memory(t) for t in tensors]
            self._pool_tensors = tensors
            spans = sorted((int(t.data_ptr()), int(t.data_ptr()) + int(t.nbytes)) for t in tensors)
            self._starts = [s for s, _ in spans]
            self._ends = [e for _, e in spans]

    def _unregistered(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, str]]:
        """The spans outside the registered host pool, as DRAM registration entries."""
        starts, ends = self._starts, self._ends
        out = []
        for addr, n in spans:
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr + n > ends[i]:
                out.append((addr, n, 0, ""))
        return out

    def _transfer(
        self, op: str, spans: list[tuple[int, int]], places: list[tuple[int, int, int]],
        files: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """NIXL transfers between host memory and files; BackendError when one fails.

        ``spans``: ``(address, bytes)`` in host memory; ``places``: the matching
        ``(offset, bytes, fd)`` in files; ``files``: ``(fd, size)`` of each file involved.
        A quarter of the plugin's I/O queue at most goes in one transfer. Returns only once
        every transfer is over.
        """
        step = max(1, self._queue // 4)
        sizes = dict(files)
        for at in range(0, len(places), step):
            part = places[at : at + step]
            fds = sorted({fd for _, _, fd in part})
            self._transfer_part(op, spans[at : at + step], part, [(fd, sizes[fd]) for fd in fds])

    def _transfer_part(
        self, op: str, spans: list[tuple[int, int]], places: list[tuple[int, int, int]],
        files: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """One NIXL transfer (see :meth:`_transfer`)."""
        n = len(places)
        with self._room:  # wait until the plugin's queue has room for all of it
            while self._in_flight and self._in_flight + n > self._queue:
                self._room.wait()
            self._in_flight += n
        agent = None
        try:
            agent = self._use_agent()
            extra = self._unregistered(spans)
            with contextlib.ExitStack() as stack:
                if extra:
                    reg = agent.register_memory(extra, "DRAM")
                    stack.callback(agent.deregister_memory, reg)
                file_reg = agent.register_memory(
                    np.array([(0, size, fd) for fd, size in files], dtype=np.uint64), "FILE"
                )
                stack.callback(agent.deregister_memory, file_reg)
                local = agent.get_xfer_descs(
                    np.array([(a, k, 0) for a, k in spans], dtype=np.uint64), "DRAM"
                )
                remote = agent.get_xfer_descs(np.array(places, dtype=np.uint64), "FILE")
                handle = agent.initialize_xfer(op, local, remote, agent.name)
                stack.callback(self._release, agent, handle)
                with self._post_lock:
                    if agent is not self._agent_obj:  # retired by a failure meanwhile
                        raise BackendError("the NIXL agent was replaced after a failure")
                    try:
                        state = agent.transfer(handle)
                    except BaseException:
                        self._retire(agent)
                        raise
                    if state == "ERR":
                        self._retire(agent)
                spins = 0
                while state == "PROC":
                    spins += 1
                    if spins > _SPINS:  # a slow device: do not burn a core polling it
                        time.sleep(min(_MAX_NAP, 1e-5 * (spins - _SPINS)))
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise BackendError(f"NIXL {op} of {n} ranges failed ({state})")
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - the bindings' nixl*Error types
            raise BackendError(f"NIXL {op} of {n} ranges failed: {exc!r}") from None
        finally:
            if agent is not None:
                self._done_with(agent)
            with self._room:
                self._in_flight -= n
                self._room.notify_all()

    def _use_agent(self) -> Any:
        """The agent, counted as in use by one more transfer (see :meth:`_done_with`)."""
        agent = self._agent()
        with self._lock:
            self._users[id(agent)] = self._users.get(id(agent), 0) + 1
        return agent

    def _done_with(self, agent: Any) -> None:
        """A transfer is over with ``agent``: a retired agent nobody uses is let go."""
        with self._lock:
            left = self._users[id(agent)] = self._users[id(agent)] - 1
            if left == 0:
                del self._users[id(agent)]
                self._retired = [a for a in self._retired if a is not agent]

    def _retire(self, agent: Any) -> None:
        """Never post on ``agent`` again; the next call makes a new one.

        A transfer whose post fails may leave part of its I/O queued in the agent (NIXL
        does not take back what it queued before a full queue stopped it), and the
        agent's next post would run it, into descriptors and memory this call has given
        back. (A failure found on completion comes after all of its I/O ended: the agent
        stays.) The retired agent is let go once its last transfer is over.
        """
        with self._lock:
            if self._agent_obj is agent:
                self._agent_obj = None
                self._pool_regs = []
                self._retired.append(agent)
                self._nixl_log("retired", "a NIXL post failed: the backend starts a new agent")

    def _release(self, agent: Any, handle: Any) -> None:
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - the pages already failed or succeeded
            self._nixl_log("release", "NIXL could not release a transfer handle: %r", exc)

    # ------------------------------------------------------------------ moving payloads

    @override
    def _payload_batch(self, opts: NixlOptions) -> int:
        return opts.batch_pages

    @override
    def move_payloads(
        self, direction: Literal["read", "write"], moves: Sequence[PayloadMove]
    ) -> None:
        """One NIXL transfer (parts of the plugin's queue at most) for every payload.

        A write then checks that each payload is whole and writes its trailer; a read
        reads each trailer the store has not read already (its batched reads read and
        check every header before the transfer).
        """
        places: list[tuple[int, int, int]] = []
        flat: list[tuple[int, int]] = []
        files: list[tuple[int, int]] = []
        write = direction == "write"
        for move in moves:
            offset = 0  # (the payload starts each file; its header is a trailer)
            for addr, nbytes in move.spans if move.spans is not None else _spans(move.views):
                places.append((offset, nbytes, move.fd))
                flat.append((addr, nbytes))
                offset += nbytes
            files.append((move.fd, move.payload if write else move.payload + HEADER_SIZE))
        if places:
            self._transfer("WRITE" if write else "READ", flat, places, files)
        for move in moves:
            if write:
                self._seal(move)
            elif move.trailer is not None:  # (a short one fails the header check)
                try:
                    os.preadv(move.fd, [move.trailer], move.payload)
                except OSError as exc:
                    raise from_os_error(exc, f"read {move.path}") from exc

    @staticmethod
    def _seal(item: PayloadMove) -> None:
        """Check that the transfer wrote the whole payload, then write the trailer.

        The payload must fill the file up to the trailer, with no hole (``SEEK_HOLE``,
        where the filesystem tells): a plugin that reported success for a short write
        fails the page here instead of publishing zeros.
        """
        payload = item.payload
        try:
            size = os.fstat(item.fd).st_size
            hole = os.lseek(item.fd, 0, os.SEEK_HOLE) if payload else 0
            if size != payload or (payload and hole < payload):
                raise BackendError(
                    f"NIXL wrote {size} of {payload} bytes to {item.path} (first hole at {hole})"
                )
            if item.trailer is None or os.pwrite(item.fd, item.trailer, payload) != HEADER_SIZE:
                raise BackendError(f"write {item.path}: short header write")
        except OSError as exc:
            raise BackendError(f"write {item.path}: {exc}") from exc

    # ------------------------------------------------------------------ lifecycle

    @override
    def close(self) -> None:
        with self._lock:
            self._closing_agent = True  # no call makes a new agent from here on
            self._retired = []
            agent, self._agent_obj = self._agent_obj, None
            regs, self._pool_regs = self._pool_regs, []
            if agent is not None and self._agent_pid == os.getpid():
                for reg in regs:
                    with contextlib.suppress(Exception):
                        agent.deregister_memory(reg)
        super().close()
