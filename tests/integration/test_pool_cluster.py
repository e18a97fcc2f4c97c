"""The KV pool on a real 3-node Ray cluster: shard actors pinned per node, blocks moved with a real transfer backend.

Node a writes into its shard over the transfer endpoint and commits; an actor on node b leases and pulls the
blocks into its own buffer; bytes must be identical. Also: lease/evict interplay, DRAM→SSD demotion and read-back,
a corrupted SSD slab is a miss with the checksum-failure metric (never data), the directory follows the shards
through their event streams, and a shard killed mid-transfer is reported as failed blocks within the deadline.

Run: ``flock /tmp/kvstack-heavy.lock timeout 900 .venv/bin/pytest tests/integration/test_pool_cluster.py``
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import ray

from kvpool.checksum import block_checksum
from kvpool.keys import Namespace, block_keys
from kvpool.shard.client import ShardClient, ShardHandle, lookup_many
from kvpool.shard.placement import PoolNode, build_pool, stop_shards
from kvpool.shard.wire import (
    AckReply,
    LeaseReply,
    LookupReply,
    ReleaseRequest,
    ShardConfig,
    ShardUnavailableError,
    decode,
    encode,
)
from kvpool.store import Lease, StoreConfig
from kvpool.transfer import make_endpoint
from kvpool.transfer.nixl import NixlOptions
from kvpool.transfer.tcp import TcpOptions
from router.index import PrefixIndex
from router.shard_sync import ShardSync
from tests.ray_cluster_fixture import RayCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SLOT = 64 * 1024
DRAM_SLOTS = 8
SSD_SLOTS = 8
FP = "ab" * 16
DEADLINE_S = 5.0


@ray.remote(num_cpus=0)
class BufferActor:
    """A client process owning a buffer registered with its own transfer endpoint (stands in for a vLLM worker)."""

    def __init__(self, backend: str, name: str, nbytes: int) -> None:
        self.mm = mmap.mmap(-1, nbytes)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.ep = make_endpoint(backend, name, options=endpoint_options(backend))
        self.region = self.ep.register(memoryview(self.mm))

    def region_id(self) -> int:
        return self.region

    def add_peer(self, raw_meta: bytes) -> None:
        from kvpool.transfer import decode_metadata

        self.ep.add_peer(decode_metadata(raw_meta))

    def fill(self, offset: int, data: bytes) -> None:
        self.arr[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def get(self, offset: int, n: int) -> bytes:
        return self.arr[offset : offset + n].tobytes()

    def _ops(self, ops: list[tuple[int, int, int, int, int]]) -> list[Any]:
        from kvpool.transfer import BlockOp

        return [BlockOp(*op) for op in ops]

    def read(self, peer: str, ops: list[tuple[int, int, int, int, int]], deadline_s: float,
             grants: list[bytes] = ()) -> bytes:
        return msgspec.msgpack.encode(self.ep.read(peer, self._ops(ops), deadline_s, grants))

    def write(self, peer: str, ops: list[tuple[int, int, int, int, int]], deadline_s: float,
              grants: list[bytes] = ()) -> bytes:
        return msgspec.msgpack.encode(self.ep.write(peer, self._ops(ops), deadline_s, grants))

    def read_until_failure(
        self, peer: str, ops: list[tuple[int, int, int, int, int]], deadline_s: float, max_s: float,
        progress_path: str, grants: list[bytes] = (),
    ) -> tuple[int, bytes, float]:
        """Read repeatedly until a read reports failed blocks (or ``max_s`` passes): (iterations, last result,
        wall seconds of the last read). After each read, the count of reads done is written to ``progress_path``
        (this actor is busy in the loop; the test runs on the same machine and reads the file)."""
        block_ops = self._ops(ops)
        stop_at = time.monotonic() + max_s
        n = 0
        while True:
            t0 = time.monotonic()
            res = self.ep.read(peer, block_ops, deadline_s, grants)
            took = time.monotonic() - t0
            n += 1
            Path(progress_path).write_text(str(n))
            if res.failed or time.monotonic() > stop_at:
                return n, msgspec.msgpack.encode(res), took

    def close(self) -> None:
        self.ep.close()


def endpoint_options(backend: str) -> NixlOptions | TcpOptions:
    """Loopback transports for this machine (the shards get the same through ShardConfig)."""
    if backend == "nixl":
        return NixlOptions(ucx_devices="lo")
    return TcpOptions(bind_host=ray.util.get_node_ip_address())


def decode_result(raw: bytes) -> Any:
    from kvpool.transfer import TransferResult

    return msgspec.msgpack.decode(raw, type=TransferResult)


def payload(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def keys_for(n: int, salt: str) -> list[bytes]:
    return block_keys(Namespace("pool-it", FP, salt), list(range(n * 8)), 8)


class Pool:
    def __init__(self, cluster: RayCluster, backend: str, shards: list[ShardHandle]) -> None:
        self.cluster = cluster
        self.backend = backend
        self.by_node = {cluster.by_ip(h.node_ip).name: h for h in shards}
        self.actors: list[Any] = []

    def client(self, node: str) -> ShardClient:
        return self.by_node[node].client(deadline_s=DEADLINE_S * 4)

    def buffer_actor(self, node: str, name: str, nbytes: int) -> Any:
        actor = BufferActor.options(scheduling_strategy=self.cluster.affinity(node)).remote(
            self.backend, name, nbytes
        )
        self.actors.append(actor)
        return actor


def shard_config(shard_id: str, store: StoreConfig, backend: str) -> ShardConfig:
    nixl = NixlOptions(ucx_devices="lo") if backend == "nixl" else None
    return ShardConfig(shard_id=shard_id, store=store, backend=backend, sweep_interval_s=0.2, nixl=nixl)


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def pool(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
         ) -> Iterator[Pool]:
    backend = request.param
    root = tmp_path_factory.mktemp(f"pool-{backend}")

    def config(node: PoolNode) -> ShardConfig:
        name = ray_cluster.by_ip(node.node_ip).name
        store = StoreConfig(slot_bytes=SLOT, dram_slots=DRAM_SLOTS, ssd_dir=os.fspath(root / name),
                            ssd_slots=SSD_SLOTS, reservation_ttl_s=60.0)
        return shard_config(f"{backend}-{name}", store, backend)

    shards = build_pool(config, named=False, ready_deadline_s=120.0)
    p = Pool(ray_cluster, backend, shards)
    yield p
    for a in p.actors:
        try:
            ray.get(a.close.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(a)
    stop_shards(shards)


@pytest.fixture(scope="module")
def writer(pool: Pool) -> Any:
    """An actor on node a that writes blocks into node a's shard."""
    w = pool.buffer_actor("a", f"writer-{pool.backend}", DRAM_SLOTS * SLOT)
    ray.get(w.add_peer.remote(pool.client("a").transfer_metadata()), timeout=60)
    return w


@pytest.fixture(scope="module")
def reader(pool: Pool) -> Any:
    """An actor on node b that pulls blocks from any shard into its own buffer."""
    r = pool.buffer_actor("b", f"reader-{pool.backend}", DRAM_SLOTS * SLOT)
    for node in ("a", "c"):
        ray.get(r.add_peer.remote(pool.client(node).transfer_metadata()), timeout=60)
    return r


def write_blocks(pool: Pool, writer: Any, keys: list[bytes], seeds: list[int]) -> Any:
    """reserve on node a's shard → transfer write from the writer's buffer → commit with checksums."""
    client = pool.client("a")
    rep = client.reserve(len(keys))
    offsets = rep.reservation.offsets
    assert len(offsets) == len(keys), f"reserve gave {len(offsets)} of {len(keys)} slots"
    ray.get(writer.fill.remote(0, b"".join(payload(s) for s in seeds)), timeout=60)
    region = ray.get(writer.region_id.remote(), timeout=30)
    ops = [(rep.region_id, off, region, i * SLOT, SLOT) for i, off in enumerate(offsets)]
    res = decode_result(ray.get(writer.write.remote(rep.agent_name, ops, DEADLINE_S, [rep.reservation.grant]),
                                timeout=60))
    assert res.all_ok, res
    return client.commit(rep.reservation.reservation_id, keys, [block_checksum(payload(s)) for s in seeds], FP,
                         epoch=rep.epoch)


def fetch(pool: Pool, reader: Any, node: str, keys: list[bytes], ttl_s: float = 30.0) -> tuple[Any, list[bytes]]:
    """lease on the node's shard → transfer read into the reader's buffer → the bytes, in key order."""
    rep = pool.client(node).lease(keys, FP, ttl_s)
    region = ray.get(reader.region_id.remote(), timeout=30)
    ops = [(rep.region_id, b.offset, region, i * SLOT, b.length) for i, b in enumerate(rep.lease.blocks)]
    if ops:
        res = decode_result(ray.get(reader.read.remote(rep.agent_name, ops, DEADLINE_S, [rep.lease.grant]), timeout=60))
        assert res.all_ok, res
    data = [ray.get(reader.get.remote(i * SLOT, SLOT), timeout=30) for i in range(len(ops))]
    for b, d in zip(rep.lease.blocks, data, strict=True):
        assert block_checksum(d) == b.checksum  # the client-side check the connector does
    return rep, data


def test_shards_are_pinned_one_per_worker_node(pool: Pool, ray_cluster: RayCluster) -> None:
    assert sorted(pool.by_node) == ["a", "b", "c"]
    for name, handle in pool.by_node.items():
        info = handle.client().info()
        assert info.node_id == ray_cluster.nodes[name].node_id
        assert info.node_ip == ray_cluster.nodes[name].ip
        assert info.backend == pool.backend and info.region_id >= 0


def test_a_tcp_shard_listens_on_its_node_address_only(pool: Pool, ray_cluster: RayCluster) -> None:
    """Issue 16: the shard's TCP server is bound to its Ray node's address, never to every interface: the same
    port on another address of this host (127.0.0.1, every node's loopback neighbour) is closed."""
    import socket

    from kvpool.transfer import decode_metadata

    if pool.backend != "tcp":
        pytest.skip("NIXL's UCX listens where UCX_NET_DEVICES says (lo here; README, Security)")
    for name, handle in pool.by_node.items():
        meta = decode_metadata(handle.client().transfer_metadata())
        host, _, port = meta.payload.decode().rpartition(":")
        assert host == ray_cluster.nodes[name].ip
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # its own address answers
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()


def test_write_on_a_fetch_on_b_bytes_identical(pool: Pool, writer: Any, reader: Any) -> None:
    keys = keys_for(4, "identical")
    out = write_blocks(pool, writer, keys, [1, 2, 3, 4])
    assert out.committed == [0, 1, 2, 3] and not out.rejected
    assert pool.client("a").lookup(keys, FP).result.prefix == 4
    assert pool.client("b").lookup(keys, FP).result.prefix == 0  # other shards hold nothing
    rep, data = fetch(pool, reader, "a", keys)
    assert data == [payload(s) for s in (1, 2, 3, 4)]
    assert pool.client("a").release(rep.lease.lease_id)


def test_commit_with_a_wrong_checksum_is_not_visible(pool: Pool, writer: Any) -> None:
    keys = keys_for(2, "badsum")
    client = pool.client("a")
    rep = client.reserve(2)
    ray.get(writer.fill.remote(0, payload(7) + payload(8)), timeout=60)
    region = ray.get(writer.region_id.remote(), timeout=30)
    ops = [(rep.region_id, off, region, i * SLOT, SLOT) for i, off in enumerate(rep.reservation.offsets)]
    assert decode_result(ray.get(writer.write.remote(rep.agent_name, ops, DEADLINE_S, [rep.reservation.grant]),
                                 timeout=60)).all_ok
    out = client.commit(rep.reservation.reservation_id, keys, [block_checksum(payload(7)), 12345], FP, epoch=rep.epoch)
    assert out.committed == [0] and out.rejected == [1]
    assert client.lookup(keys, FP).result.prefix == 1


def test_a_caller_without_the_cluster_secret_learns_nothing_and_writes_nothing(pool: Pool, writer: Any) -> None:
    """Every call to a shard needs the proof of the cluster secret (``kvpool.secret.call_proof``): a Ray caller that
    sends none (or a forged one, or another call's) gets no transfer metadata, no lookup, no lease, no events, no
    slots, and makes no block visible, even with correct checksums — and is told nothing about the shard."""
    from kvpool.secret import call_proof, pool_secret
    from kvpool.shard.client import proof_for
    from kvpool.shard.wire import (
        CommitRequest,
        EventsRequest,
        LeaseRequest,
        LookupRequest,
        ReleaseRequest,
        ReserveRequest,
        encode,
    )

    client = pool.client("a")
    held = keys_for(2, "held-by-a")
    write_blocks(pool, writer, held, [3, 4])
    calls = {
        "transfer_metadata": (), "info": (), "stats": (), "snapshot": (),
        "lookup": (encode(LookupRequest(held, FP)),),
        "lease": (encode(LeaseRequest(held, FP, 30.0)),),
        "release": (encode(ReleaseRequest(1)),),
        "events_since": (encode(EventsRequest(0)),),
        "events_wait": (encode(EventsRequest(0, wait_s=0.1)),),
        "reserve": (encode(ReserveRequest(2)),),
    }
    for op, args in calls.items():
        other = "lookup" if op != "lookup" else "lease"
        for proof in (b"", b"x" * 32, proof_for(other)):  # none, forged, another call's
            with pytest.raises(Exception, match="not authenticated") as err:
                ray.get(getattr(client.handle, op).remote(*args, proof), timeout=60)
            assert client.shard_id not in str(err.value).split("PermissionError", 1)[-1]  # says nothing of it
    assert client.stats().leases == 0  # no forged lease took a block
    keys = keys_for(1, "forged")
    rep = client.reserve(1)  # a real writer's reservation, then a forger's commit into it
    ray.get(writer.fill.remote(0, payload(21)), timeout=60)
    region = ray.get(writer.region_id.remote(), timeout=30)
    ops = [(rep.region_id, rep.reservation.offsets[0], region, 0, SLOT)]
    assert decode_result(ray.get(writer.write.remote(rep.agent_name, ops, DEADLINE_S, [rep.reservation.grant]),
                                 timeout=60)).all_ok
    forged = CommitRequest(rep.reservation.reservation_id, keys, [block_checksum(payload(21))], FP)
    with pytest.raises(Exception, match="not authenticated"):
        ray.get(client.handle.commit.remote(encode(forged), proof_for("commit")), timeout=60)
    # A commit proof of the same reservation id seen in an earlier incarnation of the shard (ids restart with it).
    replayed = msgspec.structs.replace(forged, proof=call_proof(pool_secret(), "commit", forged.reservation_id,
                                                                "an-earlier-epoch"))
    with pytest.raises(Exception, match="not authenticated"):
        ray.get(client.handle.commit.remote(encode(replayed), proof_for("commit")), timeout=60)
    assert client.lookup(keys, FP).result.prefix == 0
    assert client.lookup(held, FP).result.prefix == 2  # the cluster's own calls still work
    assert client.abort(rep.reservation.reservation_id)  # the slot back for the tests after this one
    assert "kvstack_pool_unauthenticated_total" in client.metrics_text()


def test_a_peer_reads_and_writes_only_the_slots_granted_to_it(pool: Pool, writer: Any, reader: Any) -> None:
    """Issue 16: a peer that knows the cluster secret still moves bytes only in the slots a lease (read) or a
    reservation (read, write) granted it — never an arbitrary span of the arena, never after the release. The TCP
    server checks it per span; NIXL cannot (UCX memory keys; README, Security)."""
    if pool.backend != "tcp":
        pytest.skip("NIXL's UCX memory keys cannot be checked per span (README, Security)")
    client = pool.client("a")
    keys = keys_for(2, "granted")
    write_blocks(pool, writer, keys, [61, 62])
    other = keys_for(1, "not-leased")
    write_blocks(pool, writer, other, [63])
    region = ray.get(reader.region_id.remote(), timeout=30)
    rep = client.lease(keys, FP, 30.0)
    other_rep = client.lease(other, FP, 30.0)
    assert len(rep.lease.blocks) == 2 and len(other_rep.lease.blocks) == 1 and rep.lease.grant

    def read(spans: list[tuple[int, int]], grants: list[bytes]) -> Any:
        ops = [(rep.region_id, off, region, i * SLOT, n) for i, (off, n) in enumerate(spans)]
        return decode_result(ray.get(reader.read.remote(rep.agent_name, ops, DEADLINE_S, grants), timeout=60))

    leased = [(b.offset, b.length) for b in rep.lease.blocks]
    assert read(leased, [rep.lease.grant]).all_ok
    assert ray.get(reader.get.remote(SLOT, SLOT), timeout=30) == payload(62)
    # half of a leased slot and half of its neighbour (whichever neighbour lies inside the arena)
    across = leased[0][0] + SLOT // 2 if leased[0][0] + 2 * SLOT <= DRAM_SLOTS * SLOT else leased[0][0] - SLOT // 2
    refused = {
        "no grant": read(leased, []),
        "a forged grant": read(leased, [b"\0" * 16]),
        "a slot of another lease": read([(other_rep.lease.blocks[0].offset, SLOT)], [rep.lease.grant]),
        "a span across two slots": read([(across, SLOT)], [rep.lease.grant]),
    }
    for why, res in refused.items():
        assert not res.ok and "not granted" in res.error, (why, res)
    # A lease does not grant writing: a peer holding one cannot change the blocks every tenant loads.
    ray.get(writer.fill.remote(0, payload(99)), timeout=60)
    wregion = ray.get(writer.region_id.remote(), timeout=30)
    poison = [(rep.region_id, leased[0][0], wregion, 0, SLOT)]
    res = decode_result(ray.get(writer.write.remote(rep.agent_name, poison, DEADLINE_S, [rep.lease.grant]), timeout=60))
    assert not res.ok and "not granted" in res.error, res
    assert client.release(rep.lease.lease_id) and client.release(other_rep.lease.lease_id)
    assert "not granted" in read(leased, [rep.lease.grant]).error  # the grant died with its lease
    again, data = fetch(pool, reader, "a", keys)
    assert data == [payload(61), payload(62)]  # unchanged
    assert client.release(again.lease.lease_id)
    # A reservation grants its own slots only, for writing.
    res_rep = client.reserve(1)
    mine = [(res_rep.region_id, res_rep.reservation.offsets[0], wregion, 0, SLOT)]
    granted = [res_rep.reservation.grant]
    assert decode_result(ray.get(writer.write.remote(rep.agent_name, mine, DEADLINE_S, granted), timeout=60)).all_ok
    res = decode_result(ray.get(writer.write.remote(rep.agent_name, poison, DEADLINE_S, granted), timeout=60))
    assert not res.ok and "not granted" in res.error, res
    assert client.abort(res_rep.reservation.reservation_id)
    assert 'op="tcp_write"' in client.metrics_text() and 'op="tcp_read"' in client.metrics_text()


def test_lease_protects_from_eviction(pool: Pool, writer: Any, reader: Any) -> None:
    client = pool.client("a")
    leased = keys_for(3, "leased")
    write_blocks(pool, writer, leased, [10, 11, 12])
    rep = client.lease(leased, FP, 60.0)
    assert len(rep.lease.blocks) == 3
    before = client.stats().counters
    # Push 4 x 5 blocks through a shard of 8 DRAM + 8 SSD slots: unleased blocks are demoted, then evicted.
    for round_ in range(4):
        fill = keys_for(5, f"fill-{round_}")
        out = write_blocks(pool, writer, fill, list(range(100 + 5 * round_, 105 + 5 * round_)))
        assert len(out.committed) == 5
        assert client.lookup(leased, FP).result.dram == 3
    after = client.stats().counters
    assert after["demotions"] > before["demotions"] and after["evictions_ssd"] > before["evictions_ssd"]
    region = ray.get(reader.region_id.remote(), timeout=30)
    ops = [(rep.region_id, b.offset, region, i * SLOT, b.length) for i, b in enumerate(rep.lease.blocks)]
    assert decode_result(ray.get(reader.read.remote(rep.agent_name, ops, DEADLINE_S, [rep.lease.grant]),
                                 timeout=60)).all_ok
    got = [ray.get(reader.get.remote(i * SLOT, SLOT), timeout=30) for i in range(3)]
    assert got == [payload(s) for s in (10, 11, 12)]
    assert client.release(rep.lease.lease_id)


def test_one_round_trip_leases_the_first_shard_and_looks_up_the_others(pool: Pool, writer: Any) -> None:
    """The connector's ``lease_on_lookup`` round trip (``lookup_many`` with ``lease_ttl_s``): node a's shard pins
    what it holds and grants it, node c's answers a plain lookup; a lease that finds nothing pins nothing."""
    a, c = pool.client("a"), pool.client("c")
    keys = keys_for(3, "one-trip")
    write_blocks(pool, writer, keys, [50, 51, 52])
    before = a.stats().leases
    leased, looked = lookup_many([(a, keys + keys_for(1, "one-trip-tail")), (c, keys)], FP, DEADLINE_S,
                                 lease_ttl_s=30.0)
    assert isinstance(leased, LeaseReply) and isinstance(looked, LookupReply)
    assert [b.key for b in leased.lease.blocks] == keys and leased.lease.grant and looked.result.prefix == 0
    assert a.stats().leases == before + 1
    assert a.release(leased.lease.lease_id) and a.stats().leases == before
    (missed,) = lookup_many([(c, keys)], FP, DEADLINE_S, lease_ttl_s=30.0)
    assert isinstance(missed, LeaseReply) and missed.lease.lease_id == 0 and not missed.lease.blocks


@ray.remote(num_cpus=0)
class SlowLeaseShard:
    """A stalled shard's neighbour: it answers every lease (id 42, nothing in it but the id) after ``delay_s`` and
    records the releases it gets."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.releases: list[int] = []

    def lease(self, raw: bytes, proof: bytes = b"") -> bytes:
        time.sleep(self.delay_s)
        return encode(LeaseReply("slow", "e1", "agent-slow", 0, Lease(42, [], 0.0, 30.0, b"", 1)))

    def release(self, raw: bytes, proof: bytes = b"") -> bytes:
        self.releases.append(decode(raw, ReleaseRequest).lease_id)
        return encode(AckReply("slow", "e1", True))

    def released(self) -> list[int]:
        return self.releases


def test_a_lease_answered_after_its_deadline_is_released_when_it_arrives(ray_cluster: RayCluster) -> None:
    """A lease whose caller gave up (its deadline passed: a plain lease, or the lease of a lookup's round trip)
    pins blocks nobody reads: the client releases it when the late answer comes, not at the end of its ttl."""
    shard = SlowLeaseShard.remote(1.0)
    client = ShardClient(shard, "slow", deadline_s=0.2)
    key = keys_for(1, "late")
    with pytest.raises(ShardUnavailableError):
        client.lease(key, FP, 30.0)
    assert lookup_many([(client, key)], FP, 0.2, lease_ttl_s=30.0) == [None]
    deadline = time.monotonic() + 20.0
    while ray.get(shard.released.remote(), timeout=30) != [42, 42] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(shard.released.remote(), timeout=30) == [42, 42]
    ray.kill(shard)


def test_lease_expires_on_the_shard_sweeper(pool: Pool, writer: Any) -> None:
    client = pool.client("a")
    keys = keys_for(1, "expiring")
    write_blocks(pool, writer, keys, [40])
    rep = client.lease(keys, FP, 0.5)
    assert len(rep.lease.blocks) == 1
    deadline = time.monotonic() + 10.0
    while client.stats().leases and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.stats().leases == 0  # swept by the background thread, no request needed
    assert not client.release(rep.lease.lease_id)


def test_demotion_to_ssd_and_read_back(pool: Pool, writer: Any, reader: Any) -> None:
    client = pool.client("a")
    first = keys_for(4, "demoted")
    write_blocks(pool, writer, first, [20, 21, 22, 23])
    write_blocks(pool, writer, keys_for(8, "pressure"), list(range(200, 208)))  # DRAM full → demote `first`
    res = client.lookup(first, FP).result
    assert (res.prefix, res.ssd) == (4, 4)
    rep, data = fetch(pool, reader, "a", first)
    assert [b.from_tier.value for b in rep.lease.blocks] == ["ssd"] * 4
    assert data == [payload(s) for s in (20, 21, 22, 23)]
    assert client.lookup(first, FP).result.dram == 4  # promoted on lease
    client.release(rep.lease.lease_id)


def test_corrupted_ssd_block_is_a_miss_with_metric(pool: Pool, writer: Any, reader: Any) -> None:
    client = pool.client("a")
    keys = keys_for(3, "corrupt")
    write_blocks(pool, writer, keys, [30, 31, 32])
    assert client.demote(keys) == 3
    info = client.entry_info(keys[1])
    assert info is not None and info.tier.value == "ssd" and info.path
    with open(info.path, "r+b") as f:  # same machine: the "node's" SSD directory is a local path
        f.seek(info.offset + 100)
        byte = f.read(1)
        f.seek(info.offset + 100)
        f.write(bytes([byte[0] ^ 0x5A]))

    def failures() -> float:
        total = 0.0
        for line in client.metrics_text().splitlines():
            if line.startswith("kvstack_pool_checksum_failures_total{") and 'tier="ssd"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = failures()
    rep, data = fetch(pool, reader, "a", keys)
    assert [b.key for b in rep.lease.blocks] == keys[:1]  # served up to the bad block, never its bytes
    assert data == [payload(30)]
    assert failures() == before + 1
    assert client.lookup(keys, FP).result.prefix == 1
    client.release(rep.lease.lease_id)


def test_router_view_follows_the_shards(pool: Pool, writer: Any) -> None:
    sync = ShardSync(PrefixIndex(), deadline_s=DEADLINE_S * 4)
    sync.set_shards([(h.event_source(), h.node_id) for h in pool.by_node.values()])
    rep = asyncio.run(sync.poll_once())
    assert not rep.failed and sorted(rep.resynced) == sorted(h.shard_id for h in pool.by_node.values())
    keys = keys_for(2, "directory")
    write_blocks(pool, writer, keys, [50, 51])
    rep = asyncio.run(sync.poll_once())
    assert not rep.failed and rep.applied[pool.by_node["a"].shard_id] >= 2
    holdings = sync.index.query(keys).pool
    assert [(h.shard_id, h.node_id, h.tier, h.prefix_blocks) for h in holdings] == [
        (pool.by_node["a"].shard_id, pool.by_node["a"].node_id, "dram", 2)]


def test_the_routers_long_poll_answers_at_the_shards_next_event(pool: Pool, writer: Any) -> None:
    """``events_wait`` (the router's long poll, its own concurrency group): an idle shard holds the call, a write
    elsewhere on it answers it at once, and a lookup meanwhile is not queued behind the waiting poll."""
    from concurrent.futures import ThreadPoolExecutor

    handle = pool.by_node["a"]
    source, client = handle.event_source(), pool.client("a")
    seq = client.snapshot().seq  # the shard's last event
    keys = keys_for(1, "long-poll")

    async def scenario() -> tuple[list[Any], float, float]:
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(source.events_since(seq, 64, DEADLINE_S, wait_s=8.0))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # nothing new: the shard holds it
        t1 = time.monotonic()
        await asyncio.to_thread(client.lookup, keys, FP)  # the default group is free meanwhile
        lookup_s = time.monotonic() - t1
        with ThreadPoolExecutor(1) as ex:
            await asyncio.get_running_loop().run_in_executor(ex, write_blocks, pool, writer, keys, [60])
        batch = await waiting  # the write's first event: its own block, or a block its reservation evicted
        assert batch.events and batch.events[0].seq == seq + 1
        events = list(batch.events)
        while keys[0] not in [e.key for e in events] and time.monotonic() - t0 < 6.0:
            batch = await source.events_since(batch.last_seq, 64, DEADLINE_S, wait_s=2.0)
            events += batch.events
        return events, time.monotonic() - t0, lookup_s

    events, took, lookup_s = asyncio.run(scenario())
    assert keys[0] in [e.key for e in events]
    assert took < 6.0 and lookup_s < 3.0  # answered by the write, long before its 8 s wait


def test_shard_killed_mid_transfer_fails_blocks_within_deadline(
    ray_cluster: RayCluster, pool: Pool, reader: Any, tmp_path: Path
) -> None:
    # A dedicated shard on node c (the module's shards stay up), 32 x 1 MiB blocks to make the reads long.
    big = 1 << 20

    def config(node: PoolNode) -> ShardConfig:
        store = StoreConfig(slot_bytes=big, dram_slots=32, reservation_ttl_s=60.0)
        return shard_config(f"{pool.backend}-victim", store, pool.backend)

    victim = build_pool(config, nodes=[ray_cluster.nodes["c"].node_id], named=False, ready_deadline_s=120.0)[0]
    client = victim.client(deadline_s=DEADLINE_S * 4)
    reader_big = pool.buffer_actor("b", f"reader-big-{pool.backend}", 32 * big)
    ray.get(reader_big.add_peer.remote(client.transfer_metadata()), timeout=60)
    rep = client.reserve(32)  # reserved slots are readable memory; enough for a transfer in flight
    region = ray.get(reader_big.region_id.remote(), timeout=30)
    ops = [(rep.region_id, off, region, i * big, big) for i, off in enumerate(rep.reservation.offsets)]
    grants = [rep.reservation.grant]
    warm = decode_result(ray.get(reader_big.read.remote(rep.agent_name, ops, DEADLINE_S, grants), timeout=60))
    assert warm.all_ok, warm

    progress = tmp_path / "reads-done"
    ref = reader_big.read_until_failure.remote(rep.agent_name, ops, DEADLINE_S, 60.0, str(progress), grants)
    deadline = time.monotonic() + 60.0
    while not (progress.exists() and progress.read_text()):  # reads are running once the first one is done
        assert time.monotonic() < deadline, "the reader's read loop did not complete a read within 60 s"
        time.sleep(0.02)
    ray.kill(victim.actor, no_restart=True)
    t0 = time.monotonic()
    n, raw, took = ray.get(ref, timeout=DEADLINE_S + 60.0)
    res = decode_result(raw)
    print(f"\n[{pool.backend}] shard killed during read #{n}: {len(res.failed)}/{len(ops)} blocks failed, "
          f"{len(res.ok)} ok, the failing read took {took:.2f}s (deadline {DEADLINE_S}s): {res.error[:120]}")
    assert res.failed, f"no failure reported after {n} reads"
    assert took <= DEADLINE_S + 2.0, f"the failing read took {took:.1f}s, deadline {DEADLINE_S}s"
    assert time.monotonic() - t0 <= DEADLINE_S + 30.0
    with pytest.raises(ShardUnavailableError):
        client.lookup(keys_for(1, "dead"), FP)


QUIET_DRIVER = """
import json, sys, threading, time
import ray
from kvpool.connector.config import ConnectorConfig
from kvpool.connector.pool import PoolShards
from ray._private.worker import global_worker

PoolShards(ConnectorConfig(ray_address=sys.argv[1])).ensure_ray()
alive = global_worker.listener_thread.is_alive()
nodes = sum(n["Alive"] for n in ray.nodes())
t0 = time.monotonic()
ray.shutdown()
print(json.dumps({"listener_alive": alive, "nodes": nodes, "shutdown_s": time.monotonic() - t0,
                  "threads": [t.name for t in threading.enumerate()]}))
"""


def test_an_engine_process_joins_the_cluster_without_the_error_poller(ray_cluster: RayCluster) -> None:
    """The engine's processes are Ray drivers (not workers): joining stops Ray's driver error listener, which
    otherwise long-polls the GCS in a tight loop on the engine's core; the process still talks to the cluster and
    leaves it cleanly."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", QUIET_DRIVER, ray_cluster.local.address], capture_output=True,
                         text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["listener_alive"] is False, report
    assert "ray_listen_error_messages" not in report["threads"], report
    assert report["nodes"] == 4, report
    assert report["shutdown_s"] < 30, report
