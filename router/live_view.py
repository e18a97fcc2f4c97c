"""LiveView: the ingress's cluster view and decision loop, glued from the hub stream, the index and the runner.

Who calls what (all inside one ``router.ingress.OpenAIIngress`` replica, on its event loop):
- ``run()`` is a background task: it polls the ``ClusterViewHub`` (``router.hub``) every ``poll_interval_s`` with
  an awaited actor call (never a blocking ``ray.get``), applies replica reports to the ``router.index`` view and
  acknowledges this router's in-flight assignments that the reports now count (anti-herding, see
  ``router.policies.runner``); a replica the index wants resynced makes the next poll ask for the hub's snapshot.
  Replicas not heard from within ``replica_ttl_s`` are dropped by the index. Beside it runs
  ``router.shard_sync.ShardSync`` (the pool shards' event streams into the same index, through kvpool's typed
  ``ShardEventSource``, one loop per shard), and a probe of the event loop itself: how late a timer that was due
  ran (``kvstack_router_event_loop_lag_seconds``: a request arriving meanwhile waits as long before the ingress
  reads it; the time a client sees outside the router's own timeline).
- ``decide(request_id, token_ids, tenant, client_salt)`` computes block keys (``kvpool.keys``) under the request's
  one salt (``kvpool.keys.request_salt``: engine salt, tenant, client salt) and builds a ``ClusterSnapshot``
  (per-replica HBM prefix, pool hits, load, calibrated hardware) and returns the ``Routed`` decision for the wire.
- ``record_first_token`` records the actual TTFT (regret, MFU calibration); ``request_done`` closes the assignment.
- Tier calibration: replica reports carry the pool fetches their connectors finished (``router.hub.TransferSample``);
  each is classed as the policy prices it (DRAM/SSD × same/other node, the shard's node from the shard list) and
  fed to ``Calibrator.observe_transfer`` (with its read alone where the replica reports it and it lies within the
  sample's seconds); once a class has enough samples the policy prices with the fitted bandwidth and latency
  (``RoutingPolicy.update_tier_map``). Every router sees every replica's fetches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from configs import load_gpus, load_tiers, pick
from configs.loader import gpu_for_device
from kvpool.keys import BlockKey, chain_keys, request_salt
from router.calibration import TIER_CLASSES, Calibrator
from router.cost import Hardware
from kvpool.connector.timing import PoolRequestTiming
from router.decision import AuditLog, DecisionRecord, RequestTimeline
from router.hub import EngineProfile, PollReply, PrefillHead, ReplicaReport, get_or_create_hub
from router.kv_admission import KvAdmission
from router.index import PrefixIndex
from router.ingress_settings import IngressSettings
from router.metrics import RouterMetrics
from router.policies.base import ActionName, RouteRequest
from router.policies.pricing import TierMap, tier_class
from router.policies.runner import PolicyRunner, make_policy
from router.replica_book import ReplicaBook, ReplicaLoad
from router.shard_sync import ShardEvents, ShardSync
from router.wire import FetchPlanMsg, GenerateChunk, routing_root

log = logging.getLogger("kvstack.router")

LOOP_PROBE_S = 0.05  # the event-loop probe's period: a sleep this long that wakes late measures the lag

# Role names of the app config's tier map → TierMap.from_tiers keywords.
_ROLE_TO_TIERMAP = {"local_dram": "dram_local", "remote_dram": "dram_remote", "local_ssd": "ssd_local",
                    "remote_ssd": "ssd_remote"}


@dataclass(frozen=True, slots=True)
class Routed:
    """What the ingress puts on the wire for one request."""

    record: DecisionRecord | None
    target_replica: str | None
    action: ActionName
    fetch_plan: FetchPlanMsg | None
    request_id: str
    planned_reuse_tokens: int = 0  # the decision's reused prompt tokens (the replica's queue model counts the rest)
    pool_planned: bool = False  # the policy planned the pool loads (``RoutingPolicy.plans_pool_loads``)
    cache_salt: str = ""  # the request's salt (``kvpool.keys.request_salt``), its block keys' namespace


class LiveView:
    def __init__(self, settings: IngressSettings, hardware: Hardware, tier_map: TierMap) -> None:
        self.settings = settings
        self.hardware = hardware
        rng = random.Random(settings.seed)
        self.metrics = RouterMetrics()
        self.registry = self.metrics.registry
        self.audit = AuditLog(settings.decision_log_size)
        # SPLIT runs as the replicas stage it (``deployments.split_staging``: head computed as a request of its own,
        # tail pulled to the node meanwhile, then loaded on top of the cached head) and is priced that way
        # (``split_staging``). Not for models with linear-attention state: the engine would need the head's state
        # cached at the split boundary, which vLLM's hybrid prefix cache does not promise.
        options = ({"allow_split": hardware.model.linear_state_bytes() == 0, "split_staging": True}
                   if settings.policy == "cost_based" else {})
        self.base_tier_map = tier_map  # configured prices; the calibrator replaces classes it has fitted
        self.tier_map = tier_map
        policy = make_policy(settings.policy, rng=rng, tier_map=tier_map, **options)
        self.runner = PolicyRunner(policy, rng=rng, audit=self.audit, metrics=self.metrics)
        self.calibrator = Calibrator(bw_util=settings.bw_util)
        self.transfers_unplaced = 0  # reported fetches from a shard this router does not know (yet): not used
        self.metrics.set_tier_prices(self.tier_prices())
        self.index = PrefixIndex(ttl_s=settings.replica_ttl_s)
        self.book = ReplicaBook(ttl_s=settings.replica_ttl_s, calibrator=self.calibrator,
                                hardware=lambda: self.hardware)
        self.loads = self.book.loads  # replica id -> its last report's load (the book's; read-only here)
        self.layout_fingerprint = ""  # until a replica reports the layout its engine registered
        self._cursor = 0
        self._hub: Any = None
        self.shard_sync = ShardSync(self.index, wait_s=settings.shard_events_wait_s)
        self.router_id = ""  # set by the ingress (its Serve replica id)
        self._profiled: set[str] = set()  # replicas whose start-up engine profile was applied
        self._published_decisions = 0
        self._published_at = -1e9

    @classmethod
    def from_settings(cls, settings: IngressSettings) -> LiveView:
        model = settings.pricing_model_spec()
        gpus = load_gpus()
        # No configured profile: price with the CPU placeholder until the replicas report their device.
        gpu = pick("GPU", gpus, settings.gpu_profile) if settings.gpu_profile else gpu_for_device(gpus, "cpu")
        if gpu is None:
            raise ValueError("configs/specs/gpus.yaml lists no profile for device 'cpu' (the placeholder)")
        tiers = load_tiers()
        roles = {_ROLE_TO_TIERMAP[r]: name for r, name in settings.tiers.items() if r in _ROLE_TO_TIERMAP}
        tier_map = TierMap.from_tiers(tiers, **roles)
        return cls(settings, Hardware(model, gpu, mfu=settings.mfu, bw_util=settings.bw_util), tier_map)

    # -- the hub stream and the shards' event streams -------------------------------------------------------
    async def run(self) -> None:
        shards = asyncio.create_task(self.shard_sync.run(self._list_shards, interval_s=self.settings.poll_interval_s))
        probe = asyncio.create_task(self._probe_loop())
        try:
            await self._run_hub()
        finally:
            shards.cancel()
            probe.cancel()

    async def _probe_loop(self) -> None:
        """Measure how late the event loop runs a due timer, forever (``kvstack_router_event_loop_lag_seconds``)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_PROBE_S
            await asyncio.sleep(LOOP_PROBE_S)
            self.metrics.observe_loop_lag(loop.time() - due)

    async def _run_hub(self) -> None:
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
            try:
                await self._publish_decisions()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                log.warning("publishing decisions failed: %s", exc)
            await asyncio.sleep(self.settings.poll_interval_s)

    def apply(self, reply: PollReply) -> None:
        """Apply hub reports in order (report seq n → event seqs 2n-1 removed, 2n stored)."""
        now = time.monotonic()
        calibrate = False
        if reply.snapshot:
            for rid in list(self.loads):
                if rid not in {r.replica_id for r in reply.reports}:
                    self._forget(rid)
        for report in reply.reports:
            if report.gone:
                self._forget(report.replica_id)
                continue
            if report.layout_fingerprint and report.layout_fingerprint != self.layout_fingerprint:
                # The replicas key blocks under the layout their engine registered (the pool's namespace); the
                # router must compute the same keys.
                log.info("router %s: adopting KV layout %s from replica %s", self.router_id,
                         report.layout_fingerprint[:16], report.replica_id)
                self.layout_fingerprint = report.layout_fingerprint
            self.index.apply_replica_report(report)
            sent = sent_at(report, now)
            self.book.report(report.replica_id, report.node_id, report.running, report.waiting, now, report.placement,
                             waiting_work=(report.waiting_tokens, report.waiting_tokens_sq),
                             kv=None if report.kv is None else KvAdmission.of(report.kv, sent),
                             head=aged_head(report.head, now - sent))
            self.metrics.set_replica_load(report.replica_id, report.running + report.waiting, 0.0)
            if report.kv is not None:
                self.metrics.set_replica_kv(report.replica_id, report.kv.capacity_tokens, report.kv.held_tokens)
            # what it counts: the requests that reached it before it was sent (decided a transport time earlier)
            self.runner.acknowledge_replica(report.replica_id, decided_before=min(
                now - self.settings.poll_interval_s, sent - REQUEST_TRANSPORT_S))
            if report.profile is not None and report.replica_id not in self._profiled:
                self._apply_profile(report.replica_id, report.profile)
            if report.transfers:
                self._observe_transfers(report)
                calibrate = True
        if calibrate:
            self._refresh_tier_map()
        self._cursor = reply.cursor
        if self.index.take_resync_requests("replica"):
            self._cursor = -1  # the hub answers an impossible cursor with a full snapshot

    def _apply_profile(self, replica_id: str, profile: EngineProfile) -> None:
        """A replica's start-up profile: without a configured GPU profile, the one its device matches
        (``configs/specs/gpus.yaml`` ``device_names``) prices every replica from now on; its probe prefills fit
        its MFU (``router.calibration``), so the first decision for it is priced with what its engine measured."""
        self._profiled.add(replica_id)
        if self.settings.gpu_profile is None:
            gpu = gpu_for_device(load_gpus(), profile.device)
            if gpu is None:
                log.warning("router %s: replica %s's device %r matches no profile in gpus.yaml; pricing with %s",
                            self.router_id, replica_id, profile.device, self.hardware.gpu.name)
            elif gpu != self.hardware.gpu:
                log.info("router %s: pricing with GPU profile %s (device %r)", self.router_id, gpu.name,
                         profile.device)
                self.hardware = dataclasses.replace(self.hardware, gpu=gpu)
                self.book.touch_all()
        for sample in profile.prefills:
            if sample.tokens > 0 and sample.seconds > 0:
                self.calibrator.observe_prefill(replica_id, self.hardware, sample.tokens, 0, sample.seconds,
                                                probe=True)
        self.book.touch(replica_id)

    def _observe_transfers(self, report: ReplicaReport) -> None:
        """Feed the replica's finished pool fetches to the tier fits: the tier class is the one the policy priced
        such a fetch with (DRAM or SSD, the shard on the replica's node or another)."""
        for t in report.transfers:
            shard_node = self.shard_sync.node_of(t.shard_id)
            if shard_node is None or t.bytes_moved <= 0 or t.seconds <= 0:
                self.transfers_unplaced += 1
                continue
            cls = TIER_CLASSES[tier_class("ssd" if t.ssd else "dram", shard_node == report.node_id)]
            read_s = t.read_s if t.read_s is not None and 0 < t.read_s <= t.seconds else None
            self.calibrator.observe_transfer(cls, self.base_tier_map, t.bytes_moved, t.seconds, read_s)
            self.metrics.observe_transfer(cls, t.bytes_moved)

    def _refresh_tier_map(self) -> None:
        """Price with the calibrated tiers from the next decision on (policies keep their own ``Pricer``)."""
        tier_map = self.calibrator.tier_map(self.base_tier_map)
        if tier_map != self.tier_map:
            self.tier_map = tier_map
            self.runner.policy.update_tier_map(tier_map)
            self.metrics.set_tier_prices(self.tier_prices())

    def tier_prices(self) -> dict[str, tuple[float, float]]:
        """Per tier class: (bandwidth GB/s as priced — times ``bw_util`` —, latency s)."""
        bw_util = self.settings.bw_util
        return {cls: (getattr(self.tier_map, cls).bandwidth_gbps * bw_util, getattr(self.tier_map, cls).latency_s)
                for cls in TIER_CLASSES}

    def calibration_rows(self) -> list[dict[str, Any]]:
        """What the cost model prices with now, per tier class, and from how many observed fetches."""
        counts = self.calibrator.transfer_counts()
        return [{"tier_class": cls, "tier": getattr(self.tier_map, cls).name, "bandwidth_gbps": round(gbps, 4),
                 "latency_s": round(lat, 6), "observed": counts.get(cls, 0),
                 "calibrated": getattr(self.tier_map, cls) is not getattr(self.base_tier_map, cls)}
                for cls, (gbps, lat) in self.tier_prices().items()]

    def _forget(self, replica_id: str) -> None:
        self.book.forget(replica_id)
        self.index.remove_source("replica", replica_id)
        self.metrics.forget_replica(replica_id)
        self.calibrator.forget_replica(replica_id)
        self._profiled.discard(replica_id)

    async def _list_shards(self) -> list[tuple[ShardEvents, str]]:
        """The pool's shards (``kvpool.shard.registry``; a blocking Ray lookup, so off the loop) as event sources."""
        from kvpool.shard.registry import list_shards

        refs = await asyncio.to_thread(list_shards, self.settings.hub_namespace)
        return [(r.event_source(), r.node_id) for r in refs]

    async def _publish_decisions(self) -> None:
        """Every ~1 s, this router's recent decision summaries go to the hub (for ``kvstack status``)."""
        now = time.monotonic()
        if self._hub is None or len(self.audit) == self._published_decisions or now - self._published_at < 1.0:
            return
        summaries = self.decision_summaries(50)
        await asyncio.wait_for(self._hub.publish_decisions.remote(self.router_id, summaries), timeout=5.0)
        self._published_decisions, self._published_at = len(self.audit), now

    def decision_summaries(self, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
        return [{"request_id": d["request_id"], "action": d["action"], "replica_id": d["replica_id"],
                 "router_id": self.router_id, "decided_at": d["decided_at"], "actual_ttft_s": d.get("actual_ttft_s"),
                 "predicted": self.predicted_by_action(d), "reason": d["reason"], "tenant": d.get("tenant", "")}
                for d in self.recent_decisions(limit, tenant)]

    async def all_decisions(self, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every router's recent decisions (from the hub), falling back to this router's own; only ``tenant``'s
        when given."""
        try:
            if self._hub is not None:
                await self._publish_decisions()
                return await asyncio.wait_for(self._hub.decisions.remote(limit, tenant), timeout=5.0)
        except Exception as exc:  # noqa: BLE001
            log.warning("reading decisions from the hub failed: %s", exc)
        return self.decision_summaries(limit, tenant)

    def live_replicas(self, now: float) -> dict[str, ReplicaLoad]:
        return self.book.live(now)

    def replica_count(self) -> int:
        return len(self.live_replicas(time.monotonic()))

    # -- deciding --------------------------------------------------------------------------------------------
    def key_root(self, cache_salt: str) -> BlockKey:
        """The namespace root of a request salted ``cache_salt`` (``kvpool.keys.request_salt``)."""
        return routing_root(self.settings.served_model_name, cache_salt, self.layout_fingerprint)

    def decide(self, request_id: str, token_ids: list[int], tenant: str = "", client_salt: str | None = None
               ) -> tuple[Routed, list[bytes]]:
        """Route one prompt of ``tenant`` (its API key's; "" without keys) that asked for ``client_salt`` (its own
        ``cache_salt``): its blocks are keyed under the one salt of the three (``Routed.cache_salt``), so it never
        matches another tenant's prefix, in HBM or in the pool; the decision record names the tenant."""
        salt = request_salt(self.settings.cache_salt, tenant, client_salt)
        keys = chain_keys(self.key_root(salt), token_ids, self.settings.block_size)
        replicas, columns = self.book.view(time.monotonic())
        if not replicas:  # nothing reported yet: Serve's least-loaded fallback places it
            return Routed(None, None, "recompute", None, request_id, cache_salt=salt), list(keys)
        request = RouteRequest(request_id, len(token_ids), self.settings.block_size, keys)
        record = self.runner.decide(request, self.index.snapshot(request, replicas, columns=columns))
        record.tenant = tenant
        plan = None
        if record.fetch is not None:
            f = record.fetch
            plan = FetchPlanMsg(f.shard_id, f.node_id, f.tier, f.start_block, f.end_block)
        return (Routed(record, record.replica_id, cast(ActionName, record.action.value), plan, request_id,
                       record.hbm_tokens + record.fetched_tokens, self.runner.policy.plans_pool_loads, salt),
                list(keys))

    def record_first_token(self, routed: Routed, ttft_s: float, chunk: GenerateChunk, ingress_s: float = 0.0) -> None:
        """Actual TTFT: regret and prediction error (runner), the request's timeline (``ingress_s``: its time in
        the ingress before it was sent on), MFU calibration, the replica's mean TTFT."""
        if routed.record is not None:
            record = self.runner.record_actual(routed.request_id, ttft_s)
            if record is not None:
                replica = chunk.timeline
                transport = ttft_s - ingress_s - replica.first_chunk_s if replica is not None else None
                record.timeline = RequestTimeline(ingress_s=ingress_s, transport_s=transport, replica=replica)
                record.actual_cached_tokens = chunk.cached_tokens
                self.metrics.observe_stages(record, record.timeline.stages())
        replica_id = chunk.replica_id or (routed.target_replica or "")
        if replica_id and chunk.prompt_tokens > 0 and ttft_s > 0:
            # The engine's own prefill seconds fit the MFU, the rest of the TTFT outside the engine's queue is the
            # path's fixed cost (``router.calibration.Calibrator``); without vLLM's timestamps, the whole TTFT.
            t = chunk.timeline
            if t is not None and 0 <= t.queued_s <= t.scheduled_s < t.first_token_s:
                prefill_s = t.first_token_s - t.scheduled_s
                self.calibrator.observe_path(ttft_s - (t.first_token_s - t.queued_s))
            else:
                prefill_s = ttft_s
            self.calibrator.observe_prefill(replica_id, self.hardware, chunk.prompt_tokens,
                                            min(chunk.cached_tokens, chunk.prompt_tokens), prefill_s)
            self.book.observe_ttft(replica_id, ttft_s)  # also rebuilds its state with the new calibration
            for rid in self.book.loads:  # replicas priced with a sibling's fit (the fleet's median) move with it
                if rid != replica_id and not self.calibrator.priced_by_own_fit(rid):
                    self.book.touch(rid)

    def record_pool_timing(self, routed: Routed, timing: PoolRequestTiming) -> None:
        """The request finished: what its pool calls cost on vLLM's scheduler thread joins its timeline."""
        record = routed.record
        if record is not None and record.timeline is not None and record.timeline.pool is None:
            record.timeline.pool = timing
            self.metrics.observe_stages(record, {"pool_lookup": timing.lookup_s, "pool_lease": timing.lease_s,
                                                 "pool_wait": timing.wait_s})

    def request_done(self, routed: Routed, tpot_s: float | None = None) -> None:
        if routed.record is not None:
            self.runner.acknowledge(routed.request_id)
        if tpot_s is not None:
            self.metrics.observe_tpot(self.runner.policy_name, tpot_s)

    def recent_decisions(self, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` decisions (of ``tenant`` only, when given), oldest first."""
        return [msgspec.to_builtins(r) for r in self.audit.recent(limit, tenant)]

    @staticmethod
    def predicted_by_action(decision: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for alt in decision.get("alternatives", []):
            action, ttft = str(alt["action"]), float(alt["predicted_ttft_s"])
            out[action] = min(ttft, out.get(action, ttft))
        return out

    # -- status ----------------------------------------------------------------------------------------------
    def replica_rows(self) -> list[dict[str, Any]]:
        return [{"replica_id": rid, "node_id": load.node_id, "running": load.running, "waiting": load.waiting,
                 "hbm_blocks": self.index.held_blocks("replica", rid, "hbm"),
                 "mfu": (hw := self.calibrator.hardware(rid, self.hardware)).mfu, "attn_scale": hw.attn_scale,
                 "gpu_profile": self.hardware.gpu.name,
                 "placement": msgspec.to_builtins(load.placement) if load.placement else None,
                 # its KV cache as its last report had it (``router.kv_admission``; None: not reported)
                 "kv_capacity_tokens": load.kv.capacity_tokens if load.kv else None,
                 "kv_held_tokens": load.kv.capacity_tokens - load.kv.free_tokens if load.kv else None}
                for rid, load in self.live_replicas(time.monotonic()).items()]

    async def shard_stats(self) -> list[dict[str, Any]]:
        """One ``kvstack status`` row per shard: blocks per tier, leases and the store's counters. The shards are
        asked concurrently, each within its own deadline, so a frozen shard costs one deadline, not one each."""
        from kvpool.shard.registry import list_shards

        async def row(shard: Any) -> dict[str, Any]:
            head = {"shard_id": shard.shard_id, "node_id": shard.node_id}
            try:
                stats = await shard.async_client().stats(deadline_s=5.0)
            except Exception as exc:  # noqa: BLE001 - a dead shard shows as unavailable
                return {**head, "dram_blocks": 0, "ssd_blocks": 0, "error": str(exc)}
            return {**head, "dram_blocks": stats.dram.blocks, "ssd_blocks": stats.ssd.blocks,
                    "leases": stats.leases, "slot_bytes": stats.slot_bytes, "counters": dict(stats.counters),
                    "models": [{"model": ls.model, "layout": fp, "dram_blocks": ls.dram_blocks,
                                "ssd_blocks": ls.ssd_blocks} for fp, ls in sorted(stats.layouts.items())]}

        shards = await asyncio.to_thread(list_shards, self.settings.hub_namespace)
        return list(await asyncio.gather(*(row(s) for s in shards)))


#: How long a routed request takes to reach its replica, at most as a rule (the ingress's send to the replica's
#: receipt: ~10 ms measured on a loaded 2-core box): a report sent sooner after the decision may not count it.
REQUEST_TRANSPORT_S = 0.05

#: The most a report's age (its wall-clock ``sent_at`` to now) is believed: more is the two hosts' clock skew.
MAX_REPORT_AGE_S = 1.0


def aged_head(head: PrefillHead | None, age_s: float) -> PrefillHead | None:
    """A report's ``head`` as of its arrival: its engine has been at it ``age_s`` longer (the report's age)."""
    if head is None or age_s <= 0:
        return head
    return PrefillHead(tokens=head.tokens, tokens_sq=head.tokens_sq, elapsed_s=head.elapsed_s + age_s)


def sent_at(report: ReplicaReport, now: float) -> float:
    """When ``report`` was sent, on the monotonic clock ``now`` is read from (its age from the wall clocks, within
    [0, ``MAX_REPORT_AGE_S``])."""
    age = time.time() - report.sent_at if report.sent_at > 0 else 0.0
    return now - min(max(age, 0.0), MAX_REPORT_AGE_S)
