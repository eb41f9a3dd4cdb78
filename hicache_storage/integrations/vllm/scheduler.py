"""The scheduler side of the vLLM connector: lookups, and each step's plan for the workers.

It runs in vLLM's scheduler process. For every request it asks the store for the leading
run of the request's blocks (:meth:`SchedulerSide.get_num_new_matched_tokens`), notes the
blocks vLLM allocated for them, and each step tells the workers which blocks to load and
which newly computed full blocks to store (:meth:`SchedulerSide.build_connector_meta`):
the prompt's, and as the answer grows, the generated tokens' (up to
``store_output_tokens``), so that the next turn of a chat, whose prompt holds this
answer, hits through it. A hit covers every token but the last when the store holds all
of them: the block holding the last prompt token is loaded whole, and vLLM computes that
one token instead of the block.
It holds one backend per distinct shard, only to ask what is stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.admission import SeenCounter
from hicache_storage.integrations.adapterkit import failsafe
from hicache_storage.integrations.deadline import Lane
from hicache_storage.integrations.vllm.metadata import HiCacheConnectorMetadata, LoadSpec, SaveSpec
from hicache_storage.integrations.vllm.namespace import GroupShape, request_seed
from hicache_storage.integrations.vllm.side import ConnectorSide, Settings
from hicache_storage.keys import page_hashes, partial_page_hash, partial_page_hashes
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    from hicache_storage.integrations.deadline import Job
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["SchedulerSide"]

#: A lookup's answer: the leading run every full group holds, which of its blocks each
#: group holds (all, for a full group), and the stored partial block after it.
_Found = tuple[int, list[list[bool]], "tuple[str, int] | None"]


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    keys: list[str]  # one per full block of its tokens (prompt, then output), as known
    prompt_len: int
    stored: int  # leading blocks known to be in the store (or sent to be stored)
    #: Leading blocks the store holds in every group keeping all its blocks (loadable).
    run: int = 0
    request: Any = None  # vLLM's Request: its token ids grow as it generates
    seed: str | None = None  # the chain's namespace seed
    local_blocks: int = 0  # vLLM's own prefix hit, in blocks, at the lookup
    load: tuple[int, int, list[str]] | None = None  # blocks [start, end) to load, their keys
    block_ids: list[list[int]] = field(default_factory=list)  # one list per KV cache group
    computed_from: int = 0  # first block this request computes (after hits and loads)
    done: int | None = None  # tokens computed once the last planned step has run
    saves_sent: bool = False  # a store of its blocks was planned (async: may still read them)
    background_load: bool = False  # its hit loads while vLLM runs others (async load)
    load_pending: bool = False  # a background load was sent; the request not scheduled since
    #: A stored partial block right after the leading run: (its key, tokens with KV).
    partial: tuple[str, int] | None = None
    #: Leading blocks admitted to the store (``admit_after``: seen by enough requests).
    admitted: int = 0
    #: Blocks counted as not admitted so far (each once).
    refused: int = 0


class SchedulerSide(ConnectorSide):
    """Lookups and plans (see the module docs)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._reqs: dict[str, _Req] = {}
        #: Finished requests whose free vLLM delays, for the next step's metadata.
        self._delayed: list[str] = []
        #: Background loads planned since the last step (their requests wait for them).
        self._background_loads: list[LoadSpec] = []
        #: Partial last blocks of finished requests, to store with the next step.
        self._finish_saves: list[SaveSpec] = []
        #: Per KV cache group, one backend per distinct shard: a block is a hit only if
        #: every rank's is stored (in every group that must hold it).
        self.group_backends: list[list[HiCacheStorage]] = []
        self.shapes = settings.groups or (GroupShape(()),)
        self._lookup_lane = Lane("hicache-vllm-lookup")
        #: How many requests had each block (``admit_after``).
        self.admission = SeenCounter(settings.options.admit_after)

    # ------------------------------------------------------------------ ConnectorSide

    @property
    def lookup_backends(self) -> list[HiCacheStorage]:
        """The first group's backends, one per distinct shard."""
        return self.group_backends[0] if self.group_backends else []

    @override
    def ready(self) -> bool:
        """True once attached (see :meth:`ConnectorSide.ready`)."""
        return bool(self.group_backends)

    @override
    def _build(self) -> None:
        out: list[list[HiCacheStorage]] = []
        try:
            for group in range(len(self.shapes)):
                seen: set[str | None] = set()
                out.append([])
                for rank in range(self.settings.tp_size):
                    config = self.settings.storage_config(rank, group)
                    if config.shard in seen:
                        continue
                    seen.add(config.shard)
                    out[-1].append(create_backend(self.settings.backend_name, config))
        except BaseException:
            for b in (b for part in out for b in part):
                b.close()
            raise
        if self._closed.is_set():
            for b in (b for part in out for b in part):
                b.close()
            return
        self.group_backends = out

    @override
    def _take_backends(self) -> list[HiCacheStorage]:
        out, self.group_backends = self.group_backends, []
        return [b for part in out for b in part]

    @override
    def _live_backends(self) -> list[HiCacheStorage]:
        return [b for part in self.group_backends for b in part]

    @override
    def _lanes(self) -> list[Lane]:
        return [self._lookup_lane]

    # ------------------------------------------------------------------ vLLM's hooks

    def keys_for(self, request: Any) -> list[str] | None:
        """The keys of the full blocks of ``request``'s prompt; None: not cacheable."""
        usable, seed = request_seed(request)
        tokens = list(getattr(request, "prompt_token_ids", None) or [])
        if not usable or not tokens:
            return None
        return page_hashes(tokens, self.block_size, namespace_seed=seed)

    @staticmethod
    def _tokens(state: _Req) -> Any:
        """The request's token ids so far (prompt and output), or the prompt's alone."""
        tokens = getattr(state.request, "all_token_ids", None)
        return tokens if tokens is not None else state.request.prompt_token_ids

    def _known_tokens(self, state: _Req) -> int:
        """How many of the request's tokens have keys: its tokens, up to the output cap."""
        cap = state.prompt_len + self.settings.options.store_output_tokens
        return min(len(self._tokens(state)), cap)

    def _partial_keys(self, state: _Req, block: int, most: int) -> list[tuple[str, int]]:
        """Keys of the partial versions of block ``block``, longest first.

        Its first ``most`` tokens down to its first one, each with its token count.
        """
        bs = self.block_size
        tokens = list(self._tokens(state)[block * bs : block * bs + most])
        prior = state.keys[block - 1] if block > 0 else None
        keys = partial_page_hashes(tokens, prior_hash=prior, namespace_seed=state.seed)
        return [(k, m) for m, k in reversed(list(enumerate(keys, 1)))]

    def _extend_keys(self, state: _Req) -> None:
        """Key the request's full blocks of generated tokens known by now (chained on)."""
        bs = self.block_size
        have = len(state.keys)
        want = self._known_tokens(state) // bs
        if want <= have:
            return
        tokens = self._tokens(state)[have * bs : want * bs]
        prior = state.keys[-1] if state.keys else None
        state.keys.extend(
            page_hashes(list(tokens), bs, prior_hash=prior, namespace_seed=state.seed)
        )
        self._admit(state, have)

    def _admit(self, state: _Req, start: int) -> None:
        """Count one more request having ``state.keys[start:]``; extend the admitted run.

        Each block is counted once per request (its keys are made once). A block
        extends the run only if every block before it is admitted: a block past a
        refused one could never be loaded (hits are leading runs).
        """
        flags = self.admission.see(state.keys[start:])
        if state.admitted != start:
            return
        for ok in flags:
            if not ok:
                break
            state.admitted += 1

    @failsafe(lambda self, args: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store holds.

        The store's leading run of the request's blocks, at most all its tokens but the
        last (vLLM computes that one: with every block stored, the hit is not block
        aligned, and the block holding the last token is loaded whole); 0 when the run
        does not go beyond vLLM's own hit. Synchronous loads.
        """
        req_id = request.request_id
        state = self._reqs.get(req_id)
        if state is None or state.prompt_len != len(request.prompt_token_ids or ()):
            keys = self.keys_for(request)
            if keys is None:
                self._reqs.pop(req_id, None)
                return 0, False
            _, seed = request_seed(request)
            state = _Req(
                keys=keys,
                prompt_len=len(request.prompt_token_ids),
                stored=0,
                request=request,
                seed=seed,
            )
            self._admit(state, 0)
            self._reqs[req_id] = state
        state.request = request
        state.load = None
        state.done = None
        # Looked up again while its background load was pending: the load failed (vLLM
        # went back to zero and freed the blocks). No hit this time, or the same failing
        # load would come round again; its blocks are computed and stored afresh.
        retry_failed = state.load_pending
        state.load_pending = False
        # Blocks of an earlier life were freed (preemption): no delayed free protects them.
        state.saves_sent = False
        # A resumed request has output tokens: its blocks are keyed too.
        self._extend_keys(state)
        local = int(num_computed_tokens) // self.block_size
        state.local_blocks = local
        state.computed_from = local
        # The store's leading run over every full block (what need not be stored again),
        # of which every token but the last is a hit (num_tokens - 1, in blocks rounded up).
        num_tokens = len(self._tokens(state))
        limit = -(-(num_tokens - 1) // self.block_size)
        stored, hit_tokens = 0, 0
        found: _Found = (0, [], None)
        state.partial = None
        if self.settings.load_on and state.keys and self.ready():
            t0 = time.perf_counter()
            found = self._lookup(state, num_tokens)
            stored, hit_tokens, state.partial = self._restorable(state, found, num_tokens, local)
            self.count(
                lookups=1,
                lookup_blocks=limit,
                lookup_hit_blocks=(
                    -(-hit_tokens // self.block_size)
                    if state.partial is None
                    else hit_tokens // self.block_size
                ),
                lookup_seconds=time.perf_counter() - t0,
            )
        state.stored = stored
        state.run = found[0] if hit_tokens else 0
        if retry_failed:
            state.stored = local  # (what vLLM recomputes is stored again)
            return 0, False
        if hit_tokens <= local * self.block_size:
            return 0, False
        state.background_load = self._load_in_background(req_id)
        return hit_tokens - local * self.block_size, state.background_load

    def _lookup(self, state: _Req, num_tokens: int) -> _Found:
        """What the store holds of ``state``'s blocks, on every rank and group (on the lane).

        The leading run of blocks every group keeping all its blocks holds; which of
        that run's blocks each sliding-window group holds; and after the run, the
        longest stored partial version of the next block (every group holds it).
        """
        groups, keys = [list(g) for g in self.group_backends], state.keys
        shapes, bs = self.shapes, self.block_size
        partial_on = self.settings.options.partial_blocks

        def lookup(job: Job[Any] | None) -> _Found:
            run = len(keys)
            for shape, backends in zip(shapes, groups, strict=True):
                for backend in backends if shape.window is None else ():
                    if job is not None and job.cut:
                        return 0, [], None
                    run = min(run, int(backend.batch_exists(keys[:run])))
                    if run == 0:
                        return 0, [], None
            held: list[list[bool]] = []
            for shape, backends in zip(shapes, groups, strict=True):
                have = [True] * run
                for backend in backends if shape.window is not None else ():
                    if job is not None and job.cut:
                        return 0, [], None
                    answers = iter(backend.batch_exists_each(keys[:run]))
                    have = [h and bool(next(answers, False)) for h in have]
                held.append(have)
            # After the run, the block a finished request left partly computed (the
            # last block of an answer): the longest stored version, on every rank.
            most = min(bs - 1, num_tokens - 1 - run * bs)
            if most <= 0 or not partial_on:
                return run, held, None
            try:
                candidates = self._partial_keys(state, run, most)
                have = [True] * len(candidates)
                for backend in (b for part in groups for b in part):
                    if job is not None and job.cut:
                        return run, held, None
                    if not any(have):
                        break
                    ask = [k for (k, _), h in zip(candidates, have, strict=True) if h]
                    answers = iter(backend.batch_exists_each(ask))
                    have = [h and bool(next(answers, False)) for h in have]
            except Exception as exc:  # noqa: BLE001 - the full blocks' run still holds
                self.count(hook_errors=1)
                self._log("lookup", "HiCacheKVConnector: partial lookup failed (%s)", exc)
                return run, held, None
            found = [c for c, ok in zip(candidates, have, strict=True) if ok]
            return run, held, (found[0] if found else None)

        ok, found = self.on_lane(self._lookup_lane, lookup, "lookup")
        return found if ok and found is not None else (0, [], None)

    def _restorable(
        self, state: _Req, found: _Found, num_tokens: int, local: int
    ) -> tuple[int, int, tuple[str, int] | None]:
        """``(stored, hit_tokens, partial)``: the longest hit every group can restore.

        At most every token but the last. A sliding-window group needs, at a hit of N
        tokens, the blocks vLLM holds for it there (its window); the hit is the longest
        length (the stored partial block's, then each block boundary down) at which each
        such group's blocks from vLLM's own hit on are stored. ``stored``: the blocks
        not to store again: the full groups' run, less any block a window group lacks
        from where this request computes on (it stores those; a gap before, such as
        vLLM's null blocks before another writer's window, stays).
        """
        run, held, partial = found
        bs = self.block_size
        if len(held) != len(self.shapes):  # (no answer from every group: no hit)
            return 0, 0, None
        hit, part = self._longest(run, held, partial, num_tokens, local)
        start = max(local, hit // bs)
        stored = run
        for have in held:
            stored = min(stored, next((p for p in range(start, run) if not have[p]), run))
        return stored, hit, part

    def _longest(
        self,
        run: int,
        held: list[list[bool]],
        partial: tuple[str, int] | None,
        num_tokens: int,
        local: int,
    ) -> tuple[int, tuple[str, int] | None]:
        """The longest hit every group can restore (see :meth:`_restorable`); 0: none."""
        bs = self.block_size
        limit = -(-(num_tokens - 1) // bs)
        lengths: list[tuple[int, tuple[str, int] | None]] = []
        if partial is not None and run <= limit:
            lengths.append((min(run * bs + partial[1], num_tokens - 1), partial))
        lengths += [(min(k * bs, num_tokens - 1), None) for k in range(min(run, limit), local, -1)]
        for hit, part in lengths:
            end = min(-(-hit // bs), run)  # (a partial block was looked up in every group)
            if all(
                all(have[max(shape.first_held(hit, bs), local) : end])
                for shape, have in zip(self.shapes, held, strict=False)
                if shape.window is not None
            ):
                return hit, part
        return 0, None

    def _load_in_background(self, req_id: str) -> bool:
        """Whether a hit loads in the background (see ``async_loads``).

        Unset: when another request is running (its decoding never waits for this load),
        not for a lone request (loaded before the forward pass, its lowest TTFT), and
        never with tensor parallelism (the ranks share a step's load failures before
        anything computed over them is stored: the synchronous path). Always with several
        KV cache groups or a sliding window: vLLM takes a failed load of such a model
        only as a request failed as a whole (see ``Settings.whole_request_loads``), which
        only a background load can report.
        """
        if self.settings.whole_request_loads:
            return True
        choice = self.settings.options.async_loads
        if choice is not None:
            return choice
        if self.settings.tp_size > 1:
            return False
        return any(r != req_id and st.done is not None for r, st in self._reqs.items())

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Note the blocks to load for ``request`` (``num_external_tokens`` of them).

        Never raises. A background load that cannot be planned is sent as failed, so
        the request (which vLLM holds until its load is reported) is recomputed, never
        left waiting.
        """
        state = self._reqs.get(request.request_id)
        background = state is not None and state.background_load and num_external_tokens > 0
        try:
            self._note_load(request, state, blocks, num_external_tokens)
        except Exception as exc:  # noqa: BLE001 - vLLM's scheduler must not see it
            self._hook_failed("update_state_after_alloc", exc)
            if background:
                assert state is not None
                state.load_pending = True  # (looked up again: no hit, not the same load)
                self._background_loads.append(
                    LoadSpec(request.request_id, [], [], background=True, failed=True)
                )

    def _note_load(
        self, request: Any, state: _Req | None, blocks: Any, num_external_tokens: int
    ) -> None:
        if state is None or num_external_tokens <= 0:
            if state is not None:
                state.load = None
            return
        start = state.local_blocks
        # Blocks holding the hit: the last one may hold the token vLLM computes, and is
        # loaded whole (vLLM writes that token's KV over its slot afterwards).
        end = start + -(-int(num_external_tokens) // self.block_size)
        keys = state.keys[start : min(end, state.run, len(state.keys))]
        if state.partial is not None and end > state.run >= start:
            keys.append(state.partial[0])  # (loaded whole: vLLM computes the rest of it)
        end = start + len(keys)
        state.load = (start, end, keys)
        state.computed_from = end
        if state.background_load:
            # The request is not scheduled until its load is reported: its blocks are
            # known now, and the load goes to the workers with the next step.
            ids = [list(g)[start:end] for g in blocks.get_block_ids()]
            self._background_loads.append(LoadSpec(request.request_id, keys, ids, True))
            state.load = None
            state.load_pending = True

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheConnectorMetadata:
        """The step's loads (blocks promised to vLLM) and saves (full blocks computed now).

        Never raises. A request whose part fails is planned no further (its stores are
        lost), but a load vLLM already counts as computed is still sent.
        """
        meta = HiCacheConnectorMetadata()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        # vLLM's own block tables of the scheduled requests, where it offers them: a
        # sliding-window group's blocks that left the window are null there, while the
        # tables kept from the steps' new blocks still name them (freed, maybe reused).
        # (Only where a window group can have nulls: a full group's table only grows.)
        windowed = any(shape.window is not None for shape in self.shapes)
        exact = getattr(scheduler_output, "kv_connector_block_state", None) if windowed else None

        def table(req_id: str) -> list[list[int]] | None:
            try:
                ids = exact.get_block_ids(req_id) if exact is not None else None
                return [list(g) for g in ids] if ids is not None else None
            except Exception as exc:  # noqa: BLE001 - the tables built from the steps hold
                self._hook_failed("kv_connector_block_state", exc)
                return None

        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            state = self._reqs.get(str(getattr(new, "req_id", "")))
            try:
                # Blocks past what the request already has computed are its own, afresh.
                ids = [list(g) for g in new.block_ids]
                for g in ids:
                    meta.fresh_blocks.extend(g[new.num_computed_tokens // self.block_size :])
                if state is not None:
                    state.load_pending = False  # scheduled: a background load (if any) landed
                    state.block_ids = table(new.req_id) or ids
                    self._plan_safely(meta, new.req_id, state, new.num_computed_tokens, scheduled)
            except Exception as exc:  # noqa: BLE001 - vLLM's scheduler must not see it
                self._request_failed(meta, getattr(new, "req_id", None), state, exc)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for i, req_id in enumerate(getattr(cached, "req_ids", None) or ()):
            state = self._reqs.get(req_id)
            try:
                assert cached is not None
                new_ids = cached.new_block_ids[i]
                resumed = req_id in cached.resumed_req_ids
                first = cached.num_computed_tokens[i] // self.block_size if resumed else 0
                for g in new_ids or ():
                    meta.fresh_blocks.extend(list(g)[first:])
                if state is None:
                    continue
                state.load_pending = False  # scheduled: a background load (if any) landed
                if resumed:
                    state.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
                    state.done = None
                elif new_ids is not None:
                    if not state.block_ids:
                        state.block_ids = [[] for _ in new_ids]
                    for mine, g in zip(state.block_ids, new_ids, strict=True):
                        mine.extend(g)
                state.block_ids = table(req_id) or state.block_ids
                self._plan_safely(meta, req_id, state, cached.num_computed_tokens[i], scheduled)
            except Exception as exc:  # noqa: BLE001 - vLLM's scheduler must not see it
                self._request_failed(meta, req_id, state, exc)
        # Last, once nothing can raise: a delayed free and a background load are each
        # sent exactly once (a request waits for both).
        meta.saves.extend(self._finish_saves)
        self._finish_saves = []
        meta.delayed_frees, self._delayed = self._delayed, []
        meta.loads.extend(self._background_loads)
        self._background_loads = []
        return meta

    def _request_failed(
        self, meta: HiCacheConnectorMetadata, req_id: Any, state: _Req | None, exc: Exception
    ) -> None:
        """One request's part of the step failed: send its promised load, forget it."""
        self._hook_failed("build_connector_meta", exc)
        if state is None:
            return
        try:
            self._send_load(meta, str(req_id), state)
        except Exception:  # noqa: BLE001, S110 - nothing more can be done for it
            pass
        self._reqs.pop(req_id, None)

    def _plan_safely(
        self,
        meta: HiCacheConnectorMetadata,
        req_id: str,
        state: _Req,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        """:meth:`_plan` for one request; a failure costs its stores, never its loads.

        vLLM already counts a promised load as computed: if planning fails, the load is
        still sent (its blocks load, or are reported as failed), and the request is
        forgotten (nothing more stored for it).
        """
        try:
            self._plan(meta, req_id, state, num_computed, scheduled)
        except Exception as exc:  # noqa: BLE001 - one request's plan, not vLLM's step
            self.count(hook_errors=1)
            self._log("plan", "HiCacheKVConnector: planning %s failed (%s)", req_id, exc)
            self._send_load(meta, req_id, state)
            self._reqs.pop(req_id, None)

    @staticmethod
    def _send_load(meta: HiCacheConnectorMetadata, req_id: str, state: _Req) -> None:
        """Put ``state``'s pending load (blocks vLLM counts as computed) in ``meta``."""
        if state.load is not None:
            a, b, keys = state.load
            state.load = None
            meta.loads.append(LoadSpec(req_id, keys, [g[a:b] for g in state.block_ids]))

    def _plan(
        self,
        meta: HiCacheConnectorMetadata,
        req_id: str,
        state: _Req,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        self._send_load(meta, req_id, state)
        num_computed = int(num_computed)
        if state.done is not None and num_computed < state.done:
            # vLLM went back (a block failed to load, here or on another request sharing
            # it): what it computes again is this request's own, and is stored again.
            back = num_computed // self.block_size
            state.stored = min(state.stored, back)
            state.computed_from = min(state.computed_from, back)
        state.done = num_computed + int(scheduled.get(req_id, 0))
        if not self.settings.save_on:
            return
        # Blocks whose KV exists once this step has run and whose tokens are known (not
        # draft tokens, which may be rejected), up to the output cap.
        self._extend_keys(state)
        full = min(
            min(state.done, self._known_tokens(state)) // self.block_size,
            len(state.keys),
            min((len(g) for g in state.block_ids), default=0),
        )
        if full > state.admitted:  # (admit_after) blocks not seen often enough yet
            refused = full - max(state.admitted, state.stored, state.refused)
            if refused > 0:
                self.count(save_not_admitted_blocks=refused)
                state.refused = full
            full = max(state.admitted, min(full, state.stored))
        if full > state.stored:
            a = state.stored
            meta.saves.append(
                SaveSpec(
                    req_id,
                    state.keys[a:full],
                    [g[a:full] for g in state.block_ids],
                    prefix_block_ids=[g[:full] for g in state.block_ids],
                    computed_from=state.computed_from,
                    events=self._events_safely(state, a, full),
                )
            )
            state.stored = full
            state.saves_sent = True

    def _events_safely(self, state: _Req, a: int, b: int) -> list[Any]:
        """:meth:`_events` when vLLM's KV events are on; a failure costs the events only."""
        if not self.settings.events:
            return []
        try:
            return self._events(state, a, b)
        except Exception as exc:  # noqa: BLE001 - the blocks are stored all the same
            self._hook_failed("kv events", exc)
            return []

    def _events(
        self, state: _Req, a: int, b: int
    ) -> list[tuple[Any, Any, list[int], tuple[Any, Any]] | None]:
        """What the events of blocks ``[a, b)`` name: vLLM's hashes, tokens and LoRA.

        None for a block vLLM has not hashed yet (the hashes are vLLM's own, from the
        request: salt, adapter and multimodal inputs are in them).
        """
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(state.request, "block_hashes", None) or ())
        tokens = self._tokens(state)
        bs = self.block_size
        lora = getattr(state.request, "lora_request", None)
        adapter = (
            (getattr(lora, "adapter_id", None), getattr(lora, "name", None))
            if lora is not None
            else (None, None)
        )
        out: list[tuple[Any, Any, list[int], tuple[Any, Any]] | None] = []
        for p in range(a, b):
            if p >= len(hashes):
                out.append(None)
                continue
            parent = maybe_convert_block_hash(hashes[p - 1]) if p > 0 else None
            block = [int(t) for t in tokens[p * bs : (p + 1) * bs]]
            out.append((maybe_convert_block_hash(hashes[p]), parent, block, adapter))
        return out

    @failsafe(lambda self, args: (False, None))
    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget ``request``; True: vLLM keeps its blocks until the workers report it.

        ``block_ids``: the request's blocks, one list per KV cache group.

        With ``async_saves``, a request some of whose blocks were sent to be stored is
        freed only once the workers' stores have read them (:meth:`WorkerSide.get_finished`);
        it is announced to them in the next step's metadata.
        """
        req_id = request.request_id
        state = self._reqs.pop(req_id, None)
        if state is not None and state.load_pending:
            # Finished (aborted) while its background load runs: vLLM itself keeps the
            # blocks until the load is reported; a second delay would report it twice.
            return False, None
        if state is not None and self.settings.options.async_saves:
            try:
                if self._save_partial(req_id, state, block_ids, request):
                    state.saves_sent = True
            except Exception as exc:  # noqa: BLE001 - a lost partial store, never a lost delay
                self._hook_failed("request_finished", exc)
            if state.saves_sent:
                self._delayed.append(req_id)
                return True, None
        return False, None

    def _save_partial(
        self, req_id: str, state: _Req, block_ids: tuple[list[int], ...], request: Any = None
    ) -> bool:
        """Plan the store of a finished request's last, partly computed block.

        Its tokens with KV (all but the last sampled token's, in an answer) are keyed
        as a partial block: the next turn, which sends them again, loads it and computes
        from there instead of from the block's start. Sent with the next step's
        metadata, before vLLM frees the block (the free is delayed for it).
        """
        if not (self.settings.save_on and self.settings.options.partial_blocks):
            return False
        if state.done is None:
            return False
        bs = self.block_size
        done = min(state.done, self._known_tokens(state))
        # vLLM's own count: after spec decoding's rejections (state.done counts drafts).
        computed = getattr(request, "num_computed_tokens", None)
        if isinstance(computed, int):
            done = min(done, computed)
        full, m = divmod(done, bs)
        if not 0 < full <= len(state.keys) or m == 0 or full != state.stored:
            return False  # (nothing partial, or the blocks before it are not all stored)
        if not block_ids or any(full >= len(g) for g in block_ids):
            return False
        tokens = list(self._tokens(state)[full * bs : full * bs + m])
        key = partial_page_hash(tokens, prior_hash=state.keys[full - 1])
        self._finish_saves.append(
            SaveSpec(
                req_id,
                [key],
                [[int(g[full])] for g in block_ids],
                prefix_block_ids=[[int(b) for b in g[: full + 1]] for g in block_ids],
                computed_from=state.computed_from,
                partial=True,
            )
        )
        return True
