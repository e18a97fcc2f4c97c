"""The pool shard's wire: every request and reply between a shard actor and its clients, the shard's config, the
errors of the control path, and the one decode (with the wire-version check) every message goes through.

Who calls what: ``kvpool.shard.client`` encodes every request (``encode``) and decodes every reply (``decode``);
``kvpool.shard.actor`` decodes the requests and encodes its replies the same way; ``kvpool.shard.placement``
encodes the ``ShardConfig`` a shard actor starts from. Nothing else builds these bytes (tests excepted, to reach
the actor past the client's checks).

Every message is a msgspec struct encoded with msgpack, tagged by its kind (``tag``) and carrying
``version`` = ``POOL_WIRE_VERSION`` (the one wire version of the pool protocol). A message of another version, or
one that does not decode as the expected kind, raises ``WireVersionError``. Event batches and snapshots are the
events protocol (``kvpool.events``, ``EVENTS_WIRE_VERSION``); store structs travel inside versioned replies.
``check_pull`` refuses a ``PullRequest`` that can never succeed; the client checks before sending, the shard again.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar, get_args

import msgspec

from kvpool.checksum import CHECKSUM_ALGO
from kvpool.events import EVENTS_WIRE_VERSION, EventBatch, ShardSnapshot
from kvpool.keys import KEY_BYTES
from kvpool.store import CommitResult, EntryInfo, Lease, LookupResult, Reservation, StoreConfig, StoreStats
from kvpool.transfer.nixl import NixlOptions
from kvpool.transfer.tcp import TcpOptions

POOL_WIRE_VERSION = 1
SHARD_NAMESPACE = "kvstack"  # the Ray namespace of the named shard actors (``kvpool.shard.registry``)
PULL_LEASE_TTL_S = 30.0  # default lease a pull takes on its source (must cover the pull's deadline)
Backend = Literal["nixl", "tcp", "none"]  # "none": no transfer endpoint (control-plane only; nothing can move bytes)
BACKENDS: tuple[Backend, ...] = get_args(Backend)


class WireVersionError(ValueError):
    """A request or reply of a pool wire version this build does not speak."""


class ShardUnavailableError(RuntimeError):
    """The shard did not answer within the deadline, or its actor is dead."""


class ShardDeadError(ShardUnavailableError):
    """The shard's actor is dead (a handle to a restarted shard must be resolved again)."""


class ShardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    shard_id: str
    store: StoreConfig
    backend: Backend = "nixl"
    sweep_interval_s: float = 0.5
    metrics_port: int = 0  # > 0: serve this shard's registry over HTTP on that port
    registry_namespace: str = SHARD_NAMESPACE  # where ``pull`` finds source shards by id (``kvpool.shard.registry``)
    nixl: NixlOptions | None = None  # backend "nixl": None = NixlOptions() defaults
    tcp: TcpOptions | None = None  # backend "tcp": None = listen on this node's IP, any free port

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown transfer backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        if self.sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be positive, got {self.sweep_interval_s}")
        if not self.shard_id:
            raise ValueError("shard_id must not be empty")


# ---------------------------------------------------------------------------------------------- wire structs
class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    keys: list[bytes]
    fingerprint: str
    version: int = POOL_WIRE_VERSION


class LeaseRequest(msgspec.Struct, frozen=True, tag="lease"):
    keys: list[bytes]
    fingerprint: str
    ttl_s: float
    version: int = POOL_WIRE_VERSION


class TouchRequest(msgspec.Struct, frozen=True, tag="touch"):
    """``keys`` were just used from an engine's own HBM: refresh them for eviction (``BlockStore.touch``)."""

    keys: list[bytes]
    fingerprint: str
    version: int = POOL_WIRE_VERSION


class ReleaseRequest(msgspec.Struct, frozen=True, tag="release"):
    lease_id: int
    version: int = POOL_WIRE_VERSION


class ReserveRequest(msgspec.Struct, frozen=True, tag="reserve"):
    n: int
    version: int = POOL_WIRE_VERSION


class CommitRequest(msgspec.Struct, frozen=True, tag="commit"):
    reservation_id: int
    keys: list[bytes]
    checksums: list[int]
    fingerprint: str
    checksum_algo: str = CHECKSUM_ALGO  # checked against the shard's own (``kvpool.checksum``)
    version: int = POOL_WIRE_VERSION
    model: str = ""  # the writer's model id: labels the fingerprint's blocks in the shard's accounting
    proof: bytes = b""  # kvpool.secret.call_proof(secret, "commit", reservation id, shard epoch)


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    reservation_id: int
    version: int = POOL_WIRE_VERSION


MAX_EVENTS_WAIT_S = 10.0  # the longest a shard holds an events long poll (``EventsRequest.wait_s``)


class EventsRequest(msgspec.Struct, frozen=True, tag="events"):
    """The events after ``after_seq``; ``wait_s`` > 0 (the ``events_wait`` call only): when there are none yet, the
    shard answers at the next one or after ``wait_s`` (at most ``MAX_EVENTS_WAIT_S``), whichever comes first."""

    after_seq: int
    max_events: int = 4096
    wait_s: float = 0.0
    version: int = POOL_WIRE_VERSION


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    """Copy ``keys`` (those not held here yet) from shard ``source_shard_id`` into this shard's DRAM, within
    ``deadline_s`` seconds of the shard starting on it; the source's lease on them lasts ``lease_ttl_s``."""

    source_shard_id: str
    keys: list[bytes]
    fingerprint: str
    deadline_s: float
    lease_ttl_s: float = PULL_LEASE_TTL_S
    version: int = POOL_WIRE_VERSION


class LookupReply(msgspec.Struct, frozen=True, tag="lookup_reply"):
    shard_id: str
    epoch: str
    result: LookupResult
    version: int = POOL_WIRE_VERSION


class LeaseReply(msgspec.Struct, frozen=True, tag="lease_reply"):
    """``lease.blocks[i]`` lies at ``offset`` in region ``region_id`` of transfer agent ``agent_name``."""

    shard_id: str
    epoch: str
    agent_name: str
    region_id: int
    lease: Lease
    version: int = POOL_WIRE_VERSION


class ReserveReply(msgspec.Struct, frozen=True, tag="reserve_reply"):
    shard_id: str
    epoch: str
    agent_name: str
    region_id: int
    reservation: Reservation
    version: int = POOL_WIRE_VERSION


class CommitReply(msgspec.Struct, frozen=True, tag="commit_reply"):
    shard_id: str
    epoch: str
    result: CommitResult
    version: int = POOL_WIRE_VERSION


class AckReply(msgspec.Struct, frozen=True, tag="ack_reply"):
    """Reply of release / abort: ``ok`` False = the lease / reservation was unknown (already ended)."""

    shard_id: str
    epoch: str
    ok: bool
    version: int = POOL_WIRE_VERSION


class PullReply(msgspec.Struct, frozen=True, tag="pull_reply"):
    """What a pull did. ``requested`` = ``present`` + ``pulled`` + ``failed`` + ``missing``:
    ``present`` already held here (skipped, or committed meanwhile by another writer); ``pulled`` committed now;
    ``failed`` not committed although asked for: source unreachable / dead / too slow, transfer failed, checksum
    mismatch, no free slot here; ``missing`` not held by the source (beyond the prefix its lease pinned).
    ``error`` says why when anything failed ("" otherwise). ``seconds``: wall time of the pull in the shard;
    ``read_seconds``: of that, the one transfer read (the rest is the lease / release round trips and the store)."""

    shard_id: str
    epoch: str
    requested: int
    present: int
    pulled: int
    failed: int
    missing: int
    bytes_moved: int
    seconds: float
    error: str = ""
    read_seconds: float = 0.0
    version: int = POOL_WIRE_VERSION


class ShardInfo(msgspec.Struct, frozen=True, tag="shard_info"):
    shard_id: str
    epoch: str
    node_id: str
    node_ip: str
    backend: Backend
    agent_name: str
    region_id: int
    slot_bytes: int
    version: int = POOL_WIRE_VERSION


class StatsReply(msgspec.Struct, frozen=True, tag="stats_reply"):
    """Reply of ``stats``: the store's stats, its counters merged with the shard's pull counters."""

    stats: StoreStats
    version: int = POOL_WIRE_VERSION


class EntryReply(msgspec.Struct, frozen=True, tag="entry_reply"):
    """Reply of ``entry_info``: where one block lies, or None when it is not held."""

    entry: EntryInfo | None
    version: int = POOL_WIRE_VERSION


class DemoteRequest(msgspec.Struct, frozen=True, tag="demote"):
    keys: list[bytes]
    version: int = POOL_WIRE_VERSION


class CountReply(msgspec.Struct, frozen=True, tag="count_reply"):
    """Reply of ``touch`` (keys held here) and ``demote`` (blocks moved to SSD)."""

    n: int
    version: int = POOL_WIRE_VERSION


_R = TypeVar("_R")
_ENC = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of one wire struct."""
    return _ENC.encode(msg)


def decode(raw: bytes, typ: type[_R], *, version: int = POOL_WIRE_VERSION) -> _R:
    """``raw`` as a ``typ`` of wire version ``version`` (``EVENTS_WIRE_VERSION`` for event batches and snapshots);
    anything else raises ``WireVersionError``."""
    try:
        msg = msgspec.msgpack.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise WireVersionError(f"undecodable {typ.__name__}: {exc}") from exc
    got = getattr(msg, "version", None)
    if got != version:
        raise WireVersionError(f"{typ.__name__} of wire version {got}, this build speaks {version}")
    return msg


def decode_events(raw: bytes) -> EventBatch:
    return decode(raw, EventBatch, version=EVENTS_WIRE_VERSION)


def decode_snapshot(raw: bytes) -> ShardSnapshot:
    return decode(raw, ShardSnapshot, version=EVENTS_WIRE_VERSION)


def check_pull(target_shard_id: str, req: PullRequest) -> None:
    """Refuse a request that can never succeed (``ValueError``); the client checks before sending, the shard again."""
    if not req.source_shard_id:
        raise ValueError("pull: empty source shard id")
    if req.source_shard_id == target_shard_id:
        raise ValueError(f"pull: source and target are the same shard {target_shard_id!r}; a shard cannot pull from "
                         "itself")
    if not req.fingerprint:
        raise ValueError("pull: empty layout fingerprint")
    if not (math.isfinite(req.deadline_s) and req.deadline_s > 0):
        raise ValueError(f"pull: deadline_s must be a positive number of seconds, got {req.deadline_s}")
    if not (math.isfinite(req.lease_ttl_s) and req.lease_ttl_s >= req.deadline_s):
        raise ValueError(f"pull: lease_ttl_s ({req.lease_ttl_s}) must cover deadline_s ({req.deadline_s})")
    for k in req.keys:
        if len(k) != KEY_BYTES:
            raise ValueError(f"pull: block keys are {KEY_BYTES} bytes, got {len(k)}")
