"""The connector's scheduler role: what the pool can supply, leases, and which blocks to save.

vLLM's scheduler (one per engine, in the engine-core process) calls, through ``KvPoolConnector``:
- ``set_xfer_handshake_metadata`` once at startup with the workers' ``KvPoolHandshake`` → the layout fingerprint
  used in every block key and pool call. Until then the pool is not consulted.
- ``on_new_request(request)`` when a request arrives (we keep the ``Request`` for its tokens and salt).
- ``get_num_new_matched_tokens(request, num_computed)`` possibly many times while the request waits. It never waits
  on the pool: the lookup (one parallel round trip over the shards; the router's planned shard
  ``kv_transfer_params[PLAN_PARAM]`` first, and alone when it holds the plan's blocks up to ``PLAN_END_PARAM``: the
  router's view of every shard chose it, so the other shards are asked only when it falls short) runs on the
  pool-call threads (``kvpool.connector.pool_calls``), started when the request arrives; while it is in flight the
  answer is vLLM's "not yet" (``None``: the request is skipped this step and asked again on the next). A finished
  lookup answers every later ask whose first block is at or after the looked-up one (vLLM's own cache may have
  grown); one older than ``LOOKUP_REFRESH_S`` is refreshed in the background while still answering. Nothing for a
  request flagged ``NO_LOAD_PARAM`` (the head of a SPLIT, which the replica computes on purpose; a RECOMPUTE the
  router priced). A HOLDER the router planned carries its HBM
  prefix in tokens (``HOLDER_PARAM``): when vLLM's own cache supplies that much, nothing is looked up (no step
  waits on the pool); when it supplies less — the router decided on a view of this engine's HBM that was out of
  date — the rest is looked up in the pool like any request's (counted in ``holders_short``) instead of recomputed.
  Only full blocks of the prompt, keyed by chained block keys (``kvpool.keys``) under ``Namespace(model_id,
  fingerprint, cache_salt)``. Hybrids: the hit ends at the furthest boundary where the
  shard holds the full-attention blocks *and* the state snapshot (``state_key``). With ``lease_on_lookup`` (default;
  not for hybrids) the lookup leases its first candidate shard (the router's planned one, else the local one) in
  the same round trip as the other shards' lookups — a lease pins the longest prefix the shard holds, a lookup that
  keeps what it found; only when another shard holds more is that one leased, in a second round trip, and the first
  lease released. The answer is what the lease pinned, and the lease waits, unused, for vLLM's allocation
  (released when a newer lookup replaces it or the request ends; one older than half the lease's ttl is not used; a
  leased answer is refreshed only after a quarter of the ttl). Loads are asynchronous in vLLM's terms
  (``load_kv_async=True``): the request waits in ``WAITING_FOR_REMOTE_KVS`` while the worker pulls its blocks; the
  engine keeps stepping the others. The worker
  reports a load at the end of the step it ran in, and vLLM schedules the request in the next one: a load handed
  over in the step of its allocation costs the request that one step, a lease taken only at the allocation two.
- ``update_state_after_alloc(request, blocks, n)`` once vLLM allocated blocks for ``n`` external tokens: hands the
  lookup's lease to this step's load, or (no usable lease) starts the lease on a pool-call thread.
- ``build_connector_meta(scheduler_output)`` every step: hands the worker a ``LoadSpec`` for every lease that has
  come back (a failed lease: a spec without remote blocks — the worker reports it failed, vLLM recomputes), releases
  the leases of preempted requests, and plans saves: the full prompt blocks this step completes (and, for hybrids,
  the state at a chunk end on a block boundary), to be written to the local shard after the forward. A block counts
  as saved only once the shard committed it (``update_connector_output`` with the workers' ``SaveReport``); a
  failed save is planned again, bounded (``kvpool.connector.save_book``). A saved block that a lookup or a lease on
  the local shard finds gone (evicted, or the shard restarted empty) is wanted again: the next computation of it
  saves it again.
- ``request_finished[_all_groups](request, ...)`` once per request (finished, aborted — also before it was ever
  scheduled — or errored): releases its leases (fire-and-forget) and hands back what its pool calls cost
  (``PoolRequestTiming`` in the final output's ``kv_transfer_params``). A request aborted while its lease is in
  flight still gets its (failed) ``LoadSpec`` — vLLM frees its blocks once the worker reports it — and the late
  lease is released when it arrives. Blocks are never held back (the saver copies what it writes).
A shard that does not answer is a miss (lookup) or a failed load (lease) — recomputed, never a failed request — and
is skipped for a backoff period after (``kvpool.connector.breaker``).
A request vLLM asks about again after its load failed completely (no preemption in between) is offered nothing:
it recomputes once instead of looping on blocks that fail the same way (measured: a slot corrupted under a lease
otherwise made the request re-load forever).
Inline loads: a hit on the own node's shard whose lookup leased it (``lease_on_lookup``), which every worker maps
through shared memory (their handshake says so), of at most ``inline_load_max_bytes`` per worker (not for hybrids),
is answered to vLLM as a synchronous load (``load_kv_async=False``): vLLM schedules the request in the step that
allocates its blocks, and the worker reads the blocks in that step before the forward (one shared-memory copy and
the checksums, ``kvpool.connector.worker``) — the request saves the engine step it would wait in
``WAITING_FOR_REMOTE_KVS``, the step costs the batch the copy.
A block that fails comes back as an invalid block id of that step and vLLM recomputes it (its token is not emitted).
Every pool call has a deadline (``lookup_deadline_s``, ``lease_deadline_s``); none runs on the scheduler's thread.
Tensor-parallel engines: every rank stores its heads under its own key (``kvpool.keys.rank_key``), so lookups and
leases ask for every rank's key of each block, block-major (``rank_interleaved``): the shard's longest held prefix
of that list, divided by the world size, is the blocks every rank can load; one lease (one grant) pins them all
and the ``LoadSpec`` lists every rank's slots. Saves are planned (and the save book kept) under rank 0's keys.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.layout import PoolPlan, group_kinds, pool_plan, state_key
from kvpool.connector.meta import (
    KvPoolHandshake,
    KvPoolMetadata,
    LoadBlock,
    LoadSpec,
    RemoteBlock,
    SaveReport,
    SaveSpec,
)
from kvpool.connector.pool import PoolShards
from kvpool.connector.pool_calls import PoolCalls
from kvpool.connector.save_book import SaveBook
from kvpool.connector.timing import PoolRequestTiming, to_params
from kvpool.events import Tier
from kvpool.keys import BlockKey, Namespace, chain_keys, rank_interleaved
from kvpool.layout import KvLayout
from kvpool.shard.wire import LeaseReply

log = logging.getLogger(__name__)

PLAN_PARAM = "kvpool_shard"  # optional kv_transfer_params hint from the router: the shard to fetch from
PLAN_END_PARAM = "kvpool_plan_end"  # with PLAN_PARAM: the block the router's plan expects that shard to supply up to
NO_LOAD_PARAM = "kvpool_no_load"  # kv_transfer_params flag: compute this request, load nothing (a SPLIT's head)
HOLDER_PARAM = "kvpool_holder_tokens"  # kv_transfer_params: the HBM prefix (tokens) a HOLDER decision counted on
LOOKUP_REFRESH_S = 1.0  # a finished lookup older than this is refreshed (in the background) when asked again


@dataclass(frozen=True)
class _Found:
    """A finished lookup: the pool holds blocks [start, end) on ``shard_id`` (end == start: nothing), of the
    blocks [start, limit) asked for."""

    shard_id: str
    start: int
    limit: int
    end: int
    at: float  # time.monotonic() when it finished
    failures: int  # shards that did not answer
    seconds: float
    local_prefix: int | None = None  # blocks from ``start`` the local shard holds (None: it did not answer)
    lease: Any = None  # ``lease_on_lookup``: the LeaseReply pinning [start, end) on ``shard_id``, not yet used
    lease_s: float = 0.0  # what that lease call took

    def answer(self, start: int, limit: int, hybrid: bool) -> int | None:
        """One past the last pool block for an ask of [start, limit); None when this lookup cannot tell."""
        if start < self.start:
            return None
        end = min(self.end, limit)
        if hybrid and end != self.end:
            return None  # the state is loaded at ``self.end`` exactly
        return max(end, start)


@dataclass
class _Match:
    shard_id: str
    start: int  # first block the pool supplies (blocks before it are in the local cache)
    end: int  # one past the last block; for hybrids also the boundary whose state is loaded
    found: _Found | None = None  # the lookup it came from (its lease, if any, covers [start, end))
    inline: bool = False  # vLLM was told the load is synchronous ("Inline loads")


@dataclass(frozen=True)
class _Lease:
    shard_id: str
    lease_id: int
    step: int  # scheduler step whose allocation asked for it


@dataclass
class _Leasing:
    """A lease in flight on a pool-call thread, for blocks vLLM has allocated."""

    match: _Match
    block_ids: tuple[list[int], ...]
    future: Future[tuple[Any, float]]
    step: int
    abandoned: bool = False  # the request finished meanwhile: release the lease when it arrives


@dataclass
class _Req:
    request: Any
    keys: list[BlockKey] | None = None
    leases: list[_Lease] = field(default_factory=list)
    save_from: int | None = None
    loaded_at: int | None = None  # request.num_preemptions when a load was last planned
    lookup: Future[_Found] | None = None  # in flight
    found: _Found | None = None  # the latest finished lookup
    lookups: int = 0  # pool lookups for this request, their seconds (on the pool-call threads)
    lookup_s: float = 0.0
    not_yet: int = 0  # asks answered "not yet" (the request was skipped that step)
    lease_s: float = 0.0
    loaded_tokens: int = 0  # tokens its loads supplied (counted once the worker reported the load)
    loading: list[int] | None = None  # a load handed to the worker: its leased blocks' ids (the first group)
    holder_short: bool = False  # a HOLDER whose HBM prefix fell short of the plan (counted once)
    asked_at: float | None = None  # time.monotonic() of vLLM's first ask that went to the pool
    wait_s: float = 0.0  # from that ask to its load handed to the worker (lookup wait, skipped steps, lease)


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_failures: int = 0
    lookups_not_yet: int = 0  # asks answered "not yet" (a lookup in flight): that request skipped one step
    hit_tokens: int = 0
    leases_taken: int = 0
    leases_failed: int = 0
    leases_short: int = 0
    leases_released: int = 0
    leases_abandoned: int = 0  # arrived after their request finished: released at once
    release_failures: int = 0
    loads_planned: int = 0
    blocks_to_load: int = 0
    blocks_to_save: int = 0
    states_to_save: int = 0
    preempted_releases: int = 0
    retries_refused: int = 0
    holders_short: int = 0  # HOLDER requests whose HBM prefix fell short of the router's plan: looked up in the pool
    lookup_leases: int = 0  # leases a lookup took with its answer (``lease_on_lookup``)
    lookup_leases_used: int = 0  # of those, handed to a load at the allocation
    lookup_leases_unused: int = 0  # of those, released unused (replaced, too old, the request ended without a load)
    lookup_leases_empty: int = 0  # lookups whose hit the lease could not pin at all (evicted, no room to promote)
    loads_inline: int = 0  # loads handed to the worker as synchronous ("Inline loads")
    history: list[str] = field(default_factory=list)  # short event log for tests/debugging (bounded)

    def note(self, event: str) -> None:
        self.history.append(event)
        if len(self.history) > 1000:
            del self.history[:500]


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.cfg = cfg
        self.plan: PoolPlan = pool_plan(group_kinds(kv_cache_config))
        name = vllm_config.model_config.served_model_name
        self.model_id = cfg.model_id or (name[0] if isinstance(name, list) else str(name))
        self.block_size = self.plan.block_size
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_world = max(int(getattr(parallel, "tensor_parallel_size", 1) or 1), 1)
        self.fingerprint: str | None = None
        self.layout: KvLayout | None = None
        self.shards = PoolShards(cfg)
        self.calls = PoolCalls()
        self.stats = SchedulerStats()
        self._stats_lock = threading.Lock()  # the counters the pool-call threads update (releases)
        self._reqs: dict[str, _Req] = {}
        self._matches: dict[str, _Match] = {}
        self._leasing: dict[str, _Leasing] = {}
        self._pending_loads: list[LoadSpec] = []
        self._inline: set[str] = set()  # requests whose inline load went out and whose outcome is not counted yet
        self.block_bytes = 0  # one block's bytes per worker (the workers' handshake): sizes an inline load
        self.inline_shard = ""  # the shard every worker mapped through shared memory (the handshake): inline loads
        self.book = SaveBook()  # what this engine saved, is saving, failed to save
        self._kv_cache_manager: Any = None
        self._step = 0  # build_connector_meta calls so far
        if not self.plan.usable:
            log.warning("kvpool connector: pool disabled for this model: %s", self.plan.why_unusable)

    # ------------------------------------------------------------------ startup
    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def set_handshake(self, metas: dict[Any, Any]) -> None:
        """Adopt the workers' layout; every rank must report the same one. Joins the Ray cluster here, once, on
        the engine's own thread (never later on a pool-call thread)."""
        handshakes = [m for m in metas.values() if isinstance(m, KvPoolHandshake)]
        layouts = {m.layout for m in handshakes}
        if not layouts:
            log.warning("kvpool connector: no worker reported a layout; the pool stays off")
            return
        if len(layouts) != 1:
            raise RuntimeError("kvpool connector: workers registered different KV layouts; refusing to start")
        self.layout = KvLayout.decode(layouts.pop())
        self.fingerprint = self.layout.fingerprint
        self.block_bytes = max(m.slot_bytes_needed for m in handshakes)
        mapped = {m.shm_shard for m in handshakes}
        self.inline_shard = mapped.pop() if len(mapped) == 1 else ""  # every worker reads it through shared memory
        log.info("kvpool connector: layout %s (%s), model id %s", self.fingerprint, self.layout.model_id,
                 self.model_id)
        from kvpool.shard.wire import ShardUnavailableError

        try:
            self.shards.ensure_ray()
        except ShardUnavailableError as exc:
            log.warning("kvpool connector: %s; every lookup is a miss", exc)
        self.shards.local_shard_id(wait=False)  # resolved in the background before the first save

    @property
    def ready(self) -> bool:
        return self.fingerprint is not None and self.plan.usable and self.cfg.load

    # ------------------------------------------------------------------ requests
    def on_new_request(self, request: Any) -> None:
        """Start the request's lookup now, from its first block: by the time vLLM first asks, it has mostly come
        back. Not a planned HOLDER's: its prefix is in vLLM's cache, unless vLLM's first ask says otherwise."""
        r = self._track(request)
        if self._wants_pool(request) and _holder_tokens(request) is None:
            limit = self._limit(request, r)
            if limit > 0:
                self._submit_lookup(r, request, 0, limit)

    def _track(self, request: Any) -> _Req:
        r = self._reqs.get(request.request_id)
        if r is None:
            r = self._reqs[request.request_id] = _Req(request)
        return r

    def _wants_pool(self, request: Any) -> bool:
        if not self.ready or request.prompt_token_ids is None:
            return False
        params = getattr(request, "kv_transfer_params", None)
        return not (isinstance(params, dict) and params.get(NO_LOAD_PARAM))

    def _keys(self, r: _Req) -> list[BlockKey]:
        if r.keys is None:
            assert self.fingerprint is not None
            tokens = r.request.prompt_token_ids or []
            ns = Namespace(self.model_id, self.fingerprint, r.request.cache_salt or "")
            r.keys = chain_keys(ns.root(), tokens, self.block_size)
        return r.keys

    def _limit(self, request: Any, r: _Req) -> int:
        """Blocks the pool may supply: full prompt blocks, leaving at least one token to compute."""
        return min((request.num_tokens - 1) // self.block_size, len(self._keys(r)))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._wants_pool(request):
            return 0, False
        r = self._track(request)
        if r.loaded_at == request.num_preemptions:
            # vLLM asks again without a preemption in between: the load we planned failed completely. Offer
            # nothing this time (recompute) rather than promise blocks that may fail the same way forever.
            self.stats.retries_refused += 1
            return 0, False
        bs = self.block_size
        limit = self._limit(request, r)
        start = num_computed_tokens // bs
        if limit <= start:
            return 0, False
        held = _holder_tokens(request)
        if held is not None:
            if num_computed_tokens >= min(held, limit * bs):
                return 0, False  # the HBM prefix the router counted on is there: nothing to look up
            if not r.holder_short:
                r.holder_short = True
                self.stats.holders_short += 1
        if r.asked_at is None:
            r.asked_at = time.monotonic()
        self._harvest(r)
        end = r.found.answer(start, limit, self.plan.hybrid) if r.found is not None else None
        if end is None:
            if r.lookup is None:
                self._submit_lookup(r, request, start, limit)
            r.not_yet += 1
            self.stats.lookups_not_yet += 1
            return None, False
        found = r.found
        assert found is not None
        refresh = LOOKUP_REFRESH_S if found.lease is None else self.cfg.lease_ttl_s / 4
        if r.lookup is None and time.monotonic() - found.at > refresh:
            self._submit_lookup(r, request, start, limit)  # answer now, know better next time
        if end <= start:
            self._matches.pop(request.request_id, None)
            return 0, False
        inline = self._inline_ok(found, end - start)
        self._matches[request.request_id] = _Match(found.shard_id, start, end, found, inline)
        return end * bs - num_computed_tokens, not inline

    def _inline_ok(self, found: _Found, blocks: int) -> bool:
        """Whether a hit of ``blocks`` blocks loads inside its allocation's step ("Inline loads"): its lookup's lease
        is in hand (young enough for the allocation to use it), it is on the shard every worker reads through
        shared memory (their handshake), and it is small."""
        return (not self.plan.hybrid and 0 < blocks * self.block_bytes <= self.cfg.inline_load_max_bytes
                and bool(self.inline_shard) and found.shard_id == self.inline_shard and self._lease_usable(found))

    def _lease_usable(self, found: _Found) -> bool:
        """The lookup's lease is in hand and young enough for a load to use it (half the lease's ttl left)."""
        return found.lease is not None and time.monotonic() - found.at <= self.cfg.lease_ttl_s / 2

    def _submit_lookup(self, r: _Req, request: Any, start: int, limit: int) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        hinted = params.get(PLAN_PARAM) if isinstance(params, dict) else None
        planned_end = params.get(PLAN_END_PARAM) if hinted and isinstance(params, dict) else None
        if not isinstance(planned_end, int) or isinstance(planned_end, bool):
            planned_end = None
        keys = list(self._keys(r)[start:limit])
        self.stats.lookups += 1
        r.lookups += 1
        r.lookup = self.calls.submit(self._lookup, hinted, keys, start, limit,
                                     planned_end)  # rank 0's keys (``_lookup``)

    def _harvest(self, r: _Req) -> None:
        """Take a finished lookup's result (on the scheduler's thread: the stats are only written here)."""
        fut = r.lookup
        if fut is None or not fut.done():
            return
        r.lookup = None
        try:
            found = fut.result()
        except Exception as exc:  # noqa: BLE001 - a bug in a lookup is a miss, never a failed request
            log.warning("kvpool connector: lookup failed: %s", exc)
            return
        self._drop_found_lease(r, "replaced")
        r.found = found
        r.lookup_s += found.seconds
        self.stats.lookup_failures += found.failures
        if found.local_prefix is not None:
            self._lost(r, found.start + found.local_prefix, found.limit)

    def _drop_found_lease(self, r: _Req, why: str) -> None:
        """Release the lease the request's latest lookup took and no load used (on a pool-call thread)."""
        found = r.found
        if found is None or found.lease is None:
            return
        r.found = replace(found, lease=None)
        with self._stats_lock:
            self.stats.lookup_leases_unused += 1
        self.calls.submit(self._release_call, r.request.request_id,
                          _Lease(found.shard_id, found.lease.lease.lease_id, self._step), f"lookup lease {why}", False)

    def _release_late_lookup_lease(self, rid: str, fut: Future[_Found]) -> None:
        """The lease of a lookup that came back after its request ended: released at once (a done-callback: it runs
        where the lookup finished, or here when it just did; the release call itself goes to a pool-call thread)."""
        try:
            found = fut.result()
        except Exception:  # noqa: BLE001 - a failed lookup holds no lease
            return
        if found.lease is not None:
            with self._stats_lock:
                self.stats.lookup_leases_unused += 1
            try:
                self.calls.submit(self._release_call, rid, _Lease(found.shard_id, found.lease.lease.lease_id, -1),
                                  "lookup lease late", False)
            except RuntimeError:  # shutting down: the lease expires on its own (ttl)
                pass

    def _lost(self, r: _Req, start: int, end: int) -> None:
        """The local shard does not hold block ``start`` of the request: when the book says this engine saved it
        (the shard evicted it, or restarted empty), the saved blocks of [start, end) are wanted again."""
        keys = self._keys(r)
        if start >= min(end, len(keys)) or not self.book.is_saved(bytes(keys[start])):
            return
        lost = [bytes(k) for k in keys[start:end]]
        if self.plan.hybrid:
            lost += [bytes(state_key(k)) for k in keys[start:end]]
        self.book.forget(lost)

    # ---------------------------------------------------------- pool-call threads (never the scheduler's)
    def _candidates(self, hinted: str | None) -> list[str]:
        ids = self.shards.shard_ids
        local = self.shards.local_shard_id()
        order: list[str] = []
        for sid in (hinted, local):
            if sid and sid in ids and sid not in order:
                order.append(sid)
        if self.cfg.lookup_remote or not order:
            order += [s for s in ids if s not in order]
        return order

    def _lookup(self, hinted: str | None, keys: list[BlockKey], start: int, limit: int,
                planned_end: int | None = None) -> _Found:
        """One parallel lookup of ``keys`` (blocks [start, limit), rank 0's keys; every rank's are asked for) over the
        candidate shards: the best match. With ``lease_on_lookup`` (not hybrids) the first candidate — the router's
        planned shard, else the local one — is leased in the same round trip instead of looked up; a second round
        trip only when another shard holds more (that one is leased, the first lease released). A plan that says
        up to which block its shard supplies (``planned_end``) asks that shard alone first, and the others only when
        its lease falls short of the plan."""
        assert self.fingerprint is not None
        t0 = time.perf_counter()
        shards = self._candidates(hinted)
        local = self.shards.local_shard_id(wait=False)
        world = self.tp_world
        asked = rank_interleaved(keys, world)
        lease_first = self.cfg.lease_on_lookup and not self.plan.hybrid
        ttl = self.cfg.lease_ttl_s if lease_first else None
        deadline = self.cfg.lookup_deadline_s
        if lease_first and planned_end is not None and len(shards) > 1 and shards[0] == hinted:
            results = self.shards.lookup_many([(hinted, asked)], self.fingerprint, deadline, lease_ttl_s=ttl)
            first = results[0]
            pinned = len(first.lease.blocks) // world if isinstance(first, LeaseReply) else 0
            if start + pinned < min(planned_end, limit):  # the plan's shard falls short: ask the others too
                results += self.shards.lookup_many([(s, asked) for s in shards[1:]], self.fingerprint, deadline)
            shards = shards[: len(results)]
        else:
            results = self.shards.lookup_many([(s, asked) for s in shards], self.fingerprint, deadline,
                                              lease_ttl_s=ttl)
        best_shard, best, failures, local_prefix, first_lease = "", 0, 0, None, None
        for sid, res in zip(shards, results, strict=True):
            if res is None:
                failures += 1
                continue
            if isinstance(res, LeaseReply):
                first_lease = res
                held = min(len(res.lease.blocks) // world, limit - start)  # blocks every rank's lease pinned
                listed = min(res.lease.held // world, limit - start) if res.lease.held >= 0 else held
                self._count_pinned(held, listed)  # the shard may hold more than it pins (a checksum, no DRAM)
            else:
                held = res.prefix // world  # blocks every rank holds
            if sid == local:
                local_prefix = held
            if held > best:
                best_shard, best = sid, held
        end = start + best
        if best and self.plan.hybrid:
            end = self._state_boundary(best_shard, keys, start, end)
        lease, lease_s = None, 0.0
        if first_lease is not None and best and best_shard == shards[0]:
            lease = first_lease
            with self._stats_lock:
                self.stats.lookup_leases += 1
        else:
            if first_lease is not None and first_lease.lease.lease_id:  # another shard holds more: not waited for
                self.calls.submit(self._release_call, "", _Lease(shards[0], first_lease.lease.lease_id, -1),
                                  "lookup lease beaten", False)
            if best and self.cfg.lease_on_lookup and not self.plan.hybrid:
                lease, lease_s, pinned = self._lease_found(best_shard, keys, start, end)
                if pinned < end and best_shard == local:
                    local_prefix = pinned - start  # the local shard dropped blocks it had (a checksum, evicted)
                end = pinned
        return _Found(best_shard, start, limit, end, time.monotonic(), failures, time.perf_counter() - t0 - lease_s,
                      local_prefix, lease, lease_s)

    def _lease_found(self, shard_id: str, keys: list[BlockKey], start: int, end: int) -> tuple[Any, float, int]:
        """(``lease_on_lookup``, a pool-call thread) Lease the blocks [start, end) a lookup found on ``shard_id``
        (``keys`` begin at ``start``): (the lease, or None — the allocation leases again; seconds; the end of what it
        pinned for every rank: blocks evicted since the lookup are not offered)."""
        world = self.tp_world
        reply, lease_s = self._lease(shard_id, list(rank_interleaved(keys[: end - start], world)))
        if reply is None:
            return None, lease_s, end
        usable = min(len(reply.lease.blocks) // world, end - start)
        self._count_pinned(usable, end - start)
        if usable == 0:
            if reply.lease.lease_id:
                self._release_call("", _Lease(shard_id, reply.lease.lease_id, -1), "lookup lease empty", False)
            return None, lease_s, start
        with self._stats_lock:
            self.stats.lookup_leases += 1
        return reply, lease_s, start + usable

    def _count_pinned(self, pinned: int, found: int) -> None:
        """A lookup's lease pinned ``pinned`` of the ``found`` blocks the shard held: short when fewer, and empty
        as well when none (``leases_short``, ``lookup_leases_empty``)."""
        if pinned >= found:
            return
        with self._stats_lock:
            self.stats.leases_short += 1
            self.stats.lookup_leases_empty += int(pinned == 0)

    def _state_boundary(self, shard_id: str, keys: list[BlockKey], start: int, end: int) -> int:
        """Furthest boundary in (start, end] whose state snapshot the shard holds; ``start`` if none. ``keys``
        begin at block ``start``."""
        assert self.fingerprint is not None
        boundaries = list(range(end, start, -1))
        world = self.tp_world
        res = self.shards.lookup_many(
            [(shard_id, rank_interleaved([state_key(keys[k - 1 - start])], world)) for k in boundaries],
            self.fingerprint, self.cfg.lookup_deadline_s)
        for k, r in zip(boundaries, res, strict=True):
            if r is not None and r.prefix == world:
                return k
        return start

    def _lease(self, shard_id: str, keys: list[bytes]) -> tuple[Any, float]:
        """(the ``LeaseReply``, or None when the shard failed; seconds the call took)."""
        t0 = time.perf_counter()
        try:
            reply = self.shards.client(shard_id).lease(keys, self.fingerprint, self.cfg.lease_ttl_s)
        except Exception as exc:  # ShardUnavailableError, a dead actor, a bad reply: the load fails, vLLM recomputes
            log.warning("kvpool connector: lease on %s failed: %s", shard_id, exc)
            reply = None
        return reply, time.perf_counter() - t0

    def _release_call(self, rid: str, lease: _Lease, why: str, counted: bool = True) -> None:
        """Release one lease (a pool-call thread). ``counted``: a load's lease (``leases_released``, which ends equal
        to ``leases_taken``); a lookup's lease no load used is counted in ``lookup_leases_unused`` instead."""
        try:
            self.shards.client(lease.shard_id).release(lease.lease_id)
        except Exception as exc:  # the lease expires on its own (ttl); never fail a request over a release
            with self._stats_lock:
                self.stats.release_failures += 1
            log.warning("kvpool connector: release of lease %s on %s failed: %s", lease.lease_id, lease.shard_id,
                        exc)
            return
        with self._stats_lock:
            self.stats.leases_released += int(counted)
            self.stats.note(f"release {rid} {lease.shard_id} {lease.lease_id} {why}")

    # ------------------------------------------------------------------ allocation
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        r = self._track(request)
        r.loaded_at = request.num_preemptions
        bs = self.block_size
        keys = self._keys(r)
        if match is None or (match.end - match.start) * bs != num_external_tokens:
            # vLLM trimmed the hit (or we lost the match): we cannot vouch for these tokens → fail the whole load,
            # vLLM recomputes the request from scratch (an inline one: every external block is reported invalid).
            log.warning("kvpool connector: %s: unexpected external token count %d (match %s)",
                        request.request_id, num_external_tokens, match)
            if match is not None and match.inline:
                self._fail_inline(request.request_id, match.start, match.start - (-num_external_tokens // bs),
                                  blocks.get_block_ids())
                return
            self._pending_loads.append(_failed_spec(request.request_id))
            return
        world = self.tp_world
        found = match.found
        if found is not None and found.lease is not None and r.found is found:
            # an inline match was checked young enough in this same scheduler pass (``_inline_ok``)
            if match.inline or self._lease_usable(found):
                # the lookup's lease pins these blocks already: the load goes out with this step
                r.found = replace(found, lease=None)
                self.stats.lookup_leases_used += 1
                lo, hi = (match.start - found.start) * world, (match.end - found.start) * world
                reply = found.lease
                sliced = msgspec.structs.replace(reply, lease=msgspec.structs.replace(
                    reply.lease, blocks=reply.lease.blocks[lo:hi]))
                done: Future[tuple[Any, float]] = Future()
                done.set_result((sliced, found.lease_s))
                self._leasing[request.request_id] = _Leasing(match, blocks.get_block_ids(), done, self._step)
                return
            self._drop_found_lease(r, "too old")  # the allocation leases again
        if match.inline:  # never expected (``_inline_ok`` checked the lease): vLLM will not wait, so recompute
            self._fail_inline(request.request_id, match.start, match.end, blocks.get_block_ids())
            return
        lease_keys: list[bytes] = list(rank_interleaved(keys[match.start : match.end], world))
        if self.plan.hybrid:
            lease_keys += rank_interleaved([state_key(keys[match.end - 1])], world)
        fut = self.calls.submit(self._lease, match.shard_id, lease_keys)
        self._leasing[request.request_id] = _Leasing(match, blocks.get_block_ids(), fut, self._step)

    def _apply_leases(self) -> None:
        """Turn every lease that came back into the worker's ``LoadSpec`` (or release it: its request is gone)."""
        for rid, p in list(self._leasing.items()):
            if not p.future.done():
                continue
            del self._leasing[rid]
            reply, lease_s = p.future.result()  # _lease never raises
            lease_id = reply.lease.lease_id if reply is not None else 0
            r = self._reqs.get(rid)
            if p.abandoned or r is None:
                if lease_id:
                    self.stats.leases_abandoned += 1
                    self.calls.submit(self._release_call, rid, _Lease(p.match.shard_id, lease_id, p.step),
                                      "abandoned")
                continue
            match = p.match
            leased = list(reply.lease.blocks) if reply is not None else []
            n = match.end - match.start
            world = self.tp_world
            usable = min(len(leased) // world, n)  # blocks every rank got a slot for
            r.lease_s += lease_s
            g = self.plan.block_groups[0]
            r.loading = [p.block_ids[g][i] for i in range(match.start, match.start + usable)]
            if reply is None:
                self.stats.leases_failed += 1
            if lease_id:
                r.leases.append(_Lease(match.shard_id, lease_id, p.step))
                self.stats.leases_taken += 1
                self.stats.note(f"lease {rid} {match.shard_id} {lease_id}")
            if len(leased) < (n + int(self.plan.hybrid)) * world:
                with self._stats_lock:  # a lookup's lease counts its short ones too (a pool-call thread)
                    self.stats.leases_short += 1
                if reply is not None and match.shard_id == self.shards.local_shard_id(wait=False):
                    self._lost(r, match.start + usable, match.end)
                if self.plan.hybrid and lease_id:
                    self._release(rid, "short", only=lease_id)  # useless without the state
            # What the request waited on the pool before its read: from vLLM's first ask to now.
            wait_s = max(time.monotonic() - r.asked_at, lease_s) if r.asked_at is not None else lease_s
            r.wait_s += wait_s
            r.asked_at = None  # a load after a preemption waits from its own first ask
            self._queue_load(rid, match.shard_id, reply, match.start, match.end, p.block_ids, leased, lease_s,
                             wait_s, inline=match.inline)

    def _fail_inline(self, req_id: str, start: int, end: int, block_ids: tuple[list[int], ...]) -> None:
        """An inline load that cannot be served: a spec without remote slots, which the worker reports as invalid
        block ids of this step, so vLLM recomputes them (it did not wait for them)."""
        r = self._reqs.get(req_id)
        if r is not None:
            g = self.plan.block_groups[0]
            r.loading = [block_ids[g][i] for i in range(start, end)]
        self._queue_load(req_id, "", None, start, end, block_ids, [], 0.0, 0.0, inline=True)

    def _queue_load(self, req_id: str, shard_id: str, reply: Any, start: int, end: int,
                    block_ids: tuple[list[int], ...], leased: list[Any], lease_s: float, wait_s: float, *,
                    inline: bool = False) -> None:
        world = self.tp_world

        def slot(j: int) -> RemoteBlock | None:
            """The ``j``-th leased slot (rank-interleaved); None: not leased, a load error from the start."""
            return RemoteBlock(leased[j].offset, leased[j].length, leased[j].checksum) if j < len(leased) else None

        loads: list[LoadBlock] = []
        for i in range(start, end):
            ids = {g: block_ids[g][i] for g in self.plan.block_groups}
            loads += [LoadBlock(ids, slot((i - start) * world + rank)) for rank in range(world)]
        states: list[LoadBlock] = []
        if self.plan.hybrid:
            n = end - start
            ids = {g: block_ids[g][end - 1] for g in self.plan.state_groups}
            states = [LoadBlock(ids, slot(n * world + rank)) for rank in range(world)]
        self._pending_loads.append(LoadSpec(
            req_id=req_id,
            shard_id=shard_id,
            agent_name=reply.agent_name if reply is not None else "",
            shard_epoch=reply.epoch if reply is not None else "",
            region_id=reply.region_id if reply is not None else -1,
            blocks=loads,
            states=states,
            all_or_nothing=self.plan.hybrid,
            lease_s=lease_s,
            wait_s=wait_s,
            ssd_blocks=sum(1 for b in leased if b.from_tier is Tier.SSD),
            grant=reply.lease.grant if reply is not None else b"",
            world=world,
            inline=inline,
        ))
        if inline:
            self._inline.add(req_id)
            self.stats.loads_inline += 1
        self.stats.loads_planned += 1
        self.stats.blocks_to_load += end - start
        self.stats.hit_tokens += (end - start) * self.block_size

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, so: Any) -> KvPoolMetadata:
        self._apply_leases()
        # A request preempted in this step may have been re-admitted (and its lease started) in the same
        # schedule() call: release only the leases of earlier steps.
        for rid in so.preempted_req_ids or ():
            r = self._reqs.get(rid)
            if r is not None:
                if any(lease.step < self._step for lease in r.leases):
                    self.stats.preempted_releases += 1
                    self._release(rid, "preempted", before_step=self._step)
                p = self._leasing.get(rid)
                if not any(lease.step == self._step for lease in r.leases) and (p is None or p.step != self._step):
                    r.save_from = None
        saves: list[SaveSpec] = []
        if (self.cfg.save and self.plan.usable and self.fingerprint is not None
                and self.shards.local_shard_id(wait=False)):
            for new in so.scheduled_new_reqs:
                self._plan_save(new.req_id, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0),
                                True, saves)
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                self._plan_save(rid, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0),
                                rid in cached.resumed_req_ids, saves)
        meta = KvPoolMetadata(self._pending_loads, saves, self.fingerprint or "")
        self._pending_loads = []
        self._step += 1
        return meta
    def _plan_save(self, rid: str, computed: int, scheduled: int, first: bool, out: list[SaveSpec]) -> None:
        """The full prompt blocks this step completes (and, at a request's first step, the blocks it holds whose
        earlier save failed), minus what the book says is saved or in flight."""
        r = self._reqs.get(rid)
        if r is None or scheduled <= 0 or r.request.prompt_token_ids is None or self._kv_cache_manager is None:
            return
        bs = self.block_size
        keys = self._keys(r)
        retry: list[int] = []
        if first or r.save_from is None:
            r.save_from = computed // bs
            # the blocks it starts with (the engine's cache, a load): save those whose earlier save failed
            retry = [i for i in range(min(r.save_from, len(keys))) if self.book.failed_before(bytes(keys[i]))]
        end = computed + scheduled
        prompt = r.request.num_prompt_tokens
        full = min(min(end, prompt) // bs, len(keys))
        if full <= r.save_from and not (self.plan.hybrid and end % bs == 0) and not retry:
            return
        table = self._kv_cache_manager.get_block_ids(rid)
        null = self._kv_cache_manager.block_pool.null_block.block_id
        save_keys: list[bytes] = []
        save_blocks: list[dict[int, int]] = []
        for i in [*retry, *range(r.save_from, full)]:
            key = bytes(keys[i])
            ids = {g: table[g][i] for g in self.plan.block_groups}
            if not self.book.wanted(key) or null in ids.values():
                continue
            save_keys.append(key)
            save_blocks.append(ids)
        r.save_from = max(r.save_from, full)
        skey: bytes | None = None
        sblock: dict[int, int] | None = None
        k = end // bs
        if self.plan.hybrid and end % bs == 0 and 0 < end <= prompt and k <= len(keys):
            candidate = bytes(state_key(keys[k - 1]))
            ids = {g: table[g][k - 1] for g in self.plan.state_groups if k - 1 < len(table[g])}
            if self.book.wanted(candidate) and len(ids) == len(self.plan.state_groups) and null not in ids.values():
                skey, sblock = candidate, ids
        if not save_keys and skey is None:
            return
        self.book.planned(save_keys + ([skey] if skey else []))
        self.stats.blocks_to_save += len(save_keys)
        self.stats.states_to_save += int(skey is not None)
        out.append(SaveSpec(rid, save_keys, save_blocks, skey, sblock))

    def load_outcomes(self, done: Any, failed: Any, invalid: Any) -> None:
        """The loads the workers finished this step (vLLM's ``update_connector_output``: finished and failed
        request ids, the block ids that failed to load): a request's ``loaded_tokens`` counts the leased blocks up
        to the first that failed — what vLLM kept; it recomputes the rest (nothing of a failed request). An inline
        load is never in ``done``: its outcome is the invalid block ids of the step it ran in, counted at the next
        output (with vLLM's async scheduling that can be the step before it: a failure then goes uncounted here,
        never unrecomputed — vLLM itself acts on the ids)."""
        for rid in self._inline:
            self._count_loaded(rid, invalid)
        self._inline.clear()
        for rid in done or ():
            self._count_loaded(rid, invalid, failed=bool(failed) and rid in failed)

    def _count_loaded(self, rid: str, invalid: Any, *, failed: bool = False) -> None:
        """A load handed over is done: its leased blocks up to the first ``invalid`` one count as loaded tokens
        (none for a ``failed`` request)."""
        r = self._reqs.get(rid)
        if r is None or r.loading is None:
            return
        ids, r.loading = r.loading, None
        if failed:
            return
        ok = next((i for i, b in enumerate(ids) if invalid and b in invalid), len(ids))
        r.loaded_tokens += ok * self.block_size

    def save_outcomes(self, report: Any) -> None:
        """The workers' ``SaveReport`` of a step (vLLM's ``update_connector_output``): committed keys count as
        saved, failed ones may be planned again (``kvpool.connector.save_book``)."""
        if isinstance(report, SaveReport):
            self.book.outcome(report.saved, report.failed, getattr(report, "skipped", ()))

    # ------------------------------------------------------------------ endings
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's leases; its blocks are freed at once (saves copy what they need). Returns, for
        the final output's ``kv_transfer_params``, what the pool calls cost it (``PoolRequestTiming``)."""
        rid = request.request_id
        p = self._leasing.get(rid)
        if p is not None and not p.abandoned:
            # vLLM frees a request waiting for its KV only once the worker reports the load: hand over a failed
            # load now; the lease itself is released when it comes back (``_apply_leases``).
            p.abandoned = True
            self._pending_loads.append(_failed_spec(rid))
        self._release(rid, "finished")
        r = self._reqs.get(rid)
        if r is not None:
            self._harvest(r)
            self._drop_found_lease(r, "unused")
            if r.lookup is not None:  # still in flight: its lease is released when it arrives
                r.lookup.add_done_callback(lambda fut, rid=rid: self._release_late_lookup_lease(rid, fut))
        r = self._reqs.pop(rid, None)
        self._matches.pop(rid, None)
        if r is None or not r.lookups:
            return False, None
        timing = PoolRequestTiming(lookups=r.lookups, lookup_s=r.lookup_s, lease_s=r.lease_s,
                                   loaded_tokens=r.loaded_tokens, not_yet=r.not_yet, wait_s=r.wait_s)
        return False, to_params(timing)

    def _release(self, rid: str, why: str, *, before_step: int | None = None, only: int | None = None) -> None:
        """Release the request's leases (all, those taken before ``before_step``, or the one ``only``), on the
        pool-call threads."""
        r = self._reqs.get(rid)
        if r is None:
            return
        keep: list[_Lease] = []
        for lease in r.leases:
            if (before_step is not None and lease.step >= before_step) or (only is not None and lease.lease_id != only):
                keep.append(lease)
                continue
            self.calls.submit(self._release_call, rid, lease, why)
        r.leases = keep

    def held_leases(self) -> dict[str, list[tuple[str, int]]]:
        """Request id → [(shard, lease id)] currently held (tests, debugging)."""
        return {rid: [(x.shard_id, x.lease_id) for x in r.leases] for rid, r in self._reqs.items() if r.leases}

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded) until every pool call started so far has finished (tests and benches read the counters
        after it)."""
        return self.calls.wait_idle(timeout_s)

    def shutdown(self) -> None:
        self.calls.close()


def _failed_spec(req_id: str) -> LoadSpec:
    """A load the worker reports failed at once (nothing leased): vLLM recomputes the request."""
    return LoadSpec(req_id, "", "", "", -1, [], [], True)


def _holder_tokens(request: Any) -> int | None:
    """The HBM prefix (tokens) the router's HOLDER decision counted on (``HOLDER_PARAM``), or None."""
    params = getattr(request, "kv_transfer_params", None)
    held = params.get(HOLDER_PARAM) if isinstance(params, dict) else None
    return held if isinstance(held, int) and not isinstance(held, bool) else None
