"""``kvstack bench transfer``: KV pool transfer throughput (NIXL, TCP, SSD) against this machine's limits.

What one run measures, interleaved repeat by repeat (so a busy neighbour slows every series alike), each reported as
GB/s (1e9 bytes/s) with the median of ``--repeats`` runs:
- ``memcpy``: ``numpy.copyto`` of ``--total-mib`` contiguous bytes (the memory-bandwidth ceiling of one core);
  ``memcpy_gather``: the same bytes as shuffled blocks of each size gathered by one ``numpy.take``.
- ``tcp_socket``: a bare Python TCP socket between two processes (``sendall`` / ``recv_into``, 1 MiB chunks).
- ``transports``: ``TransferEndpoint.read`` (and ``write`` at the largest batch) between this process and a
  spawned peer process, per backend (nixl, tcp, shm: the same-node path, the peer's memfd mapped here), block size
  (64 KiB, 1 MiB) and batch (ops per call, 1..1024). The client side runs as the connector's workers do (NIXL
  without a progress thread). Reads land in one ascending run of the local buffer (a staging buffer's shape); shm's
  ``read_scattered`` (largest batch) shuffles the local blocks too (the connector's loads into the KV cache).
  Blocks are visited in a shuffled order; each cell moves ``max(total, block*batch)`` bytes.
- ``ray`` (``--ray``): the same read between two Ray nodes of a local cluster (127.0.0.2 / 127.0.0.3): the
  ``kvpool.shard`` actor on node A holds the arena; a client actor on node B reserves slots, writes them and reads
  them back over NIXL (blocks in shuffled order, ``--batches`` max ops per call), then checks the bytes.
- ``file``: the SSD tier's read path from files under ``--file-dir`` with a cold page cache (``POSIX_FADV_DONTNEED``
  before every run): ``direct_read`` = dd-style sequential O_DIRECT reads of 1 MiB (the device ceiling), and
  ``kvpool.transfer.file_io.BlockFileIO`` (engines ``nixl_posix`` and ``preadv``, O_DIRECT) reading every block
  of the file in shuffled order, ``--batches`` max ops per call, and ``ssd_slab``: the shipped SSD tier
  (``kvpool.ssd.SsdSlab``, buffered ``preadv`` one block at a time) reading its slab in shuffled order.

Ratios per block size (largest batch): ``shm_over_memcpy`` (and ``_gather``; issue 13's goal: >= 0.8),
``shm_scattered_over_memcpy``,
``shm_over_nixl``, ``nixl_over_memcpy`` (and ``_gather``), ``nixl_over_tcp`` (NIXL read /
bare TCP socket), ``tcp_endpoint_over_tcp_socket``, ``ssd_over_direct_read`` (the SSD tier ``ssd_slab`` / direct
read), ``file_io_over_direct_read`` (default ``file_io`` engine / direct read), ``ray_nixl_over_memcpy``.

The probes live in ``bench.transfer_probes``, the peer process in ``bench.transfer_peer`` (the harness the transport
conformance suite uses too); this module is the command: arguments, the interleaving, ratios and the report.

Output: a table, or with ``--json`` exactly one JSON document on stdout (progress and errors go to stderr);
``--out FILE`` also writes the JSON. Run under the heavy lock:
``flock /tmp/kvstack-heavy.lock timeout 300 kvstack bench transfer --json``. The default run takes ~30-60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from typing import Any

import numpy as np

from bench.transfer_peer import MIB, start_peer, transport_options
from bench.transfer_probes import (
    KIB,
    TransportCell,
    file_section,
    gather_once,
    memcpy_once,
    ray_section,
    raw_tcp_once,
    series,
    size_label,
)
from cluster.cli_output import print_document


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON to stdout")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--block-sizes", default="64K,1M", help="block sizes (default 64K,1M)")
    parser.add_argument("--batches", default="1,16,256,1024", help="ops per transfer call (default 1,16,256,1024)")
    parser.add_argument("--total-mib", type=int, default=64, help="peer arena and bytes per transport cell")
    parser.add_argument("--repeats", type=int, default=5, help="runs per series (median reported)")
    parser.add_argument("--backends", default="nixl,tcp,shm",
                        help="transfer backends (default nixl,tcp,shm; shm: same-host shared memory)")
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


# ---- the run ------------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.transfer import make_endpoint
    from kvpool.transfer.file_io import BlockFileIO, FileIOOptions, aligned_buffer

    block_sizes = _sizes(args.block_sizes)
    batches = sorted(set(_ints(args.batches, "batches")))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("nixl", "tcp", "shm"):
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

    # The peer's arena holds pattern(7, region_bytes); one endpoint per backend over it, plus a bare socket server.
    peer = start_peer(backends, {b: f"bench-peer-{b}" for b in backends}, seed=7, size=region_bytes, host=args.host,
                      raw_socket=True)
    endpoints: dict[str, Any] = {}
    try:
        local = aligned_buffer(region_bytes)
        src = np.frombuffer(np.random.default_rng(1).bytes(region_bytes), dtype=np.uint8)
        for b in backends:
            ep = make_endpoint(b, f"bench-client-{b}", options=transport_options(b, "127.0.0.3", client=True))
            ep.register(local.data)
            ep.add_peer(peer.metadata(b))
            endpoints[b] = ep
        assert peer.raw_addr is not None
        raw = socket.create_connection(peer.raw_addr, timeout=60)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cells: dict[tuple[str, str, int, int], TransportCell] = {}
        for b in backends:
            for block in block_sizes:
                for batch in batches:
                    cells[(b, "read", block, batch)] = TransportCell(
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
                cells[(b, "write", block, batches[-1])] = TransportCell(
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
                if b == "shm":  # the connector's loads: shuffled slots into shuffled KV cache blocks
                    cells[(b, "read_scattered", block, batches[-1])] = TransportCell(
                        endpoints[b], f"bench-peer-{b}", "read_scattered", block, batches[-1], region_bytes,
                        region_bytes, args.deadline_s, seed=block + 2)
        for cell in cells.values():  # warm-up: connections, prepared descriptor lists, page faults
            cell.once()
        memcpy_runs: list[float] = []
        gather_runs: dict[int, list[float]] = {b: [] for b in block_sizes}
        perms = {b: np.random.default_rng(b).permutation(region_bytes // b) for b in block_sizes}
        tcp_runs: list[float] = []
        cell_runs: dict[tuple[str, str, int, int], list[float]] = {k: [] for k in cells}
        view = local.data
        for _ in range(repeats):
            memcpy_runs.append(memcpy_once(src, local))
            for b in block_sizes:
                gather_runs[b].append(gather_once(src.reshape(-1, b), local.reshape(-1, b), perms[b]))
            tcp_runs.append(raw_tcp_once(raw, view, region_bytes))
            for key, cell in cells.items():
                cell_runs[key].append(cell.once())
        raw.close()
        result["memcpy"] = {"bytes": region_bytes, **series(memcpy_runs)}
        result["memcpy_gather"] = {size_label(b): series(r) for b, r in gather_runs.items()}
        result["tcp_socket"] = {"bytes": region_bytes, **series(tcp_runs)}
        transports: dict[str, Any] = {}
        for (b, direction, block, batch), runs in cell_runs.items():
            entry = {"bytes_per_run": cells[(b, direction, block, batch)].nbytes, **series(runs)}
            errors = cells[(b, direction, block, batch)].errors
            if errors:
                entry["errors"] = sorted(set(errors))[:3]
            transports.setdefault(b, {}).setdefault(direction, {}).setdefault(size_label(block), {})[str(batch)] = entry
        result["transports"] = transports
        result["transports"]["layout"] = "process-to-process on one host (spawned peer; loopback)"
    finally:
        for ep in endpoints.values():
            ep.close()
        peer.stop()

    if args.file_mib > 0:
        result["file"] = file_section(
            args, block_sizes, batches[-1], repeats, BlockFileIO, FileIOOptions, aligned_buffer
        )
    if args.ray:
        result["ray"] = ray_section(block_sizes, batches[-1], region_bytes, repeats, args.deadline_s)
    else:
        result["ray"] = {"skipped": "--no-ray"}

    result["ratios"] = _ratios(result, block_sizes, batches[-1])
    result["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


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
        label = size_label(block)
        nixl = med("transports", "nixl", "read", label, str(batch))
        tcp_ep = med("transports", "tcp", "read", label, str(batch))
        shm = med("transports", "shm", "read", label, str(batch))
        out[label] = {
            "shm_over_memcpy": div(shm, memcpy),
            "shm_over_memcpy_gather": div(shm, med("memcpy_gather", label)),
            "shm_scattered_over_memcpy": div(med("transports", "shm", "read_scattered", label, str(batch)), memcpy),
            "shm_over_nixl": div(shm, nixl),
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
    if args.json:
        print_document(text)
    else:
        print(_table(result))
    return 0
