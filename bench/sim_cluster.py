"""The simulated cluster's state: replicas (HBM prefix cache + FIFO prefill queue + decodes) and pool shards
(DRAM + SSD per node, with an outbound link that serialises transfers).

Mechanism only, no routing: ``bench.simulate`` asks it for the policy's view (``replica_state``, ``pool_hits``)
and applies the chosen action's effects. Time is simulated seconds; nothing here reads a clock.

Service model (what ``router.cost.ttft`` assumes, so predictions and outcomes differ only by what the policy
could not see):
- a replica prefills one request at a time, FIFO; a request's service is its fetch (layer-wise loading blocks the
  forward pass) plus the prefill of the uncached part; TTFT = queue wait + service;
- decode runs after prefill and does not delay later prefills (disaggregated / chunked-prefill assumption); its
  duration is ``output_tokens × t_step`` with a memory-bound step (weights + context KV read from HBM once);
- a shard's outbound link moves one transfer at a time (reservation order), so hot shards queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.sim_cache import BlockCache, BlockHolders
from bench.sim_kv import SimKvCache
from deployments.kv_occupancy import KvOccupancyTracker
from router.cost import Hardware
from router.kv_admission import KvAdmission
from router.policies.base import PoolHit, ReplicaState, StorageTier


@dataclass(slots=True)
class SimReplica:
    index: int
    replica_id: str
    node_id: str
    hw: Hardware
    hbm: BlockCache
    shard_index: int  # the pool shard on this replica's node
    free_at: float = 0.0
    # (start, end) of prefills scheduled on this replica and not yet finished at the last query, FIFO.
    prefills: deque[tuple[float, float]] = field(default_factory=deque)
    decodes: list[float] = field(default_factory=list)  # heap of decode end times
    prefill_busy_s: float = 0.0
    # engine_sharing "batch" (bench.simulate): [solo seconds left, job] of the prefills in flight, and when they
    # were last advanced
    ps_jobs: list[list[Any]] = field(default_factory=list)
    ps_t: float = 0.0
    # ``SimConfig.kv_admission``: the engine's KV admission, and what the replica reports of it (as the live replica
    # does: ``deployments.kv_occupancy``), rebuilt into ``kv_view`` when the tracker changed (``kv_stale``)
    kv: SimKvCache | None = None
    tracker: KvOccupancyTracker | None = None
    kv_view: KvAdmission | None = None
    kv_stale: bool = False

    _last: ReplicaState | None = None

    def state(self, now: float, hbm_prefix_blocks: int) -> ReplicaState:
        """The replica as the router sees it at ``now``; the previous object is reused when nothing changed (most
        replicas of a large simulated cluster are idle, and building a frozen dataclass dominates otherwise)."""
        pf = self.prefills
        while pf and pf[0][1] <= now:
            pf.popleft()
        dec = self.decodes
        while dec and dec[0] <= now:
            heapq.heappop(dec)
        waiting = 0
        queue = 0.0
        if pf:
            for start, _end in reversed(pf):
                if start <= now:
                    break
                waiting += 1
            queue = self.free_at - now
        running = len(pf) - waiting + len(dec)
        kv = self.kv_view
        if self.kv_stale and self.tracker is not None:
            occupancy = self.tracker.occupancy()
            kv = self.kv_view = None if occupancy is None else KvAdmission.of(occupancy, now)
            self.kv_stale = False
        last = self._last
        if (
            last is not None
            and last.running == running
            and last.waiting == waiting
            and last.queue_delay_s == queue
            and last.hbm_prefix_blocks == hbm_prefix_blocks
            and last.kv is kv
        ):
            return last
        self._last = last = ReplicaState(
            replica_id=self.replica_id,
            node_id=self.node_id,
            running=running,
            waiting=waiting,
            queue_delay_s=queue,
            hbm_prefix_blocks=hbm_prefix_blocks,
            hw=self.hw,
            kv=kv,
        )
        return last


@dataclass(slots=True)
class SimShard:
    index: int
    shard_id: str
    node_id: str
    dram: BlockCache
    ssd: BlockCache
    link_free_at: float = 0.0

    def tier(self, storage: StorageTier) -> BlockCache:
        return self.dram if storage == "dram" else self.ssd

    def commit(self, blocks: list[int], tokens: list[int]) -> None:
        """Blocks written by a finished prefill: into DRAM (evicting to SSD), or straight to SSD without DRAM."""
        (self.dram if self.dram.enabled else self.ssd).admit(blocks, tokens)


class SimCluster:
    """Replicas and shards over one ``BlockHolders``.

    Cache ids: replica i -> i; shard s -> R+2s (DRAM), R+2s+1 (SSD)."""

    def __init__(
        self,
        *,
        nodes: int,
        replicas_per_node: int,
        hw: Hardware,
        hbm_tokens: float,
        pool_dram_tokens: float,
        pool_ssd_tokens: float,
    ) -> None:
        if nodes < 1 or replicas_per_node < 1:
            raise ValueError(f"need nodes >= 1 and replicas_per_node >= 1, got {nodes}, {replicas_per_node}")
        self.index = BlockHolders()
        self.replicas: list[SimReplica] = []
        self.shards: list[SimShard] = []
        n_rep = nodes * replicas_per_node
        for node in range(nodes):
            node_id = f"node-{node}"
            for j in range(replicas_per_node):
                i = len(self.replicas)
                rid = f"{node_id}/replica-{j}"
                self.replicas.append(SimReplica(i, rid, node_id, hw, BlockCache(i, hbm_tokens, self.index), node))
        self.pool_enabled = pool_dram_tokens > 0 or pool_ssd_tokens > 0
        if self.pool_enabled:
            for node in range(nodes):
                node_id = f"node-{node}"
                ssd = BlockCache(n_rep + 2 * node + 1, pool_ssd_tokens, self.index)
                dram = BlockCache(n_rep + 2 * node, pool_dram_tokens, self.index, spill=ssd if ssd.enabled else None)
                self.shards.append(SimShard(node, f"{node_id}/shard", node_id, dram, ssd))
        self.n_replicas = n_rep
        self.replica_by_id = {r.replica_id: r for r in self.replicas}
        self.shard_by_id = {s.shard_id: s for s in self.shards}
        self._hit_cache: dict[int, PoolHit] = {}
        self._states: list[ReplicaState] = [r.state(0.0, 0) for r in self.replicas]
        self._hbm: list[int] = [0] * n_rep
        self._nonzero: list[int] = []
        self._busy: set[int] = set()

    def prefix_blocks(self, blocks: list[int]) -> dict[int, int]:
        """cache id -> leading blocks held, for every cache holding the first block."""
        return self.index.prefix_blocks(blocks)

    def pool_hits(self, prefix: dict[int, int], now: float) -> list[PoolHit]:
        """Every shard tier holding a prefix of the request, in cache-id order (deterministic); ``PoolHit`` objects
        are reused while a tier's prefix and its link backlog stay the same."""
        n_rep = self.n_replicas
        hits: list[PoolHit] = []
        cache = self._hit_cache
        for cache_id in sorted(c for c in prefix if c >= n_rep):
            blocks = prefix[cache_id]
            s = self.shards[(cache_id - n_rep) >> 1]
            q = s.link_free_at - now
            q = q if q > 0.0 else 0.0
            last = cache.get(cache_id)
            if last is None or last.prefix_blocks != blocks or last.queue_delay_s != q:
                tier: StorageTier = "ssd" if (cache_id - n_rep) & 1 else "dram"
                last = cache[cache_id] = PoolHit(s.shard_id, s.node_id, tier, blocks, q)
            hits.append(last)
        return hits

    def replica_states(self, prefix: dict[int, int], now: float) -> list[ReplicaState]:
        """Every replica's state at ``now`` for a request whose HBM prefixes are ``prefix`` (cache id -> blocks).

        Only replicas that can have changed are recomputed: the busy ones (prefills or decodes pending) and those
        whose HBM prefix differs from the previous request's. The others keep their previous state object.
        """
        n_rep = self.n_replicas
        states = self._states
        hbm = self._hbm
        busy = self._busy
        replicas = self.replicas
        dirty = set(busy)
        for cache_id, blocks in prefix.items():
            if cache_id < n_rep and hbm[cache_id] != blocks:
                dirty.add(cache_id)
        for i in self._nonzero:
            if i not in prefix:
                dirty.add(i)
        nonzero = []
        for i in dirty:
            r = replicas[i]
            h = prefix.get(i, 0)
            states[i] = r.state(now, h)
            hbm[i] = h
            if not (r.prefills or r.decodes):
                busy.discard(i)
        for cache_id in prefix:
            if cache_id < n_rep:
                nonzero.append(cache_id)
        self._nonzero = nonzero
        return list(states)

    def mark_busy(self, replica: SimReplica) -> None:
        """A request was dispatched to ``replica``: recompute its state until its work drains."""
        self._busy.add(replica.index)
