"""The TCP transport against a hostile network (issue 16, item 3): a peer that does not prove the cluster secret
reads nothing and writes nothing — a plain socket speaking the wire format, and an endpoint with another secret;
nothing about the server (its name, epoch) is told before the proof, no request frame larger than a request is
read, and idle connections are closed. Real sockets on loopback, in one process."""

from __future__ import annotations

import socket
import struct
import time

import msgspec
import numpy as np
import pytest

from kvpool import secret as pool_secret
from kvpool.transfer import BlockOp
from kvpool.transfer.tcp import TCP_WIRE_VERSION, TcpEndpoint, TcpOptions, TcpRequest

pytestmark = pytest.mark.integration

SECRET = b"the-cluster-secret"
SIZE = 1 << 16


@pytest.fixture
def server():
    ep = TcpEndpoint("shard-x", TcpOptions(server_idle_timeout_s=1.0, handshake_timeout_s=1.0), secret=SECRET)
    region = np.arange(SIZE, dtype=np.uint8)
    rid = ep.register(memoryview(region))
    yield ep, region, rid
    ep.close()


def client(secret: bytes) -> tuple[TcpEndpoint, np.ndarray, int]:
    ep = TcpEndpoint("engine-y", TcpOptions(serve=False), secret=secret)
    buf = np.zeros(SIZE, dtype=np.uint8)
    return ep, buf, ep.register(memoryview(buf))


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closing: it had unread bytes of ours)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def address(ep: TcpEndpoint) -> tuple[str, int]:
    host, _, port = ep.metadata().payload.decode().rpartition(":")
    return host, int(port)


def test_the_cluster_secret_reads_and_writes(server) -> None:
    srv, region, rid = server
    ep, buf, lid = client(SECRET)
    ep.add_peer(srv.metadata())
    got = ep.read("shard-x", [BlockOp(rid, 0, lid, 0, 4096)], 5.0)
    assert got.failed == [] and bytes(buf[:4096]) == bytes(region[:4096])
    buf[:16] = 7
    assert ep.write("shard-x", [BlockOp(rid, 8192, lid, 0, 16)], 5.0).failed == []
    assert bytes(region[8192:8208]) == b"\x07" * 16
    ep.close()


def test_another_secret_reads_and_writes_nothing(server) -> None:
    srv, region, rid = server
    before = bytes(region)
    ep, buf, lid = client(b"not-the-secret")
    ep.add_peer(srv.metadata())
    read = ep.read("shard-x", [BlockOp(rid, 0, lid, 0, 4096)], 3.0)
    assert read.ok == [] and "handshake" in read.error and not buf.any()  # nothing arrived from the server
    buf[:] = 9
    write = ep.write("shard-x", [BlockOp(rid, 0, lid, 0, 4096)], 3.0)
    assert write.ok == [] and bytes(region) == before  # nothing landed on it
    ep.close()


def test_a_plain_socket_learns_nothing_and_gets_no_allocation(server) -> None:
    srv, region, rid = server
    host, port = address(srv)
    meta = srv.metadata()
    with socket.create_connection((host, port), timeout=5) as s:
        nonce = s.recv(64)
        assert len(nonce) == pool_secret.NONCE_BYTES  # a nonce: nothing about the shard
        req = msgspec.msgpack.encode(TcpRequest(TCP_WIRE_VERSION, "read", meta.agent_name, meta.epoch,
                                                [(rid, 0, 4096)]))
        s.sendall(b"\x00" * 48 + struct.pack("!I", len(req)) + req)  # a wrong proof, then a request
        assert _until_closed(s) == b""  # closed without a word: no bytes of the region, no name, no epoch
    with socket.create_connection((host, port), timeout=5) as s:  # a bare 64 MiB header instead of a proof
        s.recv(64)
        t0 = time.monotonic()
        s.sendall(struct.pack("!I", 64 << 20))
        assert _until_closed(s) == b""  # dropped at the handshake deadline, never read as a frame
        assert time.monotonic() - t0 < 5.0


def test_idle_connections_are_closed_and_the_client_redials(server) -> None:
    srv, region, rid = server
    ep, buf, lid = client(SECRET)
    ep.add_peer(srv.metadata())
    assert ep.read("shard-x", [BlockOp(rid, 0, lid, 0, 64)], 5.0).failed == []
    time.sleep(1.8)  # past the server's idle timeout: it closed the pooled connection
    assert ep.read("shard-x", [BlockOp(rid, 64, lid, 64, 64)], 5.0).failed == []
    assert bytes(buf[:128]) == bytes(region[:128])
    ep.close()


def test_a_stale_target_is_refused_without_naming_the_server(server) -> None:
    srv, _region, rid = server
    ep, _buf, lid = client(SECRET)
    meta = srv.metadata()
    ep.add_peer(msgspec.structs.replace(meta, epoch="e" * len(meta.epoch)))
    res = ep.read("shard-x", [BlockOp(rid, 0, lid, 0, 64)], 5.0)
    assert res.ok == [] and "stale target" in res.error and meta.epoch not in res.error
    ep.close()


def test_a_server_with_a_grant_check_serves_only_granted_spans() -> None:
    """``grant_check`` (the pool shard's: its leases' and reservations' grants) sees each request's op, grants and
    spans; a request it refuses moves no byte either way, and the connection stays usable."""
    seen: list[tuple[str, list[bytes], list[tuple[int, int, int]]]] = []

    def check(op: str, grants: list[bytes], spans: list[tuple[int, int, int]]) -> bool:
        seen.append((op, list(grants), [tuple(s) for s in spans]))
        return grants == [b"g" * 16] and all(off < 4096 for _, off, _ in spans)

    srv = TcpEndpoint("shard-g", TcpOptions(), secret=SECRET, grant_check=check)
    region = np.arange(SIZE, dtype=np.uint8)
    rid = srv.register(memoryview(region))
    ep, buf, lid = client(SECRET)
    ep.add_peer(srv.metadata())
    try:
        refused = ep.read("shard-g", [BlockOp(rid, 0, lid, 0, 64)], 5.0)
        assert refused.ok == [] and "not granted" in refused.error and not buf.any()
        assert ep.read("shard-g", [BlockOp(rid, 8192, lid, 0, 64)], 5.0, [b"g" * 16]).ok == []
        buf[:64] = 3
        before = bytes(region)
        assert ep.write("shard-g", [BlockOp(rid, 0, lid, 0, 64)], 5.0, [b"h" * 16]).ok == []
        assert bytes(region) == before  # nothing landed
        assert ep.read("shard-g", [BlockOp(rid, 64, lid, 0, 64)], 5.0, [b"g" * 16]).failed == []
        assert bytes(buf[:64]) == bytes(region[64:128])
        assert seen[-1] == ("read", [b"g" * 16], [(rid, 64, 64)]) and seen[2][0] == "write"
    finally:
        ep.close()
        srv.close()
