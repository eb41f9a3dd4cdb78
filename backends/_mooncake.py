"""The ``mooncake`` backend: pages in a Mooncake Store, over TCP or RDMA.

Mooncake Store is the distributed KV store that the field runs with SGLang. This backend
is built on :class:`~hicache_storage.storekit.blobstore.BlobStore` for the tensor path,
with the v1 page path done zero-copy: ``batch_put_from_multi_buffers`` sends the core
header (from a small registered arena) and the page's segments (K and V) straight from
the host pool as one object (a page of many segments, ``layer_first``, is copied once
through a registered staging buffer), and ``batch_get_into_multi_buffers`` reads
an object back into a header slot and the page's own segments, then the header is
checked against the page (length, name, xxh3): a foreign, truncated or evicted object
is a miss, never wrong bytes. Options and guarantees: ``docs/backends/mooncake.md``.

The client's traps, handled here: a zero-length value kills the process (every object
here has a 48-byte header at least); ``put`` never replaces an object (first writer
wins, our rule anyway), and answers success at once when another client's put of the
key is still in flight, before that key can be read (and if that put fails, it never
can): a set answers True only once the key reads (``put_wait``), and a read of such a
key ("not ready") is a miss; a missing key reads as empty bytes; ``get_into`` returns a
byte count; removal is refused during a lease (``clear()`` forces it); ``setup`` against
a master that does not answer blocks for about 90 s (the master's port is checked first,
with ``connect_timeout``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from typing_extensions import override

from hicache_storage.breaker import Health
from hicache_storage.buffers import is_tensor
from hicache_storage.config import Size, StorageConfig, redact_text, redacting_repr
from hicache_storage.errors import BackendError, BackendUnavailableError, ConfigError, ErrorMap
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.blobstore import PRESENT, BlobOptions, BlobStore, Present, Segments
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from hicache_storage.buffers import PageBuffer
    from hicache_storage.keys import ObjectName
    from hicache_storage.protocol import HostPool

__all__ = ["MooncakeBackend", "MooncakeOptions"]

#: Mooncake's "object not found" (a miss, not a failure).
_NOT_FOUND = -704
#: Mooncake's "replica not ready": another client's put of the key is still in flight.
_NOT_READY = -703
#: Read codes that are misses: not stored, or not stored yet.
_MISSES = (_NOT_FOUND, _NOT_READY)
#: Mooncake's "invalid parameters": on a read, a buffer of another size than the object.
_INVALID = -600
#: Mooncake's RPC failures (the master did not answer) are this code and below.
_RPC_FAIL = -900
_GiB = 2**30
_MiB = 2**20
#: Where the kernel lists this host's RDMA devices (InfiniBand, RoCE, iWARP), the ones
#: the transfer engine's RDMA transport can open.
_RDMA_SYSFS = "/sys/class/infiniband"


@redacting_repr
@dataclass(frozen=True)
class MooncakeOptions(BlobOptions):
    """Options of the ``mooncake`` backend (environment: ``HICACHE_STORAGE_MOONCAKE_<NAME>``).

    Attributes:
        master_server_address: the Mooncake master, ``host:port``.
        metadata_server: ``P2PHANDSHAKE`` (no metadata server), or the URL of one
            (``http://host:port/metadata``, ``etcd://...``).
        protocol: ``tcp``, or ``rdma`` where the hosts have it.
        device_name: RDMA devices (``mlx5_0,mlx5_1``); empty for TCP.
        local_hostname: the address this client gives its peers.
        global_segment_size: memory this client lends to the store (its segment).
        local_buffer_size: the client's registered transfer buffer (at least 1 MiB); the
            tensor path's objects (header and page) must fit it whole.
        replica_num: copies of each object.
        prefix: what every key starts with, before the object name.
        config_file: a JSON file of these options (the options given directly win).
        connect_timeout: seconds to wait for the master's port before ``setup``.
        max_buffers_per_object: a page of at most this many segments (K and V: 2) goes
            straight from its segments; one of more (``layer_first``: two per layer) is
            copied once through a registered staging buffer (the transfer engine fails
            objects made of many small remote slices).
        staging_size: bytes of that staging buffer, per engine thread (at least one
            page is staged at a time).
        put_wait: seconds a set waits for a key that another client is writing at the
            same time to become readable (Mooncake's put answers success at once for
            it); a key still not readable then is reported not stored.
    """

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: Size = Size(_GiB)  # noqa: RUF009 - an int subclass, immutable
    local_buffer_size: Size = Size(64 * 2**20)  # noqa: RUF009 - an int subclass, immutable
    replica_num: int = 1
    prefix: str = "hicache/"
    config_file: str | None = None
    connect_timeout: float = 5.0
    max_buffers_per_object: int = 8
    staging_size: Size = Size(64 * 2**20)  # noqa: RUF009 - an int subclass, immutable
    put_wait: float = 5.0

    def __post_init__(self) -> None:
        host, _, port = self.master_server_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("master_server_address must be host:port")
        if self.replica_num < 1:
            raise ConfigError("replica_num must be >= 1")
        if not 0 < self.connect_timeout < float("inf"):
            raise ConfigError("connect_timeout must be a positive number of seconds")
        if not 0 <= self.put_wait < float("inf"):
            raise ConfigError("put_wait must be a number of seconds >= 0")
        if self.global_segment_size < 0:
            raise ConfigError("global_segment_size must be >= 0")
        if self.local_buffer_size < _MiB:
            raise ConfigError(
                f"local_buffer_size must be at least 1MiB (got {int(self.local_buffer_size)} "
                "bytes): each object of the tensor path, a 48-byte header and one page, "
                "goes through it whole; give at least a page's bytes plus 48"
            )


def _with_config_file(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over the JSON file they (or the environment) name, if any."""
    path = options.get("config_file") or os.environ.get("HICACHE_STORAGE_MOONCAKE_CONFIG_FILE")
    if not path:
        return options
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the mooncake config_file {path}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"the mooncake config_file {path} must hold a JSON object")
    return {**loaded, **options}


class MooncakeBackend(BlobStore[MooncakeOptions]):
    """Pages as objects of a Mooncake Store; v1 pages move without a copy."""

    name = "mooncake"
    capabilities = Capabilities(zero_copy=True, delete=True, shared=True)
    options_class = MooncakeOptions
    error_map: ClassVar[ErrorMap] = {RuntimeError: BackendError, OSError: BackendUnavailableError}
    exists_chunk: ClassVar[int] = 0  # batch_is_exist is one call for the whole batch

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **_with_config_file(dict(options)))
        self._master = redact_text(self.options.master_server_address)  # (for messages)
        self._mc: Any = None
        self._local = threading.local()  # each thread's header arena and staging buffer
        # address -> (bytes, the tensor): holding the tensor keeps that memory from being
        # freed and reused while the transfer engine has it registered
        self._registered: dict[int, tuple[int, torch.Tensor]] = {}
        self._pool_regions: list[int] = []
        self._down_until = 0.0  # the master failed a call: fail fast until then
        self._lock = threading.Lock()
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise ConfigError(
                "the mooncake backend needs the Mooncake client: pip install "
                "'hicache-storage[mooncake]' (CPU hosts) or 'hicache-storage[mooncake-cuda]'"
                f" (GPU hosts) ({exc})"
            ) from exc
        opts = self.options
        self._prefix = opts.prefix
        if opts.protocol == "rdma":
            _check_rdma(opts.device_name)
        self._check_master()
        store = MooncakeDistributedStore()
        rc = store.setup(
            opts.local_hostname, opts.metadata_server, int(opts.global_segment_size),
            int(opts.local_buffer_size), opts.protocol, opts.device_name,
            opts.master_server_address,
        )  # fmt: skip
        if rc != 0:
            raise BackendUnavailableError(
                f"mooncake setup failed (rc {rc}) against the master at "
                f"{self._master} (metadata {redact_text(opts.metadata_server)})"
            )
        self._mc = store
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = opts.replica_num
        # The bytes path (tensors, not v1 pages) goes through the local buffer.
        self.capabilities = dataclasses.replace(
            self.capabilities, max_object_bytes=_largest_put(opts.local_buffer_size) - HEADER_SIZE
        )

    def _check_master(self) -> None:
        """The master's port answers (``setup`` would block for about 90 s otherwise)."""
        host, _, port = self.options.master_server_address.rpartition(":")
        try:
            with socket.create_connection(
                (host.strip("[]"), int(port)), self.options.connect_timeout
            ):
                pass
        except OSError as exc:
            raise BackendUnavailableError(
                f"no Mooncake master answers at {self._master}: {exc}"
            ) from None

    # ------------------------------------------------------------------ keys, arenas

    def _keys(self, names: list[ObjectName]) -> list[str]:
        prefix = self._prefix
        return [prefix + n.path for n in names]

    def _headers(self, n: int) -> torch.Tensor:
        """This thread's registered arena of at least ``n`` header slots (zeroed)."""
        arena: torch.Tensor | None = getattr(self._local, "arena", None)
        if arena is None or arena.numel() < n * HEADER_SIZE:
            import torch

            arena = torch.zeros(max(n, 128) * HEADER_SIZE, dtype=torch.uint8)
            self._register(arena)
            self._local.arena = arena
        arena[: n * HEADER_SIZE].zero_()  # (a slot never holds an earlier call's header)
        return arena

    def _register(self, t: torch.Tensor) -> int:
        """Register ``t``'s memory with the transfer engine (once) and hold ``t``.

        Held, the memory cannot be freed and reused elsewhere while registered (with
        RDMA, a registration pins physical pages: a reused address would move the old
        pages' bytes). A region of ours that overlaps it (another view of the same
        memory) is unregistered first; the engine refuses overlapping regions.
        """
        ptr, size = int(t.data_ptr()), int(t.nbytes)
        with self._lock:
            held = self._registered.get(ptr)
            if held is not None and held[0] == size and held[1] is t:
                return ptr
            for old, (old_size, _) in list(self._registered.items()):
                if old < ptr + size and ptr < old + old_size:
                    self._mc.unregister_buffer(old)
                    del self._registered[old]
            rc = self._mc.register_buffer(ptr, size)
            if rc != 0:
                raise BackendError(f"mooncake register_buffer failed (rc {rc})")
            self._registered[ptr] = (size, t)
        return ptr

    @override
    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        # RDMA needs the pool's memory registered; over TCP it is not needed but harmless.
        # A pool registered before is let go (its memory may be freed now).
        with self._lock:
            for ptr in self._pool_regions:
                if ptr in self._registered:
                    self._mc.unregister_buffer(ptr)
                    del self._registered[ptr]
            self._pool_regions = []
        buffers: Any = getattr(mem_pool_host, "kv_buffer", None)
        t: Any
        for t in buffers if isinstance(buffers, (list, tuple)) else [buffers]:
            if is_tensor(t) and t.numel():
                self._pool_regions.append(self._register(t))

    def _call(self, method: str, *args: Any) -> Any:
        """One client call, failing at once while the master is known down."""
        self._check_up()
        result = getattr(self._mc, method)(*args)
        self._note(
            result if isinstance(result, list) else [result] if isinstance(result, int) else []
        )
        return result

    def _check_up(self) -> None:
        """Fail at once while the master is known down (each call would block seconds)."""
        if self._down_until and time.monotonic() < self._down_until:
            raise BackendUnavailableError(
                f"the Mooncake master at {self._master} failed a call lately; trying again shortly"
            )

    def _note(self, codes: Sequence[object]) -> None:
        """After a call: an RPC failure (``-900`` and below) marks the master down."""
        if any(type(c) is int and c <= _RPC_FAIL for c in codes):
            self._down_until = time.monotonic() + max(1.0, 2 * self.options.connect_timeout)
        elif self._down_until:
            self._down_until = 0.0

    def _settle(self, keys: list[str], put: Callable[[list[int]], Sequence[int]]) -> list[int]:
        """Put ``keys`` (``put`` takes their indices); each code 0 only once that key reads.

        Mooncake's put also answers 0 when another client's put of the key has begun and
        its bytes are still in flight: not readable yet, and never if that put fails. A
        key that does not read after its put is put again (which stores it if the other
        put was dropped) until it reads or ``put_wait`` seconds have passed; then its code
        is ``_NOT_READY``. A key the existence query fails for (a negative code) fails with
        that code at once.
        """
        codes = list(put(list(range(len(keys)))))
        todo = [i for i, rc in enumerate(codes) if rc == 0]
        deadline = time.monotonic() + self.options.put_wait
        pause = 0.001
        while todo:
            found = self._call("batch_is_exist", [keys[i] for i in todo])
            for i, rc in zip(todo, found, strict=True):
                if rc < 0:  # the query itself failed (not "not yet"): its own code
                    codes[i] = rc
            todo = [i for i, rc in zip(todo, found, strict=True) if rc == 0]
            if todo and time.monotonic() >= deadline:
                for i in todo:
                    codes[i] = _NOT_READY
                break
            if todo:
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
                for i, rc in zip(todo, put(todo), strict=True):
                    codes[i] = rc
                todo = [i for i in todo if codes[i] == 0]
        return codes

    # ------------------------------------------------------------------ BlobStore's part

    @override
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | None]:
        keys = self._keys(names)
        got: list[bytes | None] = [bytes(v) if v else None for v in self._call("get_batch", keys)]
        # A missing key reads as b"", and so does one the batch could not carry (more
        # than the local buffer at once): those that exist are read again one by one.
        empty = [i for i, v in enumerate(got) if v is None]
        if empty:
            lost = []
            for i, rc in zip(
                empty, self._call("batch_is_exist", [keys[i] for i in empty]), strict=True
            ):
                if rc == 1:
                    value = self._call("get", keys[i])
                    got[i] = bytes(value) if value else None
                    if got[i] is None:
                        lost.append(keys[i])
            self._forget_lost(lost)
        return got

    def _forget_lost(self, keys: list[str]) -> None:
        """Remove keys the master lists but whose bytes cannot be read (a storage node gone).

        Else ``exists`` says yes and a ``set`` of them does nothing for a while. Best effort.
        """
        if keys:
            try:
                self._call("batch_remove", keys, True)
            except Exception:  # noqa: BLE001, S110 - the reads already answered misses
                pass

    @override
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> list[bool | Present | Exception]:
        keys = self._keys(names)
        out: list[bool | Present | Exception] = []
        todo: list[int] = []
        for i, present in enumerate(self._call("batch_is_exist", keys)):
            out.append(PRESENT if present == 1 else False)
            if present != 1:
                todo.append(i)
        values = [b"".join(blobs[i]) for i in todo]  # (never empty: the header is in it)

        def put(idx: list[int]) -> list[int]:
            return [self._call("put", keys[todo[j]], values[j], self._replicate) for j in idx]

        for i, rc in zip(todo, self._settle([keys[i] for i in todo], put), strict=True):
            out[i] = True if rc == 0 else _put_failed(rc)
        return out

    @override
    def _exists_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        return [_exists(rc) for rc in self._call("batch_is_exist", self._keys(names))]

    @override
    def _delete_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        out: list[bool | Exception] = []
        for rc in self._call("batch_remove", self._keys(names), True):  # forced: past a lease
            if rc == 0:
                out.append(True)
            elif rc == _NOT_FOUND:
                out.append(False)
            else:
                out.append(BackendError(f"mooncake remove failed (rc {rc})"))
        return out

    @override
    def _clear_namespace(self) -> None:
        # Only this namespace's keys, even under a lease (never remove_all).
        pattern = "^" + re.escape(self._prefix + self.namespace_prefix)
        rc = self._call("remove_by_regex", pattern, True)
        if rc < 0:
            raise BackendError(f"mooncake remove_by_regex failed (rc {rc})")

    # ------------------------------------------------------------------ v1 pages, zero-copy

    def _direct(self, page: PageBuffer) -> bool:
        return len(page.segments) <= self.options.max_buffers_per_object

    def _staging(self, nbytes: int) -> torch.Tensor:
        """This thread's registered staging buffer of at least ``nbytes`` bytes."""
        buf: torch.Tensor | None = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            import torch

            buf = torch.empty(max(nbytes, int(self.options.staging_size)), dtype=torch.uint8)
            self._register(buf)
            self._local.staging = buf
        return buf

    def _groups(self, idx: list[int], pages: Sequence[PageBuffer]) -> list[list[int]]:
        """``idx`` in runs whose staged objects fit the staging size (one page at least)."""
        groups: list[list[int]] = []
        size = 0
        for i in idx:
            n = HEADER_SIZE + pages[i].nbytes
            if groups and size + n <= self.options.staging_size:
                groups[-1].append(i)
                size += n
            else:
                groups.append([i])
                size = n
        return groups

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        """Store the pages not already present, each as its header then its segments."""
        names = self.object_names(keys)
        mkeys = self._keys(names)
        out = [False] * len(keys)
        with self._errors():
            present = self._call("batch_is_exist", mkeys)
        todo: list[int] = []
        staged: list[int] = []
        for i, rc in enumerate(present):
            if rc == 1:
                out[i] = True
            elif self._direct(pages[i]):
                todo.append(i)
            else:
                staged.append(i)
        for group in self._groups(staged, pages):
            self._set_staged(group, names, mkeys, pages, out)
        if not todo:
            return out
        arena = self._headers(len(todo))
        base = int(arena.data_ptr())
        slots = memoryview(arena.numpy().data).cast("B")
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for slot, i in enumerate(todo):
            page = pages[i]
            views = page.views
            header = encode_header(page.nbytes, checksum(views, self._algorithm), self._algorithm,
                                   names[i].path)  # fmt: skip
            slots[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE] = header
            ptrs.append([base + slot * HEADER_SIZE, *(s.ptr for s in page.segments)])
            sizes.append([HEADER_SIZE, *(s.nbytes for s in page.segments)])
        keys = [mkeys[i] for i in todo]
        with self._errors():
            rcs = self._settle(keys, lambda idx: self._call(
                "batch_put_from_multi_buffers", [keys[j] for j in idx], [ptrs[j] for j in idx],
                [sizes[j] for j in idx], self._replicate))  # fmt: skip
        self._settle_puts(todo, rcs, pages, out)
        return out

    def _stage(
        self, group: list[int], pages: Sequence[PageBuffer]
    ) -> tuple[memoryview, list[int], list[int]]:
        """This thread's staging buffer laid out for ``group``.

        A view of it, and each page's object address and size (header then payload, the
        objects one after another).
        """
        sizes = [HEADER_SIZE + pages[i].nbytes for i in group]
        buf = self._staging(sum(sizes))
        base, ptrs = int(buf.data_ptr()), []
        for size in sizes:
            ptrs.append(base)
            base += size
        return memoryview(buf.numpy().data).cast("B"), ptrs, sizes

    def _set_staged(self, group: list[int], names: list[ObjectName], mkeys: list[str],
                    pages: Sequence[PageBuffer], out: list[bool]) -> None:  # fmt: skip
        """Store ``group``'s pages, each copied (header and payload) into the staging buffer."""
        view, ptrs, sizes = self._stage(group, pages)
        for i, ptr in zip(group, ptrs, strict=True):
            page, off = pages[i], ptr - ptrs[0]
            views = page.views
            view[off : off + HEADER_SIZE] = encode_header(
                page.nbytes, checksum(views, self._algorithm), self._algorithm, names[i].path
            )
            pos = off + HEADER_SIZE
            for v in views:
                view[pos : pos + v.nbytes] = v
                pos += v.nbytes
        keys = [mkeys[i] for i in group]
        with self._errors():
            rcs = self._settle(keys, lambda idx: self._call(
                "batch_put_from", [keys[j] for j in idx], [ptrs[j] for j in idx],
                [sizes[j] for j in idx], self._replicate))  # fmt: skip
        self._settle_puts(group, rcs, pages, out)

    def _settle_puts(self, idx: list[int], rcs: Sequence[int], pages: Sequence[PageBuffer],
                     out: list[bool]) -> None:  # fmt: skip
        written = failed = 0
        for i, rc in zip(idx, rcs, strict=True):
            if rc == 0:
                out[i] = True
                written += pages[i].nbytes
            else:
                failed += 1
                self._item_failed("batch_set_pages", _put_failed(rc))
        self._record(bytes_written=written)
        self._add_item_errors(failed)

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        """Read each object into a header slot and the page's own segments, then check."""
        names = self.object_names(keys)
        if not names:
            return []
        out = [False] * len(names)
        direct = [i for i, p in enumerate(pages) if self._direct(p)]
        staged = [i for i, p in enumerate(pages) if not self._direct(p)]
        for group in self._groups(staged, pages):
            self._get_staged(group, names, pages, out)
        if direct:
            self._get_direct(direct, names, pages, out)
        return out

    def _get_staged(self, group: list[int], names: list[ObjectName],
                    pages: Sequence[PageBuffer], out: list[bool]) -> None:  # fmt: skip
        view, ptrs, sizes = self._stage(group, pages)
        with self._errors():
            got = self._call(
                "batch_get_into", [self._prefix + names[i].path for i in group], ptrs, sizes
            )
        self._forget_lost(_transfer_failed([self._prefix + names[i].path for i in group], got))
        failed = read = 0
        off = 0
        for i, n in zip(group, got, strict=True):
            page, start = pages[i], off
            off += HEADER_SIZE + page.nbytes
            payload = view[start + HEADER_SIZE : off]
            if not self._accept(n, page, names[i], view[start : start + HEADER_SIZE], [payload]):
                failed += int(n < 0 and n not in (*_MISSES, _INVALID))
                continue
            pos = 0
            for seg in page.views:
                seg[:] = payload[pos : pos + seg.nbytes]
                pos += seg.nbytes
            out[i] = True
            read += page.nbytes
        self._record(bytes_read=read)
        self._add_item_errors(failed)

    def _accept(self, n: int, page: PageBuffer, name: ObjectName, header_raw: memoryview,
                payload: list[memoryview]) -> bool:  # fmt: skip
        """Whether a read of ``n`` bytes gave this page, checked (counted when not)."""
        if n in _MISSES:
            return False
        if n == _INVALID:  # (the buffers are not the object's size)
            self._record(size_mismatches=1)
            return False
        if n < 0:
            self._item_failed("batch_get_pages", BackendError(f"mooncake get failed (rc {n})"))
            return False
        if n != HEADER_SIZE + page.nbytes:
            self._record(size_mismatches=1)
            return False
        try:
            header = decode_header(bytes(header_raw), name.path)
            if self.options.verify_checksum:
                verify_payload(header, payload)
            elif header.payload_len != page.nbytes:
                raise ValueError("length")
        except Exception as exc:  # noqa: BLE001 - any failed check is a miss
            self._record(corrupt_objects=1)
            self._log("corrupt", "object %s (%s): the read is a miss", name.path, exc)
            return False
        return True

    def _get_direct(self, idx: list[int], names: list[ObjectName],
                    pages: Sequence[PageBuffer], out: list[bool]) -> None:  # fmt: skip
        arena = self._headers(len(idx))
        base = int(arena.data_ptr())
        ptrs = [[base + j * HEADER_SIZE, *(s.ptr for s in pages[i].segments)]
                for j, i in enumerate(idx)]  # fmt: skip
        sizes = [[HEADER_SIZE, *(s.nbytes for s in pages[i].segments)] for i in idx]
        with self._errors():
            got = self._call(
                "batch_get_into_multi_buffers",
                [self._prefix + names[i].path for i in idx],
                ptrs,
                sizes,
            )
        self._forget_lost(_transfer_failed([self._prefix + names[i].path for i in idx], got))
        raw = memoryview(bytes(arena[: len(idx) * HEADER_SIZE].numpy()))
        failed = read = 0
        for j, (i, n) in enumerate(zip(idx, got, strict=True)):
            page = pages[i]
            if self._accept(n, page, names[i], raw[j * HEADER_SIZE : (j + 1) * HEADER_SIZE],
                            page.views):  # fmt: skip
                out[i] = True
                read += page.nbytes
            else:
                failed += int(n < 0 and n not in (*_MISSES, _INVALID))
        self._record(bytes_read=read)
        self._add_item_errors(failed)

    # ------------------------------------------------------------------ the rest

    @override
    def health(self) -> Health:
        """The client's health check, then an existence query the master answers.

        ``down``: not set up, closed, or the master unreachable or failing the query (also
        right after a call the master failed in the last seconds).
        """
        mc = self._mc  # (once: close() may clear it meanwhile)
        if mc is None:
            return Health("down", "not set up or closed")
        if self._down_until and time.monotonic() < self._down_until:
            return Health("down", "the master failed a call in the last seconds")
        try:
            code = int(mc.health_check())
        except Exception as exc:  # noqa: BLE001 - the probe's answer
            return Health("down", type(exc).__name__)
        if code != 0:
            return Health("down", "master unreachable" if code == 2 else f"health check {code}")
        # health_check() answers 0 with the master gone (it tells the client's state): an
        # existence query of a name nothing stores asks the master itself. (It blocks
        # seconds on a dead master: on the breaker's prober, never an engine thread.)
        return super().health()

    @override
    def close(self) -> None:
        store, self._mc = self._mc, None
        if store is not None:
            store.close()

    @override
    def __repr__(self) -> str:
        return (
            f"MooncakeBackend(master={self._master!r}, "
            f"prefix={self._prefix!r}, namespace={self.namespace.digest})"
        )


def _check_rdma(device_name: str) -> None:
    """Raise ConfigError unless this host has an RDMA device, and each one named."""
    try:
        present = sorted(os.listdir(_RDMA_SYSFS))
    except OSError:
        present = []
    if not present:
        raise ConfigError(
            f"protocol='rdma' needs an RDMA device and this host has none ({_RDMA_SYSFS} "
            "lists none): use protocol='tcp'"
        )
    named = [d.strip() for d in device_name.split(",") if d.strip() != "auto-discovery"]
    missing = [d for d in named if d and d not in present]
    if missing:
        raise ConfigError(
            f"device_name names RDMA devices this host does not have: {missing}; it has "
            f"{present} ({_RDMA_SYSFS})"
        )


def _largest_put(buffer: int) -> int:
    """The largest object the client's local buffer of ``buffer`` bytes takes whole.

    Its allocator (an offset allocator) rounds sizes to classes of four significant bits,
    so the largest is ``buffer`` with every bit below its top four cleared.
    """
    shift = max(buffer.bit_length() - 4, 0)
    return (buffer >> shift) << shift


def _put_failed(rc: int) -> BackendError:
    if rc == _NOT_READY:
        return BackendError("mooncake put: another client's put of this key did not become "
                            "readable within put_wait; not stored")  # fmt: skip
    return BackendError(f"mooncake put failed (rc {rc})")


def _exists(rc: int) -> bool | Exception:
    if rc in (0, 1):
        return bool(rc)
    return BackendError(f"mooncake batch_is_exist failed (rc {rc})")


def _transfer_failed(keys: list[str], codes: Sequence[int]) -> list[str]:
    """The keys whose read failed in the transfer (not a miss, a size or the master)."""
    return [k for k, n in zip(keys, codes, strict=True)
            if _RPC_FAIL < n < 0 and n not in (*_MISSES, _INVALID)]  # fmt: skip
