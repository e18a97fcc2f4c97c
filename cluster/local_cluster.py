"""A real multi-node Ray cluster on one machine: a head plus N worker nodes, each its own node IP on loopback.

Who calls it: ``kvstack serve`` (the embedded default), the session test fixture (``tests/ray_cluster_fixture.py``)
and the benchmarks (``bench reuse``, ``bench transfer --ray``) — one bootstrap, so the tests run on the cluster
``kvstack serve`` starts. Each worker node gets its own resources (``num_cpus``, a ``kvstack_node_<i>`` custom
resource, ``kvstack_worker``, and ``node_<name>`` when the workers are named) so replicas and pool shards can be
spread or pinned. The environment is one dict (``LOCAL_CLUSTER_ENV``): ``start`` sets what the caller has not set,
``shutdown`` puts the process environment back. Pitfalls handled here (measured on this kind of machine):
- node IP 127.0.0.1 is rewritten to the host IP → nodes use 127.0.0.2, .3, …;
- Ray's gRPC servers listen on every interface whatever the node IP, so a cluster without authentication runs code
  for anyone who reaches the host → Ray's token authentication is on with a token generated for this cluster
  (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN`` in the environment its processes inherit, which Ray prefers to
  ``~/.ray/auth_token``), unless the caller chose ``RAY_AUTH_MODE`` itself (the test suite: ``disabled``);
- default ports collide with other Ray instances → every port is picked free;
- worker nodes must join one at a time → ``add_node(wait=True)`` in sequence;
- Serve's 5 s proxy readiness check flakes on a loaded 2-core box → ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``;
- shut down with ``Cluster.shutdown()`` (own processes only), never ``ray stop`` (would kill other clusters);
- Ray gives a new node's raylet a fixed 30 s to register with the GCS ("The current node timed out during startup"),
  which a loaded 2-core box can miss (seen in CI); and a port picked free can be taken by another process before
  the GCS binds it ("Failed to start GCS", seen in CI) → a start that fails so is torn down, the processes it left
  are ended (found by this cluster's private temp dir in their command lines), and it is tried again from scratch
  with new ports, at most ``start_attempts`` times.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# Environment every process of a local cluster needs; applied by ``prepare_environment`` (called by entrypoints,
# never at import time).
LOCAL_CLUSTER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_health_check_timeout_ms": "60000",
    "RAY_DEDUP_LOGS": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "UCX_NET_DEVICES": "lo",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    # Ray starts worker processes at nice 15, and the vLLM engines are workers: at nice 15 every nice-0 process on
    # their cores (GCS, raylet, dashboard) preempts their compute (measured: first-turn prefill 7.1-7.9 s -> 5.7 s).
    "RAY_worker_niceness": "0",
}


def prepare_environment(overrides: dict[str, str] | None = None) -> None:
    """Set the local-cluster environment for this process and the Ray processes it starts."""
    for key, value in {**LOCAL_CLUSTER_ENV, **(overrides or {})}.items():
        os.environ.setdefault(key, value)


RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def ensure_ray_token(environ: MutableMapping[str, str] | None = None) -> str:
    """Ray's authentication mode for a local cluster started with ``environ`` (default ``os.environ``): the
    caller's ``RAY_AUTH_MODE`` if it set one, else ``token`` with a fresh random ``RAY_AUTH_TOKEN`` (kept if the
    caller set one), which every process of the cluster inherits and a process without it cannot connect with."""
    env = os.environ if environ is None else environ
    if not env.get("RAY_AUTH_MODE"):
        env["RAY_AUTH_MODE"] = "token"
        if not env.get("RAY_AUTH_TOKEN"):
            import secrets

            env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        if environ is None:
            _reload_ray_auth()
    return env["RAY_AUTH_MODE"]


def _reload_ray_auth() -> None:
    """Make this process's Ray read its authentication settings again: Ray reads ``RAY_AUTH_MODE`` and the token
    once, when its core module is first imported (by then the CLI has usually imported Ray), and this process is
    the cluster's first driver. The same two calls Ray's own tests use to switch modes in a process."""
    import sys

    if "ray._raylet" not in sys.modules:
        return  # not read yet: Ray reads the environment just set when it is imported
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


#: Ports ``free_port`` hands out lie in [PORT_FLOOR, the kernel's ephemeral range): above Ray's default worker
#: ports (10002-19999), below the ports the kernel gives to bind(0) and to outgoing connections. A port taken from the
#: ephemeral range was free when picked, but the Ray cluster started next opens hundreds of sockets in that range
#: before Serve's proxy binds the port: CI saw "Failed to bind to address '127.0.0.1:59547'" (the autoscaling e2e
#: test's server, 2026-12-07).
PORT_FLOOR = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port no address of this host has bound, outside the kernel's ephemeral range (``PORT_FLOOR``): tried on
    the wildcard address, because Ray's servers bind every interface, so a port free on the node's own IP but held on
    another loopback address is not free for them. Where the ephemeral range leaves no room below it, the kernel's
    pick (bind to port 0)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(256 if low > PORT_FLOOR else 0):
        port = rng.randrange(PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@dataclass
class NodeInfo:
    ip: str
    node_id: str
    resource: str  # the custom resource naming this node ("kvstack_node_<i>"; "kvstack_head" for the head)
    num_cpus: int
    name: str = ""  # "head", or the worker's name (``worker_names``; else its index)


@dataclass
class LocalCluster:
    """Start with ``start()`` (or the ``local_cluster`` context manager), stop with ``shutdown()``."""

    workers: int = 2
    cpus_per_worker: int = 2
    head_cpus: int = 0
    object_store_bytes: int = 200 * 2**20
    first_ip: int = 2
    namespace: str | None = "kvstack"
    temp_root: str | None = None
    worker_names: tuple[str, ...] | None = None  # also adds a ``node_<name>`` resource per worker
    logging_level: str = "WARNING"
    log_to_driver: bool = True
    start_attempts: int = 3
    nodes: list[NodeInfo] = field(default_factory=list)

    def start(self) -> LocalCluster:
        import ray

        if self.worker_names is not None and len(self.worker_names) != self.workers:
            raise ValueError(f"{self.workers} workers but {len(self.worker_names)} worker names")
        # Ray's socket paths must stay short: a private dir directly under /tmp.
        self._tmp = tempfile.mkdtemp(prefix="kvs-", dir=self.temp_root or "/tmp")
        # Ray writes its "current cluster" address file under RAY_TMPDIR: keep it private too.
        from kvpool.secret import POOL_SECRET_ENV, ensure_pool_secret

        self._saved_env = {k: os.environ.get(k) for k in (*LOCAL_CLUSTER_ENV, "RAY_TMPDIR", POOL_SECRET_ENV,
                                                          *RAY_AUTH_ENV)}
        prepare_environment()
        ensure_pool_secret()  # the pool's cluster secret (kvpool.secret): every Ray process started here inherits it
        ensure_ray_token()
        os.environ["RAY_TMPDIR"] = self._tmp
        for attempt in range(1, self.start_attempts + 1):
            try:
                self._start_nodes()
                break
            except Exception as exc:
                if not is_transient_start_failure(exc) or attempt == self.start_attempts:
                    self.shutdown()
                    raise
                logger.warning("local cluster: a node failed to start (%s; attempt %d of %d); starting again with "
                               "new ports", str(exc).splitlines()[0][:200], attempt, self.start_attempts)
                self._tear_down_nodes()
        ray.init(address=self._cluster.address, namespace=self.namespace, logging_level=self.logging_level,
                 log_to_driver=self.log_to_driver)
        return self

    def _start_nodes(self) -> None:
        from ray.cluster_utils import Cluster

        ray_dir = os.path.join(self._tmp, "ray")
        os.makedirs(ray_dir, exist_ok=True)
        head_ip = f"127.0.0.{self.first_ip}"
        self.nodes = []
        self._cluster = Cluster(initialize_head=False, connect=False)
        self._cluster.add_node(
            node_ip_address=head_ip,
            gcs_server_port=free_port(),
            num_cpus=self.head_cpus,
            resources={"kvstack_head": 1},
            object_store_memory=self.object_store_bytes,
            include_dashboard=False,
            temp_dir=ray_dir,
            metrics_export_port=free_port(),
            ray_client_server_port=free_port(),
        )
        self.nodes = [NodeInfo(head_ip, self._cluster.head_node.node_id, "kvstack_head", self.head_cpus, "head")]
        for _ in range(self.workers):
            self.add_worker()

    def _tear_down_nodes(self) -> None:
        """End this cluster's nodes (at shutdown, or what a failed start left): the nodes Ray knows, then any process
        of this cluster's temp dir (a node whose start raised is known to no one)."""
        cluster = getattr(self, "_cluster", None)
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the sweep below ends what is left
                logger.warning("local cluster: Ray's shutdown of its nodes failed", exc_info=True)
            self._cluster = None
        tmp = getattr(self, "_tmp", None)
        if tmp:
            end_processes_of(tmp)

    def add_worker(self) -> NodeInfo:
        """One more worker node (the next loopback address, ``cpus_per_worker`` CPUs), as an autoscaler adds one."""
        i = len(self.nodes) - 1
        ip = f"127.0.0.{self.first_ip + 1 + i}"
        name = self.worker_names[i] if self.worker_names is not None and i < len(self.worker_names) else str(i)
        resources = {f"kvstack_node_{i}": 1, "kvstack_worker": 1}
        if self.worker_names is not None:
            resources[f"node_{name}"] = 1
        node = self._cluster.add_node(
            wait=True,
            node_ip_address=ip,
            num_cpus=self.cpus_per_worker,
            resources=resources,
            object_store_memory=self.object_store_bytes,
            metrics_export_port=free_port(),
        )
        info = NodeInfo(ip, node.node_id, f"kvstack_node_{i}", self.cpus_per_worker, name)
        self.nodes.append(info)
        return info

    @property
    def address(self) -> str:
        return self._cluster.address

    @property
    def worker_nodes(self) -> list[NodeInfo]:
        return self.nodes[1:]

    def shutdown(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            self._tear_down_nodes()  # Ray's shutdown of the nodes, then what it left running
            tmp = getattr(self, "_tmp", None)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
                self._tmp = None
            for key, value in getattr(self, "_saved_env", {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env = {}


def is_transient_start_failure(exc: BaseException) -> bool:
    """Ray's own words for the two start failures a fresh attempt cures: a node's raylet that did not register with
    the GCS within Ray's fixed 30 s, and a GCS whose port (picked free) another process bound first."""
    text = str(exc)
    return "timed out during startup" in text or "Failed to start GCS" in text


def end_processes_of(tmp: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, every process whose command line names ``tmp`` (a local cluster's
    private temp dir: every Ray process of that cluster has it in its arguments, no other process has). Returns
    their pids."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(tmp in arg for arg in proc.info["cmdline"] or ()):
                procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


@contextmanager
def local_cluster(**kwargs: object) -> Iterator[LocalCluster]:
    cluster = LocalCluster(**kwargs).start()  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.shutdown()
