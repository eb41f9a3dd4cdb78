"""The conformance suite: :class:`BackendConformance`.

Subclass it in your test suite and tell it how to build your backend::

    import pytest
    from hicache_storage.conformance import BackendConformance, BackendSpec

    class TestAcmeStore(BackendConformance):
        @pytest.fixture
        def backend_spec(self, tmp_path):
            return BackendSpec("acme", {"endpoint": "127.0.0.1:7000"})

``backend_spec`` names the backend (registry name, ``NAME@DISTRIBUTION`` or
``module:Class``) and its options; worker processes build the same backend from it, so
it must be JSON-serializable. Override ``backend_factory`` instead if a backend cannot be
built from a spec (multi-process checks are then reported as not claimed), and
``break_store`` to let the suite check behaviour when the store itself fails: a callable
that takes the backend under test and returns a context manager, inside which the store
fails::

    @pytest.fixture
    def break_store(self, acme_server):
        @contextlib.contextmanager
        def paused(backend):
            acme_server.pause()
            try:
                yield
            finally:
                acme_server.resume()

        return paused

Every check states the rule it enforces in its failure message, as ``[rule-id] ...``
followed by the rule's statement, whatever the backend returned or raised; the ids and
statements are listed in :mod:`hicache_storage.conformance.rules`.
Checks that need a capability (``zero_copy``, ``delete``, ``persistent``, ``shared``) run
only when the backend claims it, and are reported as *not claimed* otherwise. Every
backend the suite builds lives in a namespace with a random tenant of this run, is put
in strict mode (a result of the wrong shape raises instead of being repaired) and, when
the backend supports ``clear``, is cleared at the end of the check.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache_storage import (
    HiCacheStorage,
    HostKVPool,
    KVCacheNamespace,
    StorageConfig,
    StorageStats,
)
from hicache_storage.conformance.data import (
    POOL_SHAPE,
    RUN_ID,
    TARGET_KINDS,
    BackendSpec,
    Factory,
    StatePool,
    content,
    engine_key_forms,
    fill_page,
    make_namespace,
    make_pool,
    make_target,
    pool_namespace,
    run_worker,
    sentinel,
    unique_keys,
    worker_output,
)
from hicache_storage.conformance.rules import failure_message, statement
from hicache_storage.conformance.wrappers import FaultyBackend, LatencyBackend
from hicache_storage.errors import (
    ContractViolationError,
    HiCacheStorageError,
    InvalidArgumentError,
    InvalidKeyError,
)
from hicache_storage.layouts import LAYOUTS, MLA_LAYOUTS, POOL_KIND_IDS, POOL_KINDS

__all__ = ["BackendConformance", "enforces", "requires"]

#: ``@requires("delete")``: run the check only if the backend claims the capability.
requires = pytest.mark.hicache_requires
#: ``@enforces("delete")``: the rule a check enforces. A failure of the check that names
#: no rule (a bare assertion, or the kit's own code tripping over what the backend
#: returned or raised) is reported under it, by the kit's pytest plugin.
enforces = pytest.mark.hicache_rule

#: (layers, page size, KV heads, head dim) of the engine-batch check's bfloat16 pages.
POOL_SHAPE_5D = (3, 4, 2, 16)
HOSTILE_KEYS = [
    "",
    ".",
    "..",
    "../escape",
    "a/b",
    "/abs",
    "nul\x00byte",
    "tab\tkey",
    "é-non-ascii",
    "k" * 1000,
]
#: The ``break_store`` fixture's value: called with the backend under test, it returns a
#: context manager inside which the store fails (and after which it works again).
BreakStore = Callable[[HiCacheStorage], contextlib.AbstractContextManager[Any]]


def rule(rule_id: str, text: str) -> str:
    """A failure message naming the rule it enforces, with the rule's statement.

    ``rule_id`` must be listed in :data:`hicache_storage.conformance.rules.RULES`
    (:class:`~hicache_storage.conformance.rules.UnknownRuleError` otherwise).
    """
    return failure_message(rule_id, text)


def as_bytes(value: Any) -> bytes | None:
    """The bytes of a ``get`` result (tensor, buffer or PageBuffer); None for a miss."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if hasattr(value, "tobytes") and hasattr(value, "segments"):
        data: bytes = value.tobytes()
        return data
    return bytes(memoryview(value))


def broken(break_store: Any, backend: HiCacheStorage) -> contextlib.AbstractContextManager[Any]:
    """``break_store(backend)``, checked for its shape (a failure naming ``fault-hook``)."""
    shape = (
        "break_store must be a callable that takes the backend under test and returns a "
        "context manager (the store fails inside the with block, and works after it)"
    )
    if not callable(break_store) or hasattr(break_store, "__enter__"):
        pytest.fail(rule("fault-hook", f"got {type(break_store).__name__}: {shape}"))
    try:
        inspect.signature(break_store).bind(backend)
    except TypeError as exc:
        pytest.fail(rule("fault-hook", f"break_store(backend) cannot be called ({exc}): {shape}"))
    except ValueError:
        pass  # no signature to read (a builtin): the call below tells
    hook: contextlib.AbstractContextManager[Any] = break_store(backend)
    if not (hasattr(hook, "__enter__") and hasattr(hook, "__exit__")):
        pytest.fail(
            rule("fault-hook", f"break_store(backend) returned {type(hook).__name__}: {shape}")
        )
    return hook


@contextlib.contextmanager
def shape_rule(rule_id: str) -> Iterator[None]:
    """Turn a contract violation (strict mode) into a failure naming ``rule_id``."""
    statement(rule_id)  # an unknown id fails now, not only when a violation happens
    try:
        yield
    except ContractViolationError as exc:
        pytest.fail(rule(rule_id, f"result of the wrong shape: {exc}"))


@contextlib.contextmanager
def raises_rule(rule_id: str, error: type[Exception], what: str) -> Iterator[None]:
    """Like ``pytest.raises(error)``, failing with a message naming ``rule_id``."""
    statement(rule_id)
    try:
        yield
    except error:
        return
    except Exception as exc:  # noqa: BLE001 - reported, naming the rule
        pytest.fail(rule(rule_id, f"{what} raised {exc!r}, not {error.__name__}"))
    pytest.fail(rule(rule_id, f"{what} was accepted: it must raise {error.__name__}"))


class Kit:
    """Builds and tracks the backends of one check."""

    def __init__(
        self, factory: Factory, spec: BackendSpec | None, request: pytest.FixtureRequest
    ) -> None:
        self.factory = factory
        self.spec = spec
        self.request = request
        self.made: list[HiCacheStorage] = []
        self._probe: HiCacheStorage | None = None

    def backend(self, namespace: KVCacheNamespace | None = None, **config: Any) -> HiCacheStorage:
        """A fresh backend instance (strict mode) in ``namespace`` (default: the run's)."""
        extra = dict(self.spec.config_extra) if self.spec else {}
        extra.update(config)
        cfg = StorageConfig(namespace=namespace or make_namespace(), **extra)
        try:
            b = self.factory(cfg)
        except Exception as exc:  # noqa: BLE001 - reported, naming the rule
            ns = cfg.namespace
            where = f"{ns.model_id}, {ns.dtype}, {ns.object_layout}, page size {ns.page_size}"
            pytest.fail(rule("factory", f"building the backend ({where}) raised {exc!r}"))
        if not isinstance(b, HiCacheStorage):
            pytest.fail(
                rule("factory", f"the factory returned {type(b).__name__}, not a HiCacheStorage")
            )
        b.strict_contract = True
        self.made.append(b)
        _note_backend(self.request, b, self.spec)
        return b

    @property
    def capabilities(self) -> Any:
        """The backend's declared capabilities."""
        if self._probe is None:
            self._probe = self.backend()
        return self._probe.capabilities

    def pool_backend(
        self, layout: str = "page_first", mla: bool = False, num_pages: int = 16
    ) -> tuple[HiCacheStorage, HostKVPool]:
        """A backend in the namespace of a fresh pool, with the pool registered."""
        pool = make_pool(layout, mla, num_pages)
        b = self.backend(pool_namespace(pool))
        b.register_mem_pool_host(pool)
        return b, pool

    def cleanup(self) -> None:
        """Clear every namespace used (when supported) and close every backend."""
        cleared: set[str] = set()
        for b in self.made:
            try:
                if b.capabilities.delete and not b.closed and b.namespace.digest not in cleared:
                    b.clear()
                    cleared.add(b.namespace.digest)
            except (HiCacheStorageError, OSError):
                pass
            with contextlib.suppress(Exception):
                b.close()


def _note_backend(
    request: pytest.FixtureRequest, backend: HiCacheStorage, spec: BackendSpec | None
) -> None:
    collector = request.config.pluginmanager.get_plugin("hicache-conformance-report")
    if collector is not None and request.cls is not None:
        collector.note_backend(request.cls.__name__, backend, spec)


def _record_metric(request: pytest.FixtureRequest, name: str, value: Any) -> None:
    request.node.user_properties.append(("hicache_metric", {name: value}))


class BackendConformance:
    """The checks every hicache-storage backend must pass. Subclass to run them."""

    _hicache_conformance = True

    # ------------------------------------------------------------------ override points

    @pytest.fixture
    def backend_spec(self, request: pytest.FixtureRequest) -> BackendSpec | None:
        """The backend under test; default: ``--hicache-storage-backend`` or its env var."""
        from hicache_storage.conformance.plugin import spec_from_config

        return spec_from_config(request.config)

    @pytest.fixture
    def backend_factory(self, backend_spec: BackendSpec | None) -> Factory:
        """Builds a backend for a :class:`StorageConfig`; default: from ``backend_spec``."""
        if backend_spec is None:
            pytest.fail(
                "no backend selected: pass --hicache-storage-backend NAME (and "
                "--hicache-storage-backend-extra-config JSON), set HICACHE_STORAGE_BACKEND, or "
                "override the backend_spec fixture"
            )
        return backend_spec.create

    @pytest.fixture
    def break_store(self) -> BreakStore | None:
        """Optional: the store's fault hook, ``break_store(backend)`` (see :data:`BreakStore`).

        A callable the kit calls with the backend instance under test; it returns a
        context manager inside which every call into the store fails, as in an outage,
        and after which the store works again.
        """
        return None

    # ------------------------------------------------------------------ plumbing

    @pytest.fixture
    def kit(
        self,
        backend_factory: Factory,
        backend_spec: BackendSpec | None,
        request: pytest.FixtureRequest,
    ) -> Iterator[Kit]:
        """The :class:`Kit` of this check; it cleans up the backends it made afterwards."""
        k = Kit(backend_factory, backend_spec, request)
        yield k
        k.cleanup()

    @pytest.fixture(autouse=True)
    def _capability_gate(self, request: pytest.FixtureRequest, kit: Kit) -> None:
        marker = request.node.get_closest_marker("hicache_requires")
        if marker is None:
            return
        caps = kit.capabilities
        missing = [c for c in marker.args if not getattr(caps, c, False)]
        if missing:
            pytest.skip(f"not claimed: {', '.join(missing)}")

    def _need_spec(self, kit: Kit) -> BackendSpec:
        if kit.spec is None:
            pytest.skip("not claimed: cross-process checks need the backend_spec fixture")
        return kit.spec

    # ------------------------------------------------------------------ result shapes

    @pytest.mark.parametrize("n", [0, 1, 2, 7])
    @enforces("exact-length")
    def test_result_shapes(self, kit: Kit, n: int) -> None:
        """Batch calls give one result per key, of the right type, for 0, 1, 2 and 7 keys."""
        b = kit.backend()
        keys = unique_keys(n)
        values = [content(k, 96) for k in keys]
        with shape_rule("exact-length"):
            stored = b.batch_set(keys, values)
            assert stored == [True] * n, rule(
                "batch-set", f"batch_set of {n} new keys returned {stored}"
            )
            hits = b.batch_exists(keys)
            assert hits == n, rule(
                "batch-exists", f"batch_exists of {n} stored keys returned {hits}"
            )
            got = b.batch_get(keys)
            assert len(got) == n
            for k, g in zip(keys, got, strict=True):
                assert isinstance(g, torch.Tensor) and g.dtype == torch.uint8, rule(
                    "get-new-tensor",
                    f"get without a target must return a uint8 tensor, got {type(g).__name__}",
                )
                assert as_bytes(g) == content(k, 96), rule(
                    "read-your-writes", "batch_get returned other bytes"
                )
            targets = [bytearray(96) for _ in keys]
            filled = b.batch_get(keys, targets)
            assert all(f is t for f, t in zip(filled, targets, strict=True)), rule(
                "get-returns-target", "get with a target must return that target"
            )
            assert [bytes(t) for t in targets] == values, rule(
                "read-your-writes", "targets not filled"
            )
            missing = unique_keys(n)
            assert b.batch_get(missing) == [None] * n, rule(
                "get-miss", "missing keys must give None"
            )
            assert b.batch_exists(missing) == 0

    @pytest.mark.parametrize("n", [0, 1, 3])
    @enforces("v1-exact-length")
    def test_v1_result_length(self, kit: Kit, n: int) -> None:
        """``batch_set_v1`` and ``batch_get_v1`` give one bool per page, for 0 pages too."""
        b, pool = kit.pool_backend()
        keys = unique_keys(n)
        idx = torch.arange(n * pool.page_size)
        with shape_rule("v1-exact-length"):
            r = b.batch_set_v1(keys, idx)
            assert r == [True] * n, rule(
                "v1-exact-length", f"batch_set_v1 of {n} pages returned {r!r}"
            )
            r = b.batch_get_v1(keys, torch.arange(n * pool.page_size, 2 * n * pool.page_size))
            assert r == [True] * n, rule(
                "v1-exact-length", f"batch_get_v1 of {n} pages returned {r!r}"
            )

    # ------------------------------------------------------------------ semantics

    @enforces("read-your-writes")
    def test_read_your_writes(self, kit: Kit) -> None:
        """A stored value reads back at once; ``get`` into a tensor returns that tensor."""
        b = kit.backend()
        (k,) = unique_keys(1)
        assert b.set(k, content(k, 4096)) is True, rule("set", "set of a new key must return True")
        assert b.exists(k) is True, rule("read-your-writes", "exists is False right after set")
        assert as_bytes(b.get(k)) == content(k, 4096), rule(
            "read-your-writes", "get returned other bytes"
        )
        t = torch.zeros(1024, dtype=torch.int32)
        assert b.get(k, t) is t, rule("get-returns-target", "get into a tensor must return it")
        assert as_bytes(t) == content(k, 4096)

    @enforces("get-miss")
    def test_get_missing_leaves_target_untouched(self, kit: Kit) -> None:
        """A miss returns None and writes nothing into the target, for every target kind."""
        b = kit.backend()
        keys = unique_keys(len(TARGET_KINDS))
        made = [(kind, *make_target(kind, 4096)) for kind in TARGET_KINDS]
        for k, (kind, target, now) in zip(keys, made, strict=True):
            before = now()
            got = b.get(k, target)
            assert got is None, rule(
                "get-miss",
                f"get of a missing key into a {kind} target must return None, "
                f"got {type(got).__name__} (a miss reported as a hit)",
            )
            assert now() == before, rule(
                "get-miss-untouched", f"a miss wrote into the {kind} target"
            )
        # the same misses in one batch, every target kind at once
        made = [(kind, *make_target(kind, 4096)) for kind in TARGET_KINDS]
        got_all = b.batch_get(keys, [t for _, t, _ in made])
        for (kind, _, now), got in zip(made, got_all, strict=True):
            assert got is None, rule(
                "get-miss", f"batch_get of a missing key into a {kind} target returned a hit"
            )
            assert now() == sentinel(len(now())), rule(
                "get-miss-untouched", f"a miss in batch_get wrote into the {kind} target"
            )
        assert not any(b.exists(k) for k in keys)

    @pytest.mark.parametrize("delta", [-1, 1, 4096])
    @enforces("get-size-mismatch")
    def test_get_size_mismatch_never_fills(self, kit: Kit, delta: int) -> None:
        """A target of the wrong size gets None and not a byte (no partial fill)."""
        b = kit.backend()
        keys = unique_keys(len(TARGET_KINDS))
        size = 8192
        assert b.batch_set(keys, [content(k, size + delta) for k in keys]) == [True] * len(keys)
        for k, kind in zip(keys, TARGET_KINDS, strict=True):
            target, now = make_target(kind, size)
            before = now()
            got = b.get(k, target)
            assert got is None, rule(
                "get-size-mismatch",
                f"get into a {kind} target of {size} bytes for a {size + delta}-byte value "
                "must return None",
            )
            assert now() == before, rule(
                "no-partial-fill",
                f"get wrote into a {kind} target of the wrong size (partial fill)",
            )

    @enforces("set-existing")
    def test_set_existing_is_a_no_op(self, kit: Kit) -> None:
        """``set`` of an existing key returns True and keeps the first value."""
        b = kit.backend()
        (k,) = unique_keys(1)
        first, second = content(k, 1000), content(k + "x", 1000)
        assert b.set(k, first) is True
        assert b.set(k, second) is True, rule(
            "set-existing", "set of an existing key must return True"
        )
        assert as_bytes(b.get(k)) == first, rule(
            "set-existing",
            "set of an existing key replaced the stored value (first writer must win)",
        )

    @enforces("batch-exists-leading-run")
    def test_batch_exists_counts_the_leading_run(self, kit: Kit) -> None:
        """``batch_exists`` counts the keys present before the first miss."""
        b = kit.backend()
        keys = unique_keys(6)
        b.batch_set([keys[i] for i in (0, 1, 3, 4)], [b"v"] * 4)
        assert b.batch_exists(keys) == 2, rule(
            "batch-exists-leading-run",
            f"batch_exists must count the leading run of present keys (2), got {b.batch_exists(keys)}",
        )
        assert b.batch_exists(keys[2:]) == 0, rule(
            "batch-exists-leading-run", "a miss at index 0 must give 0"
        )
        assert b.batch_exists([]) == 0
        assert b.batch_exists([keys[0], keys[1]]) == 2

    @enforces("miss-not-error")
    def test_a_miss_is_not_an_error(self, kit: Kit) -> None:
        """Misses, single or batched, are not counted as store errors."""
        b, pool = kit.pool_backend()
        keys = unique_keys(3)
        b.get_stats(reset=True)
        b.get(keys[0])
        b.exists(keys[0])
        b.batch_exists(keys)
        b.batch_get(keys)
        b.batch_get_v1(keys, torch.arange(3 * pool.page_size))
        stats = b.get_stats()
        errors = {op: s.errors for op, s in stats.ops.items() if s.errors}
        assert not errors, rule(
            "miss-not-error", f"misses were reported as store failures: {errors}"
        )

    @requires("delete")
    @enforces("delete")
    def test_delete(self, kit: Kit) -> None:
        """``delete`` is True for a stored key, False for a missing one; the key can be reused."""
        b = kit.backend()
        (k,) = unique_keys(1)
        b.set(k, b"value")
        assert b.delete(k) is True, rule("delete", "delete of a stored key must return True")
        assert b.exists(k) is False and b.get(k) is None, rule(
            "delete", "a deleted key is still readable"
        )
        assert b.delete(k) is False, rule("delete", "delete of a missing key must return False")
        assert b.set(k, b"again") is True and as_bytes(b.get(k)) == b"again", rule(
            "delete", "a deleted key cannot be stored again"
        )

    @requires("delete")
    @enforces("clear-scope")
    def test_clear_removes_only_its_namespace(self, kit: Kit) -> None:
        """``clear`` empties its namespace, for every instance on it, and no other namespace."""
        mine = kit.backend(make_namespace("-a"))
        twin = kit.backend(make_namespace("-a"))  # another instance on the same namespace
        other = kit.backend(make_namespace("-b"))
        keys = unique_keys(3)
        mine.batch_set(keys, [b"mine"] * 3)
        other.batch_set(keys, [b"other"] * 3)
        mine.clear()
        assert mine.batch_exists(keys) == 0 and twin.batch_exists(keys) == 0, rule(
            "clear-scope", "clear() left pages of its own namespace"
        )
        assert other.batch_exists(keys) == 3, rule(
            "clear-scope", "clear() removed pages of another namespace"
        )
        assert as_bytes(other.get(keys[0])) == b"other", rule(
            "clear-scope", "clear() damaged another namespace"
        )
        assert mine.set(keys[0], b"after") is True and as_bytes(mine.get(keys[0])) == b"after", (
            rule("clear-usable", "the backend is not usable after clear()")
        )

    @enforces("closed")
    def test_close_is_idempotent(self, kit: Kit) -> None:
        """A second ``close`` is harmless, and calls after ``close`` give failure shapes."""
        b = kit.backend()
        (k,) = unique_keys(1)
        b.set(k, b"v")
        b.close()
        b.close()
        assert b.get(k) is None and b.set(k, b"v") is False and b.batch_exists([k]) == 0, rule(
            "closed", "calls after close() must return their failure shape"
        )

    @enforces("stats")
    def test_stats_are_well_formed(self, kit: Kit) -> None:
        """``get_stats`` returns a StorageStats with the right counters, and resets them."""
        b = kit.backend()
        keys = unique_keys(2)
        b.get_stats(reset=True)
        b.batch_set(keys, [b"a", b"b"])
        b.get(keys[0])
        s = b.get_stats()
        assert isinstance(s, StorageStats), rule("stats", f"get_stats returned {type(s).__name__}")
        assert s.op("batch_set").ok == 2 and s.op("get").ok == 1, rule(
            "stats", f"wrong counters: {s.to_dict()}"
        )
        assert b.get_stats().ops == {}, rule("stats", "get_stats() must reset the counters")

    # ------------------------------------------------------------------ zero-copy v1

    @pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
    @enforces("v1-round-trip")
    def test_v1_round_trip(self, kit: Kit, layout: str, mla: bool) -> None:
        """Pages stored by ``batch_set_v1`` read back byte for byte, in each claimed layout."""
        caps = kit.capabilities
        if layout not in caps.layouts or (mla and not caps.mla):
            pytest.skip(f"not claimed: layout {layout}{' MLA' if mla else ''}")
        b, pool = kit.pool_backend(layout, mla)
        ps = pool.page_size
        keys = unique_keys(5)
        src, dst = torch.arange(5 * ps), torch.arange(8 * ps, 13 * ps)
        with shape_rule("v1-exact-length"):
            assert b.batch_set_v1(keys, src) == [True] * 5, rule(
                "v1-round-trip", "batch_set_v1 failed"
            )
            assert b.batch_exists(keys) == 5
            assert b.batch_get_v1(keys, dst) == [True] * 5, rule(
                "v1-round-trip", "batch_get_v1 failed"
            )
        for i, (a, c) in enumerate(
            zip(pool.page_buffers(src), pool.page_buffers(dst), strict=True)
        ):
            assert a.tobytes() == c.tobytes(), rule(
                "v1-round-trip",
                f"page {i} ({layout}, {'MLA' if mla else 'MHA'}) read back different bytes",
            )

    @pytest.mark.parametrize("layout", LAYOUTS)
    @enforces("v1-bounds")
    def test_v1_reads_stay_inside_the_pages(self, kit: Kit, layout: str) -> None:
        """``batch_get_v1`` writes into the destination pages of the host pool only."""
        if layout not in kit.capabilities.layouts:
            pytest.skip(f"not claimed: layout {layout}")
        b, pool = kit.pool_backend(layout)
        ps = pool.page_size
        keys = unique_keys(3)
        b.batch_set_v1(keys, torch.arange(3 * ps))
        dst = torch.arange(5 * ps, 8 * ps)
        before = pool.kv_buffer.view(-1).view(torch.uint8).clone()
        assert b.batch_get_v1(keys, dst) == [True] * 3
        after = pool.kv_buffer.view(-1).view(torch.uint8)
        inside = torch.zeros_like(before, dtype=torch.bool)
        base = pool.kv_buffer.data_ptr()
        for page in pool.page_buffers(dst):
            for s in page.segments:
                inside[s.ptr - base : s.ptr - base + s.nbytes] = True
        outside_changed = int(((before != after) & ~inside).sum())
        assert outside_changed == 0, rule(
            "v1-bounds",
            f"batch_get_v1 changed {outside_changed} bytes outside the destination pages",
        )

    @pytest.mark.parametrize("layout", LAYOUTS)
    @enforces("v1-miss")
    def test_v1_misses_leave_pages_untouched(self, kit: Kit, layout: str) -> None:
        """Missing and wrong-size pages are misses that write nothing into the host pool."""
        caps = kit.capabilities
        if layout not in caps.layouts:
            pytest.skip(f"not claimed: layout {layout}")
        for mla in (False, True) if caps.mla and layout in MLA_LAYOUTS else (False,):
            what = f"{layout}, {'MLA' if mla else 'MHA'}"
            b, pool = kit.pool_backend(layout, mla)
            ps = pool.page_size
            keys = unique_keys(6)
            # keys[1]: a page; keys[3]: a value of another size; the others: missing
            assert b.batch_set_v1([keys[1]], torch.arange(ps)) == [True]
            stored = pool.page_buffers(torch.arange(ps))[0].tobytes()
            b.set(keys[3], content(keys[3], pool.page_bytes + 7))
            flat = pool.kv_buffer.view(-1).view(torch.uint8)
            fill = torch.frombuffer(bytearray(sentinel(flat.numel())), dtype=torch.uint8)
            flat.copy_(fill)
            r = b.batch_get_v1(keys, torch.arange(8 * ps, 14 * ps))
            assert r[1] is True, rule("v1-round-trip", f"a stored page was not read ({what})")
            hits = [i for i in (0, 2, 3, 4, 5) if r[i]]
            assert not hits, rule(
                "v1-miss",
                f"batch_get_v1 reported missing or wrong-size pages {hits} as hits ({what})",
            )
            page1 = pool.page_buffers(torch.arange(9 * ps, 10 * ps))[0]
            assert page1.tobytes() == stored, rule("v1-round-trip", f"wrong bytes ({what})")
            expected = fill.clone()
            for seg in page1.segments:
                off = seg.ptr - pool.kv_buffer.data_ptr()
                expected[off : off + seg.nbytes] = torch.frombuffer(
                    bytearray(stored[: seg.nbytes]), dtype=torch.uint8
                )
                stored = stored[seg.nbytes :]
            changed = int((flat != expected).sum())
            assert changed == 0, rule(
                "v1-miss-untouched",
                f"batch_get_v1 of missing and wrong-size pages wrote {changed} bytes into the "
                f"host pool outside the one page that hit ({what})",
            )

    @enforces("v1-legacy")
    def test_v1_and_legacy_paths_agree(self, kit: Kit) -> None:
        """A page stored by ``batch_set_v1`` reads back with ``get``, and the reverse."""
        b, pool = kit.pool_backend()
        ps = pool.page_size
        k1, k2 = unique_keys(2)
        (page0, page1, page2) = pool.page_buffers(torch.arange(3 * ps))
        b.batch_set_v1([k1], torch.arange(ps))
        assert as_bytes(b.get(k1)) == page0.tobytes(), rule(
            "v1-legacy",
            "get() of a page stored by batch_set_v1 must return the page's segments in order",
        )
        data = fill_page(page2, k2)
        fill_page(page1, k1)  # overwrite, then read k2 into it
        b.set(k2, data)
        assert b.batch_get_v1([k2], torch.arange(ps, 2 * ps)) == [True]
        assert page1.tobytes() == data, rule(
            "v1-legacy", "batch_get_v1 of a value stored by set() differs"
        )

    @enforces("v1-bad-indices")
    def test_v1_bad_host_indices_fail_every_page(self, kit: Kit) -> None:
        """Misaligned or wrong-count host indices fail every page and store nothing."""
        b, pool = kit.pool_backend()
        ps = pool.page_size
        keys = unique_keys(2)
        for bad in (
            torch.arange(1, 2 * ps + 1),
            torch.arange(3 * ps),
            torch.arange(ps),
            torch.arange(100 * ps, 102 * ps),
        ):
            r = b.batch_set_v1(keys, bad)
            assert r == [False, False], rule(
                "v1-bad-indices", f"misaligned or wrong-count indices gave {r}"
            )
        assert b.batch_exists(keys) == 0, rule("v1-bad-indices", "a rejected batch stored pages")

    @enforces("v1-no-pool")
    def test_v1_before_register_fails_every_page(self, kit: Kit) -> None:
        """Zero-copy calls fail every page until a host pool is registered."""
        b = kit.backend()
        r = b.batch_set_v1(unique_keys(2), torch.arange(8))
        assert r == [False, False], rule(
            "v1-no-pool", f"v1 without a registered host pool returned {r}"
        )

    @requires("zero_copy")
    @enforces("zero-copy-native")
    def test_zero_copy_path_is_native(self, kit: Kit) -> None:
        """A backend that claims ``zero_copy`` implements the page batch methods itself."""
        cls = type(kit.backend())
        for op in ("batch_get_pages", "batch_set_pages"):
            assert cls.overrides(op), rule(
                "zero-copy-native", f"claims zero_copy but {op} is the default per-key loop"
            )

    # ------------------------------------------------------------------ hybrid-model pools

    def _state_pool_backend(self, kit: Kit, name: str = "mamba") -> tuple[Any, StatePool]:
        """A backend in the namespace the SGLang adapter gives a Mamba-like side pool."""
        from hicache_storage.sidepools import side_namespace

        pool = StatePool()
        namespace, view = side_namespace(make_namespace(), name, pool)
        b = kit.backend(namespace)
        b.register_mem_pool_host(view)
        return b, pool

    @enforces("pool-round-trip")
    def test_side_pool_pages_round_trip_in_their_own_namespace(self, kit: Kit) -> None:
        """A side pool's slots (two buffers each) come back byte for byte, and only there."""
        if "page_first" not in kit.capabilities.layouts:
            pytest.skip("not claimed: layout page_first (the state pools' layout)")
        b, pool = self._state_pool_backend(kit)
        keys = unique_keys(3)
        src, dst = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
        assert b.batch_set_v1(keys, src) == [True] * 3, rule(
            "pool-round-trip", "batch_set_v1 of a side pool's slots failed"
        )
        assert b.batch_get_v1(keys, dst) == [True] * 3, rule(
            "pool-round-trip", "batch_get_v1 of a side pool's slots failed"
        )
        for i, (a, c) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
            assert pool.slot_bytes(a) == pool.slot_bytes(c), rule(
                "pool-round-trip", f"slot {i} read back different bytes"
            )
        for what, other in (("the KV namespace", kit.backend()),
                            ("another pool's", self._state_pool_backend(kit, "swa")[0])):  # fmt: skip
            assert other.batch_exists(keys) == 0, rule(
                "pool-round-trip", f"a side pool's pages are found in {what}"
            )

    @enforces("pool-trailing-states")
    def test_states_are_restorable_only_where_stored(self, kit: Kit) -> None:
        """Sparse states (stored at pages 3 and 6): each key is answered on its own."""
        from types import SimpleNamespace

        from hicache_storage.sidepools import SidePool, exists_fold

        if "page_first" not in kit.capabilities.layouts:
            pytest.skip("not claimed: layout page_first (the state pools' layout)")
        b, pool = self._state_pool_backend(kit)
        keys = unique_keys(6)
        stored = b.batch_set_v1([keys[2], keys[5]], torch.tensor([1, 2]))
        assert stored == [True, True], rule("pool-trailing-states", "storing two states failed")
        side = {"mamba": SidePool("mamba", pool, 1, b)}
        query = [SimpleNamespace(name="mamba", keys=["_"], hit_policy="trailing_pages")]
        for n, want in ((5, [3]), (6, [3, 6])):
            hit, _, restorable = exists_fold(n, query, side, keys[:n])
            assert (hit, restorable) == (want[-1], want), rule(
                "pool-trailing-states",
                f"a {n}-page query restores {restorable} (want {want}): exists answered keys wrong",
            )

    # ------------------------------------------------------------------ pages across TP sizes

    @enforces("head-groups")
    def test_head_group_pages_are_read_at_another_tp_size(self, kit: Kit) -> None:
        """TP 2 ranks store pages as head groups over the backend; TP 1 reads them."""
        from hicache_storage.headgroups import HeadGroupStore

        heads, axis = 4, {"page_head": 2, "page_first": 3}
        layouts = [lay for lay in axis if lay in kit.capabilities.layouts]
        if not layouts:
            pytest.skip("not claimed: layout page_head or page_first")
        for layout in layouts:
            ns = make_namespace(f"-hg-{layout}", object_layout=layout, total_kv_heads=heads)
            ps = int(POOL_SHAPE["page_size"])
            shape = (3, ps)  # pages, page size (2 layers, heads of 8)

            def pool(per: int, lay: str = layout, ps: int = ps) -> HostKVPool:
                return HostKVPool(3, ps, 2, per, 8, dtype=torch.bfloat16, layout=lay)

            def store(rank: int, tp: int, writer: str, ns: KVCacheNamespace = ns) -> Any:
                config = StorageConfig(namespace=ns, tp_rank=rank, tp_size=tp)
                return HeadGroupStore(config, lambda c: kit.backend(c.namespace), heads, writer)

            model = pool(heads)
            model.kv_buffer.view(torch.int16).random_()
            idx = torch.arange(3 * shape[1])
            keys, mixed = unique_keys(3), unique_keys(3)
            for rank in (0, 1):
                mine = pool(2)
                mine.kv_buffer.copy_(model.kv_buffer.narrow(axis[layout], 2 * rank, 2))
                for ks, writer in ((keys, "w"), (mixed, f"w{rank}")):
                    b = store(rank, 2, writer)
                    b.register_mem_pool_host(mine)
                    r = b.batch_set_v1(ks, idx)
                    assert r == [True] * 3, rule("head-groups", f"TP 2 rank {rank} stored {r}")
            reader, back = store(0, 1, "r"), pool(heads)
            reader.register_mem_pool_host(back)
            r = reader.batch_get_v1(keys, idx)
            assert r == [True] * 3, rule("head-groups", f"{layout}: TP 1 read {r}")
            as_int = torch.int16  # (bytes, not values: random bits hold NaNs)
            assert torch.equal(back.kv_buffer.view(as_int), model.kv_buffer.view(as_int)), rule(
                "head-groups", f"{layout}: TP 1 read other bytes than TP 2 stored"
            )
            r = reader.batch_get_v1(mixed, idx)
            assert r == [False] * 3, rule(
                "head-groups", f"{layout}: pages of two writers' groups read as {r}"
            )

    # ------------------------------------------------------------------ the engine's shapes

    @enforces("engine-batch")
    def test_engine_batches(self, kit: Kit) -> None:
        """The engine's generic path, 128 pages per call (its storage batch).

        127 of them are written (not a power of two), as bfloat16 views of the host pool
        (strided or flattened) under chained 64-hex keys; reads go into bfloat16 staging
        pages, and the one miss is after position 64.
        """
        n = 128
        b = kit.backend()
        L, ps, H, D = POOL_SHAPE_5D
        kv = torch.randint(0, 256, (2 * n * ps * L * H * D * 2,), dtype=torch.uint8)
        kv = kv.view(torch.bfloat16).view(2, n * ps, L, H, D)  # page_first host pool
        pages = [kv[:, i * ps : (i + 1) * ps] for i in range(n)]  # strided views
        values = [p if i % 2 == 0 else p.flatten() for i, p in enumerate(pages)]
        want = [as_bytes(p.contiguous()) for p in pages]
        keys = unique_keys(n)
        gap = n - 23
        stored = [i for i in range(n) if i != gap]
        with shape_rule("exact-length"):
            r = b.batch_set([keys[i] for i in stored], [values[i] for i in stored])
            assert r == [True] * len(stored), rule(
                "engine-batch", f"batch_set of {len(stored)} engine pages stored {sum(r)}"
            )
            hits = b.batch_exists(keys)
            assert hits == gap, rule(
                "batch-exists-leading-run",
                f"batch_exists of {n} keys missing only #{gap} must return {gap}, got {hits}",
            )
            made = [make_target("bfloat16-5d", pages[0].nbytes) for _ in range(n)]
            got = b.batch_get(keys, [t for t, _ in made])
        assert len(got) == n, rule("exact-length", f"batch_get of {n} keys gave {len(got)}")
        assert got[gap] is None and made[gap][1]() == sentinel(pages[0].nbytes), rule(
            "get-miss", f"the missing key #{gap} of a {n}-page batch_get was a hit or written"
        )
        wrong = [i for i in stored if got[i] is not made[i][0] or made[i][1]() != want[i]]
        assert not wrong, rule(
            "engine-batch",
            f"batch_get of {n} engine pages returned wrong bytes or no hit for pages {wrong[:8]}"
            f"{'...' if len(wrong) > 8 else ''} (of {len(wrong)})",
        )

    @pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
    @enforces("engine-batch")
    def test_engine_batches_v1(self, kit: Kit, layout: str, mla: bool) -> None:
        """Zero-copy batches of the engine's size (128 pages) with an engine-like page.

        The page has 61 layers (122 segments per MHA layer_first page), the host pages are
        scattered, and the one miss is after position 64.
        """
        caps = kit.capabilities
        if layout not in caps.layouts or (mla and not caps.mla):
            pytest.skip(f"not claimed: layout {layout}{' MLA' if mla else ''}")
        n, ps = 128, POOL_SHAPE["page_size"]
        pool = HostKVPool(
            num_pages=2 * n + 8, page_size=ps, layer_num=61, kv_heads=1, head_dim=8,
            dtype=torch.bfloat16, layout=layout, mla=mla,
        )  # fmt: skip
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
        b = kit.backend(pool_namespace(pool))
        b.register_mem_pool_host(pool)
        order = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(n))
        src_pages, dst_pages = order[:n], order[n : 2 * n]

        def indices(page_ids: torch.Tensor) -> torch.Tensor:
            return (page_ids[:, None] * ps + torch.arange(ps)).flatten()

        keys = unique_keys(n)
        gap = 100
        what = f"{layout}, {'MLA' if mla else 'MHA'}, {pool.segments_per_page} segments/page"
        src_bufs = pool.page_buffers(indices(src_pages))
        want = [p.tobytes() for p in src_bufs]
        rest = torch.cat([src_pages[:gap], src_pages[gap + 1 :]])
        with shape_rule("v1-exact-length"):
            r = b.batch_set_v1(keys[:gap] + keys[gap + 1 :], indices(rest))
            assert r == [True] * (n - 1), rule(
                "engine-batch", f"batch_set_v1 of {n - 1} pages stored {sum(r)} ({what})"
            )
            hits = b.batch_exists(keys)
            assert hits == gap, rule(
                "batch-exists-leading-run",
                f"batch_exists of {n} keys missing only #{gap} returned {hits} ({what})",
            )
            dst_bufs = pool.page_buffers(indices(dst_pages))
            gap_page = dst_bufs[gap]
            for seg in gap_page.segments:
                seg.memoryview[:] = sentinel(seg.nbytes)
            r = b.batch_get_v1(keys, indices(dst_pages))
        assert r[:gap] == [True] * gap and r[gap] is False, rule(
            "engine-batch",
            f"batch_get_v1 of {n} pages missing only #{gap}: leading run "
            f"{next((i for i, ok in enumerate(r) if not ok), n)}, #{gap} is {r[gap]} ({what})",
        )
        assert all(s.memoryview.tobytes() == sentinel(s.nbytes) for s in gap_page.segments), rule(
            "get-miss-untouched", f"the missing page #{gap} was written ({what})"
        )
        wrong = [i for i, ok in enumerate(r) if ok and dst_bufs[i].tobytes() != want[i]]
        assert not wrong, rule(
            "engine-batch",
            f"batch_get_v1 of {n} pages returned wrong bytes for pages {wrong[:8]}"
            f"{'...' if len(wrong) > 8 else ''} (of {len(wrong)}; {what})",
        )
        with shape_rule("v1-exact-length"):
            assert b.batch_set_v1([keys[gap]], indices(src_pages[gap : gap + 1])) == [True]
            assert b.batch_exists(keys) == n, rule(
                "batch-exists-leading-run", f"batch_exists of {n} stored keys ({what})"
            )
            assert b.batch_get_v1([keys[gap]], indices(dst_pages[gap : gap + 1])) == [True]
        assert gap_page.tobytes() == want[gap], rule(
            "engine-batch", f"page #{gap} read back wrong once stored ({what})"
        )

    @enforces("key-forms")
    def test_engine_key_forms(self, kit: Kit) -> None:
        """Each key form that engines and backends derive from a page hash is its own object.

        The forms: ``_k``/``_v`` and ``-k``/``-v`` objects, ``.<pool>`` side pools, rank and
        model suffixes, the unified ``_L<a>-<b>_H<g>`` scheme.
        """
        b = kit.backend()
        forms = [k for h in unique_keys(2) for k in engine_key_forms(h)]
        with shape_rule("exact-length"):
            r = b.batch_set(forms, [content(k, 640) for k in forms])
            refused = [k for k, ok in zip(forms, r, strict=True) if not ok]
            assert not refused, rule("key-forms", f"valid engine keys were refused: {refused[:4]}")
            hits = b.batch_exists(forms)
            assert hits == len(forms), rule(
                "key-forms", f"batch_exists of {len(forms)} stored engine keys returned {hits}"
            )
            got = b.batch_get(forms)
        wrong = [
            k
            for k, g in zip(forms, got, strict=True)
            if g is None or as_bytes(g) != content(k, 640)
        ]
        assert not wrong, rule(
            "key-forms",
            f"keys derived from one page hash collide or read back wrong: {wrong[:4]}",
        )

    # ------------------------------------------------------------------ isolation

    @pytest.mark.parametrize(
        "change",
        [
            {"dtype": "float8_e4m3fn"},
            {"model_id": "hicache-conformance-other"},
            {"object_layout": "layer_first"},
            {"page_size": 8},
            {"tenant_suffix": "-other-tenant"},
        ],
        ids=["dtype", "model", "layout", "page_size", "tenant"],
    )
    @enforces("namespace-isolation")
    def test_namespaces_do_not_share_pages(self, kit: Kit, change: dict[str, Any]) -> None:
        """Namespaces that differ in one field neither see nor overwrite each other's pages."""
        a = kit.backend(make_namespace())
        b = kit.backend(make_namespace(**change))
        (k,) = unique_keys(1)
        a.set(k, b"namespace a")
        assert not b.exists(k) and b.get(k) is None and b.batch_exists([k]) == 0, rule(
            "namespace-isolation",
            f"a page stored in one namespace is visible in another ({change})",
        )
        b.set(k, b"namespace b")
        assert as_bytes(a.get(k)) == b"namespace a", rule(
            "namespace-isolation", "namespaces overwrote each other"
        )
        assert as_bytes(b.get(k)) == b"namespace b", rule(
            "namespace-isolation", "namespaces overwrote each other"
        )

    # ------------------------------------------------------------------ atomic publication

    @enforces("atomic-visibility")
    def test_concurrent_reader_never_sees_a_partial_value(self, kit: Kit) -> None:
        """A reader racing a writer sees each value whole or not at all."""
        writer, reader = kit.backend(), kit.backend()
        size = min(4 * 2**20, kit.capabilities.max_object_bytes or 4 * 2**20)
        keys = unique_keys(6)
        done = threading.Event()
        problems: list[str] = []

        def read_loop() -> None:
            target = bytearray(size)
            while not done.is_set():
                for k in keys:
                    seen = reader.exists(k)
                    got = reader.get(k, target)
                    if got is not None and bytes(target) != content(k, size):
                        problems.append(f"get returned a partial or wrong value for {k[:12]}")
                    elif seen and got is None:
                        problems.append(
                            f"exists() was True for {k[:12]} but get() did not return it"
                        )

        t = threading.Thread(target=read_loop)
        t.start()
        try:
            for k in keys:
                assert writer.set(k, content(k, size)) is True
        finally:
            done.set()
            t.join()
        assert not problems, rule(
            "atomic-visibility", f"a reader saw a partially written value: {problems[:3]}"
        )

    @requires("persistent")
    @enforces("crash-safety")
    def test_killed_writers_leave_no_wrong_object(self, kit: Kit) -> None:
        """Writer processes killed mid-write leave each object whole or absent, never wrong."""
        spec = self._need_spec(kit)
        ns = make_namespace("-crash")
        size = min(2**20, kit.capabilities.max_object_bytes or 2**20)
        rng = random.Random()
        attempted: list[str] = []
        for round_ in range(3):
            salts = [f"{RUN_ID}-{round_}-{w}-{rng.random()}" for w in range(2)]
            procs = [
                run_worker(spec, ns, {"op": "stream", "salt": s, "nbytes": size}) for s in salts
            ]
            try:
                for p in procs:
                    assert p.stdout is not None
                    ready = False
                    for line in p.stdout:
                        if line.startswith("key "):
                            attempted.append(line.split()[1])
                        elif line.strip() == "ready":
                            ready = True
                            break
                        else:
                            pytest.fail(
                                rule("worker", f"writer process failed: {worker_output(line)!r}")
                            )
                    if not ready:
                        err = p.stderr.read() if p.stderr is not None else ""
                        pytest.fail(
                            rule(
                                "worker",
                                f"writer process exited before its first write: {worker_output(err)}",
                            )
                        )
                time.sleep(rng.uniform(0.02, 0.25))
            finally:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGKILL)
                for p in procs:
                    p.wait()
                    assert p.stdout is not None
                    attempted.extend(
                        line.split()[1]
                        for line in p.stdout.read().splitlines()
                        if line.startswith("key ")
                    )
                    p.stdout.close()
                    if p.stderr is not None:
                        p.stderr.close()
        b = kit.backend(ns)
        present = 0
        for k in attempted:
            seen = b.exists(k)
            got = b.get(k)
            if got is not None:
                present += 1
                assert as_bytes(got) == content(k, size), rule(
                    "crash-safety", f"{k[:12]} reads back wrong after a killed writer"
                )
            else:
                assert not seen, rule(
                    "crash-safety", f"{k[:12]} exists after a killed writer but cannot be read"
                )
        assert present > 0, rule("crash-safety", "nothing committed before the kill is readable")

    @requires("persistent")
    @enforces("persistence")
    def test_reopened_backend_sees_committed_pages(self, kit: Kit) -> None:
        """A backend reopened on a namespace returns what an earlier instance committed."""
        ns = make_namespace("-reopen")
        first = kit.backend(ns)
        keys = unique_keys(4)
        assert first.batch_set(keys, [content(k, 2048) for k in keys]) == [True] * 4
        first.close()
        again = kit.backend(ns)
        assert [as_bytes(g) if g is not None else None for g in again.batch_get(keys)] == [
            content(k, 2048) for k in keys
        ], rule("persistence", "a reopened backend does not return what was committed")

    # ------------------------------------------------------------------ concurrency

    @enforces("threads")
    def test_prefetch_and_backup_threads_on_one_instance(self, kit: Kit) -> None:
        """A prefetch thread and a backup thread on one instance see only correct pages."""
        b, pool = kit.pool_backend(num_pages=32)
        ps = pool.page_size
        keys = unique_keys(16)
        for page, k in zip(pool.page_buffers(torch.arange(16 * ps)), keys, strict=True):
            fill_page(page, k)
        problems: list[str] = []
        done = threading.Event()

        def backup() -> None:
            for i in range(0, 16, 4):
                r = b.batch_set_v1(keys[i : i + 4], torch.arange(i * ps, (i + 4) * ps))
                if r != [True] * 4:
                    problems.append(f"backup batch {i} returned {r}")
            done.set()

        def prefetch() -> None:
            dst = torch.arange(16 * ps, 32 * ps)
            pages = pool.page_buffers(dst)
            while True:
                finished = done.is_set()
                hits = b.batch_exists(keys)
                r = b.batch_get_v1(keys[:hits], dst[: hits * ps])
                for i, ok in enumerate(r):
                    if ok and pages[i].tobytes() != content(keys[i], pool.page_bytes):
                        problems.append(f"prefetched page {i} holds wrong bytes")
                    if not ok:
                        problems.append(f"page {i} existed but batch_get_v1 failed")
                if finished:
                    if hits != 16:
                        problems.append(
                            f"only {hits} of 16 pages visible after the backup finished"
                        )
                    return

        threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not problems, rule(
            "threads", f"one prefetch and one backup thread on one instance: {problems[:3]}"
        )

    @requires("shared")
    @enforces("multi-process")
    def test_processes_writing_the_same_keys(self, kit: Kit) -> None:
        """Processes writing the same keys at once all succeed and leave the right values."""
        spec = self._need_spec(kit)
        ns = make_namespace("-procs")
        keys = unique_keys(16)
        size = 65536
        procs = [
            run_worker(spec, ns, {"op": "write", "keys": keys, "nbytes": size, "loop": False})
            for _ in range(3)
        ]
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            outputs.append((p.returncode, worker_output(out, 500), worker_output(err, 1500)))
        assert all(rc == 0 for rc, _, _ in outputs), rule(
            "multi-process", f"a process writing the same keys failed: {outputs}"
        )
        b = kit.backend(ns)
        for k in keys:
            got = b.get(k)
            assert got is not None and as_bytes(got) == content(k, size), rule(
                "multi-process", f"{k[:12]} is missing or wrong after concurrent writers"
            )

    # ------------------------------------------------------------------ robustness

    @enforces("hostile-keys")
    def test_hostile_keys_raise_typed_errors(self, kit: Kit) -> None:
        """Invalid keys raise InvalidKeyError (non-strings InvalidArgumentError) everywhere."""
        b, pool = kit.pool_backend()
        ps = pool.page_size
        calls: list[Callable[[str], Any]] = [
            lambda key: b.set(key, b"v"),
            lambda key: b.get(key),
            lambda key: b.exists(key),
            lambda key: b.batch_exists(["ok", key]),
            lambda key: b.batch_set_v1([key], torch.arange(ps)),
            lambda key: b.batch_get_v1([key], torch.arange(ps)),
        ]
        for key in HOSTILE_KEYS:
            for call in calls:
                with raises_rule("hostile-keys", InvalidKeyError, f"key {key!r}"):
                    call(key)
        for bad in (None, 42, b"bytes-key"):
            with raises_rule("hostile-keys", InvalidArgumentError, f"key {bad!r}"):
                b.set(bad, b"v")  # type: ignore[arg-type]

    @enforces("zero-length")
    def test_zero_length_value(self, kit: Kit) -> None:
        """An empty value either reads back empty or is refused and absent."""
        b = kit.backend()
        (k,) = unique_keys(1)
        if b.set(k, b""):
            got = b.get(k)
            assert got is not None and as_bytes(got) == b"", rule(
                "zero-length", "an empty value did not read back empty"
            )
        else:
            assert not b.exists(k), rule("zero-length", "a refused empty value exists")

    @enforces("large-value")
    def test_large_value(self, kit: Kit) -> None:
        """A 32 MiB value (or the claimed maximum) round-trips; one over a claimed maximum fails."""
        b = kit.backend()
        (k,) = unique_keys(1)
        size = min(32 * 2**20, kit.capabilities.max_object_bytes or 32 * 2**20)
        data = content(k, size)
        assert b.set(k, data) is True, rule("large-value", f"a {size}-byte value was refused")
        target = bytearray(size)
        assert b.get(k, target) is target and target == data, rule(
            "large-value", "a large value read back wrong"
        )
        if kit.capabilities.max_object_bytes:
            (k2,) = unique_keys(1)
            assert b.set(k2, b"x" * (kit.capabilities.max_object_bytes + 1)) is False
            assert not b.exists(k2), rule("large-value", "a value over max_object_bytes was stored")

    @enforces("bad-value")
    def test_wrong_value_types(self, kit: Kit) -> None:
        """Values of unsupported types are refused and not stored; uneven batches raise."""
        b = kit.backend()
        (k,) = unique_keys(1)
        for bad in (object(), None, 3.5):
            try:
                ok = b.set(k, bad)  # type: ignore[arg-type]  # deliberately wrong
            except InvalidArgumentError:
                ok = False
            assert ok is False, rule("bad-value", f"set() accepted a {type(bad).__name__}")
        assert not b.exists(k), rule("bad-value", "a refused value exists")
        with pytest.raises(InvalidArgumentError):
            b.batch_set([k, k + "b"], [b"only one"])

    # ------------------------------------------------------------------ faults

    @enforces("failure-shapes")
    def test_injected_failures_give_failure_shapes(self, kit: Kit) -> None:
        """Injected faults give failure shapes and are counted; a page reported stored is there."""
        b, pool = kit.pool_backend()
        ps = pool.page_size
        keys = unique_keys(4)
        down = FaultyBackend(b, failure_rate=1.0, partial=False, seed=1)
        down.register_mem_pool_host(pool)  # else every v1 page fails for want of a pool
        down.strict_contract = True
        assert (
            down.get(keys[0]) is None
            and down.set(keys[0], b"v") is False
            and down.exists(keys[0]) is False
        )
        assert down.batch_exists(keys) == 0 and down.batch_get(keys) == [None] * 4
        assert down.batch_set(keys, [b"v"] * 4) == [False] * 4
        assert down.batch_set_v1(keys, torch.arange(4 * ps)) == [False] * 4, rule(
            "failure-shapes", "a failing store must give [False] * n from batch_set_v1"
        )
        assert down.batch_get_v1(keys, torch.arange(4 * ps)) == [False] * 4
        assert down.get_stats().op("get").errors == 1, rule(
            "failure-shapes", "failures must be counted"
        )
        for kind in TARGET_KINDS:
            target, now = make_target(kind, 1024)
            before = now()
            assert down.get(keys[0], target) is None and now() == before, rule(
                "failure-shapes", f"a failed get must return None and leave the {kind} target alone"
            )
        flaky = FaultyBackend(b, failure_rate=0.5, partial=True, seed=7)
        flaky.register_mem_pool_host(pool)
        for page, k in zip(pool.page_buffers(torch.arange(4 * ps)), keys, strict=True):
            fill_page(page, k)
        r = flaky.batch_set_v1(keys, torch.arange(4 * ps))
        for k, ok in zip(keys, r, strict=True):
            if ok:
                got = b.get(k)
                assert got is not None and as_bytes(got) == content(k, pool.page_bytes), rule(
                    "no-false-success", f"page {k[:12]} reported stored but reads back wrong"
                )

    @enforces("store-failure")
    def test_store_failure_gives_failure_shapes(
        self, kit: Kit, break_store: BreakStore | None
    ) -> None:
        """Calls on a broken store give failure shapes and write nothing; the backend recovers.

        The store is broken with the ``break_store`` fixture (skipped when it is not given).
        """
        if break_store is None:
            pytest.skip("not claimed: store fault hook (override the break_store fixture)")
        b, pool = kit.pool_backend()
        ps = pool.page_size
        keys = unique_keys(3)
        b.batch_set_v1(keys[:1], torch.arange(ps))
        b.strict_contract = True
        targets = [(kind, *make_target(kind, pool.page_bytes)) for kind in TARGET_KINDS]
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        with broken(break_store, b):
            flat.copy_(torch.frombuffer(bytearray(sentinel(flat.numel())), dtype=torch.uint8))
            results = {
                "get": b.get(keys[0]),
                "set": b.set(keys[1], b"v"),
                "exists": b.exists(keys[1]),
                "batch_exists": b.batch_exists(keys[1:]),
                "batch_get": b.batch_get(keys[1:]),
                "batch_set": b.batch_set(keys[1:], [b"a", b"b"]),
                "batch_set_v1": b.batch_set_v1(keys[1:], torch.arange(2 * ps)),
                "batch_get_v1": b.batch_get_v1(keys[:2], torch.arange(2 * ps, 4 * ps)),
            }
            into = {kind: b.get(keys[0], target) for kind, target, _ in targets}
            pool_after = flat.numpy().tobytes()
        expected = {
            "get": None, "set": False, "exists": False, "batch_exists": 0, "batch_get": [None, None],
            "batch_set": [False, False], "batch_set_v1": [False, False], "batch_get_v1": [False, False],
        }  # fmt: skip
        wrong = {op: r for op, r in results.items() if r != expected[op]}
        assert not wrong, rule(
            "store-failure", f"calls on a failing store did not return failure shapes: {wrong}"
        )
        hits = [kind for kind, got in into.items() if got is not None]
        assert not hits, rule("store-failure", f"get on a failing store returned hits into {hits}")
        touched = [kind for kind, _, now in targets if now() != sentinel(len(now()))]
        assert not touched, rule(
            "store-failure", f"get on a failing store wrote into the {touched} targets"
        )
        assert pool_after == sentinel(flat.numel()), rule(
            "store-failure", "batch_get_v1 on a failing store wrote into the host pool"
        )
        # Back with its store: at once, or once its circuit breaker's health probe (after
        # breaker_backoff, 1 s by default) has found the store again.
        deadline = time.monotonic() + 20
        while b.set(keys[2], b"after") is not True:
            assert time.monotonic() < deadline, rule(
                "store-failure", "the backend did not recover with its store"
            )
            time.sleep(0.1)

    @enforces("failed-write-absent")
    def test_writes_failed_in_an_outage_stay_absent(
        self, kit: Kit, break_store: BreakStore | None
    ) -> None:
        """Writes tried while the store is broken leave no trace once it is back.

        Each key then reads back right or is absent (``exists``, ``batch_exists``), and
        can be stored again. The store is broken with the ``break_store`` fixture
        (skipped when it is not given).
        """
        if break_store is None:
            pytest.skip("not claimed: store fault hook (override the break_store fixture)")
        b, pool = kit.pool_backend()
        ps = pool.page_size
        keys = unique_keys(6)
        data = [content(k, pool.page_bytes) for k in keys]
        for page, k in zip(pool.page_buffers(torch.arange(2 * ps)), keys[4:], strict=True):
            fill_page(page, k)
        with broken(break_store, b):
            b.set(keys[0], data[0])
            b.batch_set(keys[1:4], data[1:4])
            b.batch_set_v1(keys[4:], torch.arange(2 * ps))
        for k, want in zip(keys, data, strict=True):
            seen, got = b.exists(k), as_bytes(b.get(k))
            assert got in (None, want), rule(
                "failed-write-absent", f"{k[:12]}, written in the outage, reads back wrong"
            )
            assert got is not None or not seen, rule(
                "failed-write-absent",
                f"{k[:12]}, whose write failed in the outage, exists but cannot be read",
            )
        run = b.batch_exists(keys)
        unread = [k[:12] for k in keys[:run] if b.get(k) is None]
        assert not unread, rule(
            "failed-write-absent",
            f"batch_exists counts {run} keys written in the outage, {unread} cannot be read",
        )
        again = b.batch_set(keys, data)
        back = [as_bytes(g) for g in b.batch_get(keys)]
        assert again == [True] * len(keys) and back == data, rule(
            "failed-write-absent",
            f"keys written in the outage cannot be stored again: batch_set returned {again}, "
            f"{sum(g == d for g, d in zip(back, data, strict=True))} of {len(keys)} read back",
        )

    @enforces("read-your-writes")
    def test_latency_wrapper_keeps_results(self, kit: Kit) -> None:
        """A LatencyBackend around the backend changes no result and no capability."""
        b = kit.backend()
        slow = LatencyBackend(b, latency=0.001, jitter=0.002, seed=3)
        keys = unique_keys(3)
        assert slow.batch_set(keys, [b"1", b"2", b"3"]) == [True] * 3
        assert [as_bytes(g) for g in slow.batch_get(keys)] == [b"1", b"2", b"3"]
        assert slow.capabilities == b.capabilities

    # ------------------------------------------------------------------ performance

    @enforces("performance")
    def test_performance_qualification(self, kit: Kit, request: pytest.FixtureRequest) -> None:
        """Time a 32-page zero-copy write, check and read, record the throughput, verify bytes."""
        layout = (
            "page_first"
            if "page_first" in kit.capabilities.layouts
            else min(kit.capabilities.layouts)
        )
        pool = HostKVPool(
            num_pages=64,
            page_size=16,
            layer_num=8,
            kv_heads=8,
            head_dim=128,
            dtype=torch.bfloat16,
            layout=layout,
        )
        pool.kv_buffer.view(-1).view(torch.uint8).copy_(
            torch.randint(0, 256, (pool.kv_buffer.numel() * 2,), dtype=torch.uint8)
        )
        b = kit.backend(pool_namespace(pool))
        b.register_mem_pool_host(pool)
        n = 32
        keys = unique_keys(n)
        src, dst = torch.arange(n * 16), torch.arange(n * 16, 2 * n * 16)
        t0 = time.perf_counter()
        ok_set = sum(b.batch_set_v1(keys, src))
        t1 = time.perf_counter()
        hits = b.batch_exists(keys)
        t2 = time.perf_counter()
        ok_get = sum(b.batch_get_v1(keys, dst))
        t3 = time.perf_counter()
        nbytes = n * pool.page_bytes
        metrics = {
            "pages": n,
            "page_bytes": pool.page_bytes,
            "set_GBps": float(f"{nbytes / (t1 - t0) / 1e9:.4g}"),
            "get_GBps": float(f"{nbytes / (t3 - t2) / 1e9:.4g}"),
            "exists_keys_per_s": round(n / (t2 - t1)),
        }
        _record_metric(request, "performance", metrics)
        assert ok_set == n and hits == n and ok_get == n, rule(
            "performance", f"the throughput run lost pages: {metrics}"
        )
        same = all(
            a.tobytes() == c.tobytes()
            for a, c in zip(pool.page_buffers(src), pool.page_buffers(dst), strict=True)
        )
        assert same, rule("performance", "the throughput run read back wrong bytes")
