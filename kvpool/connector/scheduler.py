"""The connector's scheduler role: what the pool can supply, leases, and which blocks to save.

vLLM's scheduler (one per engine, in the engine-core process) calls, through ``KvPoolConnector``:
- ``set_xfer_handshake_metadata`` once at startup with the workers' ``KvPoolHandshake`` → the layout fingerprint
  used in every block key and pool call. Until then the pool is not consulted.
- ``on_new_request(request)`` when a request arrives (we keep the ``Request`` for its tokens and salt).
- ``get_num_new_matched_tokens(request, num_computed)`` possibly many times while the request waits: one parallel
  lookup round trip over the shards (no lease, no state change anywhere: side-effect free), the router's planned
  shard (``kv_transfer_params[PLAN_PARAM]``) first; nothing for a request flagged ``NO_LOAD_PARAM`` (the head of
  a SPLIT, which the replica computes on purpose). Only full blocks of the
  prompt, keyed by chained block keys (``kvpool.keys``) under ``Namespace(model_id, fingerprint, cache_salt)``.
  Hybrids: the hit ends at the furthest boundary where the shard holds the full-attention blocks *and* the state
  snapshot (``state_key``). Loads are asynchronous in vLLM's terms (``load_kv_async=True``): the request waits in
  ``WAITING_FOR_REMOTE_KVS`` for one step while the worker pulls its blocks.
- ``update_state_after_alloc(request, blocks, n)`` once vLLM allocated blocks for ``n`` external tokens: takes the
  lease (pins the blocks on the shard) and queues a ``LoadSpec`` with the engine block ids.
- ``build_connector_meta(scheduler_output)`` every step: hands the queued loads to the worker, releases the leases
  of preempted requests, and plans saves: the full prompt blocks this step completes (and, for hybrids, the state
  at a chunk end on a block boundary), to be written to the local shard after the forward.
- ``request_finished[_all_groups](request, ...)`` once per request (finished, aborted — also before it was ever
  scheduled — or errored): releases its lease and hands back what its pool calls cost (``PoolRequestTiming`` in
  the final output's ``kv_transfer_params``). Blocks are never held back (the saver copies what it writes).
A shard that does not answer is a miss (lookup) or a failed load (lease) — recomputed, never a failed request.
A request vLLM asks about again after its load failed completely (no preemption in between) is offered nothing:
it recomputes once instead of looping on blocks that fail the same way (measured: a slot corrupted under a lease
otherwise made the request re-load forever).
Lookups and leases are blocking Ray calls with deadlines (``lookup_deadline_s``, ``lease_deadline_s``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.layout import PoolPlan, group_kinds, pool_plan, state_key
from kvpool.connector.meta import KvPoolHandshake, KvPoolMetadata, LoadBlock, LoadSpec, RemoteBlock, SaveSpec
from kvpool.connector.timing import PoolRequestTiming, to_params
from kvpool.connector.pool import PoolShards
from kvpool.keys import BlockKey, Namespace, chain_keys
from kvpool.layout import KvLayout
from kvpool.events import Tier

log = logging.getLogger(__name__)

PLAN_PARAM = "kvpool_shard"  # optional kv_transfer_params hint from the router: the shard to fetch from
NO_LOAD_PARAM = "kvpool_no_load"  # kv_transfer_params flag: compute this request, load nothing (a SPLIT's head)
RECENT_SAVES = 65536  # keys this engine already saved (skip re-saving them)


@dataclass
class _Match:
    shard_id: str
    start: int  # first block the pool supplies (blocks before it are in the local cache)
    end: int  # one past the last block; for hybrids also the boundary whose state is loaded


@dataclass(frozen=True)
class _Lease:
    shard_id: str
    lease_id: int
    step: int  # scheduler step that took it


@dataclass
class _Req:
    request: Any
    keys: list[BlockKey] | None = None
    leases: list[_Lease] = field(default_factory=list)
    save_from: int | None = None
    loaded_at: int | None = None  # request.num_preemptions when a load was last planned
    lookups: int = 0  # pool round trips on the scheduler's thread for this request, and their seconds
    lookup_s: float = 0.0
    lease_s: float = 0.0
    loaded_tokens: int = 0


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_failures: int = 0
    hit_tokens: int = 0
    leases_taken: int = 0
    leases_short: int = 0
    leases_released: int = 0
    release_failures: int = 0
    loads_planned: int = 0
    blocks_to_load: int = 0
    blocks_to_save: int = 0
    states_to_save: int = 0
    preempted_releases: int = 0
    retries_refused: int = 0
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
        self.fingerprint: str | None = None
        self.layout: KvLayout | None = None
        self.shards = PoolShards(cfg)
        self.stats = SchedulerStats()
        self._reqs: dict[str, _Req] = {}
        self._matches: dict[str, _Match] = {}
        self._pending_loads: list[LoadSpec] = []
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._kv_cache_manager: Any = None
        self._step = 0  # build_connector_meta calls so far
        if not self.plan.usable:
            log.warning("kvpool connector: pool disabled for this model: %s", self.plan.why_unusable)

    # ------------------------------------------------------------------ startup
    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def set_handshake(self, metas: dict[Any, Any]) -> None:
        """Adopt the workers' layout; every rank must report the same one."""
        layouts = {m.layout for m in metas.values() if isinstance(m, KvPoolHandshake)}
        if not layouts:
            log.warning("kvpool connector: no worker reported a layout; the pool stays off")
            return
        if len(layouts) != 1:
            raise RuntimeError("kvpool connector: workers registered different KV layouts; refusing to start")
        self.layout = KvLayout.decode(layouts.pop())
        self.fingerprint = self.layout.fingerprint
        log.info("kvpool connector: layout %s (%s), model id %s", self.fingerprint, self.layout.model_id,
                 self.model_id)

    @property
    def ready(self) -> bool:
        return self.fingerprint is not None and self.plan.usable and self.cfg.load

    # ------------------------------------------------------------------ requests
    def on_new_request(self, request: Any) -> None:
        self._reqs.setdefault(request.request_id, _Req(request))

    def _track(self, request: Any) -> _Req:
        r = self._reqs.get(request.request_id)
        if r is None:
            r = self._reqs[request.request_id] = _Req(request)
        return r

    def _keys(self, r: _Req) -> list[BlockKey]:
        if r.keys is None:
            assert self.fingerprint is not None
            tokens = r.request.prompt_token_ids or []
            ns = Namespace(self.model_id, self.fingerprint, r.request.cache_salt or "")
            r.keys = chain_keys(ns.root(), tokens, self.block_size)
        return r.keys

    def _candidates(self, request: Any) -> list[str]:
        params = getattr(request, "kv_transfer_params", None) or {}
        hinted = params.get(PLAN_PARAM) if isinstance(params, dict) else None
        local = self.shards.local_shard_id()
        order: list[str] = []
        for sid in (hinted, local):
            if sid and sid in self.shards.shard_ids and sid not in order:
                order.append(sid)
        if self.cfg.lookup_remote or not order:
            order += [s for s in self.shards.shard_ids if s not in order]
        return order

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.ready or request.prompt_token_ids is None:
            return 0, False
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get(NO_LOAD_PARAM):
            return 0, False
        r = self._track(request)
        if r.loaded_at == request.num_preemptions:
            # vLLM asks again without a preemption in between: the load we planned failed completely. Offer
            # nothing this time (recompute) rather than promise blocks that may fail the same way forever.
            self.stats.retries_refused += 1
            return 0, False
        keys = self._keys(r)
        bs = self.block_size
        limit = min((request.num_tokens - 1) // bs, len(keys))  # leave at least one token to compute
        start = num_computed_tokens // bs
        if limit <= start:
            return 0, False
        assert self.fingerprint is not None
        shards = self._candidates(request)
        self.stats.lookups += 1
        t0 = time.perf_counter()
        try:
            return self._match(request, shards, keys, start, limit, num_computed_tokens)
        finally:
            r.lookups += 1
            r.lookup_s += time.perf_counter() - t0

    def _match(self, request: Any, shards: list[str], keys: list[BlockKey], start: int, limit: int,
               num_computed_tokens: int) -> tuple[int, bool]:
        """One parallel lookup over ``shards`` for blocks [start, limit): remember the best match."""
        assert self.fingerprint is not None
        bs = self.block_size
        results = self.shards.lookup_many([(s, keys[start:limit]) for s in shards], self.fingerprint,
                                          self.cfg.lookup_deadline_s)
        best_shard, best = "", 0
        for sid, res in zip(shards, results, strict=True):
            if res is None:
                self.stats.lookup_failures += 1
            elif res.prefix > best:
                best_shard, best = sid, res.prefix
        end = start + best
        if best and self.plan.hybrid:
            end = self._state_boundary(best_shard, keys, start, end)
        if end <= start:
            self._matches.pop(request.request_id, None)
            return 0, False
        self._matches[request.request_id] = _Match(best_shard, start, end)
        return end * bs - num_computed_tokens, True

    def _state_boundary(self, shard_id: str, keys: list[BlockKey], start: int, end: int) -> int:
        """Furthest boundary in (start, end] whose state snapshot the shard holds; ``start`` if none."""
        assert self.fingerprint is not None
        boundaries = list(range(end, start, -1))
        res = self.shards.lookup_many([(shard_id, [state_key(keys[k - 1])]) for k in boundaries], self.fingerprint,
                                      self.cfg.lookup_deadline_s)
        for k, r in zip(boundaries, res, strict=True):
            if r is not None and r.prefix == 1:
                return k
        return start

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        r = self._track(request)
        r.loaded_at = request.num_preemptions
        bs = self.block_size
        block_ids = blocks.get_block_ids()
        keys = self._keys(r)
        if match is None or (match.end - match.start) * bs != num_external_tokens:
            # vLLM trimmed the hit (or we lost the match): we cannot vouch for these tokens → fail the whole load,
            # vLLM recomputes the request from scratch.
            log.warning("kvpool connector: %s: unexpected external token count %d (match %s)",
                        request.request_id, num_external_tokens, match)
            self._pending_loads.append(LoadSpec(request.request_id, "", "", "", -1, [], None, True))
            return
        lease_keys: list[bytes] = list(keys[match.start : match.end])
        if self.plan.hybrid:
            lease_keys.append(state_key(keys[match.end - 1]))
        reply = None
        t0 = time.perf_counter()
        try:
            reply = self.shards.client(match.shard_id).lease(lease_keys, self.fingerprint, self.cfg.lease_ttl_s)
        except Exception as exc:  # ShardUnavailableError, a dead actor, a bad reply: the load fails, vLLM recomputes
            log.warning("kvpool connector: lease on %s failed: %s", match.shard_id, exc)
            self.shards.forget(match.shard_id)
        lease_s = time.perf_counter() - t0
        r.lease_s += lease_s
        leased = list(reply.lease.blocks) if reply is not None else []
        r.loaded_tokens += len(leased[: match.end - match.start]) * bs
        if reply is not None and reply.lease.lease_id:
            r.leases.append(_Lease(match.shard_id, reply.lease.lease_id, self._step))
            self.stats.leases_taken += 1
            self.stats.note(f"lease {request.request_id} {match.shard_id} {reply.lease.lease_id}")
        if len(leased) < len(lease_keys):
            self.stats.leases_short += 1
            if self.plan.hybrid and reply is not None and reply.lease.lease_id:
                self._release(request.request_id, "short", only=reply.lease.lease_id)  # useless without the state
        self._queue_load(request.request_id, match.shard_id, reply, match.start, match.end, block_ids, leased, lease_s)

    def _queue_load(self, req_id: str, shard_id: str, reply: Any, start: int, end: int,
                    block_ids: tuple[list[int], ...], leased: list[Any], lease_s: float) -> None:
        loads: list[LoadBlock] = []
        for i in range(start, end):
            j = i - start
            remote = RemoteBlock(leased[j].offset, leased[j].length, leased[j].checksum) if j < len(leased) else None
            loads.append(LoadBlock({g: block_ids[g][i] for g in self.plan.block_groups}, remote))
        state: LoadBlock | None = None
        if self.plan.hybrid:
            n = end - start
            remote = RemoteBlock(leased[n].offset, leased[n].length, leased[n].checksum) if len(leased) > n else None
            state = LoadBlock({g: block_ids[g][end - 1] for g in self.plan.state_groups}, remote)
        self._pending_loads.append(LoadSpec(
            req_id=req_id,
            shard_id=shard_id,
            agent_name=reply.agent_name if reply is not None else "",
            shard_epoch=reply.epoch if reply is not None else "",
            region_id=reply.region_id if reply is not None else -1,
            blocks=loads,
            state=state,
            all_or_nothing=self.plan.hybrid,
            lease_s=lease_s,
            ssd_blocks=sum(1 for b in leased if b.from_tier is Tier.SSD),
        ))
        self.stats.loads_planned += 1
        self.stats.blocks_to_load += len(loads)
        self.stats.hit_tokens += len(loads) * self.block_size

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, so: Any) -> KvPoolMetadata:
        # A request preempted in this step may have been re-admitted (and leased again) in the same schedule()
        # call: release only the leases of earlier steps.
        for rid in so.preempted_req_ids or ():
            r = self._reqs.get(rid)
            if r is not None:
                if any(lease.step < self._step for lease in r.leases):
                    self.stats.preempted_releases += 1
                    self._release(rid, "preempted", before_step=self._step)
                if not any(lease.step == self._step for lease in r.leases):
                    r.save_from = None
        saves: list[SaveSpec] = []
        if self.cfg.save and self.plan.usable and self.fingerprint is not None and self.shards.local_shard_id():
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
        r = self._reqs.get(rid)
        if r is None or scheduled <= 0 or r.request.prompt_token_ids is None or self._kv_cache_manager is None:
            return
        bs = self.block_size
        if first or r.save_from is None:
            r.save_from = computed // bs
        keys = self._keys(r)
        end = computed + scheduled
        prompt = r.request.num_prompt_tokens
        full = min(min(end, prompt) // bs, len(keys))
        if full <= r.save_from and not (self.plan.hybrid and end % bs == 0):
            return
        table = self._kv_cache_manager.get_block_ids(rid)
        null = self._kv_cache_manager.block_pool.null_block.block_id
        save_keys: list[bytes] = []
        save_blocks: list[dict[int, int]] = []
        for i in range(r.save_from, full):
            key = bytes(keys[i])
            ids = {g: table[g][i] for g in self.plan.block_groups}
            if key in self._recent or null in ids.values():
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
            if candidate not in self._recent and len(ids) == len(self.plan.state_groups) and null not in ids.values():
                skey, sblock = candidate, ids
        if not save_keys and skey is None:
            return
        for key in save_keys + ([skey] if skey else []):
            self._recent[key] = None
        while len(self._recent) > RECENT_SAVES:
            self._recent.popitem(last=False)
        self.stats.blocks_to_save += len(save_keys)
        self.stats.states_to_save += int(skey is not None)
        out.append(SaveSpec(rid, save_keys, save_blocks, skey, sblock))

    # ------------------------------------------------------------------ endings
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's leases; its blocks are freed at once (saves copy what they need). Returns, for
        the final output's ``kv_transfer_params``, what the pool calls cost it (``PoolRequestTiming``)."""
        rid = request.request_id
        self._release(rid, "finished")
        r = self._reqs.pop(rid, None)
        self._matches.pop(rid, None)
        if r is None or not r.lookups:
            return False, None
        timing = PoolRequestTiming(lookups=r.lookups, lookup_s=r.lookup_s, lease_s=r.lease_s,
                                   loaded_tokens=r.loaded_tokens)
        return False, to_params(timing)

    def _release(self, rid: str, why: str, *, before_step: int | None = None, only: int | None = None) -> None:
        """Release the request's leases (all, those taken before ``before_step``, or the one ``only``)."""
        r = self._reqs.get(rid)
        if r is None:
            return
        keep: list[_Lease] = []
        for lease in r.leases:
            if (before_step is not None and lease.step >= before_step) or (only is not None and lease.lease_id != only):
                keep.append(lease)
                continue
            try:
                self.shards.client(lease.shard_id).release(lease.lease_id)
                self.stats.leases_released += 1
                self.stats.note(f"release {rid} {lease.shard_id} {lease.lease_id} {why}")
            except Exception as exc:  # the lease expires on its own (ttl); never fail a request over a release
                self.stats.release_failures += 1
                log.warning("kvpool connector: release of lease %s on %s failed: %s", lease.lease_id,
                            lease.shard_id, exc)
        r.leases = keep

    def held_leases(self) -> dict[str, list[tuple[str, int]]]:
        """Request id → [(shard, lease id)] currently held (tests, debugging)."""
        return {rid: [(x.shard_id, x.lease_id) for x in r.leases] for rid, r in self._reqs.items() if r.leases}
