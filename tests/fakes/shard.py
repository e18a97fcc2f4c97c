"""Shards as their callers see them, over a real ``BlockStore`` of this process whose arena is registered on a
``tests.fakes.transfer.LoopbackEndpoint``.

- ``StoreSource``: a source shard as the pull sees it (``kvpool.shard.pull.PullSource``). It can be dead (every
  call raises ``ShardDeadError``), frozen (every call waits out its deadline, then raises ``ShardUnavailableError``)
  or refuse leases (``PullSourceError``). Used by tests/unit/test_shard_pull.py, where the pull
  (``kvpool.shard.pull.Puller``) is under test and the source shard is its neighbour.
- ``StoreShardClient``: the write side of a shard as the connector's saver sees a ``ShardClient`` (``reserve``,
  ``commit``, ``abort``, ``transfer_metadata``); ``hold`` makes ``reserve`` wait until released (a frozen shard),
  ``fail`` makes it raise (a dead one). Used by tests/unit/test_block_saver.py.
Both serve transfers into their arena only under the grants of their store's leases and reservations, as the
shard's TCP server does.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from kvpool.shard.wire import LeaseReply, ReserveReply, ShardDeadError, ShardUnavailableError
from kvpool.shard.pull import PullSource, PullSourceError
from kvpool.store import BlockStore, CommitResult
from kvpool.transfer import encode_metadata
from tests.fakes.transfer import LoopbackEndpoint, LoopbackFabric

SourceMode = Literal["ok", "dead", "frozen", "refuse"]


class StoreSource(PullSource):
    """A ``PullSource`` over a real ``BlockStore`` in this process; ``mode`` says how it answers."""

    def __init__(self, store: BlockStore, fabric: LoopbackFabric, epoch: str = "e1") -> None:
        self.store = store
        self.shard_id = store.shard_id
        self.agent_name = f"kvpool-{store.shard_id}"
        self.endpoint = LoopbackEndpoint(fabric, self.agent_name, epoch)
        self.region_id = self.endpoint.register(store.arena.buffer)
        fabric.grant_checks[self.agent_name] = lambda write, grants, spans: store.granted(grants, spans, write)
        self.mode: SourceMode = "ok"
        self.leased: list[list[bytes]] = []  # keys of every lease asked for
        self.released: list[int] = []
        self.metadata_calls = 0

    def _enter(self, deadline_s: float) -> None:
        if self.mode == "dead":
            raise ShardDeadError(f"source shard {self.shard_id}: actor is dead (fake)")
        if self.mode == "frozen":
            time.sleep(max(deadline_s, 0.0))
            raise ShardUnavailableError(f"source shard {self.shard_id}: no answer within {deadline_s}s (fake)")

    def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float, deadline_s: float) -> LeaseReply:
        self._enter(deadline_s)
        if self.mode == "refuse":
            raise PullSourceError(f"source shard {self.shard_id}.lease refused: ttl too long (fake)")
        self.leased.append(list(keys))
        lease = self.store.lease(keys, fingerprint, ttl_s)  # the store is thread-safe
        return LeaseReply(self.shard_id, self.store.epoch, self.agent_name, self.region_id, lease)

    def release(self, lease_id: int, deadline_s: float) -> bool:
        if self.mode in ("dead", "frozen"):
            return False
        self.released.append(lease_id)
        return self.store.release(lease_id)

    def transfer_metadata(self, deadline_s: float) -> bytes:
        self._enter(deadline_s)
        self.metadata_calls += 1
        return encode_metadata(self.endpoint.metadata())


class StoreShardClient:
    """The write calls of a ``kvpool.shard.client.ShardClient`` over a real ``BlockStore`` of this process."""

    def __init__(self, store: BlockStore, fabric: LoopbackFabric, epoch: str = "e1") -> None:
        self.store = store
        self.agent_name = f"kvpool-{store.shard_id}"
        self.endpoint = LoopbackEndpoint(fabric, self.agent_name, epoch)
        self.region_id = self.endpoint.register(store.arena.buffer)
        fabric.grant_checks[self.agent_name] = lambda write, grants, spans: store.granted(grants, spans, write)
        self.hold = threading.Event()  # set: reserve waits until ``release`` (a frozen shard)
        self.fail = False  # reserve raises ShardDeadError
        self.aborted: list[int] = []
        self._released = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        self.hold.clear()
        self._released.set()

    def reserve(self, n: int) -> ReserveReply:
        if self.hold.is_set():
            self._released.wait(60)
        if self.fail:
            raise ShardDeadError(f"shard {self.store.shard_id}: actor is dead (fake)")
        with self._lock:
            res = self.store.reserve(n)
        return ReserveReply(self.store.shard_id, self.store.epoch, self.agent_name, self.region_id, res)

    def commit(self, reservation_id: int, keys: list[bytes], checksums: list[int], fingerprint: str,
               model: str = "", *, epoch: str) -> CommitResult:
        if epoch != self.store.epoch:  # the real shard refuses the commit proof of another incarnation
            raise PermissionError("commit: not authenticated (fake)")
        with self._lock:
            return self.store.commit(reservation_id, keys, checksums, fingerprint, model=model)

    def abort(self, reservation_id: int) -> bool:
        self.aborted.append(reservation_id)
        with self._lock:
            return self.store.abort(reservation_id)

    def transfer_metadata(self) -> bytes:
        return encode_metadata(self.endpoint.metadata())
