"""The vLLM replica: a Ray Serve deployment wrapping vLLM's ``AsyncLLM`` (optionally with the kvpool connector).

Who calls what:
- ``router.ingress.OpenAIIngress`` calls ``generate(GenerateRequest)`` through a Serve handle (streaming) after
  ``deployments.request_router.DecisionRequestRouter`` picked this replica for it; it receives ``GenerateChunk``s.
- The replica publishes its routing stats (running/waiting requests, the waiting prefill work and how far the
  engine has come with the oldest (``deployments.prefill_queue``), KV use (``deployments.kv_occupancy``: what its
  in-flight requests hold of the engine's KV cache and when they free it), the block keys of prefixes it has
  computed — its HBM prefix cache as the router models it) to the ``router.hub.ClusterViewHub`` actor every
  ``stats_interval_s``; the ingress replicas build their cluster view from the hub.
- With the pool on, each report also carries the pool fetches the engine's connector finished since the last one
  (``router.hub.TransferSample``: bytes, seconds with the wait and lease included, and the read alone), read from
  the workers with ``collective_rpc(kvpool.connector.kv_connector.drain_transfer_records)`` in a task of its own
  (``deployments.transfer_drain``: the engine answers between steps, and a report must not wait for a long
  prefill); the routers calibrate their tier prices with them.
- Once a request's first chunk is out, the pool blocks of the prefix the engine reused are touched in this node's shard
  (no wait), so a prefix served from HBM stays fresh in the pool's eviction order.
- A request's fetch plan travels on to the connector as a hint (the shard to look up first); with a policy that
  plans the pool loads (``pool_planned``) a RECOMPUTE tells it to load nothing and a HOLDER the HBM prefix it
  counted on (no lookup to wait for while vLLM's cache has it; ``connector_params``); a ``split`` request first has
  its head computed and its tail staged on this node (``deployments.split_staging``).
- Every request's first chunk carries its ``router.wire.ReplicaTimeline`` (the replica's preparation and vLLM's own
  queued / scheduled / first-token timestamps), its last chunk what its pool calls cost on vLLM's scheduler thread
  (``kvpool.connector.timing``, from the final output's ``kv_transfer_params``). The first token goes out at
  once; the tokens after it are merged into one chunk per ``stream_batching_interval_ms`` and the last is never
  held (``deployments.stream_batching``); a client that asked for the whole answer gets the first chunk and the
  rest at the end.
- ``reset_prefix_cache()`` drops the engine's HBM prefix cache (tests, benchmarks) and tells the hub.
- Before its engine starts, the replica claims ``threads`` cores of its own and binds the engine to exactly those
  (``deployments.cpu_placement``); every report carries that placement, with the engine's worker processes as
  they report their own binding once the engine is up (``deployments.engine_worker``).

The HBM view comes from vLLM's own KV cache events (``deployments.kv_events``): every block vLLM stores or evicts
is re-keyed with kvstack's chained keys, so the router sees exactly what the engine holds. With events off
(``EngineSettings.kv_events=False``) the replica falls back to recording the blocks of the prompts it served, an
LRU bounded at the engine's KV capacity (an estimate; the regret metric measures how wrong it was).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from deployments.app_config import STREAM_BATCHING_INTERVAL_MS, PoolSettings
from deployments.cpu_placement import claim_cores, engine_binding
from deployments.engine_probe import probe_engine
from deployments.engine_settings import EngineSettings
from deployments.engine_worker import BINDING_METHOD, WORKER_EXTENSION
from deployments.kv_occupancy import KvOccupancyTracker
from deployments.prefill_queue import PrefillQueue
from deployments.transfer_drain import TransferDrain
from router.hub import (
    DEFAULT_HUB_NAME,
    CpuBinding,
    EngineWorkerBinding,
    ReplicaReport,
    TransferSample,
    get_or_create_hub,
)
from deployments.kv_events import KeyTranslator, KvEventSubscriber
from deployments.split_staging import SplitStats, stage_split
from deployments.stream_batching import batched_outputs
from kvpool.connector.timing import from_params
from kvpool.keys import BlockKey, rank_interleaved
from router.wire import (
    ControlRequest,
    GenerateChunk,
    GenerateRequest,
    ReplicaTimeline,
    TokenLogprob,
    check_version,
    decode_sampling_params,
    routing_root,
)

log = logging.getLogger("kvstack.replica")

SPLIT_STAGING_DEADLINE_S = 60.0  # computing a SPLIT's head and staging its tail on this node, at most
# vLLM refuses to reset its prefix cache while any request holds blocks: the admin reset tries again this long.
RESET_DEADLINE_S = 10.0


class HbmPrefixLedger:
    """Bounded LRU of block keys the replica computed; produces stored/removed deltas for the hub.

    The deltas are netted: a key is in at most one of ``stored`` / ``removed`` of a drain, by its last change, so
    the order in which the hub applies them does not matter. A prompt's keys are touched tail first, so its head
    block is the most recent and a chain is evicted from its tail (as vLLM frees a finished request's blocks).
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.lock = threading.Lock()  # the KV event thread and the event loop both touch the ledger
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._stored: dict[bytes, None] = {}
        self._removed: dict[bytes, None] = {}

    def touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            if key in self._keys:
                self._keys.move_to_end(key)
                continue
            self._keys[key] = None
            self._removed.pop(key, None)
            self._stored[key] = None
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            self._stored.pop(old, None)
            self._removed[old] = None

    def remove(self, keys: list[bytes]) -> None:
        """The engine evicted these blocks (KV events)."""
        for key in keys:
            if key in self._keys:
                del self._keys[key]
                self._stored.pop(key, None)
                self._removed[key] = None

    def clear(self) -> None:
        for key in self._keys:
            self._stored.pop(key, None)
            self._removed[key] = None
        self._keys.clear()

    def drain(self) -> tuple[list[bytes], list[bytes]]:
        stored, removed = list(self._stored), list(self._removed)
        self._stored, self._removed = {}, {}
        return stored, removed

    def snapshot(self) -> list[bytes]:
        return list(self._keys)


def connector_params(request: GenerateRequest, kv_shard_hint: str | None) -> dict[str, Any] | None:
    """What the kvpool connector is told of the router's decision (``kvpool.connector.scheduler``), as the
    request's ``kv_transfer_params``. With a policy that plans the pool loads (``pool_planned``): a RECOMPUTE loads
    nothing (no lookup to wait for; its blocks are still saved), a HOLDER names the HBM prefix it counted on (the
    connector looks the pool up only if vLLM's cache supplies less: the router's view was out of date). Otherwise
    ``kv_shard_hint``, the pool shard to look up first (the plan's), if any; with a planned FETCH or SPLIT also the
    block its plan ends at (the connector asks that shard alone while it holds that much)."""
    from kvpool.connector.scheduler import HOLDER_PARAM, NO_LOAD_PARAM, PLAN_END_PARAM, PLAN_PARAM

    if request.pool_planned and request.action == "recompute":
        return {NO_LOAD_PARAM: True}
    if request.pool_planned and request.action == "holder":
        return {HOLDER_PARAM: max(request.planned_reuse_tokens, 0)}
    if not kv_shard_hint:
        return None
    plan = request.fetch_plan
    if request.pool_planned and plan is not None:
        return {PLAN_PARAM: kv_shard_hint, PLAN_END_PARAM: plan.end_block}
    return {PLAN_PARAM: kv_shard_hint}


def engine_sampling_params(raw: bytes, kv_transfer_params: dict[str, Any] | None = None) -> tuple[Any, bool]:
    """The engine's ``SamplingParams``: the ingress's (vLLM's own request conversion, ``router.wire``), streamed as
    deltas whatever the client asked (the ingress merges them), with kvstack's own ``kv_transfer_params`` (what
    ``connector_params`` tells the connector; a client's are refused at the ingress); and whether the client asked
    for the final output only (the replica then sends the first token and the rest at the end)."""
    from vllm.sampling_params import RequestOutputKind

    params = decode_sampling_params(raw)
    final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
    params.output_kind = RequestOutputKind.DELTA
    extra = dict(params.extra_args or {})
    extra.pop("kv_transfer_params", None)
    if kv_transfer_params:
        extra["kv_transfer_params"] = kv_transfer_params
    params.extra_args = extra or None
    return params, final_only


def logprob_entries(entry: Any) -> list[TokenLogprob]:
    """One position of vLLM's logprobs (token id -> ``Logprob``, the sampled token and the top-k) for the wire."""
    return [TokenLogprob(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items()]


def build_engine_args(engine: EngineSettings, kv_events_port: int | None = None, kv_transfer: Any = None,
                      extra: dict[str, Any] | None = None) -> Any:
    """The engine's ``AsyncEngineArgs``: the configured arguments parsed by vLLM's own parser (as ``vllm serve``
    parses them), then what kvstack sets itself (KV events, the connector, the worker extension; ``extra``)."""
    from router.vllm_args import parse_engine_args

    args = parse_engine_args(engine.vllm_engine_kwargs())
    if kv_events_port is not None:
        from deployments.kv_events import events_config

        args.kv_events_config = events_config(kv_events_port)
    if kv_transfer is not None:
        args.kv_transfer_config = kv_transfer
    args.worker_extension_cls = WORKER_EXTENSION  # the workers report their own binding
    for key, value in (extra or {}).items():
        setattr(args, key, value)
    return args


def _gpu_numa_node() -> int | None:
    """The NUMA node of this replica's (first) GPU, as vLLM's platform reports it; None on CPUs or when unknown."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    try:
        return current_platform.get_device_numa_node(0)
    except Exception:  # noqa: BLE001 - a placement preference only
        return None


class VLLMReplica:
    """Serve deployment body (``serve.deployment`` is applied by ``deployments.app``)."""

    async def __init__(self, engine: dict[str, Any] | EngineSettings, pool: dict[str, Any] | PoolSettings | None = None,
                       hub_name: str | None = DEFAULT_HUB_NAME, hub_namespace: str | None = "kvstack",
                       stats_interval_s: float = 0.5, threads: int = 1, cpu_binding: CpuBinding = "exclusive",
                       pool_engines: list[EngineSettings] | None = None,
                       stream_batching_interval_ms: float = STREAM_BATCHING_INTERVAL_MS) -> None:
        """``pool_engines``: every model's engine of the app (they size the node's shard; default: this one);
        ``stream_batching_interval_ms``: a streamed request's tokens after its first are sent at most this often
        (``deployments.stream_batching``)."""
        import ray
        from ray import serve
        from vllm.v1.engine.async_llm import AsyncLLM

        self.settings = engine if isinstance(engine, EngineSettings) else EngineSettings.model_validate(engine)
        self.pool_engines = list(pool_engines or [self.settings])
        self.stream_batching_s = stream_batching_interval_ms / 1000.0
        self._tp_world = self.settings.tensor_parallel_size()  # every rank's pool keys (kvpool.keys.rank_key)
        self._local_shard: Any = None  # this node's pool shard (ShardHandle) when the pool is on
        self.pool_touches = 0  # prefixes served from HBM whose pool blocks were refreshed
        self.split_stats = SplitStats()
        if pool is not None and not isinstance(pool, PoolSettings):
            pool = PoolSettings.model_validate(pool)
        self.pool = pool if pool is not None and pool.enabled else None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        # The engine's threads get cores of their own, bound explicitly: vLLM's automatic binding depends on
        # whether a KV connector is configured (deployments.cpu_placement). Held for the replica's life.
        self.cpu_claim = await asyncio.to_thread(claim_cores, threads, cpu_binding, owner=f"replica {self.replica_id}",
                                                 prefer_numa=_gpu_numa_node())
        placement_args = self._apply_placement()
        capacity_blocks = max(1, self.settings.hbm_capacity_blocks())
        self.ledger = HbmPrefixLedger(capacity_blocks)
        self._fingerprint = ""  # the layout the engine registered (the pool's namespace; "" with the pool off)
        self._events: KvEventSubscriber | None = None
        events_port = None
        if self.settings.kv_events:
            translator = KeyTranslator(self.key_root, self.ledger.touch, self.ledger.remove, self.ledger.clear)
            self._events = KvEventSubscriber(translator, self.ledger.lock)
            events_port = self._events.port
            self._events.start()
        kv_transfer = None
        if self.pool is not None:  # the node's pool shard first: the connector finds it when the engine starts
            kv_transfer = await asyncio.to_thread(self._connector_transfer_config)
            # The layout handshake (a kvpool object) comes back from the engine-core process through
            # collective_rpc; vLLM only pickles such objects when allowed. Both ends are this replica's own processes.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        started = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(
            build_engine_args(self.settings, events_port, kv_transfer, extra=placement_args))
        self.startup_s = time.monotonic() - started
        await self._record_engine_workers()
        if self.pool is not None:
            self._fingerprint = await self._registered_layout_fingerprint()
        # the device and timed cold prefills: the routers price this replica with what its engine measured
        self.profile = await probe_engine(self.engine, self.settings.max_model_len, self.settings.startup_probe)
        self.running = 0
        # What the in-flight requests hold of the engine's KV cache and when they free it (ReplicaReport.kv)
        self.kv_occupancy = KvOccupancyTracker(self.settings.block_size, self._kv_capacity_tokens())
        # The waiting requests (before their first output), their prefill work and the oldest one's progress
        self.prefills = PrefillQueue()
        self._seq = 0
        self._hub = None
        self._hub_address = (hub_name, hub_namespace)
        if hub_name:
            self._hub = get_or_create_hub(hub_name, hub_namespace)
        self._stats_interval_s = stats_interval_s
        self._served = 0  # requests finished here (the pool's transfer records are drained only after new ones)
        # the engine connector's finished loads, read without making a report wait on the engine's step
        self._transfers = TransferDrain(self._read_transfer_records, name=self.replica_id)
        self._pending_samples: list[TransferSample] = []  # SPLIT pulls, sent with the next report
        self._publisher = asyncio.get_event_loop().create_task(self._publish_loop()) if self._hub else None
        p = self.cpu_claim.placement
        log.info("replica %s on node %s: engine up in %.1f s; engine threads %d on cpus %s (%s, numa %s)",
                 self.replica_id, self.node_id[:8], self.startup_s, p.threads, p.cores, p.binding, p.numa_nodes)

    def _kv_capacity_tokens(self) -> int:
        """The engine's KV cache in tokens: its blocks × their size, as the engine core reported them at start-up
        (vLLM's front end keeps them in its ``cache_config``); 0: unknown."""
        cache = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None) or 0
        return int(blocks) * int(getattr(cache, "block_size", None) or self.settings.block_size)

    async def _record_engine_workers(self) -> None:
        """Ask every engine worker for its pid and its CPUs as the OS has them, and keep them in the placement (each
        report carries it: ``kvstack status`` shows the binding as it is)."""
        try:
            answers = await asyncio.wait_for(self.engine.collective_rpc(BINDING_METHOD), timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - a report only
            log.warning("replica %s: engine workers did not report their binding: %s", self.replica_id, exc)
            return
        workers = [EngineWorkerBinding(int(a["pid"]), [int(c) for c in a["cpus"]]) for a in answers]
        self.cpu_claim.placement = msgspec.structs.replace(self.cpu_claim.placement, engine_workers=workers)

    def _apply_placement(self) -> dict[str, Any]:
        """Bind the engine to the claimed cores: the environment its processes inherit (set here, before they
        start) and the engine arguments that go with it (GPU builds)."""
        from vllm.platforms import current_platform

        gpu = not current_platform.is_cpu()
        env, args = engine_binding(self.cpu_claim.placement, gpu=gpu, ranks=self.settings.parallel_size())
        os.environ.update(env)
        return args

    def _connector_transfer_config(self) -> Any:
        """Start (or find) this node's shard and list every shard: the connector's configuration."""
        import ray

        from deployments.pool_setup import ensure_local_shard
        from kvpool.connector.config import ConnectorConfig, ShardRef, kv_transfer_config
        from kvpool.shard.registry import list_shards, shard_actor_name
        from kvpool.shard.wire import SHARD_NAMESPACE

        assert self.pool is not None
        local = ensure_local_shard(self.pool_engines, self.pool)
        self._local_shard = local
        shards = [ShardRef(s.shard_id, shard_actor_name(s.node_id), s.node_id) for s in list_shards(SHARD_NAMESPACE)]
        cfg = ConnectorConfig(
            shards=shards, model_id=self.settings.served_model_name, local_shard=local.shard_id,
            ray_namespace=SHARD_NAMESPACE, ray_address=ray.get_runtime_context().gcs_address,
            backend=self.pool.transfer_backend, shared_memory=self.pool.shared_memory,
            lease_on_lookup=self.pool.lease_on_lookup, saver_nice=self.pool.saver_nice,
            saver_max_lag_s=self.pool.saver_max_lag_s,
            inline_load_max_bytes=self.pool.inline_load_max_bytes,
        )
        return kv_transfer_config(cfg)

    def key_root(self, cache_salt: str) -> BlockKey:
        """The namespace root of a request salted ``cache_salt`` (``GenerateRequest.cache_salt``): the router's."""
        return routing_root(self.settings.served_model_name, cache_salt, self._fingerprint)

    async def _registered_layout_fingerprint(self) -> str:
        """The fingerprint of the KV layout the engine's workers registered (the connector's handshake): the
        block-key namespace the pool uses, so the router's keys and the pool's keys are the same keys."""
        from kvpool.layout import KvLayout

        per_worker = await asyncio.wait_for(
            self.engine.collective_rpc("get_kv_connector_handshake_metadata"), timeout=60.0)
        for metas in per_worker:
            for meta in (metas or {}).values():
                return KvLayout.decode(meta.layout).fingerprint
        raise RuntimeError("the kvpool connector reported no layout: is it loaded in the engine?")

    # -- serving ---------------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest | bytes) -> AsyncIterator[GenerateChunk]:
        if isinstance(request, bytes):
            request = msgspec.msgpack.decode(request, type=GenerateRequest)
        check_version(request.version, "GenerateRequest")
        received = time.monotonic()
        first = True
        finished = False
        prompt_tokens = len(request.prompt_token_ids)
        waiting = self.prefills.add(prompt_tokens, request.planned_reuse_tokens, received)
        try:
            from vllm.inputs import tokens_input

            hint = await self._plan_hint(request)
            plan_s = time.monotonic() - received
            params, final_only = engine_sampling_params(request.sampling_params, connector_params(request, hint))
            max_new = params.max_tokens or max(0, self.settings.max_model_len - prompt_tokens)
            self.kv_occupancy.start(request.request_id, request.block_keys, prompt_tokens, max_new * params.n)
            prompt = tokens_input(list(request.prompt_token_ids), cache_salt=request.cache_salt or None)
            outputs = self.engine.generate(prompt, params, request.request_id, priority=request.priority,
                                           reasoning_ended=request.reasoning_ended,
                                           reasoning_parser_kwargs=request.reasoning_parser_kwargs)
            async for out in batched_outputs(outputs, None if final_only else self.stream_batching_s):
                self.kv_occupancy.generated(request.request_id, sum(len(c.token_ids) for c in out.outputs),
                                            time.monotonic())
                cached = out.num_cached_tokens or 0
                timeline = None
                prompt_logprobs = None
                touch = False
                if first:
                    self.prefills.first_output(waiting, time.monotonic())
                    self.running += 1
                    first = False
                    touch = True  # once the first chunk is out: the touch costs its TTFT nothing
                    timeline = request_timeline(out.metrics, received, plan_s)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs = [None if e is None else logprob_entries(e) for e in out.prompt_logprobs]
                pool_timing = from_params(out.kv_transfer_params) if out.finished else None
                finished = out.finished
                for comp in out.outputs:
                    yield GenerateChunk(
                        index=comp.index,
                        text=comp.text,
                        token_ids=list(comp.token_ids),
                        logprobs=None if comp.logprobs is None else [logprob_entries(e) for e in comp.logprobs],
                        cumulative_logprob=comp.cumulative_logprob,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                        finished=out.finished,
                        prompt_tokens=prompt_tokens,
                        prompt_logprobs=prompt_logprobs,
                        cached_tokens=cached,
                        replica_id=self.replica_id,
                        timeline=timeline,
                        pool_timing=pool_timing,
                    )
                    timeline = None
                    prompt_logprobs = None
                if touch:
                    self._touch_pool_prefix(request, cached)
        except asyncio.CancelledError:
            await self.engine.abort(request.request_id)
            raise
        finally:
            self.kv_occupancy.end(request.request_id, time.monotonic(), finished)
            if first:
                self.prefills.drop(waiting)
            else:
                self.running -= 1
            self._served += 1
            if self._events is None:  # no engine events: record the prompt's blocks ourselves
                with self.ledger.lock:
                    self.ledger.touch(list(request.block_keys))

    def _touch_pool_prefix(self, request: GenerateRequest, cached_tokens: int) -> None:
        """The engine reused ``cached_tokens`` of the prompt: refresh those blocks in this node's pool shard (where
        this engine saved them), without waiting, so a prefix kept hot in HBM does not age out of the pool."""
        n = min(cached_tokens // self.settings.block_size, len(request.block_keys))
        if self.pool is None or self._local_shard is None or n <= 0:
            return
        try:
            keys = rank_interleaved(request.block_keys[:n], self._tp_world)
            self._local_shard.async_client().touch_nowait(keys, self._fingerprint)
            self.pool_touches += 1
        except Exception as exc:  # noqa: BLE001 - eviction order only
            log.debug("replica %s: pool touch failed: %s", self.replica_id, exc)

    async def _plan_hint(self, request: GenerateRequest) -> str | None:
        """The pool shard the connector should look at first: the plan's (FETCH), or for a SPLIT the shard that
        holds the tail once the head is computed and the tail staged on this node (``deployments.split_staging``)."""
        plan = request.fetch_plan
        if self.pool is None or plan is None:
            return None
        if request.action != "split":
            return plan.shard_id
        self.split_stats.splits += 1
        local = self._local_shard
        # The router planned on the keys it sent (its pool hits are keyed the same way), so they are the pool's;
        # a caller that sent none (an operator, a test) gets them computed here.
        keys = list(request.block_keys)
        if not keys:
            from kvpool.keys import chain_keys

            keys = [bytes(k) for k in chain_keys(self.key_root(request.cache_salt), request.prompt_token_ids,
                                                 self.settings.block_size)]
        outcome = await stage_split(
            self.engine, request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            pool_keys=keys,
            plan=plan, block_size=self.settings.block_size, node_id=self.node_id,
            local_shard=local.async_client() if local is not None else None,
            local_shard_id=local.shard_id if local is not None else "", fingerprint=self._fingerprint,
            deadline_s=SPLIT_STAGING_DEADLINE_S, cache_salt=request.cache_salt,
            tensor_parallel=self._tp_world,
        )
        if outcome.pulled and outcome.pull_s > 0:  # a pool fetch like any other, for the routers' tier fits
            self._pending_samples.append(TransferSample(plan.shard_id, plan.tier == "ssd", outcome.pull_bytes,
                                                        outcome.pull_s, read_s=outcome.pull_s))
        self.split_stats.heads_computed += int(outcome.head_s > 0)
        self.split_stats.blocks_pulled += outcome.pulled
        self.split_stats.failures += int(bool(outcome.error))
        return outcome.hint_shard

    # -- control ---------------------------------------------------------------------------------------------
    async def control(self, request: ControlRequest) -> dict[str, Any]:
        """Operator calls routed to this replica (``router.wire.ControlRequest``)."""
        check_version(request.version, "ControlRequest")
        if request.target_replica != self.replica_id:
            return {"replica_id": self.replica_id, "ok": False, "error": "reached the wrong replica (target gone?)"}
        if request.op == "reset_prefix_cache":
            ok, why = await self.reset_prefix_cache()
            return {"replica_id": self.replica_id, "ok": ok, **({"error": why} if why else {})}
        if request.op == "info":
            return {"ok": True, **await self.info()}
        if request.op == "engine_metrics":  # vLLM's own vllm:* series of this replica's engine
            from router.engine_metrics import engine_metrics_text

            return {"replica_id": self.replica_id, "ok": True, "text": engine_metrics_text()}
        return {"replica_id": self.replica_id, "ok": False, "error": f"unknown op {request.op!r}"}

    async def reset_prefix_cache(self, deadline_s: float = RESET_DEADLINE_S) -> tuple[bool, str]:
        """Drop the engine's prefix cache; (ok, why not). vLLM refuses while a request holds blocks: asked again
        until ``deadline_s``. The HBM view the routers get is cleared only once the engine's cache really is."""
        end = time.monotonic() + deadline_s
        while True:
            ok = await self.engine.reset_prefix_cache()
            if ok is None or ok:
                with self.ledger.lock:
                    self.ledger.clear()
                return True, ""
            if time.monotonic() >= end:
                return False, (f"vLLM kept refusing to reset its prefix cache for {deadline_s:.0f} s: blocks in use "
                               f"({self.running} running, {self.prefills.waiting} waiting)")
            await asyncio.sleep(0.2)

    async def info(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "node_id": self.node_id, "startup_s": self.startup_s,
                "running": self.running, "waiting": self.prefills.waiting, "hbm_blocks": len(self.ledger.snapshot()),
                "kv_events_skipped": self._events.translator.skipped if self._events else 0,
                "split": dataclasses.asdict(self.split_stats), "pool_touches": self.pool_touches,
                "placement": msgspec.to_builtins(self.cpu_claim.placement)}

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (read by request routers that use it)."""
        return {"running": self.running, "waiting": self.prefills.waiting}

    async def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine of replica {self.replica_id} has errored")

    def _transfer_samples(self) -> list[TransferSample]:
        """The pool fetches finished since the last call: this replica's SPLIT pulls and the engine connector's
        loads of a read that has answered (``deployments.transfer_drain``: started after new requests finished
        here; the report never waits for it)."""
        samples, self._pending_samples = self._pending_samples, []
        if self.pool is not None:
            samples += self._transfers.collect(self._served)
        return samples

    async def _read_transfer_records(self) -> list[TransferSample]:
        from kvpool.connector.kv_connector import drain_transfer_records
        from kvpool.connector.meta import TransferRecord

        per_worker = await self.engine.collective_rpc(drain_transfer_records)
        return [TransferSample(rec.shard_id, rec.ssd_blocks > 0, rec.bytes_moved, rec.seconds, read_s=rec.read_s)
                for raw in (r for worker in per_worker for r in (worker or []))
                for rec in [msgspec.msgpack.decode(raw, type=TransferRecord)]]

    async def _publish_loop(self) -> None:
        first = True
        while True:
            transfers = self._transfer_samples()
            with self.ledger.lock:
                stored, removed = self.ledger.drain()
                snapshot = self.ledger.snapshot() if first else []
            self._seq += 1
            report = ReplicaReport(
                replica_id=self.replica_id, node_id=self.node_id, seq=self._seq, running=self.running,
                waiting=self.prefills.waiting, waiting_tokens=self.prefills.tokens,
                waiting_tokens_sq=self.prefills.tokens_sq, head=self.prefills.head(time.monotonic()),
                layout_fingerprint=self._fingerprint, stored=snapshot if first else stored,
                removed=[] if first else removed, full=first, sent_at=time.time(), transfers=transfers,
                placement=self.cpu_claim.placement, profile=self.profile, kv=self.kv_occupancy.occupancy(),
            )
            try:
                held = await asyncio.wait_for(self._hub.publish_replica.remote(msgspec.msgpack.encode(report)),
                                              timeout=5.0)
                first = held is False  # the hub forgot this replica (silent too long) or restarted: a full report
            except Exception as exc:  # hub restarting: look it up again, resend a full snapshot next time
                log.warning("replica %s: stats publish failed: %s", self.replica_id, exc)
                first = True
                try:
                    self._hub = get_or_create_hub(*self._hub_address)
                except Exception as lookup_exc:  # noqa: BLE001 - retried on the next round
                    log.warning("replica %s: hub lookup failed: %s", self.replica_id, lookup_exc)
            await asyncio.sleep(self._stats_interval_s)

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
        if getattr(self, "_transfers", None) is not None:
            self._transfers.close()
        if getattr(self, "_events", None) is not None:
            self._events.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        claim = getattr(self, "cpu_claim", None)
        if claim is not None:
            claim.release()


def request_timeline(metrics: Any, received: float, plan_s: float) -> ReplicaTimeline:
    """The replica's timeline of one request at its first output: vLLM's engine-core timestamps (``RequestStateStats``,
    monotonic like ``received``) as offsets from the replica receiving the request."""
    def since(ts: float) -> float:
        return ts - received if ts else -1.0

    return ReplicaTimeline(
        plan_s=plan_s,
        queued_s=since(getattr(metrics, "queued_ts", 0.0)),
        scheduled_s=since(getattr(metrics, "scheduled_ts", 0.0)),
        first_token_s=since(getattr(metrics, "first_token_ts", 0.0)),
        first_chunk_s=time.monotonic() - received,
    )
