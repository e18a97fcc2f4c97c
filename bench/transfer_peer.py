"""The transfer peer process: the far end of every process-to-process transfer measurement and conformance test.

``start_peer`` spawns (multiprocessing "spawn") a process that owns one arena filled with a seeded pattern
(``pattern(seed, size)``) and one ``TransferEndpoint`` per backend over it, optionally a bare TCP socket server over
the same arena (the bench's ``tcp_socket`` ceiling), and sends back the endpoints' metadata. It is then driven
through a pipe with typed commands: ``Register`` (a second region, registered after the metadata went out; answers
the new metadata), ``Digest`` (sha256 of a byte range of the arena, the peer's own view of its memory) and ``Stop``.
``kill``, ``freeze`` and ``thaw`` are real signals on the peer process.

Who calls it: ``bench.transfer_bench`` (one peer, every backend, with the socket server) and
``tests/integration/test_transport_conformance.py`` (one backend per peer; peers frozen, killed, restarted).
``transport_options`` is the one place that says how a backend is configured for loopback on this machine.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

MIB = 1 << 20
PEER_START_TIMEOUT_S = 120.0
PEER_IDLE_S = 3600.0  # a peer nobody talks to for this long exits
REPLY_TIMEOUT_S = 30.0
RAW_HEADER = struct.Struct("!cQ")  # bare-socket request: b"r"/b"w", byte count


def transport_options(backend: str, host: str, *, client: bool = False) -> Any:
    """The backend's options for loopback on one host: NIXL/UCX on ``lo``, TCP bound to ``host``. ``client``: a side
    that only initiates (the connector's worker endpoints): NIXL without its progress thread."""
    if backend == "nixl":
        from kvpool.transfer.nixl import NixlOptions

        return NixlOptions(ucx_devices="lo", progress_thread=not client)
    if backend == "shm":
        return None
    from kvpool.transfer.tcp import TcpOptions

    return TcpOptions(bind_host=host)


def pattern(seed: int, size: int) -> np.ndarray:
    """``size`` seeded random bytes: what a peer's arena (or a region registered later) holds at start."""
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8).copy()


# ---- the pipe protocol ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    meta: dict[str, bytes]  # backend -> encoded AgentMetadata
    raw_addr: tuple[str, int] | None


@dataclass(frozen=True)
class Register:
    seed: int
    size: int


@dataclass(frozen=True)
class Digest:
    offset: int
    length: int


@dataclass(frozen=True)
class Stop:
    pass


# ---- the peer process -------------------------------------------------------------------------------------------
def _peer_main(backends: list[str], names: dict[str, str], host: str, seed: int, size: int, raw_socket: bool,
               conn: Connection) -> None:
    from kvpool.arena import DramArena
    from kvpool.transfer import encode_metadata, make_endpoint

    shared = "shm" in backends
    regions: list[DramArena] = []  # every region in a memfd when a shm endpoint exports them (else anonymous)

    def region(seed: int, size: int) -> np.ndarray:
        r = DramArena(size, 1, shared=shared)
        r.array[:] = pattern(seed, size)
        regions.append(r)
        for b, ep in endpoints.items():
            if b == "shm":
                ep.register_shared(r.buffer, r.fd)
            else:
                ep.register(r.buffer)
        return r.array

    endpoints = {b: make_endpoint(b, names[b], options=transport_options(b, host)) for b in backends}
    arena = region(seed, size)
    listener = socket.create_server((host, 0)) if raw_socket else None
    stop = threading.Event()
    if listener is not None:
        threading.Thread(target=_raw_server, args=(listener, arena, stop), daemon=True).start()
    extra: list[np.ndarray] = []  # regions registered later stay alive as long as the endpoints

    def metadata() -> dict[str, bytes]:
        return {b: encode_metadata(ep.metadata()) for b, ep in endpoints.items()}

    conn.send(Ready(metadata(), tuple(listener.getsockname()[:2]) if listener is not None else None))
    try:
        while conn.poll(PEER_IDLE_S):
            cmd = conn.recv()
            if isinstance(cmd, Register):
                extra.append(region(cmd.seed, cmd.size))
                conn.send(metadata())
            elif isinstance(cmd, Digest):
                conn.send(hashlib.sha256(arena[cmd.offset : cmd.offset + cmd.length].tobytes()).hexdigest())
            else:
                return
    finally:
        stop.set()
        if listener is not None:
            listener.close()
        for ep in endpoints.values():
            ep.close()


def _raw_server(listener: socket.socket, arena: np.ndarray, stop: threading.Event) -> None:
    view = arena.data
    chunk = min(MIB, len(view))
    while not stop.is_set():
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = bytearray(RAW_HEADER.size)
            while True:
                try:
                    if sock.recv_into(head, RAW_HEADER.size, socket.MSG_WAITALL) != RAW_HEADER.size:
                        break
                    op, n = RAW_HEADER.unpack(head)
                    sent = 0
                    while sent < n:
                        k = min(chunk, n - sent)
                        if op == b"r":
                            sock.sendall(view[:k])
                        else:
                            sock.recv_into(view[:k], k, socket.MSG_WAITALL)
                        sent += k
                    sock.sendall(b"k")
                except OSError:
                    break


# ---- the test / bench side --------------------------------------------------------------------------------------
@dataclass
class PeerProcess:
    process: mp.process.BaseProcess
    conn: Connection
    meta_raw: dict[str, bytes]
    raw_addr: tuple[str, int] | None
    seed: int
    size: int

    def metadata(self, backend: str) -> Any:
        from kvpool.transfer import decode_metadata

        return decode_metadata(self.meta_raw[backend])

    @property
    def meta(self) -> Any:
        """The metadata of a one-backend peer."""
        (backend,) = self.meta_raw
        return self.metadata(backend)

    @property
    def name(self) -> str:
        return str(self.meta.agent_name)

    def expected(self, offset: int, length: int) -> np.ndarray:
        return pattern(self.seed, self.size)[offset : offset + length]

    def _ask(self, cmd: Register | Digest) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer did not answer {type(cmd).__name__}")
        return self.conn.recv()

    def digest(self, offset: int, length: int) -> str:
        return str(self._ask(Digest(offset, length)))

    def register_more(self, seed: int, size: int) -> dict[str, bytes]:
        """Register a second region (``pattern(seed, size)``); returns every backend's new encoded metadata."""
        return dict(self._ask(Register(seed, size)))

    def kill(self) -> None:
        """SIGKILL the peer and reap it."""
        self.process.kill()
        self.process.join(10)

    def freeze(self) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped (delivery is asynchronous)."""
        pid = self.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.005)
        raise TimeoutError(f"process {pid} did not stop")

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGCONT)  # type: ignore[arg-type]  # a frozen peer must hear Stop
                self.conn.send(Stop())
            except (OSError, BrokenPipeError):
                pass
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def start_peer(backends: list[str], names: dict[str, str], *, seed: int, size: int, host: str = "127.0.0.2",
               raw_socket: bool = False, start_timeout_s: float = PEER_START_TIMEOUT_S) -> PeerProcess:
    """Spawn a peer and wait (bounded) for its metadata."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(backends, names, host, seed, size, raw_socket, child), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(start_timeout_s):
        proc.kill()
        proc.join(10)
        raise TimeoutError(f"peer {sorted(names.values())} did not start within {start_timeout_s:.0f} s")
    hello = parent.recv()
    if not isinstance(hello, Ready):
        proc.kill()
        raise RuntimeError(f"peer sent {hello!r} instead of its metadata")
    return PeerProcess(process=proc, conn=parent, meta_raw=hello.meta, raw_addr=hello.raw_addr, seed=seed, size=size)
