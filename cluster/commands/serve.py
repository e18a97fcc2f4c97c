"""``kvstack serve``: the whole stack on one machine (or on an existing Ray cluster) until Ctrl-C / SIGTERM.

Steps, each printed with its elapsed time: generate the tiny model on first run → start the local multi-node Ray
cluster (``cluster.local_cluster``) or join ``cluster.address`` → start a KV pool shard on every worker node →
deploy the Serve app (``deployments.app.build_app``) with the HTTP proxy on ``http.host:http.port`` → print the
endpoint and an example ``curl`` → wait. On SIGINT/SIGTERM it tears down exactly what it started (Serve app,
shards, the local cluster's own processes; never ``ray stop``) and exits 0.

Output: the terminal shows kvstack's own lines only (the steps, one line per replica with its node and cores —
"replica ... bound to cpus ..." —, the endpoint, errors); Ray's and vLLM's logs (this process's and those of the
processes it starts) go to a log file, ``.kvstack/logs/serve-<time>-<pid>.log`` by default, whose path is the first
line printed. ``--verbose`` shows them live on the terminal instead (``cluster.cli_output.redirect_output``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.cli_output import redirect_output, say, warn
from cluster.serve_config import DEFAULT_CONFIG, parse_overrides
from cluster.stop_flag import StopFlag, handle_signals, run_app

DEPLOY_DEADLINE_S = 900.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--state-file", type=Path, default=Path(".kvstack/serve.json"),
                        help="where to write the endpoint/pids for `kvstack status` (default: %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=Path(".kvstack/logs"),
                        help="directory of the log file for Ray's and vLLM's logs (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's and vLLM's logs on the terminal instead of writing them to the log file")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose and override the serve config (``kvstack serve`` and ``kvstack serve-config``)."""
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="serve config YAML (default: %(default)s)")
    parser.add_argument("--model", metavar="ID_OR_PATH",
                        help="serve this model (a local directory, or a Hugging Face id downloaded where the hub is "
                             "reachable) instead of the config's; no tiny model is generated and the cost model's spec "
                             "comes from the model's own config (overrides app.engine.model)")
    parser.add_argument("--served-model-name", help="the name clients put in `model` (default with --model: the "
                                                    "directory's name or the id)")
    parser.add_argument("--port", type=int, help="HTTP port (overrides http.port)")
    parser.add_argument("--workers", type=int, help="local worker nodes (overrides cluster.workers)")
    parser.add_argument("--replicas", type=int, help="vLLM replicas (overrides app.replicas.num_replicas)")
    parser.add_argument("--policy", help="routing policy (overrides app.router.policy)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set app.pool.enabled=false (value parsed as YAML)")


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def step(self, what: str) -> float:
        say(f"[kvstack {time.monotonic() - self.t0:6.1f}s] {what}")
        return time.monotonic()

    def done(self, what: str, since: float) -> None:
        say(f"[kvstack {time.monotonic() - self.t0:6.1f}s] {what} ({time.monotonic() - since:.1f}s)")


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``load_serve_config``'s overrides for the flags of ``add_config_arguments``."""
    out: dict[str, Any] = {}
    if args.model is not None:  # a model of the user's: nothing generated, nothing of the tiny model's kept
        out["app.engine.model"] = args.model
        out["app.engine.served_model_name"] = None
        out["tiny_model"] = None
        out["app.router.model_spec"] = None
    if args.served_model_name is not None:
        out["app.engine.served_model_name"] = args.served_model_name
    if args.port is not None:
        out["http.port"] = args.port
    if args.workers is not None:
        out["cluster.workers"] = args.workers
    if args.replicas is not None:
        out["app.replicas.num_replicas"] = args.replicas
    if args.policy is not None:
        out["app.router.policy"] = args.policy
    out.update(parse_overrides(args.set))
    return out


def load_config(args: argparse.Namespace, command: str) -> Any:
    """The serve config the flags of ``add_config_arguments`` name, or None after printing why it is refused."""
    from configs.loader import ConfigError, UnknownNameError

    from cluster.serve_config import load_serve_config

    try:
        return load_serve_config(args.config, config_overrides(args))
    except (ConfigError, UnknownNameError, ValueError) as exc:
        print(f"kvstack {command}: {exc}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args, "serve")
    if cfg is None:
        return 2
    with log_routing(args.log_dir, verbose=args.verbose):
        return _serve(cfg, args.state_file)


def log_file_path(log_dir: Path) -> Path:
    """A fresh log file name under ``log_dir`` for one ``kvstack serve`` run."""
    return log_dir / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextlib.contextmanager
def log_routing(log_dir: Path, *, verbose: bool) -> Iterator[Path | None]:
    """Everything but kvstack's own lines goes to a new log file under ``log_dir`` (its path printed first), or
    stays on the terminal with ``verbose``. Yields the log file's path (None when verbose)."""
    if verbose:
        yield None
        return
    path = log_file_path(log_dir.resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    say(f"[kvstack] Ray and vLLM logs: {path} (--verbose shows them here)")
    with open(path, "ab", buffering=0) as log, redirect_output(stdout_to=log.fileno(), stderr_to=log.fileno()):
        yield path


def _serve(cfg: Any, state_file: Path) -> int:
    stop = StopFlag()
    handle_signals(stop)
    stack = ServeStack(cfg, state_file, on_ray_started=lambda: handle_signals(stop))
    try:
        stack.start(stop)
        if not stop.is_set():
            stack.announce()
            while not stop.wait(1.0):
                pass
        return 0
    except Exception as exc:  # noqa: BLE001 - report and clean up whatever started
        warn(f"kvstack serve: failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        stack.stop()


class ServeStack:
    """What ``kvstack serve`` started, so that ``stop`` tears down exactly that."""

    def __init__(self, cfg: Any, state_file: Path, on_ray_started: Any = None) -> None:
        self.cfg = cfg
        self.on_ray_started = on_ray_started or (lambda: None)
        self.stop_event = StopFlag()
        self.state_file = state_file
        self.progress = Progress()
        self.cluster: Any = None
        self.shards: list[Any] = []
        self.serve_started = False

    def start(self, stop: StopFlag) -> None:
        from cluster.local_cluster import LocalCluster, prepare_environment

        self.stop_event = stop
        cfg, p = self.cfg, self.progress
        prepare_environment()
        if cfg.tiny_model is not None:
            self._ensure_tiny_model()
        else:
            self._ensure_model()
        if stop.is_set():
            return
        if cfg.cluster.mode == "local":
            t = p.step(f"starting a local Ray cluster: head + {cfg.cluster.workers} worker nodes")
            self.cluster = LocalCluster(workers=cfg.cluster.workers, cpus_per_worker=cfg.cluster.cpus_per_worker)
            self.cluster.start()
            auth = os.environ.get("RAY_AUTH_MODE") or "none"  # LocalCluster: token unless the caller chose a mode
            p.done(f"Ray cluster up: {', '.join(n.ip for n in self.cluster.nodes)} (Ray authentication: {auth})", t)
        else:
            import ray

            from kvpool.secret import POOL_SECRET_ENV, configured

            t = p.step(f"joining the Ray cluster at {cfg.cluster.address}")
            ray.init(address=cfg.cluster.address, namespace="kvstack")
            p.done("joined", t)
            if not configured():
                say(f"[kvstack] no ${POOL_SECRET_ENV} here: the pool's TCP transport authenticates its peers only "
                    "when every node of the cluster has the same secret in its environment (README: Security)")
        self.on_ray_started()
        if stop.is_set():
            return
        if cfg.app.pool.enabled:
            self._start_shards()
        if stop.is_set():
            return
        self._deploy()

    def _ensure_tiny_model(self) -> None:
        from cluster.tiny_models import ensure_configured

        path = Path(self.cfg.app.first.engine.model_path)
        t = self.progress.step(f"tiny model {self.cfg.tiny_model.arch}/{self.cfg.tiny_model.preset} at {path}")
        ensure_configured(self.cfg.tiny_model.arch, self.cfg.tiny_model.preset, path)
        self.progress.done("tiny model ready", t)

    def _ensure_model(self) -> None:
        """A Hugging Face id is downloaded once here (into the hub's cache, shared by this machine's replicas and
        the ingress); a local directory is used as is."""
        for entry in self.cfg.app.entries():
            model = entry.engine.model
            if Path(model).is_dir():
                continue
            from huggingface_hub import snapshot_download

            t = self.progress.step(f"model {model}: fetching it from the Hugging Face hub (or its cache)")
            try:
                path = snapshot_download(model)
            except Exception as exc:  # noqa: BLE001 - offline, unknown id, no access: one clear message
                raise RuntimeError(f"model {model!r} is not a local directory and the Hugging Face hub cannot "
                                   f"provide it: {type(exc).__name__}: {exc}") from None
            self.progress.done(f"model ready at {path}", t)

    def _start_shards(self) -> None:
        from deployments.pool_setup import start_pool

        t = self.progress.step("starting a KV pool shard on every worker node")
        self.shards = start_pool(self.cfg.app)
        self.progress.done(f"{len(self.shards)} pool shards up", t)

    def _deploy(self) -> None:
        from ray import serve

        from deployments.app import build_app

        cfg = self.cfg
        n = ", ".join(f"{m.replicas.num_replicas or 'autoscaled'} of {m.engine.served_model_name}"
                      for m in cfg.app.entries())
        t = self.progress.step(f"deploying the app: vLLM replicas ({n}) + router (policy {cfg.app.router.policy})")
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        self.serve_started = True
        self.on_ray_started()
        if not run_app(build_app(cfg.app), "kvstack", self.stop_event, DEPLOY_DEADLINE_S):
            return
        self.on_ray_started()
        self.progress.done("app ready", t)
        self._print_placement()

    def _print_placement(self, deadline_s: float = 20.0) -> None:
        """One line per replica: the node and the CPUs its engine threads are bound to (from the replicas' first
        reports to the cluster-view hub)."""
        import msgspec
        import ray

        from router.hub import PollReply

        from deployments.app import hub_name

        entries = self.cfg.app.entries()
        want = sum(m.replicas.num_replicas or m.replicas.autoscaling_config.min_replicas for m in entries)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        end = time.monotonic() + deadline_s
        reports: list[Any] = []
        while time.monotonic() < end:
            reports = []
            try:
                for i in range(len(entries)):  # one hub per model
                    hub = ray.get_actor(hub_name(i), namespace="kvstack")
                    reply = msgspec.msgpack.decode(ray.get(hub.poll.remote(0), timeout=5.0), type=PollReply)
                    latest = {r.replica_id: r for r in reply.reports}  # the log holds several reports per replica
                    reports += [r for r in latest.values() if r.placement is not None and not r.gone]
            except Exception:  # noqa: BLE001 - not up yet: ask again until the deadline
                reports = []
            if len(reports) >= want:
                break
            time.sleep(0.5)
        for r in sorted(reports, key=lambda r: r.placement.cores):
            p = r.placement
            shared = f", shares them with {', '.join(p.shared_with)}" if p.shared_with else ""
            workers = "; engine workers: " + ", ".join(f"pid {w.pid} on cpus {w.cpus}" for w in p.engine_workers)
            bound = "unbound, may run on" if p.binding == "unbound" else "bound to"
            say(f"[kvstack] replica {r.replica_id} on {ips.get(r.node_id, r.node_id[:12])}: {p.threads} engine "
                f"thread(s) {bound} cpus {p.cores} (cpu_binding={p.binding}, numa node {p.numa_nodes}{shared})"
                f"{workers if p.engine_workers else ''}")
        if len(reports) < want:
            say(f"[kvstack] placement: {len(reports)} of {want} replicas reported within {deadline_s:.0f} s")

    def announce(self) -> None:
        host = "127.0.0.1" if self.cfg.http.host in ("0.0.0.0", "::") else self.cfg.http.host
        base = f"http://{host}:{self.cfg.http.port}/v1"
        model = self.cfg.app.first.engine.served_model_name
        others = [m.engine.served_model_name for m in self.cfg.app.entries()[1:]]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps({"endpoint": base, "model": model,
                                               "ray_address": getattr(self.cluster, "address", None)}))
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
        also = f" (and {', '.join(others)})" if others else ""
        from router.access import ADMIN_KEY_ENV, API_KEYS_ENV, load_keys

        keys, admin = load_keys(self.cfg.app.ingress)
        if keys:
            say(f"[kvstack] API keys: {len(keys)} key(s) of {len(set(keys.values()))} tenant(s); /kvstack/* "
                + ("needs $" + ADMIN_KEY_ENV if admin else f"is closed (no ${ADMIN_KEY_ENV})"))
            auth = " -H 'Authorization: Bearer KEY'"
        else:
            say(f"[kvstack] no API keys (${API_KEYS_ENV}, app.ingress.api_keys_file): the endpoint is open to "
                f"anyone who can reach {self.cfg.http.host}:{self.cfg.http.port}")
            auth = ""
        say(f"kvstack is serving {model}{also} at {base}   try: curl -s {base}/chat/completions{auth} "
            f"-H 'Content-Type: application/json' -d '{body}'")

    def stop(self) -> None:
        p = self.progress
        t = p.step("shutting down")
        try:
            if self.serve_started:
                from ray import serve

                serve.shutdown()
        except Exception as exc:  # noqa: BLE001
            warn(f"kvstack serve: serve shutdown: {exc}")
        try:
            if self.shards:
                from kvpool.shard.placement import stop_shards

                stop_shards(self.shards)
        except Exception as exc:  # noqa: BLE001
            warn(f"kvstack serve: stopping shards: {exc}")
        if self.cluster is not None:
            self.cluster.shutdown()
        else:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        self.state_file.unlink(missing_ok=True)
        p.done("stopped", t)
