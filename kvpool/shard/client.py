"""Clients of a pool shard actor: the only code that encodes shard requests (``kvpool.shard.wire``) and sends them.

Who calls what:
- ``ShardClient`` (sync, deadline-bounded): the vLLM connector's scheduler and worker sides (``kvpool.connector.pool``),
  a pull's source calls (``kvpool.shard.pull.ActorSource``), tests and benches. ``lookup_many`` fans several
  lookups out in one round trip (the connector's lookups over every shard).
- ``AsyncShardClient`` (on an event loop, never blocks it): a replica asking its node's shard to ``pull`` the tail
  of a prefix (``deployments.split_staging``), ``touch_nowait`` for prefixes served from HBM, and ``stats`` /
  ``events_since`` / ``snapshot`` for the router's cluster view and ``kvstack status``.
- ``ShardEventSource``: a shard's event stream for the router's ``router.shard_sync.ShardSync``.
- ``ShardHandle``: a started or discovered shard (``kvpool.shard.placement`` / ``kvpool.shard.registry``) and the
  clients of it.

Every call carries the cluster secret's proof (``kvpool.secret.call_proof``: the shard refuses a call without it),
as its last argument (a commit's, bound to its reservation and the shard's epoch, inside its request). Every call
has a deadline; a shard that does not answer within it raises ``ShardUnavailableError``, a dead actor
``ShardDeadError``; a reply of another wire version ``WireVersionError``. A lease answered after its caller's
deadline pins blocks nobody reads: it is released when it arrives (``release_late_lease``, a daemon thread that
waits at most ``LATE_LEASE_WAIT_S``; the lease's ttl ends it otherwise). An exception raised inside the actor
(e.g. an invalid request it refused) propagates as Ray's ``RayTaskError``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import ray

from kvpool.events import EventBatch, ShardSnapshot
from kvpool.secret import call_proof, pool_secret
from kvpool.shard.wire import (
    PULL_LEASE_TTL_S,
    AbortRequest,
    AckReply,
    CommitReply,
    CommitRequest,
    CountReply,
    DemoteRequest,
    EntryReply,
    EventsRequest,
    LeaseReply,
    LeaseRequest,
    LookupReply,
    LookupRequest,
    PullReply,
    PullRequest,
    ReleaseRequest,
    ReserveReply,
    ReserveRequest,
    ShardDeadError,
    ShardInfo,
    ShardUnavailableError,
    StatsReply,
    TouchRequest,
    check_pull,
    decode,
    decode_events,
    decode_snapshot,
    encode,
)
from kvpool.store import CommitResult, EntryInfo, StoreStats

log = logging.getLogger(__name__)

PULL_REPLY_GRACE_S = 2.0  # a pull client waits deadline_s + this for the reply (queueing, the lease release)
LATE_LEASE_WAIT_S = 30.0  # a lease answered after its caller's deadline is released if it arrives within this


def proof_for(op: str) -> bytes:
    """This process's proof for a shard call ``op`` (cached per secret and op: one HMAC each)."""
    return _proof(pool_secret(), op)


@functools.lru_cache(maxsize=256)
def _proof(secret: bytes, op: str) -> bytes:
    return call_proof(secret, op)


def _get(ref: Any, deadline_s: float, what: str) -> bytes:
    try:
        return ray.get(ref, timeout=deadline_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise ShardUnavailableError(f"{what}: no answer within {deadline_s}s") from exc
    except ray.exceptions.RayActorError as exc:
        raise ShardDeadError(f"{what}: shard actor is dead ({exc})") from exc


async def _aget(ref: Any, deadline_s: float, what: str) -> bytes:
    try:
        return await asyncio.wait_for(ref, timeout=deadline_s)
    except TimeoutError as exc:
        raise ShardUnavailableError(f"{what}: no answer within {deadline_s}s") from exc
    except ray.exceptions.RayActorError as exc:
        raise ShardDeadError(f"{what}: shard actor is dead ({exc})") from exc


def release_late_lease(client: ShardClient, ref: Any) -> threading.Thread:
    """Release the lease ``ref`` answers when it arrives (its caller gave up waiting: nobody reads its blocks), on
    a daemon thread that waits at most ``LATE_LEASE_WAIT_S``. No answer, a dead shard, nothing pinned: nothing to
    release (the lease's ttl ends what is left)."""

    def run() -> None:
        try:
            reply = decode(ray.get(ref, timeout=LATE_LEASE_WAIT_S), LeaseReply)
            if reply.lease.lease_id:
                client.release_nowait(reply.lease.lease_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the ttl ends the lease
            log.debug("shard %s: late lease not released: %s", client.shard_id, exc)

    thread = threading.Thread(target=run, name=f"kvpool-late-lease-{client.shard_id}", daemon=True)
    thread.start()
    return thread


def pull_request(
    target_shard_id: str,
    source_shard_id: str,
    keys: Sequence[bytes],
    fingerprint: str,
    deadline_s: float,
    lease_ttl_s: float,
) -> PullRequest:
    """A checked ``PullRequest`` (``ValueError`` on a request the shard would refuse; it checks again)."""
    req = PullRequest(source_shard_id, [bytes(k) for k in keys], fingerprint, float(deadline_s), float(lease_ttl_s))
    check_pull(target_shard_id, req)
    return req


class ShardClient:
    """Typed, deadline-bounded calls to one shard actor (sync: for the connector and tests). ``deadline_s`` of a call
    overrides the client's default for that call."""

    def __init__(self, handle: Any, shard_id: str, *, deadline_s: float = 5.0) -> None:
        self.handle = handle
        self.shard_id = shard_id
        self.deadline_s = deadline_s

    def _call(self, method: str, *args: Any, deadline_s: float | None = None) -> bytes:
        ref = getattr(self.handle, method).remote(*args, proof_for(method))
        return _get(ref, self.deadline_s if deadline_s is None else deadline_s, f"shard {self.shard_id}.{method}")

    def info(self) -> ShardInfo:
        return decode(self._call("info"), ShardInfo)

    def transfer_metadata(self, *, deadline_s: float | None = None) -> bytes:
        return self._call("transfer_metadata", deadline_s=deadline_s)

    def shm_metadata(self, *, deadline_s: float | None = None) -> bytes:
        """The shard's shared-memory metadata (``kvpool.transfer.shm``); an error when it exports no arena."""
        return self._call("shm_metadata", deadline_s=deadline_s)

    def send_lookup(self, keys: Sequence[bytes], fingerprint: str) -> Any:
        """Send a lookup without waiting: the Ray object ref of its reply (``lookup_many`` waits for several)."""
        return self.handle.lookup.remote(encode(LookupRequest([bytes(k) for k in keys], fingerprint)),
                                         proof_for("lookup"))

    def send_lease(self, keys: Sequence[bytes], fingerprint: str, ttl_s: float) -> Any:
        """Send a lease without waiting: the Ray object ref of its reply (``lookup_many`` with ``lease_ttl_s``)."""
        return self.handle.lease.remote(encode(LeaseRequest([bytes(k) for k in keys], fingerprint, ttl_s)),
                                        proof_for("lease"))

    def lookup(self, keys: Sequence[bytes], fingerprint: str) -> LookupReply:
        return decode(self._call("lookup", encode(LookupRequest(list(keys), fingerprint))), LookupReply)

    def lease(self, keys: Sequence[bytes], fingerprint: str, ttl_s: float, *, deadline_s: float | None = None
              ) -> LeaseReply:
        """A lease answered after ``deadline_s`` is released when it arrives (``release_late_lease``)."""
        ref = self.send_lease(keys, fingerprint, ttl_s)
        try:
            raw = _get(ref, self.deadline_s if deadline_s is None else deadline_s, f"shard {self.shard_id}.lease")
        except ShardDeadError:
            raise
        except ShardUnavailableError:
            release_late_lease(self, ref)
            raise
        return decode(raw, LeaseReply)

    def release(self, lease_id: int, *, deadline_s: float | None = None) -> bool:
        return decode(self._call("release", encode(ReleaseRequest(lease_id)), deadline_s=deadline_s), AckReply).ok

    def release_nowait(self, lease_id: int) -> None:
        """Send the release and do not wait (Ray delivers it in order after the lease; the TTL ends it otherwise)."""
        self.handle.release.remote(encode(ReleaseRequest(lease_id)), proof_for("release"))

    def reserve(self, n: int) -> ReserveReply:
        return decode(self._call("reserve", encode(ReserveRequest(n))), ReserveReply)

    def commit(
        self, reservation_id: int, keys: Sequence[bytes], checksums: Sequence[int], fingerprint: str,
        model: str = "", *, epoch: str,
    ) -> CommitResult:
        """``epoch``: the shard incarnation that granted the reservation (its ``ReserveReply.epoch``)."""
        proof = call_proof(pool_secret(), "commit", reservation_id, epoch)
        req = CommitRequest(reservation_id, list(keys), [int(c) for c in checksums], fingerprint, model=model,
                            proof=proof)
        return decode(self._call("commit", encode(req)), CommitReply).result

    def abort(self, reservation_id: int) -> bool:
        return decode(self._call("abort", encode(AbortRequest(reservation_id))), AckReply).ok

    def stats(self) -> StoreStats:
        return decode(self._call("stats"), StatsReply).stats

    def metrics_text(self) -> str:
        return self._call("metrics_text").decode()  # its own proof too: a scrape through Ray is a caller like any

    def events_since(self, after_seq: int, max_events: int = 4096) -> EventBatch:
        return decode_events(self._call("events_since", encode(EventsRequest(after_seq, max_events))))

    def snapshot(self) -> ShardSnapshot:
        return decode_snapshot(self._call("snapshot"))

    def entry_info(self, key: bytes) -> EntryInfo | None:
        return decode(self._call("entry_info", bytes(key)), EntryReply).entry

    def demote(self, keys: Sequence[bytes]) -> int:
        return decode(self._call("demote", encode(DemoteRequest([bytes(k) for k in keys]))), CountReply).n

    def pull(
        self,
        source_shard_id: str,
        keys: Sequence[bytes],
        fingerprint: str,
        *,
        deadline_s: float,
        lease_ttl_s: float = PULL_LEASE_TTL_S,
    ) -> PullReply:
        """Ask this shard to copy ``keys`` from ``source_shard_id`` (see ``PullReply``). Failures on the source side
        are data (``reply.failed`` / ``reply.error``); this shard not answering within ``deadline_s`` +
        ``PULL_REPLY_GRACE_S`` raises ``ShardUnavailableError``; an invalid request raises ``ValueError``."""
        req = pull_request(self.shard_id, source_shard_id, keys, fingerprint, deadline_s, lease_ttl_s)
        raw = self._call("pull", encode(req), deadline_s=deadline_s + PULL_REPLY_GRACE_S)
        return decode(raw, PullReply)


def lookup_many(
    calls: Sequence[tuple[ShardClient, Sequence[bytes]]], fingerprint: str, deadline_s: float,
    *, lease_ttl_s: float | None = None,
) -> list[LookupReply | LeaseReply | Exception | None]:
    """Run ``lookup(keys)`` on each ``(client, keys)`` at once, all bounded by one ``deadline_s``. Per call: the
    ``LookupReply``; None when the shard did not answer in time; the exception when the call failed (a dead actor,
    an error in the shard, a reply of another wire version). With ``lease_ttl_s`` the first call is a lease of that
    ttl instead (the shard pins the longest prefix it holds: a lookup that keeps what it found), its entry the
    ``LeaseReply``; a lease answered after the deadline is released when it arrives (``release_late_lease``)."""
    leases = lease_ttl_s is not None  # the first call
    refs = [client.send_lease(keys, fingerprint, lease_ttl_s) if i == 0 and leases
            else client.send_lookup(keys, fingerprint) for i, (client, keys) in enumerate(calls)]
    ready: set[Any] = set()
    if refs:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline_s)
        ready = set(done)
    out: list[LookupReply | LeaseReply | Exception | None] = []
    for i, ref in enumerate(refs):
        if ref not in ready:
            if i == 0 and leases:
                release_late_lease(calls[0][0], ref)
            out.append(None)
            continue
        kind: type[LookupReply] | type[LeaseReply] = LeaseReply if i == 0 and leases else LookupReply
        try:
            out.append(decode(ray.get(ref, timeout=0), kind))
        except Exception as exc:  # noqa: BLE001 - the caller decides (a miss, never data)
            out.append(exc)
    return out


class AsyncShardClient:
    """Async, deadline-bounded calls to one shard actor, for code on an event loop (a replica asking its node's shard
    to ``pull`` the tail of a prefix while vLLM computes the head; the router reading stats and events). Never
    blocks the loop."""

    def __init__(self, handle: Any, shard_id: str) -> None:
        self.handle = handle
        self.shard_id = shard_id

    def touch_nowait(self, keys: Sequence[bytes], fingerprint: str) -> None:
        """Send a ``TouchRequest`` and do not wait for it (a lost touch only ages a hot block a little sooner)."""
        self.handle.touch.remote(encode(TouchRequest([bytes(k) for k in keys], fingerprint)),
                                 proof_for("touch"))

    async def stats(self, deadline_s: float = 5.0) -> StoreStats:
        raw = await _aget(self.handle.stats.remote(proof_for("stats")), deadline_s,
                          f"shard {self.shard_id}.stats")
        return decode(raw, StatsReply).stats

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float,
                           wait_s: float = 0.0) -> EventBatch:
        """``wait_s`` > 0: a long poll (the shard's ``events_wait``: it answers at the next event or after
        ``wait_s``); the deadline then runs from the end of the wait."""
        req = encode(EventsRequest(after_seq, max_events, wait_s))
        if wait_s > 0:
            ref = self.handle.events_wait.remote(req, proof_for("events_wait"))
            return decode_events(await _aget(ref, wait_s + deadline_s, f"shard {self.shard_id}.events_wait"))
        ref = self.handle.events_since.remote(req, proof_for("events_since"))
        return decode_events(await _aget(ref, deadline_s, f"shard {self.shard_id}.events_since"))

    async def snapshot(self, deadline_s: float) -> ShardSnapshot:
        raw = await _aget(self.handle.snapshot.remote(proof_for("snapshot")), deadline_s,
                          f"shard {self.shard_id}.snapshot")
        return decode_snapshot(raw)

    async def pull(
        self,
        source_shard_id: str,
        keys: Sequence[bytes],
        fingerprint: str,
        *,
        deadline_s: float,
        lease_ttl_s: float = PULL_LEASE_TTL_S,
    ) -> PullReply:
        """Like ``ShardClient.pull``."""
        req = pull_request(self.shard_id, source_shard_id, keys, fingerprint, deadline_s, lease_ttl_s)
        ref = self.handle.pull.remote(encode(req), proof_for("pull"))
        raw = await _aget(ref, deadline_s + PULL_REPLY_GRACE_S, f"shard {self.shard_id}.pull")
        return decode(raw, PullReply)


class ShardEventSource:
    """A shard's event stream for the router's ``router.shard_sync.ShardSync`` (async, deadline-bounded; the events
    part of ``AsyncShardClient``). kvpool never imports router: the name is for the reader."""

    def __init__(self, handle: Any, shard_id: str) -> None:
        self._client = AsyncShardClient(handle, shard_id)
        self.shard_id = shard_id

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float,
                           wait_s: float = 0.0) -> EventBatch:
        return await self._client.events_since(after_seq, max_events, deadline_s, wait_s)

    async def snapshot(self, deadline_s: float) -> ShardSnapshot:
        return await self._client.snapshot(deadline_s)


class ShardHandle(msgspec.Struct, frozen=True):
    """One shard actor: its id, its node, the actor handle. ``node_ip`` is "" for a shard found by name
    (``kvpool.shard.registry.list_shards``)."""

    shard_id: str
    node_id: str
    actor: Any
    node_ip: str = ""

    def client(self, deadline_s: float = 5.0) -> ShardClient:
        return ShardClient(self.actor, self.shard_id, deadline_s=deadline_s)

    def event_source(self) -> ShardEventSource:
        return ShardEventSource(self.actor, self.shard_id)

    def async_client(self) -> AsyncShardClient:
        return AsyncShardClient(self.actor, self.shard_id)
