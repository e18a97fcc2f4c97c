"""``kvpool.transfer.shm`` beyond the conformance suite: what it refuses to map, and the shared arena it maps."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from bench.transfer_peer import Stop, start_peer
from kvpool.arena import DramArena
from kvpool.transfer import BlockOp, StaleMetadataError
from kvpool.transfer.shm import ShmEndpoint, ShmPayload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MIB = 1 << 20


@pytest.fixture(scope="module")
def peer():  # type: ignore[no-untyped-def]
    p = start_peer(["shm"], {"shm": "shard-s"}, seed=5, size=4 * MIB)
    yield p
    p.conn.send(Stop())
    p.process.join(10)


def _payload(meta: object) -> ShmPayload:
    return msgspec.msgpack.decode(meta.payload, type=ShmPayload)  # type: ignore[attr-defined]


def test_a_peer_on_another_host_is_refused(peer) -> None:  # type: ignore[no-untyped-def]
    ep = ShmEndpoint("client-host")
    try:
        forged = msgspec.structs.replace(_payload(peer.meta), boot_id="another-boot")
        with pytest.raises(StaleMetadataError, match="another host"):
            ep.add_peer(msgspec.structs.replace(peer.meta, payload=msgspec.msgpack.encode(forged)))
    finally:
        ep.close()


def test_only_the_exporters_memfd_is_mapped(peer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Metadata naming a descriptor of the exporter that is not its memfd (stdin, a pipe, a file) is refused.
    ep = ShmEndpoint("client-fd")
    try:
        forged = msgspec.structs.replace(_payload(peer.meta), fds={0: 0})
        with pytest.raises(StaleMetadataError, match="not a memfd|cannot map"):
            ep.add_peer(msgspec.structs.replace(peer.meta, payload=msgspec.msgpack.encode(forged)))
        gone = msgspec.structs.replace(_payload(peer.meta), start_ticks=1)  # the pid now runs another process
        with pytest.raises(StaleMetadataError, match="gone"):
            ep.add_peer(msgspec.structs.replace(peer.meta, payload=msgspec.msgpack.encode(gone)))
    finally:
        ep.close()


def test_a_shared_arena_is_written_and_read_by_a_same_host_client() -> None:
    # One process plays both sides here: the exporting endpoint over a shared arena and a client mapping it.
    arena = DramArena(64 * 1024, 8, shared=True)
    owner, client = ShmEndpoint("owner"), ShmEndpoint("client")
    try:
        assert arena.fd is not None and os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:")
        rid = owner.register_shared(arena.buffer, arena.fd)
        local = np.arange(256 * 1024, dtype=np.uint32).view(np.uint8)[: 128 * 1024].copy()
        lid = client.register(memoryview(local))
        client.add_peer(owner.metadata())
        assert client.write("owner", [BlockOp(rid, arena.offset(3), lid, 0, 64 * 1024)], 5.0).all_ok
        assert np.array_equal(arena.array[arena.offset(3): arena.offset(4)], local[: 64 * 1024])
        back = np.zeros(64 * 1024, dtype=np.uint8)
        bid = client.register(memoryview(back))
        assert client.read("owner", [BlockOp(rid, arena.offset(3), bid, 0, 64 * 1024)], 5.0).all_ok
        assert np.array_equal(back, local[: 64 * 1024])
        with pytest.raises(ValueError, match="outside region"):
            client.read("owner", [BlockOp(rid, arena.offset(7) + 1, bid, 0, 64 * 1024)], 5.0)
    finally:
        client.close()
        owner.close()
        arena.close()
