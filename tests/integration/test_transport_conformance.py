"""One conformance suite for every ``TransferEndpoint`` backend (NIXL over UCX, plain TCP, shared memory, the loopback).

Peers run in separate processes (``bench.transfer_peer``, the harness ``kvstack bench transfer`` measures with), each
owning one endpoint and one registered region filled with a seeded random pattern; the test process is the client. No
Ray. A peer is driven through a pipe (``Register``, ``Digest``, ``Stop``); freezing and killing use real signals on the
peer process. The loopback backend (``tests.fakes.transfer.LoopbackEndpoint``, the in-process transport the unit tests
move bytes with) has in-process peers (``LoopbackPeer``) with the same surface: killed = closed, frozen = its ops wait
out their deadline.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from bench.transfer_peer import PeerProcess, pattern, transport_options
from bench.transfer_peer import start_peer as start_transfer_peer
from kvpool.transfer import (
    TRANSFER_WIRE_VERSION,
    BlockOp,
    StaleMetadataError,
    TransferEndpoint,
    decode_metadata,
    encode_metadata,
    make_endpoint,
)
from kvpool.transfer.metrics import TransferMetrics
from tests.fakes.transfer import LoopbackEndpoint, LoopbackFabric

pytestmark = pytest.mark.integration

KIB = 1 << 10
MIB = 1 << 20
PEER_REGION = 64 * MIB
PEER_START_TIMEOUT_S = 60.0
SLACK_S = 0.75  # allowed overshoot of a deadline (poll backoff, thread wake-up on a loaded 2-core machine)
BACKENDS = ["nixl", "tcp", "shm", "loopback"]
LOOPBACK = LoopbackFabric()  # the in-process "network" of the loopback endpoints


def endpoint(backend: str, name: str, host: str, metrics: TransferMetrics | None = None) -> TransferEndpoint:
    if backend == "loopback":
        return LoopbackEndpoint(LOOPBACK, name, metrics=metrics)
    # The test process only initiates: it runs as the connector's worker endpoints do (NIXL without a progress thread).
    return make_endpoint(backend, name, options=transport_options(backend, host, client=True), metrics=metrics)


class LoopbackPeer:
    """The loopback backend's peer: an endpoint of this process over a seeded region, with the same surface as a
    ``Peer`` (killed = closed, frozen = its ops wait out their deadline)."""

    def __init__(self, name: str, seed: int) -> None:
        self.seed = seed
        self.region = pattern(seed, PEER_REGION)
        self.extra: list[np.ndarray] = []
        self.endpoint = LoopbackEndpoint(LOOPBACK, name)
        self.endpoint.register(memoryview(self.region))
        self.meta = self.endpoint.metadata()
        self.name = name
        self.closed = False

    def expected(self, offset: int, length: int) -> np.ndarray:
        return pattern(self.seed, PEER_REGION)[offset : offset + length]

    def digest(self, offset: int, length: int) -> str:
        return hashlib.sha256(self.region[offset : offset + length].tobytes()).hexdigest()

    def register_more(self, seed: int, size: int) -> dict[str, bytes]:
        self.extra.append(pattern(seed, size))
        self.endpoint.register(memoryview(self.extra[-1]))
        return {"loopback": encode_metadata(self.endpoint.metadata())}

    def kill(self) -> None:
        if not self.closed:  # a later incarnation of the same name owns the fabric entry after this
            self.closed = True
            self.endpoint.close()

    def freeze(self) -> None:
        LOOPBACK.frozen.add(self.name)

    def thaw(self) -> None:
        LOOPBACK.frozen.discard(self.name)

    def stop(self) -> None:
        self.thaw()
        self.kill()


Peer = PeerProcess | LoopbackPeer


def start_peer(backend: str, name: str, seed: int, host: str = "127.0.0.2") -> Peer:
    if backend == "loopback":
        return LoopbackPeer(name, seed)
    return start_transfer_peer([backend], {backend: name}, seed=seed, size=PEER_REGION, host=host,
                               start_timeout_s=PEER_START_TIMEOUT_S)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def peer(backend: str) -> Iterator[Peer]:
    p = start_peer(backend, "shard-a", seed=11)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def client(backend: str, peer: Peer) -> Iterator[TransferEndpoint]:
    ep = endpoint(backend, "client", "127.0.0.3")
    ep.add_peer(peer.meta)
    yield ep
    ep.close()


@pytest.fixture
def fresh_client(backend: str) -> Iterator[TransferEndpoint]:
    ep = endpoint(backend, "client-fresh", "127.0.0.4")
    yield ep
    ep.close()


@pytest.fixture
def own_peer(backend: str) -> Iterator[list[Peer]]:
    """Peers a test starts itself (frozen, killed, restarted); always stopped afterwards."""
    peers: list[Peer] = []
    yield peers
    for p in peers:
        p.stop()


def local_region(ep: TransferEndpoint, size: int) -> tuple[int, np.ndarray]:
    buf = np.zeros(size, dtype=np.uint8)
    return ep.register(memoryview(buf)), buf


# ---- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("block", "count"),
    # 1m-x128: more blocks than the peer's 64 MiB region holds (each read twice), in 128 MiB
    [(64 * KIB, 1), (64 * KIB, 7), (64 * KIB, 1024), (1 * MIB, 1), (1 * MIB, 64), (1 * MIB, 128)],
    ids=["64k-x1", "64k-x7", "64k-x1024", "1m-x1", "1m-x64", "1m-x128"],
)
def test_read_round_trip_is_byte_identical(client: TransferEndpoint, peer: Peer, block: int, count: int) -> None:
    blocks_in_peer = PEER_REGION // block
    rng = np.random.default_rng(count)
    remote_blocks = rng.permutation(max(count, blocks_in_peer))[:count] % blocks_in_peer
    region, buf = local_region(client, count * block)
    ops = [BlockOp(0, int(rb) * block, region, i * block, block) for i, rb in enumerate(remote_blocks)]
    result = client.read(peer.name, ops, deadline_s=60.0)
    assert result.all_ok, result.error
    assert result.ok == list(range(count))
    assert result.bytes_moved == count * block
    source = pattern(peer.seed, PEER_REGION).reshape(blocks_in_peer, block)
    assert np.array_equal(buf.reshape(count, block), source[remote_blocks])


@pytest.mark.timeout(60)
def test_unaligned_mixed_length_ops(client: TransferEndpoint, peer: Peer) -> None:
    lengths = [1, 4095, 65536, 3, 200_000, 17]
    region, buf = local_region(client, sum(lengths) + 100)
    ops, at, rat = [], 0, 12345
    for n in lengths:
        ops.append(BlockOp(0, rat, region, at + 1, n))
        at, rat = at + n, rat + 2 * n + 7
    result = client.read(peer.name, ops, deadline_s=30.0)
    assert result.all_ok, result.error
    source = pattern(peer.seed, PEER_REGION)
    for op in ops:
        got = buf[op.local_offset : op.local_offset + op.length]
        assert np.array_equal(got, source[op.remote_offset : op.remote_offset + op.length])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("block", "count"), [(64 * KIB, 1), (64 * KIB, 256), (1 * MIB, 16)])
def test_write_then_read_back(
    fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str, block: int, count: int
) -> None:
    p = start_peer(backend, "shard-w", seed=5)
    own_peer.append(p)
    fresh_client.add_peer(p.meta)
    src_region, src = local_region(fresh_client, count * block)
    src[:] = pattern(99, count * block)
    ops = [BlockOp(0, (2 * i + 1) * block, src_region, i * block, block) for i in range(count)]
    result = fresh_client.write(p.name, ops, deadline_s=60.0)
    assert result.all_ok, result.error
    assert result.bytes_moved == count * block
    for i in (0, count - 1):  # the peer's own view of its memory
        expect = hashlib.sha256(src[i * block : (i + 1) * block].tobytes()).hexdigest()
        assert p.digest((2 * i + 1) * block, block) == expect
    assert p.digest(0, block) == hashlib.sha256(pattern(5, block).tobytes()).hexdigest()  # untouched gap
    back_region, back = local_region(fresh_client, count * block)
    back_ops = [BlockOp(0, (2 * i + 1) * block, back_region, i * block, block) for i in range(count)]
    result = fresh_client.read(p.name, back_ops, deadline_s=60.0)
    assert result.all_ok, result.error
    assert np.array_equal(back, src)


@pytest.mark.timeout(30)
def test_empty_batch_is_ok(client: TransferEndpoint, peer: Peer) -> None:
    result = client.read(peer.name, [], deadline_s=1.0)
    assert result.all_ok and result.ok == [] and result.bytes_moved == 0


# ---- validation and unknown peers -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_unknown_peer_fails_as_data(client: TransferEndpoint) -> None:
    region, _ = local_region(client, 4096)
    ops = [BlockOp(0, 0, region, 0, 1024), BlockOp(0, 1024, region, 1024, 1024)]
    result = client.read("no-such-peer", ops, deadline_s=1.0)
    assert result.failed == [0, 1] and result.ok == [] and result.bytes_moved == 0
    assert "no-such-peer" in result.error
    assert client.write("no-such-peer", ops, deadline_s=1.0).failed == [0, 1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("remote_region", "remote_offset", "local_offset", "length", "message"),
    [
        (0, PEER_REGION - 10, 0, 11, "outside region 0"),
        (0, -1, 0, 10, "outside region 0"),
        (7, 0, 0, 10, "unknown remote region 7"),
        (0, 0, 4096 - 5, 10, "local"),
        (0, 0, 0, 0, "length 0"),
    ],
)
def test_out_of_range_ops_are_rejected(
    client: TransferEndpoint,
    peer: Peer,
    remote_region: int,
    remote_offset: int,
    local_offset: int,
    length: int,
    message: str,
) -> None:
    region, _ = local_region(client, 4096)
    ops = [BlockOp(0, 0, region, 0, 16), BlockOp(remote_region, remote_offset, region, local_offset, length)]
    with pytest.raises(ValueError, match=message) as info:
        client.read(peer.name, ops, deadline_s=1.0)
    assert "op 1" in str(info.value)


@pytest.mark.timeout(30)
def test_unknown_local_region_is_rejected(client: TransferEndpoint, peer: Peer) -> None:
    with pytest.raises(ValueError, match="unknown local region 999"):
        client.read(peer.name, [BlockOp(0, 0, 999, 0, 16)], deadline_s=1.0)


@pytest.mark.timeout(30)
def test_expired_deadline_fails_without_moving_bytes(client: TransferEndpoint, peer: Peer) -> None:
    region, buf = local_region(client, 4096)
    result = client.read(peer.name, [BlockOp(0, 0, region, 0, 4096)], deadline_s=0.0)
    assert result.failed == [0] and not buf.any()


@pytest.mark.timeout(30)
def test_removed_peer_fails_as_data(fresh_client: TransferEndpoint, peer: Peer) -> None:
    region, _ = local_region(fresh_client, 4096)
    fresh_client.add_peer(peer.meta)
    assert fresh_client.read(peer.name, [BlockOp(0, 0, region, 0, 4096)], 10.0).all_ok
    fresh_client.remove_peer(peer.name)
    assert fresh_client.read(peer.name, [BlockOp(0, 0, region, 0, 4096)], 10.0).failed == [0]
    fresh_client.remove_peer(peer.name)  # idempotent


# ---- metadata: epochs, versions, backends ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_stale_metadata_is_rejected(fresh_client: TransferEndpoint, peer: Peer, backend: str) -> None:
    meta = peer.meta
    with pytest.raises(StaleMetadataError, match="version"):
        fresh_client.add_peer(msgspec.structs.replace(meta, version=TRANSFER_WIRE_VERSION + 1))
    other = "tcp" if backend == "nixl" else "nixl"
    with pytest.raises(StaleMetadataError, match="backend"):
        fresh_client.add_peer(msgspec.structs.replace(meta, backend=other))
    with pytest.raises(StaleMetadataError):
        fresh_client.add_peer(msgspec.structs.replace(meta, payload=b"\xc1garbage"))
    with pytest.raises(StaleMetadataError):
        decode_metadata(b"not msgpack at all")
    with pytest.raises(StaleMetadataError, match="version"):
        decode_metadata(encode_metadata(msgspec.structs.replace(meta, version=0)))
    region, _ = local_region(fresh_client, 4096)
    assert fresh_client.read(peer.name, [BlockOp(0, 0, region, 0, 16)], 1.0).failed == [0]  # nothing was added


@pytest.mark.timeout(30)
def test_metadata_of_other_backend_endpoint_is_rejected(fresh_client: TransferEndpoint, backend: str) -> None:
    other = "tcp" if backend == "nixl" else "nixl"
    foreign = endpoint(other, "foreign", "127.0.0.5")
    try:
        with pytest.raises(StaleMetadataError, match="backend"):
            fresh_client.add_peer(foreign.metadata())
    finally:
        foreign.close()


@pytest.mark.timeout(30)
def test_same_epoch_is_a_noop(fresh_client: TransferEndpoint, peer: Peer) -> None:
    region, buf = local_region(fresh_client, 4096)
    fresh_client.add_peer(peer.meta)
    fresh_client.add_peer(peer.meta)
    assert fresh_client.read(peer.name, [BlockOp(0, 8192, region, 0, 4096)], 10.0).all_ok
    assert np.array_equal(buf, peer.expected(8192, 4096))


@pytest.mark.timeout(120)
def test_restarted_peer_replaces_the_old_one(
    fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str
) -> None:
    first = start_peer(backend, "shard-r", seed=1)
    own_peer.append(first)
    region, buf = local_region(fresh_client, 64 * KIB)
    ops = [BlockOp(0, 0, region, 0, 64 * KIB)]
    fresh_client.add_peer(first.meta)
    assert fresh_client.read("shard-r", ops, 10.0).all_ok
    assert np.array_equal(buf, first.expected(0, 64 * KIB))
    first.kill()
    assert fresh_client.read("shard-r", ops, 5.0).failed == [0]  # dead incarnation: failed, not stale bytes

    second = start_peer(backend, "shard-r", seed=2)  # same name, new epoch, new bytes
    own_peer.append(second)
    assert second.meta.epoch != first.meta.epoch
    fresh_client.add_peer(second.meta)
    buf[:] = 0
    result = fresh_client.read("shard-r", ops, 10.0)
    assert result.all_ok, result.error
    assert np.array_equal(buf, second.expected(0, 64 * KIB))
    with pytest.raises(StaleMetadataError, match="older"):
        fresh_client.add_peer(first.meta)  # a late copy of the dead incarnation's metadata
    assert fresh_client.read("shard-r", ops, 10.0).all_ok  # the newer peer is still in place


@pytest.mark.timeout(60)
def test_region_registered_later_is_reachable_after_refresh(
    fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str
) -> None:
    p = start_peer(backend, "shard-grow", seed=21)
    own_peer.append(p)
    fresh_client.add_peer(p.meta)
    region, buf = local_region(fresh_client, 2 * MIB)
    with pytest.raises(ValueError, match="unknown remote region 1"):
        fresh_client.read(p.name, [BlockOp(1, 0, region, 0, MIB)], 5.0)
    newer = decode_metadata(p.register_more(seed=22, size=4 * MIB)[backend])
    assert newer.epoch == p.meta.epoch and len(newer.regions) == 2
    fresh_client.add_peer(newer)  # same incarnation, more memory: refreshed, not rejected
    ops = [BlockOp(1, 3 * MIB, region, 0, MIB), BlockOp(0, 0, region, MIB, MIB)]
    result = fresh_client.read(p.name, ops, 20.0)
    assert result.all_ok, result.error
    assert np.array_equal(buf[:MIB], pattern(22, 4 * MIB)[3 * MIB :])
    assert np.array_equal(buf[MIB:], p.expected(0, MIB))


# ---- deadlines: frozen and killed peers -----------------------------------------------------------------------


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("direction", ["read", "write"])
def test_frozen_peer_before_first_contact_returns_within_deadline(
    fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str, direction: str
) -> None:
    p = start_peer(backend, "shard-f", seed=3)
    own_peer.append(p)
    p.freeze()
    region, _ = local_region(fresh_client, 16 * MIB)
    fresh_client.add_peer(p.meta)
    ops = [BlockOp(0, i * MIB, region, i * MIB, MIB) for i in range(16)]
    deadline = 1.5
    result, took = _timed(getattr(fresh_client, direction), p.name, ops, deadline)
    assert took < deadline + SLACK_S, f"{direction} took {took:.2f}s against a {deadline}s deadline"
    if backend == "shm":  # shared memory needs no CPU of the peer: a stopped peer's memory is read and written
        assert result.all_ok, result.error
    else:
        assert result.failed == list(range(16)) and result.ok == []
        assert result.error
        assert result.settled, "the late transfer's cancel was not confirmed"  # NIXL took the cancel: fenced
    p.thaw()
    result = fresh_client.read(p.name, ops, 20.0)  # the thawed peer serves again
    assert result.all_ok, result.error


@pytest.mark.timeout(90)
def test_frozen_peer_after_contact_returns_within_deadline(
    fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str
) -> None:
    """After contact, NIXL on one host reads a stopped process's memory with CMA, shm maps it (no peer CPU needed):
    ok is a valid answer then, but only with the right bytes. TCP needs the peer's CPU, so it must fail."""
    p = start_peer(backend, "shard-g", seed=4)
    own_peer.append(p)
    region, buf = local_region(fresh_client, 16 * MIB)
    fresh_client.add_peer(p.meta)
    ops = [BlockOp(0, i * MIB, region, i * MIB, MIB) for i in range(16)]
    assert fresh_client.read(p.name, ops, 20.0).all_ok
    buf[:] = 0
    p.freeze()
    deadline = 1.5
    result, took = _timed(fresh_client.read, p.name, ops, deadline)
    assert took < deadline + SLACK_S
    if backend == "tcp":
        assert result.failed == list(range(16))
    for i in result.ok:
        assert np.array_equal(buf[i * MIB : (i + 1) * MIB], p.expected(i * MIB, MIB))
    assert sorted(result.ok + result.failed) == list(range(16))


@pytest.mark.timeout(90)
def test_killed_peer_fails_within_deadline(fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str) -> None:
    p = start_peer(backend, "shard-k", seed=6)
    own_peer.append(p)
    region, _ = local_region(fresh_client, 16 * MIB)
    fresh_client.add_peer(p.meta)
    ops = [BlockOp(0, i * MIB, region, i * MIB, MIB) for i in range(16)]
    assert fresh_client.read(p.name, ops, 20.0).all_ok
    p.kill()
    for direction in ("read", "write"):
        deadline = 2.0
        result, took = _timed(getattr(fresh_client, direction), p.name, ops, deadline)
        assert took < deadline + SLACK_S
        assert result.failed == list(range(16)) and result.bytes_moved == 0


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer(fresh_client: TransferEndpoint, own_peer: list[Peer], backend: str) -> None:
    """Kill during a large batch: the call returns within the deadline; every op is ok or failed; ok ops hold
    exactly the peer's bytes."""
    p = start_peer(backend, "shard-m", seed=8)
    own_peer.append(p)
    block, count = MIB, 512  # 512 MiB: takes long enough over TCP to be cut in the middle
    region, buf = local_region(fresh_client, count * block)
    fresh_client.add_peer(p.meta)
    ops = [BlockOp(0, (i % 64) * block, region, i * block, block) for i in range(count)]
    assert fresh_client.read(p.name, ops[:4], 20.0).all_ok
    killer = threading.Timer(0.05, p.kill)
    killer.start()
    deadline = 10.0
    result, took = _timed(fresh_client.read, p.name, ops, deadline)
    killer.join()
    assert took < deadline + SLACK_S
    assert sorted(result.ok + result.failed) == list(range(count))
    source = pattern(p.seed, PEER_REGION).reshape(64, block)
    for i in result.ok[:: max(1, len(result.ok) // 16)]:
        assert np.array_equal(buf[i * block : (i + 1) * block], source[i % 64])
    result, took = _timed(fresh_client.read, p.name, ops[:4], 2.0)  # and now it is dead
    assert result.failed == [0, 1, 2, 3] and took < 2.0 + SLACK_S


# ---- metrics --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metrics_count_bytes_and_failures(backend: str, peer: Peer) -> None:
    registry = CollectorRegistry()
    ep = endpoint(backend, "client-metrics", "127.0.0.6", metrics=TransferMetrics(registry))
    try:
        ep.add_peer(peer.meta)
        region, _ = local_region(ep, MIB)
        ops = [BlockOp(0, i * 64 * KIB, region, i * 64 * KIB, 64 * KIB) for i in range(16)]
        assert ep.read(peer.name, ops, 20.0).all_ok
        assert ep.read("nobody", ops[:3], 1.0).failed == [0, 1, 2]
        labels = {"backend": backend, "direction": "read"}
        assert registry.get_sample_value("kvstack_transfer_bytes_total", labels) == MIB
        assert registry.get_sample_value("kvstack_transfer_ops_total", labels) == 19
        assert registry.get_sample_value("kvstack_transfer_failed_ops_total", labels) == 3
        assert registry.get_sample_value("kvstack_transfer_seconds_count", labels) == 2
    finally:
        ep.close()
