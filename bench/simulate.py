"""Discrete-event cluster simulator: N nodes × replicas, HBM prefix caches, a DRAM/SSD KV pool per node, and the
real ``router.policies`` code (``make_policy`` + ``PolicyRunner``) deciding every request.

Who calls what: ``bench.simulate_cli`` (``kvstack simulate``) and ``bench.compare_cli`` build a ``SimConfig`` and
call ``simulate(records, config)`` with Mooncake-format ``TraceRecord``s (a real trace or
``bench.agent.workload_trace``); they get a ``SimResult`` whose ``to_json()`` is the CLI output.

One request, at its arrival time t (requests are processed in arrival order, ties in trace order):
1. pool commits finished by t become visible (blocks a prefill wrote to its node's shard);
2. its hash ids are interned into chained prefix ids (block ``i`` names the whole prefix up to ``i``);
3. one index walk gives every cache's prefix length; the policy sees ``ReplicaState``s (running, waiting, queue
   delay = the replica's backlog in seconds, HBM prefix) and ``PoolHit``s (shard, tier, prefix, link backlog);
4. ``PolicyRunner.decide`` returns the action, replica and fetch plan; the simulator applies it:
   HBM reuse is what the replica holds (the engine's own prefix cache reuses it whatever the router says);
   FETCH moves blocks [max(start, hbm), end) over the tier ``TierMap`` names (same node or not); without a planned
   FETCH / SPLIT the replica's connector loads the longest pool prefix beyond its HBM prefix on its own, as the live
   connector does (``connector_pick``; ``connector_fetch=False``: only planned fetches);
   SPLIT runs as the replicas run it (``deployments.split_staging``): the head [hbm, start) is computed while the
   tail [start, end) is pulled to the replica's node, then the tail is loaded from the node's DRAM (a tail already
   on the node is loaded after the head);
   service = fetch + prefill of the rest (``router.cost.t_fetch`` / ``t_prefill``, or the live engine's measured
   prefill time: ``engine_cost``) + ``prefill_overhead_s``, FIFO
   per replica (``engine_sharing="batch"``: every prefill in flight shares the replica's compute evenly, as vLLM's
   continuous batching does; ``_ps_advance``); TTFT = queue wait + service + ``request_overhead_s``;
5. the request's blocks enter the replica's HBM cache (LRU) at dispatch; the blocks it computed are written to
   its node's shard when its prefill ends (``pool_write``), evicting LRU blocks from DRAM to SSD. With
   ``pool_touch`` (default, as the replicas do) the blocks it reused from HBM are refreshed in its node's shard.
6. with ``kv_admission`` (batch engines only) a dispatched prompt waits until its blocks fit in the replica's KV
   cache (``bench.sim_kv``: the blocks its admitted requests hold until their decode ends), and every replica
   reports its occupancy as the live ones do (``deployments.kv_occupancy``'s tracker, fed at dispatch, first token
   and decode end), so the router's ``ReplicaState.kv`` is what a live router would see. A waiting prompt counts as
   waiting with its work queued; its fetch is priced from its dispatch (a simplification).

Hit accounting is token-weighted over a trace's hash-id blocks, the last (partial) block included, so with
unbounded caches and one replica the hit rate equals the trace's own bound (``bench.traces.prefix_reuse_bound``).
Policies themselves only count full blocks (``router.policies.pricing.clamp_blocks``).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from bench.engine_fit import EngineCost
from bench.sim_cluster import SimCluster, SimReplica
from bench.sim_kv import KvHold, SimKvCache, hold_of
from bench.stats import summarize
from bench.traces import TraceRecord
from deployments.kv_occupancy import KvOccupancyTracker
from kvpool.keys import BlockKey
from router.cost import GIB, Hardware, kv_bytes_per_token, t_fetch, t_prefill
from router.policies.base import Action, ClusterSnapshot, PoolHit, RouteRequest
from router.policies.pricing import TierMap
from router.policies.runner import PolicyRunner, make_policy

PoolWrite = Literal["computed", "all", "none"]
TIER_KEYS = ("hbm", "dram_local", "dram_remote", "ssd_local", "ssd_remote")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What to simulate. Capacities are tokens (``math.inf`` = unbounded, 0 = none); pool capacities per node."""

    nodes: int
    policy: str
    hw: Hardware
    tier_map: TierMap
    replicas_per_node: int = 1
    hbm_tokens: float = math.inf
    pool_dram_tokens: float = 0.0
    pool_ssd_tokens: float = 0.0
    pool_write: PoolWrite = "computed"
    pool_touch: bool = True  # HBM hits refresh the node shard's copies (``deployments.replica``)
    seed: int = 0
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    anti_herding: bool = False
    # Costs the live path has and the cost model's FLOPs do not (``bench.sim_live`` measures them): added to every
    # prefill's service time (the engine's fixed cost per prefill: scheduling, sampling, the connector's calls on the
    # scheduler's thread), and to every TTFT outside the replica (ingress, transport to and from the replica).
    prefill_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    # How a replica runs the prefills it was given: "fifo", one after another (the default); "batch", all in flight
    # at once sharing its compute evenly (vLLM's continuous batching with chunked prefill: what ``bench.sim_live``
    # compares with a live engine).
    engine_sharing: Literal["fifo", "batch"] = "fifo"
    # The replicas' connector loads the longest pool prefix beyond the HBM prefix when the router planned no fetch
    # (what the live replicas do: ``connector_pick``); False: only the router's FETCH / SPLIT plans move blocks.
    connector_fetch: bool = True
    # The engine admits a request only when its KV fits in the replica's KV cache (``hbm_tokens``), as vLLM does
    # (``bench.sim_kv``), and each replica reports its occupancy to the router as the live ones do (``KvAdmission``
    # in its state: cost_based prices the wait). Needs engine_sharing "batch"; without a bound on hbm_tokens, a no-op.
    kv_admission: bool = False
    # The engine's prefill time as a live run measured it (``bench.engine_fit``, fitted by ``bench.sim_live``): the
    # simulated prefills take that long; None: the cost model's FLOPs at ``hw.mfu``. The policy prices with ``hw``
    # either way, as the live router does.
    engine_cost: EngineCost | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.replicas_per_node < 1:
            raise ValueError(f"need nodes >= 1 and replicas_per_node >= 1, got {self.nodes}, {self.replicas_per_node}")
        for name in ("hbm_tokens", "pool_dram_tokens", "pool_ssd_tokens"):
            v = getattr(self, name)
            if v < 0 or math.isnan(v):
                raise ValueError(f"{name} must be >= 0 (math.inf for unbounded), got {v}")
        for name in ("prefill_overhead_s", "request_overhead_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.engine_sharing not in ("fifo", "batch"):
            raise ValueError(f"engine_sharing must be fifo or batch, got {self.engine_sharing!r}")
        if self.kv_admission and self.engine_sharing != "batch":
            raise ValueError("kv_admission needs engine_sharing='batch' (a FIFO engine admits one request at a time)")
        if self.pool_write not in ("computed", "all", "none"):
            raise ValueError(f"pool_write must be computed, all or none, got {self.pool_write!r}")

    def describe(self) -> dict[str, Any]:
        def cap(v: float) -> float | str:
            return "inf" if math.isinf(v) else v

        return {
            "nodes": self.nodes,
            "replicas_per_node": self.replicas_per_node,
            "policy": self.policy,
            "policy_options": dict(self.policy_options),
            "model": self.hw.model.name,
            "gpu": self.hw.gpu.name,
            "mfu": self.hw.mfu,
            "bw_util": self.hw.bw_util,
            "gpus_per_replica": self.hw.gpus,
            "hbm_tokens": cap(self.hbm_tokens),
            "pool_dram_tokens": cap(self.pool_dram_tokens),
            "pool_ssd_tokens": cap(self.pool_ssd_tokens),
            "pool_write": self.pool_write,
            "pool_touch": self.pool_touch,
            "tiers": {
                "dram_local": self.tier_map.dram_local.name,
                "dram_remote": self.tier_map.dram_remote.name,
                "ssd_local": self.tier_map.ssd_local.name,
                "ssd_remote": self.tier_map.ssd_remote.name,
            },
            "seed": self.seed,
            "anti_herding": self.anti_herding,
            "prefill_overhead_s": self.prefill_overhead_s,
            "request_overhead_s": self.request_overhead_s,
            "connector_fetch": self.connector_fetch,
            "engine_sharing": self.engine_sharing,
            "kv_admission": self.kv_admission,
            "engine_cost": None if self.engine_cost is None else self.engine_cost.to_json(),
        }


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    requests: int
    prompt_tokens: int
    hit_tokens: dict[str, int]
    ttft_s: np.ndarray
    predicted_ttft_s: np.ndarray
    prefill_gpu_s: float
    fetch_s: float
    fetch_bytes: dict[str, float]
    decisions: dict[str, int]
    decision_latency_s: np.ndarray
    makespan_s: float
    wall_s: float
    evicted_tokens: dict[str, int]
    per_replica_requests: list[int]
    replica_busy_s: float

    @property
    def token_hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    def hit_rate_by_tier(self) -> dict[str, float]:
        p = self.prompt_tokens or 1
        h = self.hit_tokens
        return {
            "hbm": h["hbm"] / p,
            "dram": (h["dram_local"] + h["dram_remote"]) / p,
            "ssd": (h["ssd_local"] + h["ssd_remote"]) / p,
        }

    def to_json(self) -> dict[str, Any]:
        ttft = summarize(self.ttft_s)
        err = self.ttft_s - self.predicted_ttft_s
        lat = summarize(self.decision_latency_s * 1e6)
        loads = np.asarray(self.per_replica_requests, dtype=float)
        return {
            "schema": "kvstack.simulate/v1",
            "config": self.config.describe(),
            "policy": self.config.policy,
            "nodes": self.config.nodes,
            "replicas": self.config.nodes * self.config.replicas_per_node,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "token_hit_rate": self.token_hit_rate,
            "hit_rate_by_tier": self.hit_rate_by_tier(),
            "hit_tokens_by_tier": dict(self.hit_tokens),
            "ttft_p50_s": ttft["p50"],
            "ttft_p90_s": ttft["p90"],
            "ttft_p99_s": ttft["p99"],
            "ttft_mean_s": ttft["mean"],
            "prefill_gpu_s": self.prefill_gpu_s,
            "fetch_s": self.fetch_s,
            "fetch_bytes_by_tier": dict(self.fetch_bytes),
            "decisions": dict(self.decisions),
            "prediction_error_s": {k: summarize(np.abs(err))[k] for k in ("p50", "p99", "mean")},
            "decision_latency_us": {k: lat[k] for k in ("p50", "p99", "mean")},
            "evicted_tokens": dict(self.evicted_tokens),
            "replica_load_cv": float(loads.std() / loads.mean()) if loads.size and loads.mean() > 0 else 0.0,
            "replica_busy_fraction": (
                self.replica_busy_s / (loads.size * self.makespan_s) if loads.size and self.makespan_s > 0 else 0.0
            ),
            "makespan_s": self.makespan_s,
            "wall_s": self.wall_s,
        }


class _Interner:
    """(parent prefix id, hash id) -> chained prefix id: equal ids mean equal prefixes, like block keys."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def chain(self, hash_ids: Sequence[int]) -> list[int]:
        ids = self._ids
        out = []
        parent = -1
        for h in hash_ids:
            key = (parent, h)
            pid = ids.get(key)
            if pid is None:
                pid = ids[key] = len(ids)
            out.append(pid)
            parent = pid
        return out


def _decode_step_s(hw: Hardware, context_tokens: int) -> float:
    """One memory-bound decode step: weights plus the context's KV read once from HBM at BW_util."""
    weights = hw.model.params * hw.model.bytes_per_elem
    kv = context_tokens * kv_bytes_per_token(hw.model) + hw.model.linear_state_bytes()
    return (weights / hw.gpus + kv) / (hw.bw_util * hw.gpu.hbm_gbps * 1e9)


def default_hbm_tokens(hw: Hardware, *, gpu_memory_utilization: float = 0.9) -> float:
    """KV tokens one replica's HBM holds after the weights (vLLM's gpu_memory_utilization convention)."""
    free = hw.gpus * hw.gpu.hbm_gib * GIB * gpu_memory_utilization - hw.model.params * hw.model.bytes_per_elem
    return max(0.0, free / kv_bytes_per_token(hw.model))


def simulate(records: Sequence[TraceRecord], config: SimConfig) -> SimResult:
    """Run the trace through the simulated cluster; deterministic for a given ``config.seed``."""
    wall0 = time.perf_counter()
    hw = config.hw
    tiers = config.tier_map
    cluster = SimCluster(
        nodes=config.nodes,
        replicas_per_node=config.replicas_per_node,
        hw=hw,
        hbm_tokens=config.hbm_tokens,
        pool_dram_tokens=config.pool_dram_tokens,
        pool_ssd_tokens=config.pool_ssd_tokens,
    )
    if config.kv_admission and math.isfinite(config.hbm_tokens) and config.hbm_tokens >= 1 and records:
        block_tokens = records[0].block_tokens
        for r in cluster.replicas:
            r.kv = SimKvCache(int(config.hbm_tokens), block_tokens)
            r.tracker = KvOccupancyTracker(block_tokens, int(config.hbm_tokens))
    now = 0.0
    policy = make_policy(
        config.policy, rng=random.Random(config.seed), tier_map=tiers, **dict(config.policy_options)
    )
    runner = PolicyRunner(
        policy,
        rng=random.Random(config.seed + 1),
        anti_herding=config.anti_herding,
        clock=lambda: now,
    )
    interner = _Interner()
    model, gpu = hw.model, hw.gpu
    kvb = kv_bytes_per_token(model)

    def prefill_s(tokens: int, cached: int) -> float:
        """A simulated prefill's compute: the measured engine's (``SimConfig.engine_cost``) or the cost model's."""
        if config.engine_cost is not None:
            return config.engine_cost.prefill_s(tokens, cached)
        return t_prefill(model, gpu, tokens, mfu=hw.mfu, gpus=hw.gpus, cached_tokens=cached, attn_scale=hw.attn_scale)

    n = len(records)
    ttfts = np.empty(n)
    preds = np.empty(n)
    lat = np.empty(n)
    hit = dict.fromkeys(TIER_KEYS, 0)
    fetch_bytes = dict.fromkeys(TIER_KEYS[1:], 0.0)
    decisions: Counter[str] = Counter()
    prefill_gpu_s = fetch_s = 0.0
    prompt_total = 0
    per_replica = [0] * cluster.n_replicas
    commits: list[tuple[float, int, int, list[int], list[int]]] = []  # (time, seq, shard, blocks, tokens)
    seq = 0
    classes = {("dram", True): "dram_local", ("dram", False): "dram_remote",
               ("ssd", True): "ssd_local", ("ssd", False): "ssd_remote"}
    replicas = cluster.replicas

    shared = config.engine_sharing == "batch"
    makespan = 0.0

    def finish(rep: SimReplica, job: _Job, end_t: float) -> None:
        """What a prefill's end decides: its TTFT, its decode, its blocks' commit to the node's shard."""
        nonlocal seq, makespan
        ttfts[job.k] = end_t - job.arrival + config.request_overhead_s
        decode_end = end_t + job.output_length * _decode_step_s(hw, job.prompt + job.output_length // 2)
        heapq.heappush(rep.decodes, decode_end)
        makespan = max(makespan, decode_end)
        if job.hold is not None and rep.kv is not None and rep.tracker is not None:
            rep.kv.finish(job.hold, decode_end)
            rep.tracker.generated(_kv_id(job), 1, end_t)
            rep.kv_stale = True
        if job.new_blocks:
            heapq.heappush(commits, (end_t, seq, rep.shard_index, job.new_blocks, job.new_tokens))
            seq += 1

    def advance(rep: SimReplica, t: float) -> None:
        """Run ``rep``'s batch engine up to ``t``; with KV admission, decode ends free KV and admit the requests
        waiting for it, in time order with the prefills' ends (a prefill's end makes its decode end known)."""
        kv = rep.kv
        if kv is None:
            _ps_advance(rep, t, finish)
            return
        while True:
            r = kv.next_end()
            if _ps_step(rep, min(t, r), finish):
                continue
            if r > t or math.isinf(r):
                return
            for hold in kv.release(r):
                _kv_ended(rep, hold, r)
            admit(rep, r)

    def admit(rep: SimReplica, at: float) -> None:
        """The requests waiting for KV on ``rep`` that fit at ``at`` start their prefill then."""
        assert rep.kv is not None
        for hold in rep.kv.admit():
            _ps_start(rep, hold.job, at)

    for k, rec in enumerate(records):
        now = rec.timestamp_s
        if shared:
            for rep in replicas:
                if rep.ps_jobs or (rep.kv is not None and rep.kv.busy()):
                    advance(rep, now)
                    _ps_queue(rep, now)
        while commits and commits[0][0] <= now:
            _t, _s, shard_i, done_blocks, done_tokens = heapq.heappop(commits)
            cluster.shards[shard_i].commit(done_blocks, done_tokens)
        blocks = interner.chain(rec.hash_ids)
        lengths = rec.block_lengths()
        prompt = rec.input_length
        prompt_total += prompt
        prefix = cluster.prefix_blocks(blocks)
        get = prefix.get
        states = cluster.replica_states(prefix, now)
        hits = cluster.pool_hits(prefix, now) if cluster.pool_enabled else []
        request = RouteRequest(
            request_id=f"r{rec.index}",
            prompt_tokens=prompt,
            block_size=rec.block_tokens,
            block_keys=[BlockKey(b.to_bytes(16, "little")) for b in blocks],
        )
        d = runner.decide(request, ClusterSnapshot(states, hits))
        rep: SimReplica = cluster.replica_by_id[d.replica_id]
        hbm_blocks = get(rep.index, 0)
        cum = _cumsum(lengths)
        cached_blocks = hbm_blocks
        head_blocks = hbm_blocks  # blocks [hbm_blocks, head_blocks) computed by a SPLIT's head
        hit["hbm"] += cum[hbm_blocks]
        service = 0.0
        fetch_t = 0.0
        start = now if shared or rep.free_at <= now else rep.free_at  # batch: a prefill starts on arrival
        plan = d.fetch
        source: tuple[str, str, int, int] | None = None  # (shard id, storage tier, first block, end block)
        if plan is not None and d.action in (Action.FETCH, Action.SPLIT):
            source = (plan.shard_id, plan.tier, plan.start_block, plan.end_block)
        elif config.connector_fetch and hits:
            own = connector_pick(hits, hbm_blocks, (prompt - 1) // rec.block_tokens, rep.node_id)
            if own is not None:
                source = (own.shard_id, own.tier, hbm_blocks, min(own.prefix_blocks, (prompt - 1) // rec.block_tokens))
        if source is not None:
            shard = cluster.shard_by_id[source[0]]
            same = shard.node_id == rep.node_id
            tier_key = classes[(source[1], same)]
            tier = tiers.tier(source[1], same)
            first = max(source[2], hbm_blocks)
            end = min(source[3], len(blocks))
            if end > first:
                moved = cum[end] - cum[first]
                xfer = t_fetch(model, tier, moved, bw_util=hw.bw_util)
                link_start = start if shard.link_free_at <= start else shard.link_free_at
                shard.link_free_at = link_start + xfer
                fetch_t = (link_start - start) + xfer
                fetch_s += xfer
                fetch_bytes[tier_key] += moved * kvb
                hit[tier_key] += moved
                shard.tier(source[1]).touch(blocks[first:end])
                if d.action == Action.SPLIT and first > hbm_blocks:
                    # head [hbm, first) computed while the tail is pulled to the node, then the tail loaded from
                    # the node's shard (a tail on the node already: head, then load); the head's KV is not a hit
                    head = prefill_s(cum[first], cum[hbm_blocks])
                    prefill_gpu_s += head
                    if same:
                        service = head + fetch_t
                    else:
                        reload = t_fetch(model, tiers.tier("dram", True), moved, bw_util=hw.bw_util)
                        fetch_s += reload
                        service = max(head, fetch_t) + reload
                    head_blocks = first
                else:
                    service = fetch_t
                cached_blocks = end
        compute = prefill_s(prompt, cum[cached_blocks])
        prefill_gpu_s += compute
        service += compute + config.prefill_overhead_s
        rep.prefill_busy_s += service
        preds[k] = d.predicted_ttft_s
        lat[k] = d.decision_latency_s
        decisions[str(d.action)] += 1
        per_replica[rep.index] += 1
        rep.hbm.admit(blocks, lengths)
        if cluster.pool_enabled and config.pool_touch and hbm_blocks:
            node_shard = cluster.shards[rep.shard_index]
            node_shard.dram.touch(blocks[:hbm_blocks])
            node_shard.ssd.touch(blocks[:hbm_blocks])
        new_blocks: list[int] = []
        new_tokens: list[int] = []
        if cluster.pool_enabled and config.pool_write != "none":
            if config.pool_write == "all":
                new_blocks, new_tokens = blocks, lengths
            else:  # what this prefill computed: a SPLIT's head and everything after the reused prefix
                new_blocks = blocks[hbm_blocks:head_blocks] + blocks[cached_blocks:]
                new_tokens = lengths[hbm_blocks:head_blocks] + lengths[cached_blocks:]
        job = _Job(k, now, rec.output_length, prompt, new_blocks, new_tokens, service)
        if shared:
            if rep.kv is not None and rep.tracker is not None:  # it waits until its KV fits
                job.hold = hold_of(blocks, prompt, rec.block_tokens, job)
                rep.kv.request(job.hold)
                rep.tracker.start(_kv_id(job), request.block_keys[:len(job.hold.blocks)], prompt, rec.output_length)
                rep.kv_stale = True
                admit(rep, now)
            else:  # an idle engine starts it now (a busy one was advanced to now above)
                _ps_start(rep, job, now)
            _ps_queue(rep, now)
            cluster.mark_busy(rep)
        else:
            end_t = start + service
            rep.free_at = end_t
            cluster.mark_busy(rep)
            rep.prefills.append((start, end_t))
            finish(rep, job, end_t)

    if shared:  # the prefills still running (or waiting for KV) at the end of the trace
        for rep in replicas:
            advance(rep, math.inf)
    evicted = {"hbm": sum(r.hbm.evicted_tokens for r in replicas)}
    if cluster.pool_enabled:
        evicted["dram"] = sum(s.dram.evicted_tokens for s in cluster.shards)
        evicted["ssd"] = sum(s.ssd.evicted_tokens for s in cluster.shards)
    return SimResult(
        config=config,
        requests=n,
        prompt_tokens=prompt_total,
        hit_tokens=hit,
        ttft_s=ttfts,
        predicted_ttft_s=preds,
        prefill_gpu_s=prefill_gpu_s,
        fetch_s=fetch_s,
        fetch_bytes=fetch_bytes,
        decisions=dict(decisions),
        decision_latency_s=lat,
        makespan_s=makespan,
        wall_s=time.perf_counter() - wall0,
        evicted_tokens=evicted,
        per_replica_requests=per_replica,
        replica_busy_s=sum(r.prefill_busy_s for r in replicas),
    )


@dataclass(slots=True)
class _Job:
    """A dispatched prefill, until its end is known."""

    k: int  # index of the request in the trace
    arrival: float
    output_length: int
    prompt: int
    new_blocks: list[int]  # what it computed, committed to the node's shard when it ends
    new_tokens: list[int]
    service: float = 0.0  # its solo service time (fetch + prefill)
    hold: KvHold | None = None  # its KV (``SimConfig.kv_admission``)


def _kv_id(job: _Job) -> str:
    return f"k{job.k}"


def _kv_ended(rep: SimReplica, hold: KvHold, at: float) -> None:
    """``hold``'s request decoded its last token at ``at``: the replica's tracker learns it, as the live one does."""
    job: _Job = hold.job
    if rep.tracker is not None:
        if job.output_length > 1:
            rep.tracker.generated(_kv_id(job), job.output_length - 1, at)
        rep.tracker.end(_kv_id(job), at)
        rep.kv_stale = True


def _ps_advance(rep: SimReplica, t: float, finish: Any) -> None:
    """Run ``rep``'s shared engine up to ``t``: the prefills in flight split its compute evenly (vLLM's continuous
    batching); each that completes is ``finish``ed at its end time."""
    while _ps_step(rep, t, finish):
        pass


def _ps_start(rep: SimReplica, job: _Job, at: float) -> None:
    """``job``'s prefill joins ``rep``'s shared engine at ``at`` (an idle engine's clock starts then)."""
    if not rep.ps_jobs:
        rep.ps_t = at
    rep.ps_jobs.append([job.service, job])


def _ps_step(rep: SimReplica, t: float, finish: Any) -> bool:
    """Run ``rep``'s shared engine until its next prefills complete (True: ``finish``ed at their end time, the
    engine's time is then) or until ``t`` (False)."""
    jobs, tt = rep.ps_jobs, rep.ps_t
    if not jobs:
        if math.isfinite(t):
            rep.ps_t = max(tt, t)
        return False
    n = len(jobs)
    m = min(j[0] for j in jobs)
    if tt + m * n <= t:
        tt += m * n
        for j in jobs:
            j[0] -= m
        done = [j for j in jobs if j[0] <= 1e-12]
        jobs[:] = [j for j in jobs if j[0] > 1e-12]
        rep.ps_t = tt
        for j in done:
            finish(rep, j[1], tt)
        return True
    step = (t - tt) / n
    for j in jobs:
        j[0] -= step
    rep.ps_t = t
    return False


def _ps_queue(rep: SimReplica, now: float) -> None:
    """What the router sees of a shared engine: every prefill in flight running, the work left as its queue (the
    prefills waiting for KV waiting, their work queued behind)."""
    waiting = rep.kv.waiting_holds() if rep.kv is not None else ()
    rep.free_at = now + sum(j[0] for j in rep.ps_jobs) + sum(h.job.service for h in waiting)
    rep.prefills.clear()
    rep.prefills.extend((now, rep.free_at) for _ in rep.ps_jobs)
    rep.prefills.extend((math.inf, rep.free_at) for _ in waiting)


def connector_pick(hits: Sequence[PoolHit], hbm_blocks: int, limit: int, node_id: str) -> PoolHit | None:
    """The pool hit a replica's connector loads when the router planned no fetch (``kvpool.connector.scheduler``:
    it looks every shard up for the blocks beyond its HBM prefix, at most ``limit`` full blocks, and loads the
    longest run): the longest prefix beyond ``hbm_blocks``; a tie goes to the replica's own node, then to DRAM."""
    best: PoolHit | None = None
    for h in hits:
        if min(h.prefix_blocks, limit) <= hbm_blocks:
            continue
        if best is None or (min(h.prefix_blocks, limit), h.node_id == node_id, h.tier == "dram") > (
                min(best.prefix_blocks, limit), best.node_id == node_id, best.tier == "dram"):
            best = h
    return best


def _cumsum(lengths: Sequence[int]) -> list[int]:
    out = [0]
    acc = 0
    for x in lengths:
        acc += x
        out.append(acc)
    return out
