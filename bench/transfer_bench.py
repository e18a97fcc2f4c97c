"""``kvstack bench transfer``: KV pool transfer throughput (NIXL, TCP, SSD) against this machine's limits.

What one run measures, interleaved repeat by repeat (so a busy neighbour slows every series alike), each reported as
GB/s (1e9 bytes/s) with the median of ``--repeats`` runs:
- ``memcpy``: ``numpy.copyto`` of ``--total-mib`` contiguous bytes (the memory-bandwidth ceiling of one core);
  ``memcpy_gather``: the same bytes as shuffled blocks of each size gathered by one ``numpy.take``.
- ``tcp_socket``: a bare Python TCP socket between two processes (``sendall`` / ``recv_into``, 1 MiB chunks).
- ``transports``: ``TransferEndpoint.read`` (and ``write`` at the largest batch) between this process and a
  spawned peer process, per backend (nixl, tcp), block size (64 KiB, 1 MiB) and batch (ops per call, 1..1024).
  Blocks are visited in a shuffled order; each cell moves ``max(total, block*batch)`` bytes.
- ``ray`` (``--ray``): the same read between two Ray nodes of a local cluster (127.0.0.2 / 127.0.0.3): the
  ``kvpool.shard`` actor on node A holds the arena; a client actor on node B reserves slots, writes them and reads
  them back over NIXL (blocks in shuffled order, ``--batches`` max ops per call), then checks the bytes.
- ``file``: the SSD tier's read path from files under ``--file-dir`` with a cold page cache (``POSIX_FADV_DONTNEED``
  before every run): ``direct_read`` = dd-style sequential O_DIRECT reads of 1 MiB (the device ceiling), and
  ``kvpool.transfer.file_io.BlockFileIO`` (engines ``nixl_posix`` and ``preadv``, O_DIRECT) reading every block
  of the file in shuffled order, ``--batches`` max ops per call, and ``ssd_slab``: the shipped SSD tier
  (``kvpool.ssd.SsdSlab``, buffered ``preadv`` one block at a time) reading its slab in shuffled order.

Ratios per block size (largest batch): ``nixl_over_memcpy`` (and ``_gather``), ``nixl_over_tcp`` (NIXL read /
bare TCP socket), ``tcp_endpoint_over_tcp_socket``, ``ssd_over_direct_read`` (the SSD tier ``ssd_slab`` / direct
read), ``file_io_over_direct_read`` (default ``file_io`` engine / direct read), ``ray_nixl_over_memcpy``.

Output: a table, or JSON to stdout with ``--json``; ``--out FILE`` also writes the JSON. Run under the heavy lock:
``flock /tmp/kvstack-heavy.lock timeout 300 kvstack bench transfer --json``. The default run takes ~30-60 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


KIB = 1 << 10
MIB = 1 << 20
_RAW = struct.Struct("!cQ")  # bare-socket request: b"r"/b"w", byte count


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON to stdout")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--block-sizes", default="64K,1M", help="block sizes (default 64K,1M)")
    parser.add_argument("--batches", default="1,16,256,1024", help="ops per transfer call (default 1,16,256,1024)")
    parser.add_argument("--total-mib", type=int, default=64, help="peer arena and bytes per transport cell")
    parser.add_argument("--repeats", type=int, default=5, help="runs per series (median reported)")
    parser.add_argument("--backends", default="nixl,tcp", help="transfer backends (default nixl,tcp)")
    parser.add_argument("--host", default="127.0.0.2", help="address the TCP servers bind to")
    parser.add_argument("--file-mib", type=int, default=64, help="size of the SSD test files (0 = skip)")
    parser.add_argument("--file-dir", default="", help="directory for the SSD test file (default: a temp dir)")
    parser.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure between two Ray nodes' shards (default on)",
    )
    parser.add_argument("--deadline-s", type=float, default=120.0, help="deadline of every transfer call")


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        if not part:
            continue
        mult = {"K": KIB, "M": MIB}.get(part[-1], 1)
        try:
            value = int(part[:-1] if mult != 1 else part) * mult
        except ValueError:
            raise SystemExit(f"--block-sizes: cannot parse {part!r}") from None
        if value <= 0:
            raise SystemExit(f"--block-sizes: {part!r} must be positive")
        out.append(value)
    if not out:
        raise SystemExit("--block-sizes: need at least one size")
    return out


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise SystemExit(f"--{what}: need positive integers, got {text!r}")
    return values


def _label(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes % MIB == 0 else f"{nbytes // KIB}KiB"


def _options(backend: str, host: str) -> Any:
    if backend == "nixl":
        from kvpool.transfer.nixl import NixlOptions

        return NixlOptions(ucx_devices="lo")
    from kvpool.transfer.tcp import TcpOptions

    return TcpOptions(bind_host=host)


def _series(runs: list[float]) -> dict[str, Any]:
    return {
        "gbps_median": round(statistics.median(runs), 3),
        "gbps_min": round(min(runs), 3),
        "gbps_max": round(max(runs), 3),
        "runs": [round(r, 3) for r in runs],
    }


# ---- the peer process ---------------------------------------------------------------------------------------
def _peer_main(conn: Connection, region_bytes: int, backends: list[str], host: str) -> None:
    """A second process: one endpoint per backend over one arena, plus a bare TCP socket server."""
    from kvpool.transfer import encode_metadata, make_endpoint
    from kvpool.transfer.file_io import aligned_buffer

    arena = aligned_buffer(region_bytes)
    arena[:] = np.frombuffer(np.random.default_rng(7).bytes(region_bytes), dtype=np.uint8)
    endpoints = [make_endpoint(b, f"bench-peer-{b}", options=_options(b, host)) for b in backends]
    for ep in endpoints:
        ep.register(arena.data)
    listener = socket.create_server((host, 0))
    stop = threading.Event()
    threading.Thread(target=_raw_server, args=(listener, arena, stop), daemon=True).start()
    conn.send(
        {
            "meta": {b: encode_metadata(ep.metadata()) for b, ep in zip(backends, endpoints, strict=True)},
            "raw": listener.getsockname()[:2],
        }
    )
    try:
        conn.poll(3600)
    finally:
        stop.set()
        listener.close()
        for ep in endpoints:
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
            head = bytearray(_RAW.size)
            while True:
                try:
                    if sock.recv_into(head, _RAW.size, socket.MSG_WAITALL) != _RAW.size:
                        break
                    op, n = _RAW.unpack(head)
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


class _Peer:
    def __init__(self, region_bytes: int, backends: list[str], host: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child, region_bytes, backends, host), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(120):
            self.stop()
            raise RuntimeError("bench peer process did not start within 120 s")
        hello = self.conn.recv()
        self.meta: dict[str, bytes] = hello["meta"]
        self.raw_addr: tuple[str, int] = tuple(hello["raw"])  # type: ignore[assignment]

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except (OSError, BrokenPipeError):
            pass
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# ---- measurements ---------------------------------------------------------------------------------------------
def _memcpy_once(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return src.nbytes / (time.perf_counter() - t0) / 1e9


def _gather_once(src2d: np.ndarray, dst2d: np.ndarray, perm: np.ndarray) -> float:
    """The same shuffled blocks as a transport cell, gathered by one ``np.take`` (one pass, no temporary)."""
    t0 = time.perf_counter()
    np.take(src2d, perm, axis=0, out=dst2d, mode="clip")  # mode="raise" would buffer `out` (a second copy)
    return dst2d.nbytes / (time.perf_counter() - t0) / 1e9


def _raw_tcp_once(sock: socket.socket, buf: memoryview, nbytes: int) -> float:
    chunk = min(MIB, len(buf))
    t0 = time.perf_counter()
    sock.sendall(_RAW.pack(b"r", nbytes))
    got = 0
    while got < nbytes:
        k = min(chunk, nbytes - got)
        got += sock.recv_into(buf[:k], k, socket.MSG_WAITALL)
    if sock.recv(1) != b"k":
        raise RuntimeError("bare TCP peer did not acknowledge")
    return nbytes / (time.perf_counter() - t0) / 1e9


class _Cell:
    """One (backend, direction, block, batch) series: prebuilt op lists, one timed run per call of ``once``."""

    def __init__(
        self,
        ep: Any,
        peer: str,
        direction: str,
        block: int,
        batch: int,
        region_bytes: int,
        total: int,
        deadline_s: float,
        seed: int,
    ) -> None:
        from kvpool.transfer import BlockOp

        nblocks = region_bytes // block
        perm = np.random.default_rng(seed).permutation(nblocks)
        calls = max(1, total // (block * batch))
        self.batches = []
        j = 0
        for _ in range(calls):
            ops = []
            for _ in range(batch):
                ops.append(BlockOp(0, int(perm[j % nblocks]) * block, 0, (j % nblocks) * block, block))
                j += 1
            self.batches.append(ops)
        self.nbytes = calls * batch * block
        self.fn = ep.read if direction == "read" else ep.write
        self.peer = peer
        self.deadline_s = deadline_s
        self.errors: list[str] = []

    def once(self) -> float:
        t0 = time.perf_counter()
        for ops in self.batches:
            result = self.fn(self.peer, ops, self.deadline_s)
            if not result.all_ok:
                self.errors.append(result.error)
                return 0.0
        return self.nbytes / (time.perf_counter() - t0) / 1e9


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _make_file(path: str, nbytes: int) -> None:
    rng = np.random.default_rng(3)
    with open(path, "wb") as f:
        for _ in range(nbytes // (16 * MIB)):
            f.write(rng.bytes(16 * MIB))
        f.write(rng.bytes(nbytes % (16 * MIB)))
        f.flush()
        os.fsync(f.fileno())


def _direct_read_once(path: str, buf: np.ndarray) -> float:
    """dd if=path of=/dev/null bs=1M iflag=direct, in-process."""
    _drop_cache(path)
    from kvpool.transfer.file_io import open_block_file

    fd, _direct = open_block_file(path)
    view = buf.data
    try:
        t0 = time.perf_counter()
        size, at = os.fstat(fd).st_size, 0
        while at < size:
            n = os.preadv(fd, [view[: min(MIB, size - at)]], at)
            if n <= 0:
                break
            at += n
        return at / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def _file_cell(io: Any, path: str, block: int, batch: int, nbytes: int) -> Callable[[], float]:
    from kvpool.transfer.file_io import FileOp, open_block_file

    nblocks = nbytes // block
    perm = np.random.default_rng(block).permutation(nblocks)

    def once() -> float:
        _drop_cache(path)
        fd, _direct = open_block_file(path)
        try:
            ops = [FileOp(fd, int(perm[i]) * block, 0, i * block, block) for i in range(nblocks)]
            t0 = time.perf_counter()
            for at in range(0, nblocks, batch):
                result = io.read(ops[at : at + batch], 120.0)
                if not result.all_ok:
                    raise RuntimeError(f"file read failed: {result.error}")
            return nblocks * block / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)

    return once


# ---- Ray: between two nodes' shards -------------------------------------------------------------------------------
def _ray_section(
    block_sizes: list[int], batch: int, region_bytes: int, repeats: int, deadline_s: float
) -> dict[str, Any]:
    try:
        import ray

        from cluster.local_cluster import LocalCluster
        from kvpool.shard.placement import start_shards, stop_shards
        from kvpool.shard.wire import ShardConfig
        from kvpool.store import StoreConfig
        from kvpool.transfer.nixl import NixlOptions
    except ImportError as exc:
        return {"skipped": f"pool shard or ray not importable: {exc}"}
    cluster = LocalCluster(workers=2, cpus_per_worker=1, worker_names=("a", "b"), object_store_bytes=80 * MIB,
                           namespace=None, logging_level="ERROR", log_to_driver=False)
    out: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        cluster.start()
        nodes = {n.name: n for n in cluster.worker_nodes}
        out["cluster_start_s"] = round(time.monotonic() - t0, 1)
        slot = max(block_sizes)
        slots = max(1, region_bytes // slot)
        handles = start_shards(
            lambda node_id, node_ip: ShardConfig(
                shard_id=f"bench-{node_ip}",
                store=StoreConfig(slot_bytes=slot, dram_slots=slots),
                backend="nixl",
                nixl=NixlOptions(ucx_devices="lo"),
            ),
            include=lambda n: n.get("Resources", {}).get("node_a", 0) > 0,
        )
        try:
            shard = handles[0]
            client_cls = ray.remote(num_cpus=0)(_RayClient)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            client = client_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nodes["b"].node_id, soft=False)
            ).remote(shard.actor, slots, slot)
            res = ray.get(client.run.remote(block_sizes, batch, repeats, deadline_s),  # type: ignore[attr-defined]
                          timeout=600)
            out.update(res)
            out["shard_node_ip"] = shard.node_ip
            out["client_node_ip"] = nodes["b"].ip
        finally:
            stop_shards(handles)
    except Exception as exc:  # the other sections stay valid; say what failed
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        cluster.shutdown()
    return out


class _RayClient:
    """Runs on node B: reserve slots in node A's shard, NIXL-write them, read them back (timed)."""

    def __init__(self, shard_actor: Any, slots: int, slot_bytes: int) -> None:
        from kvpool.shard.client import ShardClient
        from kvpool.transfer import decode_metadata, make_endpoint
        from kvpool.transfer.file_io import aligned_buffer
        from kvpool.transfer.nixl import NixlOptions

        self.shard = ShardClient(shard_actor, "bench", deadline_s=30.0)
        self.slot_bytes = slot_bytes
        reply = self.shard.reserve(slots)
        self.reservation = reply.reservation
        self.shard_region = reply.region_id
        self.ep = make_endpoint("nixl", f"bench-client-{os.getpid()}", options=NixlOptions(ucx_devices="lo"))
        self.buf = aligned_buffer(len(self.reservation.offsets) * slot_bytes)
        self.buf[:] = np.frombuffer(np.random.default_rng(1).bytes(self.buf.nbytes), dtype=np.uint8)
        self.region = self.ep.register(self.buf.data)
        self.meta = decode_metadata(self.shard.transfer_metadata())
        self.ep.add_peer(self.meta)

    def run(self, block_sizes: list[int], batch: int, repeats: int, deadline_s: float) -> dict[str, Any]:
        from kvpool.transfer import BlockOp

        offsets = self.reservation.offsets
        rid = self.shard_region
        out: dict[str, Any] = {"slots": len(offsets), "read": {}, "write": {}}
        for block in block_sizes:
            per_slot = self.slot_bytes // block
            ops = [
                BlockOp(rid, off + k * block, self.region, (i * per_slot + k) * block, block)
                for i, off in enumerate(offsets)
                for k in range(per_slot)
            ]
            order = np.random.default_rng(block).permutation(len(ops))  # shuffled, as in the transport cells
            ops = [ops[int(i)] for i in order]
            chunks = [ops[i : i + batch] for i in range(0, len(ops), batch)]
            nbytes = len(ops) * block
            for direction, fn in (("write", self.ep.write), ("read", self.ep.read)):
                for chunk in chunks:  # warm-up: connection, prepared descriptor lists
                    fn(self.meta.agent_name, chunk, deadline_s)
                runs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for chunk in chunks:
                        result = fn(self.meta.agent_name, chunk, deadline_s)
                        if not result.all_ok:
                            raise RuntimeError(f"ray {direction} failed: {result.error}")
                    runs.append(nbytes / (time.perf_counter() - t0) / 1e9)
                out[direction][_label(block)] = _series(runs)
        back = np.zeros_like(self.buf)
        back_region = self.ep.register(back.data)
        ops = [BlockOp(rid, off, back_region, i * self.slot_bytes, self.slot_bytes) for i, off in enumerate(offsets)]
        if not self.ep.read(self.meta.agent_name, ops, deadline_s).all_ok:
            raise RuntimeError("ray read-back failed")
        out["bytes_identical"] = bool(np.array_equal(back, self.buf))
        self.shard.abort(self.reservation.reservation_id)
        self.ep.close()
        return out


# ---- the run ------------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.transfer import decode_metadata, make_endpoint
    from kvpool.transfer.file_io import BlockFileIO, FileIOOptions, aligned_buffer

    block_sizes = _sizes(args.block_sizes)
    batches = sorted(set(_ints(args.batches, "batches")))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("nixl", "tcp"):
            raise SystemExit(f"--backends: unknown backend {b!r}")
    repeats = max(1, args.repeats)
    region_bytes = args.total_mib * MIB
    if region_bytes < max(block_sizes):
        raise SystemExit("--total-mib must hold at least one block of the largest size")
    started = time.monotonic()
    result: dict[str, Any] = {
        "schema": "kvstack.bench.transfer/1",
        "config": {
            "block_sizes": block_sizes,
            "batches": batches,
            "total_mib": args.total_mib,
            "repeats": repeats,
            "backends": backends,
            "file_mib": args.file_mib,
            "ray": args.ray,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "notes": [],
    }

    peer = _Peer(region_bytes, backends, args.host)
    endpoints: dict[str, Any] = {}
    try:
        local = aligned_buffer(region_bytes)
        src = np.frombuffer(np.random.default_rng(1).bytes(region_bytes), dtype=np.uint8)
        for b in backends:
            ep = make_endpoint(b, f"bench-client-{b}", options=_options(b, "127.0.0.3"))
            ep.register(local.data)
            ep.add_peer(decode_metadata(peer.meta[b]))
            endpoints[b] = ep
        raw = socket.create_connection(peer.raw_addr, timeout=60)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cells: dict[tuple[str, str, int, int], _Cell] = {}
        for b in backends:
            for block in block_sizes:
                for batch in batches:
                    cells[(b, "read", block, batch)] = _Cell(
                        endpoints[b],
                        f"bench-peer-{b}",
                        "read",
                        block,
                        batch,
                        region_bytes,
                        region_bytes,
                        args.deadline_s,
                        seed=block + batch,
                    )
                cells[(b, "write", block, batches[-1])] = _Cell(
                    endpoints[b],
                    f"bench-peer-{b}",
                    "write",
                    block,
                    batches[-1],
                    region_bytes,
                    region_bytes,
                    args.deadline_s,
                    seed=block,
                )
        for cell in cells.values():  # warm-up: connections, prepared descriptor lists, page faults
            cell.once()
        memcpy_runs: list[float] = []
        gather_runs: dict[int, list[float]] = {b: [] for b in block_sizes}
        perms = {b: np.random.default_rng(b).permutation(region_bytes // b) for b in block_sizes}
        tcp_runs: list[float] = []
        cell_runs: dict[tuple[str, str, int, int], list[float]] = {k: [] for k in cells}
        view = local.data
        for _ in range(repeats):
            memcpy_runs.append(_memcpy_once(src, local))
            for b in block_sizes:
                gather_runs[b].append(_gather_once(src.reshape(-1, b), local.reshape(-1, b), perms[b]))
            tcp_runs.append(_raw_tcp_once(raw, view, region_bytes))
            for key, cell in cells.items():
                cell_runs[key].append(cell.once())
        raw.close()
        result["memcpy"] = {"bytes": region_bytes, **_series(memcpy_runs)}
        result["memcpy_gather"] = {_label(b): _series(r) for b, r in gather_runs.items()}
        result["tcp_socket"] = {"bytes": region_bytes, **_series(tcp_runs)}
        transports: dict[str, Any] = {}
        for (b, direction, block, batch), runs in cell_runs.items():
            entry = {"bytes_per_run": cells[(b, direction, block, batch)].nbytes, **_series(runs)}
            errors = cells[(b, direction, block, batch)].errors
            if errors:
                entry["errors"] = sorted(set(errors))[:3]
            transports.setdefault(b, {}).setdefault(direction, {}).setdefault(_label(block), {})[str(batch)] = entry
        result["transports"] = transports
        result["transports"]["layout"] = "process-to-process on one host (spawned peer; loopback)"
    finally:
        for ep in endpoints.values():
            ep.close()
        peer.stop()

    if args.file_mib > 0:
        result["file"] = _file_section(
            args, block_sizes, batches[-1], repeats, BlockFileIO, FileIOOptions, aligned_buffer
        )
    if args.ray:
        result["ray"] = _ray_section(block_sizes, batches[-1], region_bytes, repeats, args.deadline_s)
    else:
        result["ray"] = {"skipped": "--no-ray"}

    result["ratios"] = _ratios(result, block_sizes, batches[-1])
    result["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _file_section(
    args: argparse.Namespace,
    block_sizes: list[int],
    batch: int,
    repeats: int,
    io_cls: Any,
    opts_cls: Any,
    aligned_buffer: Callable[[int], np.ndarray],
) -> dict[str, Any]:
    nbytes = args.file_mib * MIB
    owned = not args.file_dir
    directory = args.file_dir or tempfile.mkdtemp(prefix="kvbench-ssd-", dir="/tmp")
    path = os.path.join(directory, "blocks.bin")
    out: dict[str, Any] = {"bytes": nbytes, "dir": directory, "order": "shuffled blocks, cold page cache"}
    ios: dict[str, Any] = {}
    slabs: list[Any] = []
    try:
        _make_file(path, nbytes)
        buf = aligned_buffer(nbytes)
        for engine in ("nixl_posix", "preadv"):
            try:
                io = io_cls(opts_cls(engine=engine))
            except RuntimeError as exc:
                out[engine] = {"skipped": str(exc)}
                continue
            io.register(buf.data)
            ios[engine] = io
        cells = {
            (engine, block): _file_cell(io, path, block, batch, nbytes)
            for engine, io in ios.items()
            for block in block_sizes
        }
        for block in block_sizes:  # the shipped SSD tier (kvpool.ssd.SsdSlab): one slab, buffered preadv per block
            once, slab = _slab_cell(os.path.join(directory, f"slab-{_label(block)}"), buf, block, nbytes)
            slabs.append(slab)
            cells[("ssd_slab", block)] = once
        direct_runs: list[float] = []
        runs: dict[tuple[str, int], list[float]] = {k: [] for k in cells}
        for _ in range(repeats):
            direct_runs.append(_direct_read_once(path, buf))
            for key, once in cells.items():
                runs[key].append(once())
        out["direct_read"] = {"block": MIB, **_series(direct_runs)}
        for (engine, block), r in runs.items():
            out.setdefault(engine, {})[_label(block)] = {
                "batch": batch if engine != "ssd_slab" else 1,
                **_series(r),
            }
        from kvpool.transfer.file_io import FileIOOptions

        out["default_engine"] = FileIOOptions().engine
    finally:
        for io in ios.values():
            io.close()
        for slab in slabs:
            slab.close()
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)
    return out


def _slab_cell(directory: str, buf: np.ndarray, block: int, nbytes: int) -> tuple[Callable[[], float], Any]:
    from kvpool.ssd import SsdSlab

    nblocks = nbytes // block
    slab = SsdSlab(directory, block, nblocks)
    view = buf.data
    for i in range(nblocks):
        slab.write(i, view[i * block : (i + 1) * block])
    perm = np.random.default_rng(block + 1).permutation(nblocks)

    def once() -> float:
        _drop_cache(str(slab.path))
        t0 = time.perf_counter()
        for i in range(nblocks):
            if slab.read_into(int(perm[i]), view[i * block : (i + 1) * block]) != block:
                raise RuntimeError("ssd slab read came back short")
        return nblocks * block / (time.perf_counter() - t0) / 1e9

    return once, slab


def _ratios(result: dict[str, Any], block_sizes: list[int], batch: int) -> dict[str, Any]:
    def med(*path: str) -> float | None:
        node: Any = result
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node.get("gbps_median") if isinstance(node, dict) else None

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    out: dict[str, Any] = {"batch": batch}
    memcpy, tcp = med("memcpy"), med("tcp_socket")
    file_engine = result.get("file", {}).get("default_engine", "nixl_posix")
    direct = med("file", "direct_read")
    for block in block_sizes:
        label = _label(block)
        nixl = med("transports", "nixl", "read", label, str(batch))
        tcp_ep = med("transports", "tcp", "read", label, str(batch))
        out[label] = {
            "nixl_over_memcpy": div(nixl, memcpy),
            "nixl_over_memcpy_gather": div(nixl, med("memcpy_gather", label)),
            "nixl_over_tcp": div(nixl, tcp),
            "tcp_endpoint_over_tcp_socket": div(tcp_ep, tcp),
            "ssd_over_direct_read": div(med("file", "ssd_slab", label), direct),
            "file_io_over_direct_read": div(med("file", file_engine, label), direct),
            "ray_nixl_over_memcpy": div(med("ray", "read", label), memcpy),
        }
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"memcpy {result['memcpy']['gbps_median']} GB/s   bare TCP socket {result['tcp_socket']['gbps_median']} GB/s"
    ]
    for b, dirs in result["transports"].items():
        if not isinstance(dirs, dict):
            continue
        for direction, sizes in dirs.items():
            for label, batches in sizes.items():
                row = "  ".join(f"x{k}: {v['gbps_median']}" for k, v in batches.items())
                lines.append(f"{b:5s} {direction:5s} {label:7s} {row}  GB/s")
    f = result.get("file")
    if f:
        lines.append(f"file direct_read {f.get('direct_read', {}).get('gbps_median')} GB/s")
        for engine in ("nixl_posix", "preadv", "ssd_slab"):
            for label, v in f.get(engine, {}).items():
                if isinstance(v, dict):
                    lines.append(f"file {engine} {label} {v.get('gbps_median')} GB/s")
    ray_part = result.get("ray", {})
    lines.append(f"ray: {json.dumps(ray_part.get('read', ray_part))}")
    lines.append(f"ratios: {json.dumps(result['ratios'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        result = measure(args)
    except (RuntimeError, OSError) as exc:
        print(f"kvstack bench transfer: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text if args.json else _table(result))
    return 0
