"""CPU placement of a replica's engine threads: which cores it runs on, how many threads, and how vLLM is told.

Why: Ray accounts CPUs per node but pins nothing, and vLLM's CPU build, left to itself
(``VLLM_CPU_OMP_THREADS_BIND=auto``), binds every engine to the cores it can see minus the ones it reserves — one
reserved core, two when a KV connector is configured. On a 2-core box that gave each pool-off replica ``[0]`` and
each pool-on replica ``[0, 1]``: both replicas on the same core(s), and a thread count (so bf16 greedy outputs)
that depended on whether the pool was on. Here each replica claims its own cores and binds its engine to exactly
those, whatever else is configured.

Who calls what:
- ``deployments.replica.VLLMReplica.__init__`` calls ``claim_cores(threads, binding)`` before its engine starts
  (on GPUs preferring the NUMA node of its GPU, as vLLM's platform reports it),
  then ``engine_binding(placement, gpu=..., ranks=...)`` (``ranks``: the engine's tensor × pipeline parallel
  worker processes, each bound to its share of the cores): it applies the environment to the process environment
  that vLLM's engine-core and worker processes inherit (CPU build: ``VLLM_CPU_OMP_THREADS_BIND`` and the
  multiprocess executor that applies it; both builds: ``OMP_NUM_THREADS``) and passes the engine arguments — on
  GPUs vLLM's own ``numa_bind`` / ``numa_bind_cpus``, when ``numactl`` is installed — to the engine.
- ``bench.oracle`` binds its plain-vLLM reference with the same ``engine_environment``. The
  replica holds the returned ``CoreClaim`` for its whole life and reports ``claim.placement`` (a
  ``router.hub.ReplicaPlacement``) to the hub, so ``kvstack serve`` prints it and ``kvstack status`` shows it.
- Tests call ``claim_cores`` with their own ``claims_dir`` and ``allowed`` CPU sets.

Mechanism: the candidate cores are the CPUs this process may run on (``os.sched_getaffinity``: the pod's cpuset on
Kubernetes, the whole machine for a local cluster of several Ray nodes on one box), grouped by NUMA node
(``/sys/devices/system/node``), one logical CPU per physical core first (as vLLM's own x86 policy binds). A claim
on a core is an exclusive ``flock`` on a file of the replica's own under ``<claims_dir>/cpu<N>/`` — a directory
every process of the machine sees (``/dev/shm``) — so a core counts as taken exactly while a live process holds
it: the kernel drops the lock when the process dies, and a crashed replica never leaks its cores. One machine-wide
mutex file, taken with a deadline, makes choosing and claiming atomic.

Claims coordinate the processes that share one ``/dev/shm``: every node of a local cluster, every replica of one
Ray node or pod. Pods on one Kubernetes host see separate ``/dev/shm``s, so there each replica pod needs a cpuset
of its own (Guaranteed QoS with the kubelet's static CPU manager); the claim then picks within it.

Policy (``ReplicaSettings.cpu_binding``): ``exclusive`` (default) takes only cores no live replica holds, within
one NUMA node when one has enough, and refuses with a message naming the cores and their holders otherwise;
``shared`` takes the least-claimed cores (replicas share cores because the config says so); ``unbound`` claims
nothing and binds nothing (``VLLM_CPU_OMP_THREADS_BIND=nobind``, the thread count still set): the OS scheduler moves
the engine's threads to whichever allowed core is free, which on a small box that also runs the Serve proxy, the
routers and the pool shards can beat a core of its own (what Ray Serve LLM's CPU engines do; ``bench.ray_serve_llm``).
Its placement lists every allowed CPU as its cores.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.lockfiles import reap_if_orphan
from router.hub import CpuBinding, ReplicaPlacement

MUTEX_DEADLINE_S = 10.0

log = logging.getLogger(__name__)


def default_claims_dir() -> str:
    """Where claims live: a directory every process of this machine sees (``/dev/shm``, else ``/tmp``)."""
    return "/dev/shm/kvstack-cpu-claims" if os.path.isdir("/dev/shm") else "/tmp/kvstack-cpu-claims"


class PlacementError(RuntimeError):
    """The replica cannot get the cores its config asks for (the message says which and why)."""


@dataclass(frozen=True)
class CpuInfo:
    cpu: int
    core: int  # physical core id (siblings of one core share it, within a NUMA node)
    numa_node: int


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` → ``[0, 1, 2, 3, 8, 10, 11]`` (Linux cpulist syntax)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_topology(allowed: Iterable[int], sys_root: str = "/sys/devices/system") -> list[CpuInfo]:
    """NUMA node and physical core of every allowed CPU (node 0 and the CPU's own id where sysfs says nothing)."""
    numa: dict[int, int] = {}
    for node_dir in sorted(Path(sys_root, "node").glob("node[0-9]*")):
        try:
            for cpu in parse_cpu_list((node_dir / "cpulist").read_text()):
                numa[cpu] = int(node_dir.name[4:])
        except (OSError, ValueError):
            continue
    out = []
    for cpu in sorted(set(allowed)):
        try:
            core = int(Path(sys_root, "cpu", f"cpu{cpu}", "topology", "core_id").read_text())
        except (OSError, ValueError):
            core = cpu
        out.append(CpuInfo(cpu, core, numa.get(cpu, 0)))
    return out


@dataclass
class CoreClaim:
    """The cores a live process holds. ``release()`` (or the process's death) gives them back."""

    placement: ReplicaPlacement
    _fds: list[int] = field(default_factory=list, repr=False)
    _paths: list[Path] = field(default_factory=list, repr=False)

    @property
    def cores(self) -> list[int]:
        return list(self.placement.cores)

    def release(self) -> None:
        fds, paths, self._fds, self._paths = self._fds, self._paths, [], []
        for path in paths:
            path.unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)


def _holders(core_dir: Path) -> list[str]:
    """The live claims on one core (files whose lock is held); stale files (lock free) are removed."""
    live: list[str] = []
    for path in sorted(core_dir.glob("*.claim")):
        if reap_if_orphan(path)[0] == "held":  # else nobody held it (its owner died without releasing): removed
            live.append(path.read_text().strip() or path.stem)
    return live


def _take_mutex(claims_dir: Path, deadline_s: float) -> int:
    fd = os.open(claims_dir / ".mutex", os.O_RDWR | os.O_CREAT, 0o666)
    end = time.monotonic() + deadline_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > end:
                os.close(fd)
                raise PlacementError(f"CPU claims: {claims_dir}/.mutex still held after {deadline_s:.0f} s") from None
            time.sleep(0.05)


def choose_cores(topology: list[CpuInfo], claimed: dict[int, int], threads: int, binding: CpuBinding,
                 prefer_numa: int | None = None) -> list[int]:
    """Pure policy: ``threads`` CPUs out of ``topology`` given the live claim count per CPU.

    exclusive: unclaimed CPUs only, all in one NUMA node when any node has enough (``prefer_numa`` — a GPU's own
    node — when it has enough, else the node with the most free CPUs, lowest id on ties), otherwise across nodes;
    physical cores with no claimed sibling first.
    shared: the least-claimed CPUs (same ordering), claimed or not. Raises ``PlacementError`` when it cannot."""
    if threads <= 0:
        raise PlacementError(f"threads must be positive, got {threads}")
    busy_cores = {(c.numa_node, c.core) for c in topology if claimed.get(c.cpu, 0) > 0}

    def order(c: CpuInfo) -> tuple[int, int, int]:
        return (claimed.get(c.cpu, 0), int((c.numa_node, c.core) in busy_cores), c.cpu)

    if binding == "shared":
        if len(topology) < threads:
            raise PlacementError(f"{threads} threads asked, this process may run on {len(topology)} CPUs only")
        return sorted(c.cpu for c in sorted(topology, key=order)[:threads])
    free = [c for c in topology if claimed.get(c.cpu, 0) == 0]
    by_node: dict[int, list[CpuInfo]] = {}
    for c in free:
        by_node.setdefault(c.numa_node, []).append(c)
    fitting = [n for n, cpus in by_node.items() if len(cpus) >= threads]
    if prefer_numa in fitting:
        fitting = [prefer_numa]
    pool = by_node[min(fitting, key=lambda n: (-len(by_node[n]), n))] if fitting else free
    if len(pool) < threads:
        raise PlacementError(
            f"{threads} exclusive CPU(s) asked, {len(free)} free of {[c.cpu for c in topology]} "
            f"(claimed: {sorted(cpu for cpu, n in claimed.items() if n)}); lower app.replicas.threads, run fewer "
            f"replicas per machine, or set app.replicas.cpu_binding=shared")
    return sorted(c.cpu for c in sorted(pool, key=order)[:threads])


def claim_cores(threads: int, binding: CpuBinding = "exclusive", *, owner: str = "", prefer_numa: int | None = None,
                allowed: Iterable[int] | None = None, claims_dir: str | None = None,
                sys_root: str = "/sys/devices/system", mutex_deadline_s: float = MUTEX_DEADLINE_S) -> CoreClaim:
    """Claim ``threads`` CPUs for this process (see the module docstring); hold the result while the engine runs."""
    allowed_set = set(allowed) if allowed is not None else os.sched_getaffinity(0)
    topology = cpu_topology(allowed_set, sys_root)
    if binding == "unbound":  # nothing to claim: the threads may run on any allowed CPU
        if threads <= 0:
            raise PlacementError(f"threads must be positive, got {threads}")
        return CoreClaim(ReplicaPlacement(
            cores=sorted(allowed_set), threads=threads, binding=binding,
            numa_nodes=sorted({c.numa_node for c in topology}), allowed=sorted(allowed_set), pid=os.getpid()))
    root = Path(claims_dir or default_claims_dir())
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o777)  # every local user's replicas share the machine's cores
    mutex = _take_mutex(root, mutex_deadline_s)
    try:
        holders = {c.cpu: _holders(root / f"cpu{c.cpu}") for c in topology}
        cores = choose_cores(topology, {cpu: len(h) for cpu, h in holders.items()}, threads, binding, prefer_numa)
        shared_with = sorted({h for cpu in cores for h in holders[cpu]})
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.claim"
        claim = CoreClaim(ReplicaPlacement(
            cores=cores, threads=threads, binding=binding,
            numa_nodes=sorted({c.numa_node for c in topology if c.cpu in cores}),
            allowed=sorted(allowed_set), shared_with=shared_with, pid=os.getpid()))
        try:
            for cpu in cores:
                core_dir = root / f"cpu{cpu}"
                core_dir.mkdir(exist_ok=True)
                path = core_dir / name
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(fd, (owner or name[:-6]).encode())
                claim._fds.append(fd)
                claim._paths.append(path)
        except BaseException:
            claim.release()
            raise
        return claim
    finally:
        os.close(mutex)


def vllm_cpu_bind(cores: list[int], ranks: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers of one engine: the cores split evenly, ``|`` between
    ranks (``[0, 1, 2, 3]``, 2 ranks → ``"0,1|2,3"``)."""
    if ranks <= 0 or len(cores) % ranks:
        raise PlacementError(f"{len(cores)} cores cannot be split evenly over {ranks} engine worker(s)")
    per = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(ranks))


def engine_environment(placement: ReplicaPlacement, *, gpu: bool, ranks: int = 1) -> dict[str, str]:
    """The environment the engine's processes must inherit for this placement.

    CPU build: ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM binds each worker's OpenMP threads to exactly these cores and
    reserves none), ``OMP_NUM_THREADS`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the executor that binds). GPU build: ``OMP_NUM_THREADS`` only (the host-side threads next to the
    GPU); the cores themselves go to vLLM's ``numa_bind_cpus`` (``engine_arguments``)."""
    env = {"OMP_NUM_THREADS": str(max(1, placement.threads // ranks))}
    if not gpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ("nobind" if placement.binding == "unbound"
                                            else vllm_cpu_bind(list(placement.cores), ranks))
        # vLLM binds OpenMP threads only in its multiprocess executor; with V1 multiprocessing off (a variable
        # inherited from whoever started Ray) the engine runs in-process and unbound.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return env


def engine_arguments(placement: ReplicaPlacement, *, gpu: bool, ranks: int = 1) -> dict[str, object]:
    """vLLM engine arguments for this placement: on GPUs, vLLM's own worker binding (``numactl --physcpubind``
    to the claimed cores, one list per GPU worker) when ``numactl`` is installed; nothing on CPUs."""
    if not gpu or placement.binding == "unbound" or shutil.which("numactl") is None:
        return {}
    return {"numa_bind": True, "numa_bind_cpus": vllm_cpu_bind(list(placement.cores), ranks).split("|")}


def engine_binding(placement: ReplicaPlacement, *, gpu: bool, ranks: int = 1) -> tuple[dict[str, str],
                                                                                      dict[str, object]]:
    """(``engine_environment``, ``engine_arguments``) for an engine of ``ranks`` worker processes (tensor × pipeline
    parallel). CPU build: each rank computes on its own share of the claimed cores, so cores that do not split
    evenly are refused (``PlacementError``, naming the setting to change); GPU build: the cores only host threads,
    so an uneven split leaves vLLM's NUMA binding off instead (logged)."""
    if placement.binding == "unbound":  # no cores to split: every rank's threads float
        return engine_environment(placement, gpu=gpu, ranks=ranks), {}
    uneven = len(placement.cores) % ranks != 0
    if uneven and not gpu:
        raise PlacementError(
            f"the engine's {ranks} CPU worker processes (tensor × pipeline parallel) each need their share of the "
            f"replica's cores; it has {len(placement.cores)} ({placement.cores}): set app.replicas.threads (and "
            f"num_cpus) to a multiple of {ranks}")
    env = engine_environment(placement, gpu=gpu, ranks=ranks)
    if uneven:
        log.warning("%d cores do not split over %d GPU workers: vLLM's NUMA binding is off", len(placement.cores),
                    ranks)
        return env, {}
    return env, engine_arguments(placement, gpu=gpu, ranks=ranks)
