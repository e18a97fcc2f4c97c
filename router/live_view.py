"""LiveView: the ingress's cluster view and decision loop, glued from the hub stream, the index and the runner.

Who calls what (all inside one ``router.ingress.OpenAIIngress`` replica, on its event loop):
- ``run()`` is a background task: it polls the ``ClusterViewHub`` (``router.hub``) every ``poll_interval_s`` with
  an awaited actor call (never a blocking ``ray.get``), applies replica reports to the ``router.index`` view and
  acknowledges this router's in-flight assignments that the reports now count (anti-herding, see
  ``router.policies.runner``). Replicas not heard from within ``replica_ttl_s`` are dropped by the index.
- ``decide(request_id, token_ids)`` computes block keys (``kvpool.keys``) and builds a ``ClusterSnapshot``
  (per-replica HBM prefix, pool hits, load, calibrated hardware) and returns the ``Routed`` decision for the wire.
- ``record_first_token`` records the actual TTFT (regret, calibration); ``request_done`` closes the assignment.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from configs import load_gpus, load_models, load_tiers, pick
from kvpool.keys import Namespace, chain_keys
from router.cost import Hardware
from router.decision import AuditLog, DecisionRecord
from router.hub import PollReply, get_or_create_hub
from router.index import ClusterIndex
from router.ingress_settings import IngressSettings
from router.metrics import RouterMetrics
from router.policies.base import ClusterSnapshot, ReplicaState, RouteRequest
from router.policies.pricing import TierMap
from router.policies.runner import PolicyRunner, make_policy
from router.wire import FetchPlanMsg, GenerateChunk

log = logging.getLogger("kvstack.router")

# Role names of the app config's tier map → TierMap.from_tiers keywords.
_ROLE_TO_TIERMAP = {"local_dram": "dram_local", "remote_dram": "dram_remote", "local_ssd": "ssd_local",
                    "remote_ssd": "ssd_remote"}


@dataclass(frozen=True, slots=True)
class Routed:
    """What the ingress puts on the wire for one request."""

    record: DecisionRecord | None
    target_replica: str | None
    action: str
    fetch_plan: FetchPlanMsg | None
    request_id: str


class LiveView:
    def __init__(self, settings: IngressSettings, hardware: Hardware, tier_map: TierMap) -> None:
        self.settings = settings
        self.hardware = hardware
        rng = random.Random(settings.seed)
        self.metrics = RouterMetrics()
        self.registry = self.metrics.registry
        self.audit = AuditLog(settings.decision_log_size)
        policy = make_policy(settings.policy, rng=rng, tier_map=tier_map)
        self.runner = PolicyRunner(policy, rng=rng, audit=self.audit, metrics=self.metrics)
        self.index = ClusterIndex(replica_ttl_s=settings.replica_ttl_s)
        self.key_root = Namespace(settings.served_model_name, "kvstack-engine", settings.cache_salt).root()
        self._cursor = 0
        self._hub: Any = None

    @classmethod
    def from_settings(cls, settings: IngressSettings) -> LiveView:
        model = pick("model", load_models(), settings.model_spec)
        gpu = pick("GPU", load_gpus(), settings.gpu_profile)
        tiers = load_tiers()
        roles = {_ROLE_TO_TIERMAP[r]: name for r, name in settings.tiers.items() if r in _ROLE_TO_TIERMAP}
        tier_map = TierMap.from_tiers(tiers, **roles)
        return cls(settings, Hardware(model, gpu, mfu=settings.mfu, bw_util=settings.bw_util), tier_map)

    # -- the hub stream --------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                if self._hub is None:
                    self._hub = get_or_create_hub(self.settings.hub_name, self.settings.hub_namespace)
                raw = await asyncio.wait_for(self._hub.poll.remote(self._cursor), timeout=5.0)
                self.apply(msgspec.msgpack.decode(raw, type=PollReply))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - hub restarting: keep the last view, retry
                log.warning("cluster view poll failed: %s", exc)
                self._hub = None
            await asyncio.sleep(self.settings.poll_interval_s)

    def apply(self, reply: PollReply) -> None:
        if reply.snapshot:
            self.index.reset_replicas()
        now = time.monotonic()
        for report in reply.reports:
            if report.gone:
                self.index.drop_replica(report.replica_id)
                self.metrics.forget_replica(report.replica_id)
                continue
            self.index.apply_replica_report(report, now=now)
            self.metrics.set_replica_load(report.replica_id, report.running + report.waiting, 0.0)
            self.runner.acknowledge_replica(report.replica_id, decided_before=now - self.settings.poll_interval_s)
        self._cursor = reply.cursor

    def replica_count(self) -> int:
        return len(self.index.replica_ids(now=time.monotonic()))

    # -- deciding --------------------------------------------------------------------------------------------
    def decide(self, request_id: str, token_ids: list[int]) -> tuple[Routed, list[bytes]]:
        keys = chain_keys(self.key_root, token_ids, self.settings.block_size)
        now = time.monotonic()
        replicas = [
            ReplicaState(replica_id=r.replica_id, node_id=r.node_id, running=r.running, waiting=r.waiting,
                         queue_delay_s=0.0, hbm_prefix_blocks=r.prefix_blocks, hw=self.hardware)
            for r in self.index.replica_prefixes(keys, now=now)
        ]
        if not replicas:  # nothing reported yet: Serve's least-loaded fallback places it
            return Routed(None, None, "recompute", None, request_id), list(keys)
        request = RouteRequest(request_id, len(token_ids), self.settings.block_size, keys)
        record = self.runner.decide(request, ClusterSnapshot(replicas, self.index.pool_hits(keys)))
        plan = None
        if record.fetch is not None:
            f = record.fetch
            plan = FetchPlanMsg(f.shard_id, f.node_id, f.tier, f.start_block, f.end_block)
        return Routed(record, record.replica_id, str(record.action), plan, request_id), list(keys)

    def record_first_token(self, routed: Routed, ttft_s: float, chunk: GenerateChunk) -> None:
        if routed.record is not None:
            self.runner.record_actual(routed.request_id, ttft_s)

    def request_done(self, routed: Routed) -> None:
        if routed.record is not None:
            self.runner.acknowledge(routed.request_id)

    def recent_decisions(self, limit: int) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(r) for r in self.audit.recent(limit)]

    @staticmethod
    def predicted_by_action(decision: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for alt in decision.get("alternatives", []):
            action, ttft = str(alt["action"]), float(alt["predicted_ttft_s"])
            out[action] = min(ttft, out.get(action, ttft))
        return out

    # -- status ----------------------------------------------------------------------------------------------
    def replica_rows(self) -> list[dict[str, Any]]:
        return [{"replica_id": r.replica_id, "node_id": r.node_id, "running": r.running, "waiting": r.waiting,
                 "hbm_blocks": r.prefix_blocks} for r in self.index.replica_prefixes([], now=time.monotonic())]

    async def shard_stats(self) -> list[dict[str, Any]]:
        from kvpool.shard_registry import list_shards

        rows = []
        for shard in await asyncio.to_thread(list_shards, self.settings.hub_namespace):
            try:
                stats = await shard.stats_async(deadline_s=5.0)
            except Exception as exc:  # noqa: BLE001 - a dead shard shows as unavailable
                rows.append({"shard_id": shard.shard_id, "node_id": shard.node_id, "dram_blocks": 0,
                             "ssd_blocks": 0, "error": str(exc)})
                continue
            rows.append({"shard_id": shard.shard_id, "node_id": shard.node_id, **stats})
        return rows
