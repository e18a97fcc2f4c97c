"""PoolKeeper: the Serve deployment through which the KV pool belongs to the app.

Contract: while the app is deployed — by ``kvstack serve``, ``serve run`` / ``serve deploy`` of the file ``kvstack
serve-config`` writes, or KubeRay's ``serveConfigV2`` — one ``PoolKeeper`` replica makes sure every alive node that
can run replicas (a node with CPUs; a 0-CPU head gets none) has its named pool shard (``kvpool.shard.registry``),
sized from the app's models by ``deployments.pool_setup.shard_config``. It looks every ``interval_s`` seconds, so a node
that joins later (KubeRay's autoscaler adding a worker for a new replica) gets its shard within one interval, before
or while that replica starts (the replica also ensures its own node's shard before its engine starts:
``ensure_local_shard``; both are idempotent, the shard is a detached actor found by name). A shard on a node that
leaves dies with it and drops out of ``kvpool.shard.registry.list_shards``, which is how the routers forget it.

Built by ``deployments.app.build_app`` when ``app.pool.enabled`` (0 CPUs, one replica) and bound into the ingress's
arguments so Serve deploys it with the app. Every Ray call runs off the event loop with a deadline; a failed pass is
logged and retried at the next interval. ``status()`` reports the last pass (tests, ``kvstack status``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from deployments.app_config import PoolSettings
from deployments.engine_settings import EngineSettings

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
SHARD_READY_DEADLINE_S = 120.0


class PoolKeeper:
    def __init__(self, engines: list[EngineSettings], pool: PoolSettings | dict[str, Any],
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.engines = [e if isinstance(e, EngineSettings) else EngineSettings.model_validate(e) for e in engines]
        self.pool = pool if isinstance(pool, PoolSettings) else PoolSettings.model_validate(pool)
        self.interval_s = interval_s
        self.passes = 0
        self.started: list[str] = []  # node ids this keeper started a shard on
        self.last_error = ""
        self.last_pass_unix_s = 0.0
        self._task = asyncio.get_event_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                started = await asyncio.wait_for(asyncio.to_thread(self.ensure_shards),
                                                 timeout=SHARD_READY_DEADLINE_S + 30)
                self.started += started
                self.last_error = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a node that went away mid-start, GCS busy: next pass
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("pool keeper: %s", self.last_error)
            self.passes += 1
            self.last_pass_unix_s = time.time()
            await asyncio.sleep(self.interval_s)

    def ensure_shards(self) -> list[str]:
        """Start a shard on every alive node with CPUs that has none; the node ids it started them on."""
        from deployments.pool_setup import shard_config
        from kvpool.shard.placement import alive_nodes, build_pool
        from kvpool.shard.registry import list_shards

        have = {h.node_id for h in list_shards()}
        missing = [n["NodeID"] for n in alive_nodes() if n["NodeID"] not in have]
        if not missing:
            return []
        log.info("pool keeper: starting shards on %d node(s): %s", len(missing), [m[:12] for m in missing])
        handles = build_pool(lambda node: shard_config(self.engines, self.pool, node), nodes=missing, detached=True,
                             ready_deadline_s=SHARD_READY_DEADLINE_S)
        return [h.node_id for h in handles]

    async def status(self) -> dict[str, Any]:
        return {"passes": self.passes, "started_on": list(self.started), "last_error": self.last_error,
                "last_pass_unix_s": self.last_pass_unix_s, "interval_s": self.interval_s}

    async def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError(f"pool keeper loop ended: {self._task.exception()!r}")
