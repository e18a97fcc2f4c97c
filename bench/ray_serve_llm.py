"""The anchor a user would pick instead of kvstack: Ray Serve LLM's own OpenAI app over the same vLLM engine.

    .venv/bin/python -m bench.ray_serve_llm --port 8100 [--config FILE] [--set KEY=VALUE ...] [--router prefix]

What it starts, from the same serve config ``kvstack serve`` reads (``cluster.serve_config``; ``--set`` overrides
apply to both): the config's tiny model if it names one (``cluster.tiny_models.ensure_configured``), the same local
multi-node Ray cluster (``cluster.local_cluster.LocalCluster``, the config's worker count and CPUs), and
``ray.serve.llm.build_openai_app`` with one ``LLMConfig``: the model served under the config's
``served_model_name``, engine arguments ``EngineSettings.vllm_engine_kwargs`` (what every kvstack replica and
``kvstack bench oracle`` start vLLM with) plus the config's OpenAI frontend options
(``app.ingress.openai``: the tool parser, chat template; Ray Serve LLM hands ``FrontendArgs`` keys of
``engine_kwargs`` to vLLM's serving layer), so an OpenAI ``tools`` request is served as kvstack and plain vLLM serve
it; ``app.replicas.num_replicas`` replicas of one CPU bundle each, and Ray
Serve LLM's ``PrefixCacheAffinityRouter`` (``--router prefix``, default) or Serve's default power-of-two router
(``--router pow2``). No KV pool, no kvstack code on the request path.

Engine threads: Ray Serve LLM has no per-replica core binding, and vLLM's automatic binding (``auto``) put every
engine on the same core in our measurements (issue 11), so each engine runs the config's thread count unbound
(``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_NUM_THREADS``): the same thread count as a kvstack replica (bf16
results depend on it), placed by the OS. The ingress takes no CPU (the cluster's CPUs are the replicas').

It prints ``Ray Serve LLM is serving MODEL at URL`` once the app is ready (within ``--ready-timeout-s``), then
serves until SIGINT/SIGTERM and shuts the cluster down. Who calls it: ``bench.live_compare`` (configuration
``ray_serve_llm``) through ``bench.serve_process.ServerProcess``, or a person. Needs ``pyarrow`` (Ray Serve LLM
imports it; the ``bench`` extra of ``pyproject.toml``); ``ray[llm]`` itself pins another vLLM and is not installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 900.0
ROUTERS = ("prefix", "pow2")


def llm_config(cfg: Any, router: str = "prefix") -> Any:
    """The ``LLMConfig`` of the anchor for a loaded serve config (``cluster.serve_config.ServeConfig``)."""
    from ray.serve.llm import LLMConfig

    engine, replicas = cfg.app.engine, cfg.app.replicas
    if replicas.num_replicas is None:
        raise SystemExit("the Ray Serve LLM anchor needs app.replicas.num_replicas (a fixed replica count)")
    kwargs = {**engine.vllm_engine_kwargs(), **cfg.app.ingress.openai.vllm_serve_kwargs()}
    model_source = kwargs.pop("model")
    kwargs.pop("served_model_name")
    deployment: dict[str, Any] = {"num_replicas": replicas.num_replicas,
                                  "max_ongoing_requests": replicas.max_ongoing_requests}
    if router == "prefix":
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        deployment["request_router_config"] = {"request_router_class": PrefixCacheAffinityRouter}
    elif router != "pow2":
        raise SystemExit(f"--router must be one of {ROUTERS}, got {router!r}")
    threads = replicas.engine_threads()
    return LLMConfig(
        model_loading_config={"model_id": engine.served_model_name, "model_source": model_source},
        engine_kwargs=kwargs,
        deployment_config=deployment,
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}},
        placement_group_config={"bundles": [{"CPU": max(1.0, replicas.num_cpus)}]},
    )


def build_app(cfg: Any, router: str = "prefix") -> Any:
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(cfg, router)],
                             "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="serve config (default: kvstack serve's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router", choices=ROUTERS, default="prefix",
                        help="prefix: Ray Serve LLM's PrefixCacheAffinityRouter; pow2: Serve's default")
    parser.add_argument("--ready-timeout-s", type=float, default=READY_TIMEOUT_S)


def run(args: argparse.Namespace) -> int:
    from cluster.local_cluster import LocalCluster, prepare_environment
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides
    from cluster.stop_flag import StopFlag, handle_signals, run_app
    from cluster.tiny_models import ensure_configured

    cfg = load_serve_config(args.config or DEFAULT_CONFIG, parse_overrides(args.set))
    if cfg.cluster.mode != "local":
        raise SystemExit("the Ray Serve LLM anchor starts its own local cluster (cluster.mode: local)")
    stop = StopFlag()
    handle_signals(stop)
    prepare_environment()
    if cfg.tiny_model is not None:
        ensure_configured(cfg.tiny_model.arch, cfg.tiny_model.preset, Path(cfg.app.engine.model_path))
    cluster = LocalCluster(workers=cfg.cluster.workers, cpus_per_worker=cfg.cluster.cpus_per_worker)
    try:
        cluster.start()
        handle_signals(stop)  # ray.init replaced the handlers
        from ray import serve

        serve.start(http_options={"host": args.host, "port": args.port})
        t0 = time.monotonic()
        try:
            if not run_app(build_app(cfg, args.router), "ray-serve-llm", stop, args.ready_timeout_s):
                return 130
        except Exception as exc:  # noqa: BLE001 - a failed or late deploy is this command's failure
            print(f"Ray Serve LLM: deploy failed: {exc!r}", file=sys.stderr)
            return 1
        url = f"http://{args.host}:{args.port}/v1"
        print(f"Ray Serve LLM is serving {cfg.app.engine.served_model_name} at {url} "
              f"(router {args.router}, ready after {time.monotonic() - t0:.0f} s)", flush=True)
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_serve_llm", description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
