"""``kvpool.connector.pool.KnownPeers``: which endpoint moves a shard's bytes — shared memory for a shard it could
map (per shard epoch), the transfer endpoint otherwise — and one region id per buffer in both."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.connector.pool import KnownPeers
from kvpool.transfer import BlockOp, encode_metadata
from tests.fakes.transfer import LoopbackEndpoint, LoopbackFabric


class _Shard:
    """A shard's two exports over two fabrics: its transfer endpoint and its shared-memory one."""

    def __init__(self, main: LoopbackFabric, shm: LoopbackFabric, name: str, epoch: str) -> None:
        self.data = np.arange(4096, dtype=np.uint8)
        self.main = LoopbackEndpoint(main, name, epoch=epoch)
        self.shm = LoopbackEndpoint(shm, name, epoch=epoch)
        for ep in (self.main, self.shm):
            ep.register(memoryview(self.data))
        self.shm_calls = 0

    def transfer_metadata(self) -> bytes:
        return encode_metadata(self.main.metadata())

    def shm_metadata(self) -> bytes:
        self.shm_calls += 1
        return encode_metadata(self.shm.metadata())


def _peers() -> tuple[KnownPeers, LoopbackEndpoint, LoopbackEndpoint, LoopbackFabric, LoopbackFabric]:
    main_fabric, shm_fabric = LoopbackFabric(), LoopbackFabric()
    main, shm = LoopbackEndpoint(main_fabric, "engine"), LoopbackEndpoint(shm_fabric, "engine-shm")
    return KnownPeers(main, shm), main, shm, main_fabric, shm_fabric


def test_a_mapped_shard_goes_through_shared_memory_and_a_refused_one_through_the_transfer_endpoint() -> None:
    peers, main, shm, mf, sf = _peers()
    local = np.zeros(64, dtype=np.uint8)
    rid = peers.register(memoryview(local))
    shard = _Shard(mf, sf, "shard-a", "e1")
    peers.ensure("shard-a", "e1", shard.transfer_metadata, shard.shm_metadata)
    assert peers.endpoint_for("shard-a") is shm
    assert peers.endpoint_for("shard-a").read("shard-a", [BlockOp(0, 100, rid, 0, 64)], 1.0).all_ok
    assert np.array_equal(local, shard.data[100:164])
    peers.ensure("shard-a", "e1", shard.transfer_metadata, shard.shm_metadata)
    assert shard.shm_calls == 1  # once per shard epoch

    def refuse() -> bytes:
        raise RuntimeError("shard b does not export its arena")

    other = _Shard(mf, sf, "shard-b", "e1")
    peers.ensure("shard-b", "e1", other.transfer_metadata, refuse)
    assert peers.endpoint_for("shard-b") is main
    peers.ensure("shard-b", "e1", other.transfer_metadata, other.shm_metadata)
    assert other.shm_calls == 0 and peers.endpoint_for("shard-b") is main  # a refusal holds for that epoch
    peers.ensure("shard-b", "e2", other.transfer_metadata, other.shm_metadata)  # restarted: tried again
    assert other.shm_calls == 1
    peers.ensure("shard-c", "e1", _Shard(mf, sf, "shard-c", "e1").transfer_metadata)  # no same-host offer
    assert peers.endpoint_for("shard-c") is main


def test_forget_and_a_new_epoch_fall_back_until_mapped_again() -> None:
    peers, main, shm, mf, sf = _peers()
    shard = _Shard(mf, sf, "shard-a", "e1")
    peers.ensure("shard-a", "e1", shard.transfer_metadata, shard.shm_metadata)
    peers.forget("shard-a")
    assert peers.endpoint_for("shard-a") is main
    peers.ensure("shard-a", "e1", shard.transfer_metadata, shard.shm_metadata)
    assert peers.endpoint_for("shard-a") is shm and shard.shm_calls == 2


def test_register_keeps_one_region_id_in_both_endpoints() -> None:
    peers, main, shm, _, _ = _peers()
    shm.register(memoryview(np.zeros(8, dtype=np.uint8)))  # the endpoints' regions diverge
    with pytest.raises(RuntimeError, match="diverged"):
        peers.register(memoryview(np.zeros(8, dtype=np.uint8)))
    alone = KnownPeers(LoopbackEndpoint(LoopbackFabric(), "solo"))
    assert alone.register(memoryview(np.zeros(8, dtype=np.uint8))) == 0


def test_fence_closes_the_transfer_endpoint_and_remakes_it_with_the_same_regions() -> None:
    """After a transfer that may still land, ``fence`` ends the endpoint (its agent gone: nothing it started can
    write) and a new one takes its place: the same buffers under the same region ids, every shard's metadata
    fetched again; the shared-memory endpoint (synchronous copies) is kept."""
    main_fabric, shm_fabric = LoopbackFabric(), LoopbackFabric()
    made: list[LoopbackEndpoint] = []

    def remake() -> LoopbackEndpoint:
        made.append(LoopbackEndpoint(main_fabric, f"engine-{len(made)}"))
        return made[-1]

    first, shm = remake(), LoopbackEndpoint(shm_fabric, "engine-shm")
    peers = KnownPeers(first, shm, remake=remake)
    bufs = [np.zeros(64, dtype=np.uint8), np.zeros(128, dtype=np.uint8)]
    rids = [peers.register(memoryview(b)) for b in bufs]
    shard = _Shard(main_fabric, shm_fabric, "shard-a", "e1")
    calls: list[int] = []

    def metadata() -> bytes:
        calls.append(1)
        return shard.transfer_metadata()

    peers.ensure("shard-a", "e1", metadata)
    peers.fence()
    assert "engine-0" not in main_fabric.buffers  # the old endpoint is closed
    assert peers.transfer_endpoint is made[1] and peers.fences == 1
    assert [len(b) for b in main_fabric.buffers["engine-1"]] == [64, 128]  # the same regions, the same ids
    peers.ensure("shard-a", "e1", metadata)
    assert len(calls) == 2  # the new agent learns the shard again
    assert peers.endpoint_for("shard-a").read("shard-a", [BlockOp(0, 10, rids[1], 0, 128)], 1.0).all_ok
    assert np.array_equal(bufs[1], shard.data[10:138])
    with pytest.raises(RuntimeError, match="remake"):
        KnownPeers(LoopbackEndpoint(main_fabric, "bare")).fence()
