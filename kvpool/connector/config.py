"""Typed configuration of the vLLM kvpool connector, parsed once from ``kv_connector_extra_config``.

Who calls what: whoever builds an engine (the Serve replica, tests, the reuse bench) calls
``kv_transfer_config(ConnectorConfig(...))`` to get the ``KVTransferConfig`` that registers ``KvPoolConnector``
from outside vLLM; both connector roles call ``ConnectorConfig.from_extra`` in their constructors. Unknown keys
are refused (a typo must not silently disable the pool). Nothing here reads the environment.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

CONNECTOR_NAME = "KvPoolConnector"
CONNECTOR_MODULE = "kvpool.connector.kv_connector"  # vLLM's kv_connector_module_path (the one place it is set)
EXTRA_KEY = "kvpool"  # kv_connector_extra_config = {"kvpool": <ConnectorConfig as builtins>}


class ShardRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the connector reaches one pool shard: its id, its named Ray actor, and the node it runs on."""

    shard_id: str
    actor_name: str
    node_id: str = ""


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the connector needs; defaults in one place.

    - ``model_id``: the block-key namespace's model id ("" = vLLM's served model name).
    - ``shards``: every pool shard the connector may read from; empty = discover the named shards of
      ``kvpool.shard.registry`` (one per node, refreshed when a shard is missing). ``local_shard`` (or, when empty,
      the shard whose ``node_id`` is this process's Ray node) receives saves. ``lookup_remote``: also look up the other shards
      (one parallel round trip); off = local shard only (a router plan can still name another shard).
    - ``ray_address`` / ``node_id``: for an engine core that is not itself a Ray worker (vLLM's multiprocess mode
      runs it in a subprocess of the replica): the cluster to join ("" = this process's Ray or "auto") and the
      node it runs on ("" = the Ray runtime context's node), which picks the local shard.
    - ``backend``: the transfer implementation (``kvpool.transfer``), must match the shards'.
    - Deadlines in seconds: every wait is bounded. ``lease_ttl_s`` bounds how long a crashed engine can pin blocks.
    - ``load`` / ``save``: switch either direction off (e.g. a read-only replica).
    - ``save_staging_bytes``: the background saver's staging memory per worker, the bound on save bytes in flight
      (``kvpool.connector.saver``); blocks that find it full are not saved.
    - ``shared_memory``: reach the own node's shard through shared memory (``kvpool.transfer.shm``: loads and saves
      are one memory copy) when it exports its arena; the other shards, and a shard that does not export, through
      ``backend``.
    - ``lease_on_lookup``: a lookup leases what it finds (on its first candidate shard in the lookup's own round
      trip; on another shard that holds more, one more round trip; both on the pool-call thread, before vLLM's ask
      is answered), so the load is handed to the worker in the step vLLM allocates its blocks; off = the lease
      starts at the allocation and the load goes out a step later (``kvpool.connector.scheduler``). Not for hybrid
      models (their hit ends where a state is held).
    - ``saver_nice``: the nice value (0..19) of the background saver's thread. On Linux each thread has its own
      scheduling priority. The saver shares the worker's cores with the forward pass and the output path, and saves
      are asynchronous by design. So with 19 (the default) the saver runs when the engine's threads leave a core
      idle, and a save waits instead of the request that computed the blocks. 0 gives it the engine's priority.
      Negative values would need privileges and are refused.
    - ``saver_max_lag_s``: with ``saver_nice`` > 0, a save that has waited this long in the saver's queue is taken
      by a second saver thread that keeps the engine's priority (beside threads that keep every core busy, a
      nice-19 thread gets ~1.5% of a core and saves fell behind without end; ``kvpool.connector.saver``). 0: no
      second thread.
    - ``inline_load_max_bytes``: a pool hit on the own node's shard, already leased by its lookup
      (``lease_on_lookup``), of at most this many bytes per worker, is loaded inside the step that allocates it (vLLM's
      synchronous load: one shared-memory copy and its checksums on the model runner's thread before the forward),
      instead of in the background with the request waiting one more engine step. 0: every load in the background.
      Not for hybrid models. ``kvpool.connector.scheduler``, "Inline loads".
    """

    shards: list[ShardRef] = []
    model_id: str = ""
    local_shard: str = ""
    lookup_remote: bool = True
    ray_namespace: str = "kvstack"  # where the named shard actors live (kvpool.shard.wire.SHARD_NAMESPACE)
    ray_address: str = ""
    node_id: str = ""
    backend: Literal["nixl", "tcp"] = "nixl"
    endpoint_options: dict[str, str | int | float | bool] = {}
    lookup_deadline_s: float = 2.0
    lease_deadline_s: float = 5.0
    lease_ttl_s: float = 120.0
    transfer_deadline_s: float = 10.0
    save_deadline_s: float = 10.0
    save_staging_bytes: int = 256 << 20  # np.zeros: pages are touched only as slots are used
    load: bool = True
    save: bool = True
    shared_memory: bool = True
    lease_on_lookup: bool = True
    saver_nice: int = 19
    saver_max_lag_s: float = 1.0
    inline_load_max_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("lookup_deadline_s", "lease_deadline_s", "lease_ttl_s", "transfer_deadline_s", "save_deadline_s",
                     "save_staging_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kvpool connector: {name} must be positive, got {getattr(self, name)}")
        if self.inline_load_max_bytes < 0:
            raise ValueError(f"kvpool connector: inline_load_max_bytes must be >= 0, got {self.inline_load_max_bytes}")
        if not 0 <= self.saver_nice <= 19:
            raise ValueError(f"kvpool connector: saver_nice must be in [0, 19], got {self.saver_nice}")
        if self.saver_max_lag_s < 0:
            raise ValueError(f"kvpool connector: saver_max_lag_s must be >= 0, got {self.saver_max_lag_s}")
        ids = [s.shard_id for s in self.shards]
        if len(set(ids)) != len(ids):
            raise ValueError(f"kvpool connector: duplicate shard ids {ids}")
        if self.shards and self.local_shard and self.local_shard not in ids:
            raise ValueError(f"kvpool connector: local_shard {self.local_shard!r} is not among shards {ids}")

    @staticmethod
    def from_extra(extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config`` (empty = all defaults); a malformed entry is a clear error."""
        if not extra:
            return ConnectorConfig()
        unknown = set(extra) - {EXTRA_KEY}
        if unknown:
            raise ValueError(f"kvpool connector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        try:
            return msgspec.convert(extra.get(EXTRA_KEY, {}), ConnectorConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"kvpool connector: bad configuration: {exc}") from exc

    def to_extra(self) -> dict[str, Any]:
        return {EXTRA_KEY: msgspec.to_builtins(self)}


def kv_transfer_config(
    cfg: ConnectorConfig, *, connector: str = CONNECTOR_NAME, module_path: str = CONNECTOR_MODULE
) -> Any:
    """The ``vllm.config.KVTransferConfig`` registering the connector from outside vLLM.

    ``kv_load_failure_policy="recompute"``: a block that fails to arrive is recomputed, never fails the request
    (the connector refuses to start under the "fail" policy). ``connector`` / ``module_path`` name a subclass
    (tests inject faults that way).
    """
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=cfg.to_extra(),
    )
