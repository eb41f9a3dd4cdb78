"""Test data and helpers of the conformance kit, public for anyone testing a backend.

The suite's own pieces, usable in a vendor's tests as in this project's: the
:class:`BackendSpec` of a backend under test, namespaces of this run (:data:`RUN_ID`, a
random tenant, so a run never touches another's data), small random host pools
(:func:`make_pool`, :func:`pool_namespace`), keys no other test uses
(:func:`unique_keys`), content every reader can verify (:func:`content`,
:func:`fill_page`), read targets of every kind (:func:`make_target`), and writer
subprocesses (:func:`run_worker`).

Black-box: only the public API of ``hicache_storage`` is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage import (
    HiCacheStorage,
    KVCacheNamespace,
    PageBuffer,
    Segment,
    StorageConfig,
    create_backend,
    load_backend_class,
    page_hashes,
)
from hicache_storage.config import redact_options
from hicache_storage.conformance import _secrets

if TYPE_CHECKING:
    from hicache_storage import HostKVPool  # needs torch: imported where a pool is made

__all__ = [
    "RUN_ID",
    "TARGET_KINDS",
    "BackendSpec",
    "StatePool",
    "content",
    "engine_key_forms",
    "fill_page",
    "make_namespace",
    "make_pool",
    "make_target",
    "pool_namespace",
    "run_worker",
    "sentinel",
    "tree_files",
    "unique_keys",
    "worker_output",
]

#: One random id per process: every namespace the kit creates carries it in its tenant,
#: so a run never touches data of another run, even on a shared production cluster.
RUN_ID = secrets.token_hex(6)

POOL_SHAPE = {"layer_num": 3, "kv_heads": 2, "head_dim": 16, "page_size": 4}

#: Every kind of read target ``get`` accepts: buffers, CPU tensors of the dtypes KV pages
#: come in (the engine's generic path reads into a multi-dimensional bfloat16 staging
#: page), and a multi-segment PageBuffer (the v1 path's target).
TARGET_KINDS = (
    "bytearray",
    "memoryview",
    "ndarray-float32",
    "uint8",
    "int8",
    "bfloat16",
    "float16",
    "float32",
    "bfloat16-5d",
    "pagebuffer",
)

#: Bytes between the segments of a :func:`make_target` PageBuffer (guards, checked too).
_GUARD = 16


@dataclass(frozen=True)
class BackendSpec:
    """How to build the backend under test, in this process or another one.

    Attributes:
        name: registry name, ``NAME@DISTRIBUTION`` or ``module:Class``.
        options: backend options (JSON-serializable, so worker processes can use them).
            Secret options (passwords, tokens, keys, URL passwords, fields the backend's
            options class marks secret) never appear in the kit's output: the repr, the
            reports and every message show them redacted, and workers receive the options
            on an inherited pipe, never on their command line.
        config_extra: extra :class:`StorageConfig` fields (tp_rank...), rarely needed.
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    config_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Register the options' secrets, so that the kit's output never shows them."""
        _secrets.register(self.options)

    @override
    def __repr__(self) -> str:
        """The spec with its options redacted."""
        return (
            f"BackendSpec(name={self.name!r}, options={self.redacted_options()!r}, "
            f"config_extra={self.config_extra!r})"
        )

    def options_class(self) -> type | None:
        """The backend's options dataclass, if the backend class declares one."""
        try:
            cls = load_backend_class(self.name)
        except Exception:  # noqa: BLE001 - building the backend will report the error
            return None
        return _secrets.options_class_of(cls)

    def redacted_options(self, options_class: type | None = None) -> dict[str, Any]:
        """The options as they may be shown (secrets replaced by ``<redacted>``)."""
        cls = options_class or self.options_class()
        _secrets.register(self.options, cls)
        return redact_options(self.options, cls)

    def create(self, config: StorageConfig) -> HiCacheStorage:
        """Build the backend for ``config``."""
        try:
            backend = create_backend(self.name, config, **self.options)
        except Exception as exc:
            _secrets.register(self.options, self.options_class())
            clean = _secrets.scrub(str(exc))
            if clean != str(exc):  # the error showed a secret: raise a scrubbed copy
                raise type(exc)(clean) if _rebuildable(exc) else RuntimeError(clean) from None
            raise
        _secrets.register(self.options, _secrets.options_class_of(backend))
        return backend


def _rebuildable(exc: BaseException) -> bool:
    try:
        type(exc)("probe")
    except Exception:  # noqa: BLE001
        return False
    return True


def make_namespace(tenant_suffix: str = "", **overrides: Any) -> KVCacheNamespace:
    """A namespace of this run (random tenant), matching :func:`make_pool`'s pools."""
    fields: dict[str, Any] = {
        "model_id": "hicache-conformance",
        "dtype": "bfloat16",
        "page_size": POOL_SHAPE["page_size"],
        "object_layout": "page_first",
        "tenant": f"conformance-{RUN_ID}{tenant_suffix}",
    }
    fields.update(overrides)
    return KVCacheNamespace(**fields)


def make_pool(
    layout: str = "page_first",
    mla: bool = False,
    num_pages: int = 16,
    *,
    page_size: int = POOL_SHAPE["page_size"],
    layer_num: int = POOL_SHAPE["layer_num"],
    kv_heads: int = POOL_SHAPE["kv_heads"],
    head_dim: int = POOL_SHAPE["head_dim"],
) -> HostKVPool:
    """A small bfloat16 host pool (the kit's page shape by default), filled with random bytes."""
    import torch

    from hicache_storage import HostKVPool

    pool = HostKVPool(
        num_pages=num_pages,
        page_size=page_size,
        layer_num=layer_num,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        layout=layout,
        mla=mla,
    )
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    return pool


def pool_namespace(pool: HostKVPool, **overrides: Any) -> KVCacheNamespace:
    """The run's namespace for ``pool``, read off the pool.

    :meth:`KVCacheNamespace.for_pool` with the kit's model id and this run's tenant
    (both overridable).
    """
    fields: dict[str, Any] = {"tenant": f"conformance-{RUN_ID}", **overrides}
    model_id = fields.pop("model_id", "hicache-conformance")
    return KVCacheNamespace.for_pool(pool, model_id=model_id, **fields)


class StatePool:
    """A stand-in for a hybrid model's side pool as SGLang keeps one (a Mamba state pool).

    One page is one slot, its bytes spread over two buffers (a float32 temporal state and
    a bfloat16 conv state), addressed through ``get_page_buffer_meta`` like SGLang's.

    The SGLang adapter files such a pool's pages in a namespace of their own
    (:func:`hicache_storage.sidepools.side_namespace`); the kit checks a
    backend keeps them there.
    """

    page_size = 1
    layout = "page_first"

    def __init__(self, slots: int = 8, temporal: int = 24, conv: int = 10) -> None:
        import torch

        self.dtype = torch.bfloat16
        self.kv_buffer = [
            torch.randint(0, 256, (slots, temporal), dtype=torch.uint8).view(torch.float32),
            torch.randint(0, 256, (slots, conv), dtype=torch.uint8).view(torch.bfloat16),
        ]

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """The address and size of each buffer's row of each slot, as SGLang's pools give them."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for i in indices:
            for b in self.kv_buffer:
                row = b[int(i)]
                ptrs.append(int(row.data_ptr()))
                sizes.append(int(row.nbytes))
        return ptrs, sizes

    def slot_bytes(self, i: int) -> bytes:
        """The bytes of slot ``i`` (every buffer's row, in order)."""
        import torch

        return b"".join(bytes(b[i].view(torch.uint8).numpy()) for b in self.kv_buffer)


def tree_files(path: str) -> list[str]:
    """Every regular file under ``path`` (to check what a backend left on disk)."""
    out: list[str] = []
    for dirpath, _dirs, files in os.walk(path):
        out.extend(os.path.join(dirpath, f) for f in files)
    return out


def unique_keys(n: int, salt: str = "") -> list[str]:
    """``n`` chained page hashes no other test uses."""
    start = int.from_bytes(
        hashlib.sha256((salt or secrets.token_hex(8)).encode()).digest()[:4], "little"
    )
    return page_hashes([start + i for i in range(n * 2)], 2)[:n]


def content(key: str, nbytes: int) -> bytes:
    """``nbytes`` of data that only ``key`` produces (so any reader can verify any page)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def fill_page(page: PageBuffer, key: str) -> bytes:
    """Write ``key``'s content into ``page``; return it."""
    data = content(key, page.nbytes)
    off = 0
    for seg in page.segments:
        seg.memoryview[:] = data[off : off + seg.nbytes]
        off += seg.nbytes
    return data


def run_worker(
    spec: BackendSpec, namespace: KVCacheNamespace, task: dict[str, Any]
) -> subprocess.Popen[str]:
    """Start ``python -m hicache_storage.conformance._worker`` on ``task``.

    The spec (options included) goes to the worker on its stdin, an inherited pipe that
    only this process writes and only the worker reads; nothing of it is on the worker's
    command line (which every local user can read in ``ps``) or in a file.
    """
    payload = json.dumps(
        {"name": spec.name, "options": spec.options, "namespace": namespace.to_dict(), "task": task}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_storage.conformance._worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_worker_env(), "PYTHONUNBUFFERED": "1"},
    )
    stdin, proc.stdin = proc.stdin, None  # written once here; communicate() must not touch it
    assert stdin is not None
    try:
        stdin.write(payload)
        stdin.close()
    except BrokenPipeError:  # the worker died at start; its stderr says why
        with contextlib.suppress(BrokenPipeError):
            stdin.close()
    return proc


def _worker_env() -> dict[str, str]:
    """This process's environment without the kit's extra-config variable.

    The worker gets the options on stdin. A backend's own
    ``HICACHE_STORAGE_<BACKEND>_<OPTION>`` variables are kept, so that the worker builds
    the same backend.
    """
    return {k: v for k, v in os.environ.items() if k != "HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"}


def worker_output(text: str | None, limit: int = 1500) -> str:
    """The tail of a worker's output, safe to show (secrets scrubbed)."""
    return _secrets.scrub((text or "").strip())[-limit:]


def sentinel(nbytes: int) -> bytes:
    """A recognizable fill pattern for targets (never zero, no long runs, odd period)."""
    pattern = bytes((0xA5 ^ (i * 29)) & 0xFF or 0x5A for i in range(251))
    return (pattern * (nbytes // len(pattern) + 1))[:nbytes]


def make_target(kind: str, nbytes: int) -> tuple[Any, Callable[[], bytes]]:
    """A read target of ``kind`` and ``nbytes`` bytes, and a function reading its bytes back.

    The target (see :data:`TARGET_KINDS`) is filled with :func:`sentinel`; the function
    returns the bytes it holds now (for a PageBuffer, its whole backing memory, the guards
    between its segments included).
    """
    import numpy as np
    import torch

    if kind == "bytearray":
        ba = bytearray(sentinel(nbytes))
        return ba, lambda: bytes(ba)
    if kind == "memoryview":
        mv = memoryview(bytearray(sentinel(nbytes)))
        return mv, mv.tobytes
    if kind == "ndarray-float32":
        arr = np.frombuffer(bytearray(sentinel(nbytes)), dtype=np.float32)
        return arr, arr.tobytes
    if kind == "pagebuffer":
        n = 3 if nbytes >= 3 else 1
        sizes = [nbytes // n] * (n - 1) + [nbytes - (nbytes // n) * (n - 1)]
        total = nbytes + _GUARD * (n + 1)
        backing = bytearray(sentinel(total))
        mv = memoryview(backing)
        base = ctypes.addressof((ctypes.c_char * total).from_buffer(backing))
        # segments in reverse memory order, with guard bytes around each of them
        offsets, off = [], _GUARD
        for size in reversed(sizes):
            offsets.append(off)
            off += size + _GUARD
        offsets.reverse()
        segs = [
            Segment(base + o, size, mv[o : o + size])
            for o, size in zip(offsets, sizes, strict=True)
        ]
        return PageBuffer(segs), lambda: bytes(mv)
    dtype = {
        "uint8": torch.uint8,
        "int8": torch.int8,
        "bfloat16": torch.bfloat16,
        "bfloat16-5d": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }[kind]
    raw = torch.frombuffer(bytearray(sentinel(nbytes)), dtype=torch.uint8)
    t = raw.view(dtype)
    if kind == "bfloat16-5d":  # the engine's get_dummy_flat_data_page: (2, L, P, H, D)
        t = t.view(2, 2, -1, 2, 2)
    return t, lambda: raw.numpy().tobytes()


def engine_key_forms(page_hash: str) -> list[str]:
    """``page_hash`` and the keys that engines and backends derive from it.

    The derived keys carry suffixes for K/V objects, side pools, ranks and models, or
    follow the unified layer/head scheme.
    """
    h = page_hash
    return [
        h,
        f"{h}_k",
        f"{h}_v",
        f"{h}-k",
        f"{h}-v",
        f"{h}.mamba",
        f"{h}.swa",
        f"{h}_0",
        f"{h}_1_0",
        f"{h}-3",
        f"{h}_meta-llama-Llama-3.1-70B-Instruct_3_8",
        f"{h}_ukv1-0123456789abcdef_L0-39_H1_k",
        f"hicache-conformance_{h}_0_k",
    ]


Factory = Callable[[StorageConfig], HiCacheStorage]
