"""Pull: a pool shard copies blocks from a peer shard into its own DRAM arena (the one transfer a shard initiates).

Who calls what: ``PoolShard.pull`` (``kvpool.shard.actor``) hands every ``PullRequest`` to its one ``Puller``;
clients call ``ShardClient.pull`` (sync) or ``AsyncShardClient.pull`` (async, on an event loop). Callers: the
replica for the router's SPLIT action (the tail of a prefix is pulled into the shard on the replica's node while
vLLM computes the head; vLLM's connector then loads it from that local shard), and anyone who wants blocks
replicated onto a node. The source is reached through ``kvpool.shard.client.ShardClient`` (``ActorSource``).

Mechanism, on the target shard (one actor thread per pull; the store is thread-safe and locks itself only inside its
own calls, never while a Ray call or a transfer waits):
1. Keys this shard already holds under the fingerprint are skipped (``present``).
2. The source is resolved by id (``named_shard_resolver``: ``kvpool.shard.registry.find_shard``) and cached
   per id; a cached handle that turns out dead is dropped and resolved once more within the deadline.
3. ``lease`` the rest on the source: it pins the longest prefix it holds; only that is pulled (the remainder is
   ``missing``). The reply must come from the shard asked for, and every leased block must be exactly this shard's
   slot size, else the pull is refused with an error (nothing reserved).
4. ``reserve`` that many local slots (fewer when DRAM is full of pinned blocks: the rest ``failed``).
5. Trust the source's transfer metadata (cached per agent name and source epoch; refetched when the source's epoch
   changes or after a failed read, like the connector worker's ``_ensure_peer``), then ONE batched
   ``endpoint.read`` from the leased offsets into the reserved slots with the time that is left.
6. ``commit`` the blocks that arrived with the checksums the lease returned: the store recomputes each checksum over
   the arena bytes (``kvpool.checksum``), so a block whose bytes do not match the source's checksum is rejected
   (``failed``) and never becomes visible.
7. Always (``finally``): abort the reservation if it was not committed, and release the source lease (sent even
   when the deadline has passed, waited for at most the time that is left; the lease's TTL ends it otherwise).

Deadlines: ``deadline_s`` bounds the whole pull (clamped to this store's reservation TTL, so the reserved slots
cannot expire under a running read); every Ray call and the read get the time that is left. A dead, frozen or
unknown source is a reply with ``failed`` = the blocks asked for and ``error`` set, within the deadline: never a
hang and never an exception. An invalid request (target == source, empty fingerprint, a key of the wrong length, a
non-positive deadline, a lease TTL shorter than the deadline) raises ``ValueError`` (``kvpool.shard.wire.check_pull``).

Known limits: the first resolution of a source lists the GCS's named actors on a helper thread, waited for with
the deadline (a hung GCS keeps that one thread waiting, not the pull). A lease whose reply came too late stays
pinned on the source until its TTL. Bytes of a read that was cancelled at its deadline are undefined (see
``kvpool.transfer.nixl``); those slots go back to the free list and whoever fills them next commits with checksums.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Protocol

import ray

from kvpool.shard.client import ShardClient
from kvpool.shard.registry import find_shard
from kvpool.shard.wire import (
    LeaseReply,
    PullReply,
    PullRequest,
    ShardDeadError,
    ShardUnavailableError,
    WireVersionError,
    check_pull,
)
from kvpool.store import BlockStore
from kvpool.transfer.base import BlockOp, StaleMetadataError, TransferEndpoint, decode_metadata

log = logging.getLogger(__name__)

Clock = Callable[[], float]
PULL_COUNTERS = (
    "pulls",  # pull requests served (valid ones)
    "pull_errors",  # pulls whose reply carried an error
    "pulled_blocks",  # committed by pulls
    "pull_failed_blocks",
    "pull_present_blocks",
    "pull_missing_blocks",
    "pull_bytes",  # bytes read from sources
)


class PullSourceError(RuntimeError):
    """The source shard answered a pull's call with an error (e.g. a lease TTL above its maximum)."""


class PullSource(Protocol):
    """What a pull needs from its source shard. Every call is bounded by ``deadline_s`` (seconds from now) and
    raises ``ShardUnavailableError`` / ``PullSourceError`` on failure."""

    shard_id: str

    def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float, deadline_s: float) -> LeaseReply: ...

    def release(self, lease_id: int, deadline_s: float) -> bool:
        """Send the release; wait at most ``deadline_s`` (<= 0: do not wait) for its answer. Never raises."""
        ...

    def transfer_metadata(self, deadline_s: float) -> bytes: ...


Resolver = Callable[[str], PullSource]


# ---------------------------------------------------------------------------------------------- the source side
class ActorSource:
    """A source shard reached through its actor (``ShardClient``: typed, versioned, deadline-bounded calls); an error
    raised inside the source is a ``PullSourceError``."""

    def __init__(self, client: ShardClient) -> None:
        self.client = client
        self.shard_id = client.shard_id

    def _refused(self, what: str, exc: ray.exceptions.RayTaskError) -> PullSourceError:
        cause = getattr(exc, "cause", None) or exc
        return PullSourceError(f"source shard {self.shard_id}.{what} refused: {cause}")

    def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float, deadline_s: float) -> LeaseReply:
        try:
            return self.client.lease(keys, fingerprint, ttl_s, deadline_s=max(deadline_s, 0.0))
        except ray.exceptions.RayTaskError as exc:
            raise self._refused("lease", exc) from exc

    def release(self, lease_id: int, deadline_s: float) -> bool:
        if deadline_s <= 0:
            self.client.release_nowait(lease_id)
            return False  # sent; Ray delivers it in order after the lease
        try:
            return self.client.release(lease_id, deadline_s=deadline_s)
        except ray.exceptions.RayTaskError as exc:
            err: Exception = self._refused("release", exc)
        except (ShardUnavailableError, WireVersionError) as exc:
            err = exc
        log.warning("pull: release of lease %d on %s: %s (the lease expires on its own)", lease_id, self.shard_id, err)
        return False

    def transfer_metadata(self, deadline_s: float) -> bytes:
        try:
            return self.client.transfer_metadata(deadline_s=max(deadline_s, 0.0))
        except ray.exceptions.RayTaskError as exc:
            raise self._refused("transfer_metadata", exc) from exc


def named_shard_resolver(namespace: str) -> Resolver:
    """Shard id → ``ActorSource`` through the named shard actors of ``namespace`` (``kvpool.shard.registry``; the
    shard id is the node id or its first 12 characters). Raises ``ShardUnavailableError`` when no such actor lives."""

    def resolve(shard_id: str) -> PullSource:
        return ActorSource(find_shard(shard_id, namespace).client())

    return resolve


# ---------------------------------------------------------------------------------------------- the target side
@dataclass
class _Tally:
    """Outcome of one pull; ``failed`` is whatever was asked for and is neither present, pulled nor missing."""

    requested: int
    present: int = 0
    pulled: int = 0
    missing: int = 0
    bytes_moved: int = 0
    read_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.requested - self.present - self.pulled - self.missing


class Puller:
    """The pull mechanism of one shard (see the module docstring). Thread-safe: pulls may run concurrently."""

    def __init__(
        self,
        store: BlockStore,
        endpoint: TransferEndpoint | None,
        region_id: int,
        resolve: Resolver,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.store = store  # thread-safe on its own (kvpool.store)
        self.endpoint = endpoint
        self.region_id = region_id
        self._resolve = resolve
        self._clock = clock
        self._cache_lock = threading.Lock()  # guards the caches and counters below, never held while waiting
        self._sources: dict[str, PullSource] = {}
        self._peer_epochs: dict[str, str] = {}  # source agent name -> source epoch whose metadata we hold
        self._agents: dict[str, str] = {}  # source shard id -> its agent name
        self._counters = dict.fromkeys(PULL_COUNTERS, 0)
        self._resolver = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pull-resolve-{store.shard_id}")

    def counters(self) -> dict[str, int]:
        with self._cache_lock:
            return dict(self._counters)

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)

    def pull(self, req: PullRequest) -> PullReply:
        check_pull(self.store.shard_id, req)
        t0 = self._clock()
        deadline = t0 + min(req.deadline_s, self.store.config.reservation_ttl_s)
        keys = [bytes(k) for k in req.keys]
        held = self.store.held(keys, req.fingerprint)
        todo = [k for k, h in zip(keys, held, strict=True) if not h]
        t = _Tally(requested=len(keys), present=len(keys) - len(todo))
        if todo:
            if self.endpoint is None:
                t.errors.append(f"shard {self.store.shard_id} has no transfer endpoint (backend 'none'): "
                                "it cannot pull")
            else:
                self._pull(req, todo, deadline, t)
        reply = PullReply(
            shard_id=self.store.shard_id, epoch=self.store.epoch, requested=t.requested, present=t.present,
            pulled=t.pulled, failed=t.failed, missing=t.missing, bytes_moved=t.bytes_moved,
            seconds=self._clock() - t0, error="; ".join(t.errors), read_seconds=t.read_seconds,
        )
        with self._cache_lock:
            c = self._counters
            c["pulls"] += 1
            c["pull_errors"] += bool(reply.error)
            c["pulled_blocks"] += reply.pulled
            c["pull_failed_blocks"] += reply.failed
            c["pull_present_blocks"] += reply.present
            c["pull_missing_blocks"] += reply.missing
            c["pull_bytes"] += reply.bytes_moved
        if reply.error:
            log.warning("shard %s: pull of %d block(s) from %s: %d pulled, %d failed: %s", self.store.shard_id,
                        reply.requested, req.source_shard_id, reply.pulled, reply.failed, reply.error)
        return reply

    def _pull(self, req: PullRequest, todo: list[bytes], deadline: float, t: _Tally) -> None:
        def remaining() -> float:
            return deadline - self._clock()

        assert self.endpoint is not None  # checked by the caller
        src_id = req.source_shard_id
        source: PullSource | None = None
        lease_id = 0
        reservation_id: int | None = None
        try:
            source, rep = self._lease(req, todo, remaining)
            lease_id = rep.lease.lease_id
            blocks = rep.lease.blocks
            if rep.shard_id != src_id:
                t.errors.append(f"source {src_id!r} resolved to a shard that calls itself {rep.shard_id!r}")
                return
            t.missing = len(todo) - len(blocks)
            slot = self.store.config.slot_bytes
            wrong = sorted({b.length for b in blocks if b.length != slot})
            if wrong:
                t.errors.append(f"slot size mismatch: source shard {src_id} serves {wrong}-byte blocks, shard "
                                f"{self.store.shard_id} has {slot}-byte slots; refusing to pull")
                return
            if not blocks:
                return
            res = self.store.reserve(len(blocks))
            if res.slots:
                reservation_id = res.reservation_id
            if len(res.slots) < len(blocks):
                t.errors.append(f"DRAM of shard {self.store.shard_id} full of pinned blocks: reserved "
                                f"{len(res.slots)} of {len(blocks)} slots")
                blocks = blocks[: len(res.slots)]
            if not blocks:
                return
            self._ensure_peer(source, rep.agent_name, rep.epoch, remaining())
            if remaining() <= 0:
                t.errors.append(f"deadline of {req.deadline_s}s expired before the read")
                return
            ops = [BlockOp(rep.region_id, b.offset, self.region_id, off, b.length)
                   for b, off in zip(blocks, res.offsets, strict=False)]
            t_read = self._clock()
            result = self.endpoint.read(rep.agent_name, ops, remaining(), grants=[rep.lease.grant])
            t.read_seconds = self._clock() - t_read
            t.bytes_moved += result.bytes_moved
            if result.failed:
                t.errors.append(f"read of {len(result.failed)} block(s) from {src_id} failed: {result.error}")
                self._forget(src_id)
            ok = sorted(result.ok)
            if not ok:
                return
            out = self.store.commit(res.reservation_id, [blocks[i].key for i in ok],
                                    [blocks[i].checksum for i in ok], req.fingerprint, slot_index=ok)
            reservation_id = None
            t.pulled += len(out.committed)
            t.present += len(out.duplicate)  # committed meanwhile by another writer
            if out.error:
                t.errors.append(f"commit: {out.error}")
            elif out.rejected:
                t.errors.append(f"{len(out.rejected)} block(s) did not match the checksum source {src_id} leased "
                                "them with: not committed")
        except (ShardUnavailableError, PullSourceError, StaleMetadataError, WireVersionError) as exc:
            t.errors.append(str(exc))
            self._forget(src_id)
        except Exception as exc:  # a bug must not take the request down: report it and log the traceback
            log.exception("shard %s: pull from %s failed", self.store.shard_id, src_id)
            t.errors.append(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if reservation_id is not None:
                self.store.abort(reservation_id)
            if lease_id and source is not None:
                try:
                    source.release(lease_id, remaining())
                except Exception:  # noqa: BLE001 - the lease expires on its own
                    log.exception("shard %s: releasing lease %d on %s", self.store.shard_id, lease_id, src_id)

    def _lease(self, req: PullRequest, todo: list[bytes], remaining: Callable[[], float]
               ) -> tuple[PullSource, LeaseReply]:
        """Lease ``todo`` on the source; a cached source whose actor is dead (restarted) is resolved again once."""
        for attempt in (0, 1):
            source, cached = self._source(req.source_shard_id, remaining())
            try:
                return source, source.lease(todo, req.fingerprint, req.lease_ttl_s, remaining())
            except ShardUnavailableError as exc:
                self._forget(req.source_shard_id)
                if not (cached and not attempt and isinstance(exc, ShardDeadError) and remaining() > 0):
                    raise
        raise AssertionError("unreachable")

    def _source(self, shard_id: str, deadline_s: float) -> tuple[PullSource, bool]:
        """(source, came from the cache)."""
        with self._cache_lock:
            src = self._sources.get(shard_id)
        if src is not None:
            return src, True
        if deadline_s <= 0:
            raise ShardUnavailableError(f"deadline expired before source shard {shard_id!r} was resolved")
        fut = self._resolver.submit(self._resolve, shard_id)
        try:
            src = fut.result(timeout=deadline_s)
        except FutureTimeout as exc:
            fut.cancel()
            raise ShardUnavailableError(f"resolving source shard {shard_id!r}: no answer within {deadline_s:.3f}s"
                                        ) from exc
        with self._cache_lock:
            self._sources[shard_id] = src
        return src, False

    def _ensure_peer(self, source: PullSource, agent_name: str, epoch: str, deadline_s: float) -> None:
        """Trust the source's current transfer metadata (refetched when the source restarted)."""
        assert self.endpoint is not None
        with self._cache_lock:
            if self._peer_epochs.get(agent_name) == epoch:
                return
        if deadline_s <= 0:
            raise ShardUnavailableError(f"deadline expired before the transfer metadata of {source.shard_id} came")
        meta = decode_metadata(source.transfer_metadata(deadline_s))
        if meta.agent_name != agent_name:
            raise StaleMetadataError(f"source shard {source.shard_id}: transfer metadata of agent {meta.agent_name!r},"
                                     f" its lease names {agent_name!r}")
        self.endpoint.add_peer(meta)
        with self._cache_lock:
            self._peer_epochs[agent_name] = epoch
            self._agents[source.shard_id] = agent_name

    def _forget(self, shard_id: str) -> None:
        """Drop the cached handle and peer epoch of a source that failed; the next pull resolves and re-adds it."""
        with self._cache_lock:
            self._sources.pop(shard_id, None)
            agent = self._agents.pop(shard_id, None)
            if agent is not None:
                self._peer_epochs.pop(agent, None)
