"""``pull`` on a real 3-node Ray cluster: a shard copies blocks from a peer shard into its own arena over NIXL.

Shards are named actors (``kvpool.shard.registry``) in a test namespace, so the target resolves its source by id
the way it does in a deployment. The test process writes blocks into a source shard (reserve → NIXL write →
commit) and reads blocks back from the target (lease → NIXL read → checksum) with its own endpoint. Checked: bytes
pulled into B equal A's; a second pull reports them present; a source holding part of the list gives its prefix; a
corrupted block is never committed (by the target's checksum, or already cut by a verifying source's lease); an
unknown, frozen (SIGSTOP) or killed source is an error reply within the deadline with the target unchanged and no
reservation left; a source with another slot size is refused; target == source raises. Also the async client.

Run: ``flock /tmp/kvstack-heavy.lock timeout 900 .venv/bin/pytest tests/integration/test_pool_pull.py -q``
(``-s`` prints the pull times).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray

from kvpool.checksum import block_checksum
from kvpool.keys import Namespace, block_keys
from kvpool.shard.client import ShardClient, ShardHandle, proof_for
from kvpool.shard.placement import PoolNode, build_pool, stop_shards
from kvpool.shard.wire import PullReply, PullRequest, ShardConfig, decode, encode
from kvpool.store import StoreConfig
from kvpool.transfer import BlockOp, decode_metadata, make_endpoint
from kvpool.transfer.nixl import NixlOptions
from kvpool.transfer.shm import process_start_ticks
from kvpool.transfer.tcp import TcpOptions
from tests.ray_cluster_fixture import RayCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SLOT = 64 * 1024
FP = "ef" * 16
NS = "kvstack-pull-it"  # the module's shards: a (source, verifies on lease), b (target), c (source, does not)
NS_FAULTS = "kvstack-pull-it-faults"  # a (target), b (another slot size), c (victim: frozen, then killed)
NS_TCP = "kvstack-pull-it-tcp"  # a, b on the TCP backend
DEADLINE_S = 5.0
IO_SLOTS = 64


def payload(seed: int, size: int = SLOT) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def keys_for(n: int, salt: str) -> list[bytes]:
    return block_keys(Namespace("pull-it", FP, salt), list(range(n * 8)), 8)


class Shards:
    """Named shards of one namespace, by node name, and this process's own NIXL endpoint to write / read them."""

    def __init__(self, cluster: RayCluster, handles: list[ShardHandle], backend: str = "nixl") -> None:
        self.handles = handles
        self.by_node = {cluster.by_ip(h.node_ip).name: h for h in handles}
        self.mm = mmap.mmap(-1, IO_SLOTS * SLOT)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        options = NixlOptions(ucx_devices="lo") if backend == "nixl" else TcpOptions(
            bind_host=ray.util.get_node_ip_address(), serve=False)
        self.ep = make_endpoint(backend, f"pull-test-{os.getpid()}-{handles[0].shard_id}", options=options)
        self.region = self.ep.register(memoryview(self.mm))
        for h in handles:
            self.ep.add_peer(decode_metadata(self.client(h).transfer_metadata()))

    def client(self, node: str | ShardHandle) -> ShardClient:
        h = node if isinstance(node, ShardHandle) else self.by_node[node]
        return h.client(deadline_s=DEADLINE_S * 4)

    def id(self, node: str) -> str:
        return self.by_node[node].shard_id

    def write(self, node: str, keys: list[bytes], seeds: list[int]) -> None:
        """reserve on the node's shard → NIXL write from our buffer → commit with checksums (all must commit)."""
        client = self.client(node)
        slot = client.info().slot_bytes
        rep = client.reserve(len(keys))
        offsets = rep.reservation.offsets
        assert len(offsets) == len(keys), f"reserve gave {len(offsets)} of {len(keys)} slots"
        for i, s in enumerate(seeds):
            self.buf[i * slot : (i + 1) * slot] = np.frombuffer(payload(s, slot), dtype=np.uint8)
        ops = [BlockOp(rep.region_id, off, self.region, i * slot, slot) for i, off in enumerate(offsets)]
        res = self.ep.write(rep.agent_name, ops, DEADLINE_S, [rep.reservation.grant])
        assert res.all_ok, res
        out = client.commit(rep.reservation.reservation_id, keys, [block_checksum(payload(s, slot)) for s in seeds],
                            FP, epoch=rep.epoch)
        assert out.committed == list(range(len(keys))), out

    def read_back(self, node: str, keys: list[bytes]) -> list[bytes]:
        """lease on the node's shard → NIXL read into our buffer → verify → release: the leased prefix's bytes."""
        client = self.client(node)
        rep = client.lease(keys, FP, 30.0)
        blocks = rep.lease.blocks
        try:
            ops = [BlockOp(rep.region_id, b.offset, self.region, i * SLOT, b.length) for i, b in enumerate(blocks)]
            if ops:
                res = self.ep.read(rep.agent_name, ops, DEADLINE_S, [rep.lease.grant])
                assert res.all_ok, res
            data = [self.buf[i * SLOT : (i + 1) * SLOT].tobytes() for i in range(len(blocks))]
            assert [block_checksum(d) for d in data] == [b.checksum for b in blocks]
            return data
        finally:
            if rep.lease.lease_id:
                assert client.release(rep.lease.lease_id)

    def corrupt(self, node: str, key: bytes) -> None:
        """Flip bytes of a committed DRAM block in place (a stray write into the shard's arena)."""
        client = self.client(node)
        info = client.entry_info(key)
        assert info is not None and info.tier.value == "dram"
        shard = client.info()
        self.buf[:16] = 0xA5
        res = self.ep.write(shard.agent_name, [BlockOp(shard.region_id, info.offset + 100, self.region, 0, 16)],
                            DEADLINE_S)
        assert res.all_ok, res

    def state(self, node: str) -> tuple[int, int, int, int]:
        """(DRAM blocks, free DRAM slots, reservations, leases) of the node's shard."""
        st = self.client(node).stats()
        return st.dram.blocks, st.dram.free, st.reservations, st.leases

    def close(self) -> None:
        self.ep.close()


def start_named(cluster: RayCluster, namespace: str, store_for: dict[str, StoreConfig], backend: str = "nixl"
                ) -> list[ShardHandle]:
    """One named shard on each node in ``store_for``, finding its peers in ``namespace``."""
    def config(node: PoolNode) -> ShardConfig:
        nixl = NixlOptions(ucx_devices="lo") if backend == "nixl" else None
        return ShardConfig(shard_id=node.node_id[:12], store=store_for[cluster.by_ip(node.node_ip).name],
                           backend=backend, sweep_interval_s=0.2, nixl=nixl)

    return build_pool(config, nodes=[cluster.nodes[name].node_id for name in store_for], namespace=namespace,
                      ready_deadline_s=120.0)


def running_shards(cluster: RayCluster, namespace: str, store_for: dict[str, StoreConfig], backend: str = "nixl"
                   ) -> Iterator[Shards]:
    """Body of the module fixtures: start the named shards, yield them, stop them."""
    handles = start_named(cluster, namespace, store_for, backend=backend)
    shards = Shards(cluster, handles, backend=backend)
    yield shards
    shards.close()
    stop_shards(handles)


@pytest.fixture(scope="module")
def pool(ray_cluster: RayCluster) -> Iterator[Shards]:
    yield from running_shards(ray_cluster, NS, {
        "a": StoreConfig(slot_bytes=SLOT, dram_slots=96, reservation_ttl_s=60.0),
        "b": StoreConfig(slot_bytes=SLOT, dram_slots=96, reservation_ttl_s=60.0),
        "c": StoreConfig(slot_bytes=SLOT, dram_slots=16, reservation_ttl_s=60.0, verify_dram_on_lease=False),
    })


@pytest.fixture(scope="module")
def faults(ray_cluster: RayCluster) -> Iterator[Shards]:
    yield from running_shards(ray_cluster, NS_FAULTS, {
        "a": StoreConfig(slot_bytes=SLOT, dram_slots=16, reservation_ttl_s=60.0),
        "b": StoreConfig(slot_bytes=SLOT // 2, dram_slots=16, reservation_ttl_s=60.0),
        "c": StoreConfig(slot_bytes=SLOT, dram_slots=16, reservation_ttl_s=60.0),
    })


@pytest.fixture(scope="module")
def tcp_pool(ray_cluster: RayCluster) -> Iterator[Shards]:
    store = StoreConfig(slot_bytes=SLOT, dram_slots=16, reservation_ttl_s=60.0)
    yield from running_shards(ray_cluster, NS_TCP, {"a": store, "b": store}, backend="tcp")


def test_pull_32_blocks_bytes_identical(pool: Shards) -> None:
    for round_, salt in enumerate(("pull32-cold", "pull32-warm")):
        keys = keys_for(32, salt)
        seeds = [1000 * (round_ + 1) + i for i in range(32)]
        pool.write("a", keys, seeds)
        assert pool.client("b").lookup(keys, FP).result.prefix == 0
        t0 = time.perf_counter()
        rep = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
        wall = time.perf_counter() - t0
        print(f"\n[pull] {salt}: 32 x {SLOT // 1024} KiB a→b: {rep.seconds * 1e3:.1f} ms in the shard (read "
              f"{rep.read_seconds * 1e3:.1f} ms), {wall * 1e3:.1f} ms at the client")
        assert (rep.requested, rep.present, rep.pulled, rep.failed, rep.missing) == (32, 0, 32, 0, 0), rep
        assert rep.error == "" and rep.bytes_moved == 32 * SLOT and rep.shard_id == pool.id("b")
        assert 0 < rep.read_seconds <= rep.seconds
        assert pool.client("b").lookup(keys, FP).result.prefix == 32
        assert pool.read_back("b", keys) == [payload(s) for s in seeds]
        assert pool.state("a")[2:] == (0, 0) and pool.state("b")[2:] == (0, 0)  # lease released, no reservation
    counters = pool.client("b").stats().counters
    assert counters["pulls"] >= 2 and counters["pulled_blocks"] >= 64


def test_second_pull_reports_present(pool: Shards) -> None:
    keys = keys_for(4, "twice")
    pool.write("a", keys, [1, 2, 3, 4])
    first = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert first.pulled == 4
    again = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert (again.present, again.pulled, again.failed, again.bytes_moved) == (4, 0, 0, 0)
    assert pool.state("a")[3] == 0


def test_source_missing_part_of_the_list_pulls_its_prefix(pool: Shards) -> None:
    keys = keys_for(6, "prefix")
    pool.write("a", keys[:3], [11, 12, 13])
    rep = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.pulled, rep.missing, rep.failed, rep.error) == (3, 3, 0, "")
    assert pool.client("b").lookup(keys, FP).result.prefix == 3
    assert pool.read_back("b", keys) == [payload(s) for s in (11, 12, 13)]
    pool.write("a", keys[3:], [14, 15, 16])  # the rest appears on the source: a second pull completes it
    rep = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.present, rep.pulled) == (3, 3)
    assert pool.client("b").lookup(keys, FP).result.prefix == 6


def test_corrupted_block_is_not_committed(pool: Shards) -> None:
    """Source c hands out stored checksums without rechecking (verify_dram_on_lease off): B's check catches it."""
    keys = keys_for(4, "corrupt-c")
    pool.write("c", keys, [21, 22, 23, 24])
    pool.corrupt("c", keys[1])
    before = pool.client("b").stats().counters["commit_rejected"]
    rep = pool.client("b").pull(pool.id("c"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.pulled, rep.failed, rep.missing) == (3, 1, 0) and "checksum" in rep.error, rep
    assert pool.client("b").stats().counters["commit_rejected"] == before + 1
    assert pool.client("b").lookup(keys, FP).result.prefix == 1  # a miss from the bad block on
    assert pool.read_back("b", keys) == [payload(21)]
    assert pool.read_back("b", keys[2:]) == [payload(23), payload(24)]  # its neighbours arrived intact
    assert pool.state("b")[2] == 0 and pool.state("c")[3] == 0


def test_corrupted_block_on_a_verifying_source_ends_its_lease(pool: Shards) -> None:
    keys = keys_for(4, "corrupt-a")
    pool.write("a", keys, [31, 32, 33, 34])
    pool.corrupt("a", keys[1])
    rep = pool.client("b").pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.pulled, rep.missing, rep.failed) == (1, 3, 0), rep
    assert pool.read_back("b", keys) == [payload(31)]


def test_unknown_source_is_an_error_within_the_deadline(pool: Shards) -> None:
    before = pool.state("b")
    t0 = time.monotonic()
    rep = pool.client("b").pull("nosuchshard0", keys_for(3, "unknown"), FP, deadline_s=2.0)
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert (rep.requested, rep.pulled, rep.failed) == (3, 0, 3) and "unknown source shard" in rep.error, rep
    assert pool.state("b") == before


def test_target_equals_source_raises(pool: Shards) -> None:
    keys = keys_for(1, "self")
    with pytest.raises(ValueError, match="same shard"):
        pool.client("b").pull(pool.id("b"), keys, FP, deadline_s=1.0)
    raw = encode(PullRequest(pool.id("b"), keys, FP, 1.0))  # the shard refuses too, not only the client
    with pytest.raises(ValueError, match="same shard"):
        ray.get(pool.by_node["b"].actor.pull.remote(raw, proof_for("pull")), timeout=30)


def test_async_client(pool: Shards) -> None:
    keys = keys_for(3, "async")
    pool.write("a", keys, [41, 42, 43])
    rep = asyncio.run(pool.by_node["b"].async_client().pull(pool.id("a"), keys, FP, deadline_s=DEADLINE_S))
    assert (rep.pulled, rep.error) == (3, "")
    assert pool.read_back("b", keys) == [payload(s) for s in (41, 42, 43)]


def test_slot_size_mismatch_is_refused(faults: Shards) -> None:
    keys = keys_for(2, "slots")
    faults.write("b", keys, [51, 52])
    before = faults.state("a")
    rep = faults.client("a").pull(faults.id("b"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.pulled, rep.failed) == (0, 2) and "slot size mismatch" in rep.error, rep
    assert faults.state("a") == before
    assert faults.state("b")[3] == 0  # the lease it took to find out was released


def wait_until_gone(pid: int, *, deadline_s: float) -> None:
    """Wait until process ``pid`` (on this machine) has exited (``process_start_ticks``: gone, or a zombie);
    fail the test past ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while process_start_ticks(pid) is not None:
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} still alive {deadline_s:.0f} s after ray.kill")
        time.sleep(0.05)


def test_frozen_then_killed_source(faults: Shards) -> None:
    victim = faults.by_node["c"]
    keys = keys_for(4, "victim")
    faults.write("c", keys, [61, 62, 63, 64])
    warm = faults.client("a").pull(victim.shard_id, keys[:1], FP, deadline_s=DEADLINE_S)  # cached handle and peer
    assert warm.pulled == 1
    before = faults.state("a")
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rep = faults.client("a").pull(victim.shard_id, keys, FP, deadline_s=2.0, lease_ttl_s=3.0)
        took = time.monotonic() - t0
        # More pulls stuck on the frozen source than the actor has threads: its control path still answers.
        raw = encode(PullRequest(victim.shard_id, keys, FP, 2.0, 3.0))
        proof = proof_for("pull")
        stuck = [faults.by_node["a"].actor.pull.remote(raw, proof) for _ in range(10)]
        time.sleep(0.3)  # without a concurrency group of their own, every actor thread now waits ~1.7 s more
        t1 = time.monotonic()
        faults.client("a").lookup(keys, FP)
        lookup_s = time.monotonic() - t1
        stuck_replies = [decode(r, PullReply) for r in ray.get(stuck, timeout=60)]
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"\n[pull] frozen source: error reply after {took:.2f}s (deadline 2.0s): {rep.error[:100]}; a lookup "
          f"during 10 stuck pulls took {lookup_s * 1e3:.1f} ms")
    assert took < 2.0 + 1.5, took
    assert (rep.present, rep.pulled, rep.failed) == (1, 0, 3) and "no answer within" in rep.error, rep
    assert lookup_s < 0.5, lookup_s
    assert all(r.failed == 3 and r.error for r in stuck_replies)
    assert faults.state("a") == before

    thawed = faults.client("a").pull(victim.shard_id, keys[1:2], FP, deadline_s=DEADLINE_S)  # cached again
    assert thawed.pulled == 1, thawed
    before = faults.state("a")
    ray.kill(victim.actor, no_restart=True)  # asynchronous: a pull right after it once reached the live actor
    wait_until_gone(pid, deadline_s=30.0)
    for attempt in ("cached handle", "resolved again"):
        t0 = time.monotonic()
        rep = faults.client("a").pull(victim.shard_id, keys, FP, deadline_s=2.0)
        took = time.monotonic() - t0
        print(f"[pull] killed source ({attempt}): error reply after {took:.2f}s: {rep.error[:100]}")
        assert took < 2.0 + 1.5, took
        assert (rep.present, rep.pulled, rep.failed) == (2, 0, 2) and rep.error, rep
        assert faults.state("a") == before


def test_pull_over_tcp(tcp_pool: Shards) -> None:
    keys = keys_for(8, "tcp")
    seeds = list(range(70, 78))
    tcp_pool.write("a", keys, seeds)
    rep = tcp_pool.client("b").pull(tcp_pool.id("a"), keys, FP, deadline_s=DEADLINE_S)
    assert (rep.pulled, rep.failed, rep.error) == (8, 0, ""), rep
    assert tcp_pool.read_back("b", keys) == [payload(s) for s in seeds]
    assert tcp_pool.state("a")[2:] == (0, 0) and tcp_pool.state("b")[2:] == (0, 0)
