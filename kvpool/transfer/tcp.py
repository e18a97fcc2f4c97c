"""TcpEndpoint: the plain-TCP fallback implementation of ``kvpool.transfer.base.TransferEndpoint``.

Used where NIXL is not installed or not wanted (``make_endpoint("tcp", name, options=TcpOptions(...))``); it passes
the same conformance suite as ``NixlEndpoint`` (``tests/integration/test_transport_conformance.py``).

Roles: every endpoint runs a small server (a listening socket, one accept thread, one thread per connection) that
serves READ/WRITE requests against the regions registered here. A client endpoint ``add_peer(meta)`` with the
peer's metadata (``payload`` = ``b"host:port"``) and pulls/pushes block ops over pooled connections.

Handshake (issue 16: nothing is read, allocated or said before the peer proved it knows the cluster secret,
``kvpool.secret``): on accept the server sends a 16-byte nonce; the client answers with its own nonce and
HMAC(secret, "client", both nonces); the server checks it (within ``handshake_timeout_s``) and answers
HMAC(secret, "server", both nonces), which the client checks in turn. A failed proof closes the connection without
a word. Requests are then at most ``MAX_REQUEST_FRAME`` bytes (their spans, not data), and a connection idle past
``server_idle_timeout_s`` is closed (the client's pool redials).

Grants (issue 16): an endpoint made with a ``grant_check`` (the pool shard's: ``BlockStore.granted``) serves a
request only when the grants it carries cover every span — a lease's blocks for a READ, a reservation's slots for
either — so a peer that knows the cluster secret still reads and writes only the slots it was granted, never an
arbitrary span of a region. Without a ``grant_check`` (a client's own endpoint) any span of a registered region is
served to an authenticated peer.

Wire (one TCP connection carries one request at a time; every frame is a 4-byte big-endian length + msgpack):
  client -> server  ``TcpRequest`` (version, op, target agent name, target epoch, spans of (region, offset, len),
                    grants)
  WRITE:            then the raw bytes of every span, in order
  server -> client  ``TcpResponse`` (version, ok, error)
  READ and ok:      then the raw bytes of every span, in order
The server checks the target name and epoch, so a request meant for an earlier incarnation that reaches a
restarted server on the same port is refused, never served from the wrong memory (and the refusal names neither).

Deadlines: the client derives every socket timeout (connect, send, receive) from the call's deadline. On expiry,
peer death or a protocol error the connection is dropped; READ ops whose bytes fully arrived are reported ok, the
rest failed; a WRITE is all-or-nothing (ok only after the server acknowledged it).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np

from kvpool import secret as pool_secret
from kvpool.transfer.base import (
    TRANSFER_WIRE_VERSION,
    AgentMetadata,
    BlockOp,
    RegionDesc,
    StaleMetadataError,
    TransferEndpoint,
    TransferResult,
)
from kvpool.transfer.common import (
    LENGTH,
    LOCAL_OFFSET,
    LOCAL_REGION,
    REMOTE_OFFSET,
    REMOTE_REGION,
    Admission,
    Deadline,
    OpTable,
    admit,
    all_failed,
    all_ok,
    buffer_address,
    new_epoch,
)
from kvpool.transfer.metrics import TransferMetrics, transfer_metrics

TCP_WIRE_VERSION = 2  # 2: requests carry grants
TcpOp = Literal["read", "write"]  # a request of another op does not decode ("bad request")
# (op, the request's grants, its spans as (region, offset, length)) -> serve it?
GrantCheck = Callable[[TcpOp, Sequence[bytes], Sequence[tuple[int, int, int]]], bool]
_FRAME = struct.Struct("!I")
_MAX_FRAME = 64 << 20
MAX_REQUEST_FRAME = 1 << 20  # a request is its spans (~20 bytes each): 50k spans, never a data-sized frame
_CLIENT, _SERVER = b"kvstack-tcp-client-v1", b"kvstack-tcp-server-v1"
_DRAIN_CHUNK = 1 << 20


class TcpOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Typed options of ``TcpEndpoint`` (defaults in one place)."""

    bind_host: str = "127.0.0.1"  # address the server listens on (tests: 127.0.0.x)
    port: int = 0  # 0 = any free port
    advertise_host: str = ""  # host peers dial; "" = bind_host (required when bind_host is 0.0.0.0 / ::)
    serve: bool = True  # run the server (a pure client may skip it)
    server_io_timeout_s: float = 30.0  # server side: bound on a client that stalls in the middle of a request
    server_idle_timeout_s: float = 120.0  # server side: a connection idle this long between requests is closed
    handshake_timeout_s: float = 5.0  # server side: the client's proof must arrive within this
    max_idle_connections: int = 8  # pooled connections kept per peer

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if self.bind_host in ("0.0.0.0", "::", "") and not self.advertise_host:
            raise ValueError(f"bind_host {self.bind_host!r} needs an explicit advertise_host")
        if self.server_io_timeout_s <= 0 or self.server_idle_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError("server_io_timeout_s, server_idle_timeout_s and handshake_timeout_s must be > 0")
        if self.max_idle_connections < 0:
            raise ValueError("max_idle_connections must be >= 0")


class TcpRequest(msgspec.Struct, frozen=True, tag="tcp_req"):
    version: int
    op: TcpOp
    target: str
    epoch: str
    spans: list[tuple[int, int, int]]  # (region, offset, length) on the server
    grants: list[bytes] = []  # the leases' / reservations' grants covering the spans (see "Grants")


class TcpResponse(msgspec.Struct, frozen=True, tag="tcp_resp"):
    version: int
    ok: bool
    error: str = ""


class _ProtocolError(Exception):
    pass


_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(TcpRequest)
_resp_decoder = msgspec.msgpack.Decoder(TcpResponse)


def _send_frame(sock: socket.socket, payload: bytes, deadline: Deadline | None) -> None:
    _settimeout(sock, deadline)
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> bool:
    """Fill ``view``; False on a clean EOF before the first byte, ``ConnectionError`` on EOF mid-way."""
    got, n = 0, len(view)
    while got < n:
        _settimeout(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed the connection mid-message")
        got += k
    return True


def _recv_frame(sock: socket.socket, deadline: Deadline | None, limit: int = _MAX_FRAME) -> bytes | None:
    head = bytearray(_FRAME.size)
    if not _recv_exact(sock, memoryview(head), deadline):
        return None
    (length,) = _FRAME.unpack(head)
    if length > limit:
        raise _ProtocolError(f"frame of {length} bytes exceeds {limit}")
    body = bytearray(length)
    if length and not _recv_exact(sock, memoryview(body), deadline):
        raise ConnectionError("peer closed the connection after a frame header")
    return bytes(body)


def _settimeout(sock: socket.socket, deadline: Deadline | None) -> None:
    if deadline is None:
        return
    remaining = deadline.remaining()
    if remaining <= 0:
        raise TimeoutError("deadline expired")
    sock.settimeout(remaining)


@dataclass
class _Peer:
    meta: AgentMetadata
    host: str
    port: int
    regions: dict[int, int]
    idle: list[socket.socket] = field(default_factory=list)


class TcpEndpoint(TransferEndpoint):
    backend = "tcp"

    def __init__(
        self, agent_name: str, options: TcpOptions | None = None, metrics: TransferMetrics | None = None,
        secret: bytes | None = None, grant_check: GrantCheck | None = None,
    ) -> None:
        """``secret``: the cluster secret both ends prove (default: this process's, ``kvpool.secret``).
        ``grant_check``: serve only the spans it grants (see "Grants"); None serves any span of a region."""
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        self._name = agent_name
        self._grant_check = grant_check
        self._secret = pool_secret.pool_secret() if secret is None else secret
        self._options = options or TcpOptions()
        self._metrics = metrics or transfer_metrics()
        self._epoch = new_epoch()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[np.ndarray, memoryview]] = {}
        self._peers: dict[str, _Peer] = {}
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._address = ""
        if self._options.serve:
            self._start_server()

    # ---- server -------------------------------------------------------------------------------------------
    def _start_server(self) -> None:
        opts = self._options
        family = socket.AF_INET6 if ":" in opts.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((opts.bind_host, opts.port))
        listener.listen(64)
        listener.settimeout(0.25)  # the accept loop re-checks ``_closed`` this often
        self._listener = listener
        host = opts.advertise_host or opts.bind_host
        self._address = (
            f"[{host}]:{listener.getsockname()[1]}" if ":" in host else f"{host}:{listener.getsockname()[1]}"
        )
        thread = threading.Thread(target=self._accept_loop, name=f"tcp-xfer-accept-{self._name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="tcp-xfer-conn", daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _authenticate(self, conn: socket.socket) -> bool:
        """The server's side of the handshake (see the module doc); False: drop the connection, say nothing."""
        conn.settimeout(self._options.handshake_timeout_s)
        ours = pool_secret.nonce()
        conn.sendall(ours)
        answer = bytearray(pool_secret.NONCE_BYTES + pool_secret.MAC_BYTES)
        if not _recv_exact(conn, memoryview(answer), None):
            return False
        theirs, mac = bytes(answer[: pool_secret.NONCE_BYTES]), bytes(answer[pool_secret.NONCE_BYTES:])
        if not pool_secret.verify(self._secret, mac, _CLIENT, ours, theirs):
            return False
        conn.sendall(pool_secret.proof(self._secret, _SERVER, ours, theirs))
        return True

    def _serve(self, conn: socket.socket) -> None:
        io_timeout = self._options.server_io_timeout_s
        try:
            if not self._authenticate(conn):
                return
            while not self._closed.is_set():
                conn.settimeout(self._options.server_idle_timeout_s)  # idle between requests: bounded
                try:
                    raw = _recv_frame(conn, None, MAX_REQUEST_FRAME)
                except TimeoutError:
                    return  # idle too long: the client's pool redials
                if raw is None:
                    return
                conn.settimeout(io_timeout)
                try:
                    req = _req_decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    _send_frame(
                        conn, _encoder.encode(TcpResponse(TCP_WIRE_VERSION, False, f"bad request: {exc}")), None
                    )
                    return  # unknown framing of what follows: drop the connection
                error, views = self._check_request(req)
                if views is None:
                    if req.op == "write":
                        self._drain(conn, req)
                    _send_frame(conn, _encoder.encode(TcpResponse(TCP_WIRE_VERSION, False, error)), None)
                    continue
                if req.op == "read":
                    _send_frame(conn, _encoder.encode(TcpResponse(TCP_WIRE_VERSION, True)), None)
                    for view in views:
                        conn.sendall(view)
                else:
                    for view in views:
                        if not _recv_exact(conn, view, None):
                            return
                    _send_frame(conn, _encoder.encode(TcpResponse(TCP_WIRE_VERSION, True)), None)
        except (OSError, _ProtocolError, ConnectionError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check_request(self, req: TcpRequest) -> tuple[str, list[memoryview] | None]:
        if req.version != TCP_WIRE_VERSION:
            return f"tcp wire version {req.version}, server speaks {TCP_WIRE_VERSION}", None
        if req.target != self._name or req.epoch != self._epoch:
            return "stale target: not this incarnation of the agent (peer restarted?)", None
        views: list[memoryview] = []
        with self._lock:
            regions = dict(self._regions)
        for i, (region, offset, length) in enumerate(req.spans):
            entry = regions.get(region)
            if entry is None:
                return f"span {i}: unknown region {region}", None
            mv = entry[1]
            if offset < 0 or length <= 0 or offset + length > len(mv):
                return f"span {i}: range [{offset}, {offset + length}) outside region {region} of {len(mv)} bytes", None
            views.append(mv[offset : offset + length])
        if self._grant_check is not None and not self._grant_check(req.op, req.grants, req.spans):
            return "not granted: no lease or reservation of this peer covers these spans", None
        return "", views

    def _drain(self, conn: socket.socket, req: TcpRequest) -> None:
        """Discard the body of a refused WRITE so the connection stays in sync."""
        remaining = sum(max(length, 0) for _, _, length in req.spans)
        scratch = memoryview(bytearray(min(_DRAIN_CHUNK, max(remaining, 1))))
        while remaining > 0:
            k = conn.recv_into(scratch[: min(len(scratch), remaining)])
            if k == 0:
                raise ConnectionError("peer closed while draining")
            remaining -= k

    # ---- TransferEndpoint -----------------------------------------------------------------------------------
    def register(self, buffer: memoryview) -> int:
        view, flat, _, _ = buffer_address(buffer)
        with self._lock:
            self._check_open()
            region_id = len(self._regions)
            self._regions[region_id] = (view, flat)
        return region_id

    def metadata(self) -> AgentMetadata:
        with self._lock:
            regions = [RegionDesc(rid, int(v.nbytes)) for rid, (v, _) in sorted(self._regions.items())]
        return AgentMetadata(
            version=TRANSFER_WIRE_VERSION,
            backend=self.backend,
            agent_name=self._name,
            epoch=self._epoch,
            regions=regions,
            payload=self._address.encode(),
        )

    def add_peer(self, meta: AgentMetadata) -> None:
        with self._lock:
            self._check_open()
            current = self._peers.get(meta.agent_name)
            action = admit(meta, self.backend, current.meta if current else None)
            if action is Admission.KEEP:
                return
            host, port = _parse_address(meta)
            peer = _Peer(meta=meta, host=host, port=port, regions={r.region_id: r.length for r in meta.regions})
            if current is not None:
                if action is Admission.REFRESH:
                    peer.idle = current.idle  # same incarnation: the connections stay valid
                else:
                    _close_all(current.idle)
            self._peers[meta.agent_name] = peer

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
        if peer is not None:
            _close_all(peer.idle)

    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
             ) -> TransferResult:
        return self._transfer("read", peer, ops, deadline_s, grants)

    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        return self._transfer("write", peer, ops, deadline_s, grants)

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            listener, self._listener = self._listener, None
            conns = list(self._conns)
            peers = list(self._peers.values())
            self._peers.clear()
            threads = list(self._threads)
        if listener is not None:
            listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for peer in peers:
            _close_all(peer.idle)
        for thread in threads:
            thread.join(timeout=2.0)
        with self._lock:
            self._regions.clear()

    # ---- client -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RuntimeError(f"endpoint {self._name!r} is closed")

    def _transfer(self, direction: TcpOp, peer_name: str, ops: Sequence[BlockOp], deadline_s: float,
                  grants: Sequence[bytes]) -> TransferResult:
        deadline = Deadline(deadline_s)
        table = OpTable(ops)
        with self._lock:
            self._check_open()
            local = {rid: int(v.nbytes) for rid, (v, _) in self._regions.items()}
            views = {rid: mv for rid, (_, mv) in self._regions.items()}
            peer = self._peers.get(peer_name)
        table.check_local(local)
        if peer is None:
            result = all_failed(len(table), deadline.elapsed(), f"unknown peer {peer_name!r}")
        else:
            table.check_remote(peer.regions, peer_name)
            if not len(table):
                result = all_ok(table, 0.0)
            elif deadline.expired():
                result = all_failed(len(table), deadline.elapsed(), "deadline expired before the transfer started")
            else:
                result = self._run(direction, peer, table, views, deadline, grants)
        self._metrics.observe(self.backend, direction, result)
        return result

    def _run(
        self, direction: TcpOp, peer: _Peer, table: OpTable, views: dict[int, memoryview], deadline: Deadline,
        grants: Sequence[bytes],
    ) -> TransferResult:
        rows = table.rows
        spans = [(r[REMOTE_REGION], r[REMOTE_OFFSET], r[LENGTH]) for r in rows]
        local = [views[r[LOCAL_REGION]][r[LOCAL_OFFSET] : r[LOCAL_OFFSET] + r[LENGTH]] for r in rows]
        request = _encoder.encode(TcpRequest(TCP_WIRE_VERSION, direction, peer.meta.agent_name, peer.meta.epoch, spans,
                                             [bytes(g) for g in grants]))
        attempts = 2  # a pooled connection may have gone stale: one retry on a fresh one
        done = 0
        error = ""
        for _ in range(attempts):
            sock, pooled = self._checkout(peer, deadline)
            if sock is None:
                return all_failed(len(table), deadline.elapsed(), _connect_error(peer, deadline))
            done, error, reusable = self._exchange(sock, direction, request, local, deadline)
            if reusable:
                self._checkin(peer, sock)
            else:
                sock.close()
            if not error or done or not pooled or reusable or deadline.expired():
                break
        if not error:
            return all_ok(table, deadline.elapsed())
        return TransferResult(
            ok=list(range(done)),
            failed=list(range(done, len(table))),
            bytes_moved=sum(r[LENGTH] for r in rows[:done]),
            seconds=deadline.elapsed(),
            error=f"peer {peer.meta.agent_name!r}: {error}",
        )

    def _exchange(
        self, sock: socket.socket, direction: TcpOp, request: bytes, local: list[memoryview], deadline: Deadline
    ) -> tuple[int, str, bool]:
        """Run one request; returns (ops completed in order, error text or "", connection still usable)."""
        done = 0
        try:
            _send_frame(sock, request, deadline)
            if direction == "write":
                for view in local:
                    _settimeout(sock, deadline)
                    sock.sendall(view)
            raw = _recv_frame(sock, deadline)
            if raw is None:
                return 0, "connection closed by peer", False
            resp = _resp_decoder.decode(raw)
            if resp.version != TCP_WIRE_VERSION:
                return 0, f"tcp wire version {resp.version}, expected {TCP_WIRE_VERSION}", False
            if not resp.ok:
                return 0, resp.error or "refused", True
            if direction == "read":
                for view in local:
                    if not _recv_exact(sock, view, deadline):
                        return done, "connection closed by peer", False
                    done += 1
            else:
                done = len(local)
            return done, "", True
        except TimeoutError:
            return (done if direction == "read" else 0), "deadline expired", False
        except (OSError, ConnectionError, _ProtocolError, msgspec.DecodeError) as exc:
            return (done if direction == "read" else 0), f"{type(exc).__name__}: {exc}", False

    def _checkout(self, peer: _Peer, deadline: Deadline) -> tuple[socket.socket | None, bool]:
        with self._lock:
            if peer.idle:
                return peer.idle.pop(), True
        remaining = deadline.remaining()
        if remaining <= 0:
            return None, False
        try:
            sock = socket.create_connection((peer.host, peer.port), timeout=remaining)
        except OSError:
            return None, False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            authenticated = self._prove(sock, deadline)
        except (OSError, ConnectionError):
            authenticated = False
        if not authenticated:
            sock.close()
            return None, False
        return sock, False

    def _prove(self, sock: socket.socket, deadline: Deadline) -> bool:
        """The client's side of the handshake: answer the server's nonce, then check the server's proof."""
        theirs = bytearray(pool_secret.NONCE_BYTES)
        if not _recv_exact(sock, memoryview(theirs), deadline):
            return False
        ours = pool_secret.nonce()
        _settimeout(sock, deadline)
        sock.sendall(ours + pool_secret.proof(self._secret, _CLIENT, bytes(theirs), ours))
        mac = bytearray(pool_secret.MAC_BYTES)
        if not _recv_exact(sock, memoryview(mac), deadline):
            return False
        return pool_secret.verify(self._secret, bytes(mac), _SERVER, bytes(theirs), ours)

    def _checkin(self, peer: _Peer, sock: socket.socket) -> None:
        with self._lock:
            current = self._peers.get(peer.meta.agent_name)
            if current is peer and not self._closed.is_set() and len(peer.idle) < self._options.max_idle_connections:
                peer.idle.append(sock)
                return
        sock.close()


def _connect_error(peer: _Peer, deadline: Deadline) -> str:
    if deadline.expired():
        return f"peer {peer.meta.agent_name!r}: deadline expired while connecting to {peer.host}:{peer.port}"
    return (f"peer {peer.meta.agent_name!r}: cannot connect to {peer.host}:{peer.port} (or the handshake failed: "
            "not the same cluster secret?)")


def _parse_address(meta: AgentMetadata) -> tuple[str, int]:
    try:
        text = meta.payload.decode()
        host, _, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host:
            raise ValueError("no host")
        return host, int(port)
    except (UnicodeDecodeError, ValueError) as exc:
        raise StaleMetadataError(f"peer {meta.agent_name!r}: tcp payload {meta.payload!r} is not host:port") from exc


def _close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()
    socks.clear()
