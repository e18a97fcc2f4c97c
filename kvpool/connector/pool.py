"""The connector's handle on the pool shards: named Ray actors resolved lazily, parallel deadline-bounded lookups.

Who calls what: the connector's scheduler role (lookups, leases, releases) and worker role (transfer metadata,
reserve / commit / abort of saves) each own one ``PoolShards``. Every call goes through ``kvpool.shard.client``
(typed, versioned, deadline-bounded); ``lookup_many`` fans several lookups out in one round trip
(``kvpool.shard.client.lookup_many``). A shard that does not answer is a miss on the read path
(``ShardUnavailableError`` is caught by the callers), never a crash, and is skipped for a while after
(``kvpool.connector.breaker``).
``KnownPeers`` is the worker role's (and its saver's) record of which shards' transfer metadata an endpoint holds, and
of which of them it reaches through shared memory (the shard on its own node, ``kvpool.transfer.shm``).
The engine's processes are not Ray workers: ``ensure_ray`` joins the cluster as a driver and stops the driver's
GCS error poller (``stop_driver_error_listener``), which otherwise takes CPU from the engine's own core.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpool.connector.breaker import ShardBreaker
from kvpool.connector.config import ConnectorConfig, ShardRef
from kvpool.deadline import GCS_DEADLINE_S

log = logging.getLogger(__name__)

REDISCOVER_S = 10.0  # at most one registry listing per this many seconds


class KnownPeers:
    """The shard agents whose transfer metadata ``endpoint`` holds, by the shard epoch it came from: ``ensure`` fetches
    and adds a shard's metadata only when it has none of that epoch (first contact, the shard restarted, or a
    failure made the caller ``forget`` it). One per endpoint, used from one thread.

    With a ``same_host`` endpoint (``kvpool.transfer.shm``) it also maps the shards that export their arena to this
    host: ``ensure(..., fetch_same_host=...)`` tries once per shard epoch (a refusal — another host, no export, an old
    shard — is logged and remembered: that epoch goes through ``endpoint``), and ``endpoint_for`` names the endpoint
    to move a shard's bytes with. Buffers are registered with both (``register``: the same region id in each).

    ``fence()`` (after a transfer that reported ``settled=False``: it may still land) closes the transfer endpoint —
    destroying its agent ends every transfer it started — and replaces it with ``remake()``, the same buffers
    registered under the same region ids, every shard's metadata to be fetched again. Shared memory copies are
    synchronous: ``same_host`` is kept."""

    def __init__(self, endpoint: Any, same_host: Any = None, remake: Any = None) -> None:
        self._endpoint = endpoint
        self._same_host = same_host
        self._remake = remake  # () -> a new transfer endpoint (``fence``)
        self._buffers: list[tuple[int, memoryview]] = []  # (region id, buffer) in order (``fence`` registers again)
        self.fences = 0
        self._epochs: dict[str, str] = {}  # agent name -> shard epoch whose metadata the endpoint holds
        self._shared: dict[str, str] = {}  # agent name -> shard epoch mapped through ``same_host``
        self._refused: dict[str, str] = {}  # agent name -> shard epoch ``same_host`` could not map

    def register(self, buffer: memoryview) -> int:
        """Register local memory with the endpoint (and ``same_host``); returns its region id (the same in both)."""
        rid = self._endpoint.register(buffer)
        if self._same_host is not None and self._same_host.register(buffer) != rid:
            raise RuntimeError("the shared-memory endpoint's regions diverged from the transfer endpoint's")
        self._buffers.append((rid, buffer))
        return rid

    @property
    def transfer_endpoint(self) -> Any:
        return self._endpoint

    def fence(self) -> None:
        """End every transfer the transfer endpoint started (see the class doc); returns once none can land."""
        if self._remake is None:
            raise RuntimeError("KnownPeers.fence needs a remake() for its transfer endpoint")
        old, self._endpoint = self._endpoint, None
        old.close()
        self._endpoint = fresh = self._remake()
        for rid, buffer in self._buffers:
            if fresh.register(buffer) != rid:
                raise RuntimeError("a fenced endpoint's regions diverged from the old one's")
        self._epochs.clear()
        self.fences += 1

    def ensure(self, agent_name: str, epoch: str, fetch_metadata: Any, fetch_same_host: Any = None) -> None:
        """Trust the shard's current transfer metadata; ``fetch_metadata()`` returns its encoded metadata and
        ``fetch_same_host()`` (when given: the shard may be reached through shared memory) its shared-memory one."""
        from kvpool.transfer.base import decode_metadata

        if self._epochs.get(agent_name) != epoch:
            self._endpoint.add_peer(decode_metadata(fetch_metadata()))
            self._epochs[agent_name] = epoch
        if (self._same_host is None or fetch_same_host is None or self._shared.get(agent_name) == epoch
                or self._refused.get(agent_name) == epoch):
            return
        try:
            self._same_host.add_peer(decode_metadata(fetch_same_host()))
        except Exception as exc:  # noqa: BLE001 - shared memory is a shortcut; the transfer endpoint still works
            log.info("kvpool connector: %s is not reachable through shared memory (%s); using %s", agent_name,
                     exc, getattr(self._endpoint, "backend", "the transfer endpoint"))
            self._shared.pop(agent_name, None)
            self._refused[agent_name] = epoch
        else:
            self._shared[agent_name] = epoch

    def shared(self, agent_name: str, epoch: str) -> bool:
        """Whether the shard's ``epoch`` is trusted and mapped through shared memory (a read needs no call first)."""
        return (self._same_host is not None and self._epochs.get(agent_name) == epoch
                and self._shared.get(agent_name) == epoch)

    def endpoint_for(self, agent_name: str) -> Any:
        """The endpoint that moves this shard's bytes: shared memory when it is mapped for the shard's current
        epoch, else the transfer endpoint."""
        if self._same_host is not None and agent_name in self._shared and \
                self._shared[agent_name] == self._epochs.get(agent_name):
            return self._same_host
        return self._endpoint

    def forget(self, agent_name: str | None = None) -> None:
        """Refetch the metadata of ``agent_name`` (of every shard when None) on the next ``ensure``."""
        if agent_name is None:
            self._epochs.clear()
            self._shared.clear()
            self._refused.clear()
        else:
            self._epochs.pop(agent_name, None)
            self._shared.pop(agent_name, None)
            self._refused.pop(agent_name, None)

    def close(self) -> None:
        """Close the endpoints."""
        self._endpoint.close()
        if self._same_host is not None:
            self._same_host.close()


class GuardedClient:
    """A ``ShardClient`` whose blocking calls report to the ``PoolShards``' breaker: a shard that did not answer or
    is dead counts as a failure (and its handle is dropped), any answer as a success. Other attributes (``handle``,
    ``send_lookup``, ``release_nowait``) are the client's own."""

    _GUARDED = frozenset({"info", "transfer_metadata", "shm_metadata", "lookup", "lease", "release", "reserve",
                          "commit", "abort", "stats", "entry_info", "demote"})

    def __init__(self, client: Any, shards: PoolShards) -> None:
        self._client, self._shards = client, shards

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self._GUARDED:
            return attr
        from kvpool.shard.wire import ShardUnavailableError

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                out = attr(*args, **kwargs)
            except ShardUnavailableError:  # ShardDeadError too: no answer in time, or no actor
                self._shards.forget(self._client.shard_id)
                raise
            self._shards.breaker.success(self._client.shard_id)
            return out

        return guarded


class PoolShards:
    """The shards one connector role talks to. Thread-safe (the scheduler role calls from its pool-call threads).

    Every shard call passes the breaker (``kvpool.connector.breaker``): a shard that failed is skipped (a miss, at
    once) until its backoff has passed, then probed. Every GCS look-up (discovery, an actor by name) has a deadline
    (``kvpool.shard.registry``). ``local_shard_id(wait=False)`` never waits: it answers from what is known and
    resolves the rest on a background thread (the worker's forward path and the scheduler's step call it)."""

    def __init__(self, cfg: ConnectorConfig, breaker: ShardBreaker | None = None) -> None:
        self._cfg = cfg
        self.breaker = breaker if breaker is not None else ShardBreaker()
        self._lock = threading.RLock()
        self._refs: dict[str, ShardRef] = {s.shard_id: s for s in cfg.shards}
        self._discover = not cfg.shards
        self._discovered_at = -REDISCOVER_S
        self._clients: dict[str, Any] = {}
        self._local: str | None = None
        self._local_resolved = False
        self._resolving: threading.Thread | None = None

    @property
    def shard_ids(self) -> list[str]:
        self._maybe_discover()
        with self._lock:
            return list(self._refs)

    def _maybe_discover(self, force: bool = False) -> None:
        """Refresh the shard list from the named actors of ``kvpool.shard.registry`` (discovery mode only)."""
        now = time.monotonic()
        with self._lock:
            if not self._discover or (not force and self._refs and now - self._discovered_at < REDISCOVER_S):
                return
            if now - self._discovered_at < 1.0:
                return
            self._discovered_at = now
        from kvpool.shard.registry import list_shards, shard_actor_name

        try:
            self.ensure_ray()
            found = list_shards(self._cfg.ray_namespace, GCS_DEADLINE_S)
        except Exception as exc:  # the GCS is busy or gone: keep what we have
            log.warning("kvpool connector: shard discovery failed: %s", exc)
            return
        with self._lock:
            self._refs = {s.shard_id: ShardRef(s.shard_id, shard_actor_name(s.node_id), s.node_id) for s in found}

    def ensure_ray(self) -> None:
        """Connect this process to the Ray cluster (``ShardUnavailableError`` when there is none to join)."""
        import ray

        from kvpool.shard.wire import ShardUnavailableError

        if ray.is_initialized():
            return
        try:
            ray.init(
                address=self._cfg.ray_address or "auto",
                namespace=self._cfg.ray_namespace,
                logging_level="warning",
                log_to_driver=False,
            )
        except Exception as exc:  # no cluster to join: the pool is unreachable, reads are misses
            raise ShardUnavailableError(f"cannot connect to the Ray cluster: {exc}") from exc
        stop_driver_error_listener()

    def client(self, shard_id: str, *, allowed: bool = False) -> Any:
        """``GuardedClient`` of a shard; ``ShardUnavailableError`` if its breaker is open or its actor cannot be
        found. ``allowed``: the caller already passed the breaker for this operation (one operation asks it once:
        a second ``allow`` would refuse the caller's own half-open probe, and the shard would never recover)."""
        from kvpool.shard.client import ShardClient
        from kvpool.shard.registry import get_named_actor
        from kvpool.shard.wire import ShardUnavailableError

        if not allowed and not self.breaker.allow(shard_id):
            raise ShardUnavailableError(f"shard {shard_id}: skipped (it failed recently; retried after a backoff)")
        with self._lock:
            client = self._clients.get(shard_id)
            ref = self._refs.get(shard_id)
        if client is not None:
            return client
        if ref is None:
            self._maybe_discover(force=True)
            with self._lock:
                ref = self._refs.get(shard_id)
        if ref is None:
            raise ShardUnavailableError(f"unknown shard {shard_id!r}; configured: {self.shard_ids}")
        self.ensure_ray()
        try:
            handle = get_named_actor(ref.actor_name, self._cfg.ray_namespace, GCS_DEADLINE_S)
        except ValueError as exc:
            self.breaker.failure(shard_id)
            raise ShardUnavailableError(f"shard {shard_id}: no actor named {ref.actor_name!r}: {exc}") from exc
        except ShardUnavailableError:
            self.breaker.failure(shard_id)
            raise
        client = GuardedClient(ShardClient(handle, shard_id, deadline_s=self._cfg.lease_deadline_s), self)
        with self._lock:
            self._clients[shard_id] = client
        return client

    def forget(self, shard_id: str) -> None:
        """The shard failed (no answer, dead actor, a failed transfer): drop its cached handle (the next call
        resolves the name again) and count the failure in its breaker."""
        with self._lock:
            self._clients.pop(shard_id, None)
        self.breaker.failure(shard_id)

    def local_shard_id(self, *, wait: bool = True) -> str | None:
        """The shard that receives saves: ``local_shard`` or the shard on this process's Ray node. ``wait=False``:
        answer from what is known now (None until resolved) and resolve on a background thread."""
        if self._cfg.local_shard:
            return self._cfg.local_shard
        with self._lock:
            if self._local is not None and self._local in self._refs:
                return self._local
            if self._local_resolved and not self._discover:
                return None
            if not wait:
                if self._resolving is None or not self._resolving.is_alive():
                    self._resolving = threading.Thread(target=self._resolve_local, name="kvpool-local-shard",
                                                       daemon=True)
                    self._resolving.start()
                return self._local if self._local in self._refs else None
        return self._resolve_local()

    def _resolve_local(self) -> str | None:
        from kvpool.shard.wire import ShardUnavailableError

        try:
            self.ensure_ray()
        except ShardUnavailableError as exc:
            if not self._local_resolved:
                log.warning("kvpool connector: %s; saves are off", exc)
            self._local_resolved = True
            return None
        import ray

        node = self._cfg.node_id or ray.get_runtime_context().get_node_id()
        self._maybe_discover()
        with self._lock:
            local = next((s.shard_id for s in self._refs.values() if s.node_id == node), None)
            if local is None and not self._local_resolved:
                log.warning("kvpool connector: no pool shard on this node (%s); saves are off until one appears",
                            node)
            self._local, self._local_resolved = local, True
        return local

    def lookup_many(
        self, calls: Sequence[tuple[str, Sequence[bytes]]], fingerprint: str, deadline_s: float,
        *, lease_ttl_s: float | None = None,
    ) -> list[Any]:
        """Run ``lookup(keys)`` on each ``(shard_id, keys)`` at once; the ``LookupResult`` of each, or None where the
        shard failed, did not answer within ``deadline_s``, or is skipped by its breaker. With ``lease_ttl_s`` the
        first call leases instead (``kvpool.shard.client.lookup_many``): its entry is the ``LeaseReply`` (or None)."""
        from kvpool.shard.client import lookup_many
        from kvpool.shard.wire import LeaseReply, LookupReply, ShardUnavailableError

        clients: list[Any] = []
        for shard_id, _ in calls:
            try:
                clients.append(self.client(shard_id))
            except ShardUnavailableError as exc:
                log.debug("kvpool connector: lookup on %s skipped: %s", shard_id, exc)
                clients.append(None)
        sent = [(c._client, keys) for c, (_, keys) in zip(clients, calls, strict=True) if c is not None]
        lease_first = lease_ttl_s is not None and bool(clients) and clients[0] is not None
        replies = iter(lookup_many(sent, fingerprint, deadline_s, lease_ttl_s=lease_ttl_s if lease_first else None))
        out: list[Any] = []
        for i, ((shard_id, _), c) in enumerate(zip(calls, clients, strict=True)):
            reply = None if c is None else next(replies)
            kind = LeaseReply if i == 0 and lease_first else LookupReply
            if c is not None and not isinstance(reply, kind):  # no answer in time, a dead actor, a bad reply
                log.warning("kvpool connector: lookup on %s failed: %s", shard_id, reply or "no answer in time")
                self.forget(shard_id)
            elif c is not None:
                self.breaker.success(shard_id)
            out.append(reply.result if isinstance(reply, LookupReply) else reply if isinstance(reply, kind) else None)
        return out


def stop_driver_error_listener(join_s: float = 2.0) -> bool:
    """Stop the thread Ray starts in every driver to print the cluster's error messages; True once it is gone.

    The engine's processes join the cluster as drivers (they are not Ray workers), and there that thread long-polls
    the GCS in a tight loop: measured with Ray 2.60 on a local cluster, ~110 ``GcsSubscriberPoll`` calls per second
    per driver (the GCS's ``ObservabilityPubSubService`` event stats), ~13% of the engine's own core in the listener
    and gRPC threads, and GCS CPU for each of them. The engine never reads those messages (they are in the Ray logs),
    so it stops the thread the way ``ray.shutdown`` does: ``threads_stopped``, which only the error listener and the
    log printer (off: ``log_to_driver=False``) watch, and closing the error subscriber it polls. Ray's private driver state; if it changes, nothing is stopped
    and the engine runs as before (a warning says so)."""
    try:
        from ray._private.worker import global_worker

        stopped, thread = global_worker.threads_stopped, global_worker.listener_thread
        subscriber = global_worker.gcs_error_subscriber
    except (ImportError, AttributeError) as exc:
        log.warning("kvpool connector: cannot stop Ray's driver error listener (%s): it keeps polling the GCS", exc)
        return False
    stopped.set()
    # The thread checks the event between long polls; closing its subscriber (what ``ray.shutdown`` does next)
    # ends the poll in flight, so the thread is gone at once instead of after the GCS answers (seconds on a busy
    # box: the join used to run out).
    subscriber.close()
    thread.join(join_s)
    return not thread.is_alive()
