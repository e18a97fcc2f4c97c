"""Replica KV-cache events: what a vLLM replica tells routers about the prefix blocks in its HBM.

Who calls what: the replica deployment (``deployments/``) turns vLLM's KV events (BlockStored / BlockRemoved /
AllBlocksCleared) into ``ReplicaEventBatch``es keyed by kvstack block keys (``kvpool.keys``) and publishes them;
each router's ``router.index.PrefixIndex`` applies them, and when it detects a gap (or a new epoch it did not see
from the start) it asks for a ``ReplicaSnapshot`` through a ``ResyncRequest``. Pool shards publish the
equivalent ``kvpool.events.EventBatch`` / ``ShardSnapshot``; the index consumes those directly.

Sequence numbers start at 1 per epoch (a restarted replica has a new epoch) and have no holes; a batch carries the
events ``(after_seq, last_seq]``; an empty batch is a heartbeat (it refreshes the replica's TTL). All structs cross
processes: versioned msgspec structs, encoded with msgpack (``encode`` / ``decode`` below).
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

REPLICA_EVENTS_VERSION = 1


class ReplicaEventKind(enum.Enum):
    STORED = "stored"  # blocks became reusable in HBM (keys in chain order)
    REMOVED = "removed"  # blocks were evicted
    CLEARED = "cleared"  # the whole prefix cache was reset (keys empty)


class ReplicaBlockEvent(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    kind: ReplicaEventKind
    keys: list[bytes]


class ReplicaEventBatch(msgspec.Struct, frozen=True, tag="replica_event_batch"):
    """Events ``(after_seq, last_seq]`` of one replica epoch; ``gap`` = the publisher dropped some (resync)."""

    version: int
    replica_id: str
    node_id: str
    epoch: str
    after_seq: int
    last_seq: int
    events: list[ReplicaBlockEvent]
    gap: bool = False


class ReplicaSnapshot(msgspec.Struct, frozen=True, tag="replica_snapshot"):
    """Every block key in the replica's HBM prefix cache at ``seq``."""

    version: int
    replica_id: str
    node_id: str
    epoch: str
    seq: int
    keys: list[bytes]


class ResyncRequest(msgspec.Struct, frozen=True, tag="resync_request"):
    """The index wants a snapshot of ``source_id`` (a replica or a pool shard)."""

    version: int
    source_kind: Literal["replica", "shard"]
    source_id: str
    reason: str


RouterEvent = ReplicaEventBatch | ReplicaSnapshot | ResyncRequest

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RouterEvent)


def encode(event: RouterEvent) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> RouterEvent:
    return _decoder.decode(data)
