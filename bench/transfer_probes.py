"""The probes of ``kvstack bench transfer``: each measures one path once and returns GB/s (1e9 bytes/s).

- ``memcpy_once`` / ``gather_once``: the memory-bandwidth ceiling of one core (contiguous, shuffled blocks).
- ``raw_tcp_once``: a bare TCP socket read from the peer process's socket server (``bench.transfer_peer``).
- ``TransportCell``: one (backend, direction, block, batch) series of ``TransferEndpoint`` calls to the peer.
- ``file_section``: the SSD tier's read paths with a cold page cache (direct read, ``BlockFileIO`` engines, the
  shipped ``kvpool.ssd.SsdSlab``), every series interleaved repeat by repeat.
- ``ray_section``: NIXL between two Ray nodes' shards of a ``cluster.local_cluster.LocalCluster``.

``series`` turns a list of runs into the JSON entry every section reports. Called by ``bench.transfer_bench``
(the CLI, which interleaves the probes, adds ratios and prints the report) only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.transfer_peer import MIB, RAW_HEADER

KIB = 1 << 10


def size_label(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes % MIB == 0 else f"{nbytes // KIB}KiB"


def series(runs: list[float]) -> dict[str, Any]:
    return {
        "gbps_median": round(statistics.median(runs), 3),
        "gbps_min": round(min(runs), 3),
        "gbps_max": round(max(runs), 3),
        "runs": [round(r, 3) for r in runs],
    }


def memcpy_once(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return src.nbytes / (time.perf_counter() - t0) / 1e9


def gather_once(src2d: np.ndarray, dst2d: np.ndarray, perm: np.ndarray) -> float:
    """The same shuffled blocks as a transport cell, gathered by one ``np.take`` (one pass, no temporary)."""
    t0 = time.perf_counter()
    np.take(src2d, perm, axis=0, out=dst2d, mode="clip")  # mode="raise" would buffer `out` (a second copy)
    return dst2d.nbytes / (time.perf_counter() - t0) / 1e9


def raw_tcp_once(sock: socket.socket, buf: memoryview, nbytes: int) -> float:
    chunk = min(MIB, len(buf))
    t0 = time.perf_counter()
    sock.sendall(RAW_HEADER.pack(b"r", nbytes))
    got = 0
    while got < nbytes:
        k = min(chunk, nbytes - got)
        got += sock.recv_into(buf[:k], k, socket.MSG_WAITALL)
    if sock.recv(1) != b"k":
        raise RuntimeError("bare TCP peer did not acknowledge")
    return nbytes / (time.perf_counter() - t0) / 1e9


class TransportCell:
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
        """``direction``: "read", "write", or "read_scattered" (a read whose local blocks are shuffled too, as the
        connector's loads land in whichever KV cache blocks the engine gave the request; else the local side is
        one ascending run)."""
        from kvpool.transfer import BlockOp

        nblocks = region_bytes // block
        perm = np.random.default_rng(seed).permutation(nblocks)
        local = (np.random.default_rng(seed + 1).permutation(nblocks) if direction == "read_scattered"
                 else np.arange(nblocks))
        calls = max(1, total // (block * batch))
        self.batches = []
        j = 0
        for _ in range(calls):
            ops = []
            for _ in range(batch):
                ops.append(BlockOp(0, int(perm[j % nblocks]) * block, 0, int(local[j % nblocks]) * block, block))
                j += 1
            self.batches.append(ops)
        self.nbytes = calls * batch * block
        self.fn = ep.write if direction == "write" else ep.read
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
def ray_section(
    block_sizes: list[int], batch: int, region_bytes: int, repeats: int, deadline_s: float
) -> dict[str, Any]:
    try:
        import ray

        from cluster.local_cluster import LocalCluster
        from kvpool.shard.placement import build_pool, stop_shards
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
        handles = build_pool(
            lambda node: ShardConfig(shard_id=f"bench-{node.node_ip}",
                                     store=StoreConfig(slot_bytes=slot, dram_slots=slots),
                                     backend="nixl", nixl=NixlOptions(ucx_devices="lo")),
            nodes=[nodes["a"].node_id], named=False,
        )
        try:
            shard = handles[0]
            client_cls = ray.remote(num_cpus=0)(_RayClient)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            client = client_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nodes["b"].node_id, soft=False)
            ).remote(shard.actor, shard.shard_id, slots, slot)
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

    def __init__(self, shard_actor: Any, shard_id: str, slots: int, slot_bytes: int) -> None:
        from kvpool.shard.client import ShardClient
        from kvpool.transfer import decode_metadata, make_endpoint
        from kvpool.transfer.file_io import aligned_buffer
        from kvpool.transfer.nixl import NixlOptions

        self.shard = ShardClient(shard_actor, shard_id, deadline_s=30.0)  # its id: the write proof names it
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
                out[direction][size_label(block)] = series(runs)
        back = np.zeros_like(self.buf)
        back_region = self.ep.register(back.data)
        ops = [BlockOp(rid, off, back_region, i * self.slot_bytes, self.slot_bytes) for i, off in enumerate(offsets)]
        if not self.ep.read(self.meta.agent_name, ops, deadline_s).all_ok:
            raise RuntimeError("ray read-back failed")
        out["bytes_identical"] = bool(np.array_equal(back, self.buf))
        self.shard.abort(self.reservation.reservation_id)
        self.ep.close()
        return out


def file_section(
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
            once, slab = _slab_cell(os.path.join(directory, f"slab-{size_label(block)}"), buf, block, nbytes)
            slabs.append(slab)
            cells[("ssd_slab", block)] = once
        direct_runs: list[float] = []
        runs: dict[tuple[str, int], list[float]] = {k: [] for k in cells}
        for _ in range(repeats):
            direct_runs.append(_direct_read_once(path, buf))
            for key, once in cells.items():
                runs[key].append(once())
        out["direct_read"] = {"block": MIB, **series(direct_runs)}
        for (engine, block), r in runs.items():
            out.setdefault(engine, {})[size_label(block)] = {
                "batch": batch if engine != "ssd_slab" else 1,
                **series(r),
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
