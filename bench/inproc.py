"""In-process vLLM engines (CPU build) for the reuse benchmark and the e2e reuse tests, locally or as a Ray actor.

Who calls what:
- ``bench.reuse_bench`` and ``tests/e2e`` build engines with ``make_llm(EngineSpec, connector)`` in their own
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, starts in seconds), run
  token-id prompts with ``generate``, and close them with ``close_llm`` (which also drops vLLM's process-global
  KV connector so the next engine gets its own).
- For an engine on another Ray node (another process), they start ``EngineActor`` pinned to that node; it wraps
  the same functions and returns plain values.
Every engine uses greedy sampling through ``generate``; the results carry tokens and per-request TTFT.
Environment settings the CPU build needs are applied by ``engine_env()`` at call time, never at import.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from typing import Any

import msgspec

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


_GENERATE_IDS = itertools.count()


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One in-process engine. ``kv_cache_bytes`` must be set on the CPU build."""

    model: str
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 4096
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 16
    dtype: str = "bfloat16"
    prefix_caching: bool = True
    seed: int = 0
    tensor_parallel: int = 1  # > 1: vLLM's multiprocess executor, one worker process per rank, one core each


class GenResult(msgspec.Struct, frozen=True):
    tokens: list[list[int]]
    ttft_s: list[float]  # per prompt: arrival → first token (vLLM's own timing); -1 when unavailable
    wall_s: float
    cached: list[int] = []  # per prompt: prompt tokens the engine reused (its prefix cache + its connector)


def engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # these engines run in this process, whatever else set it


def make_llm(spec: EngineSpec, connector: Any | None = None, *, connector_class: tuple[str, str] | None = None) -> Any:
    """A ``vllm.LLM`` in this process; ``connector`` is a ``kvpool.connector.config.ConnectorConfig`` or None.

    ``connector_class`` = (class name, module path) of a ``KvPoolConnector`` subclass (tests)."""
    engine_env()
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if connector is not None:
        from kvpool.connector.config import kv_transfer_config

        names = {"connector": connector_class[0], "module_path": connector_class[1]} if connector_class else {}
        kwargs["kv_transfer_config"] = kv_transfer_config(connector, **names)
    def build() -> Any:
        return LLM(
            model=spec.model,
            kv_cache_memory_bytes=spec.kv_cache_bytes,
            enforce_eager=True,
            # tensor-parallel: one worker process per rank (vLLM's multiprocess executor)
            distributed_executor_backend="mp" if spec.tensor_parallel > 1 else "uni",
            tensor_parallel_size=spec.tensor_parallel,
            max_model_len=spec.max_model_len,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            enable_prefix_caching=spec.prefix_caching,
            dtype=spec.dtype,
            seed=spec.seed,
            **kwargs,
        )

    return _with_bound_ranks(spec.tensor_parallel, build) if spec.tensor_parallel > 1 else build()


def _with_bound_ranks(ranks: int, build: Any) -> Any:
    """``build()`` with ``VLLM_CPU_OMP_THREADS_BIND`` set for ``ranks`` worker processes (the CPU build refuses to
    place several workers on one NUMA node by itself): one core each, the first of this process's cores. The
    workers inherit it when they start; vLLM's ``set_env_var`` puts the variable back after."""
    from vllm.utils.system_utils import set_env_var

    from deployments.cpu_placement import vllm_cpu_bind

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise RuntimeError(f"{ranks} tensor-parallel ranks need {ranks} cores; this process may use {len(cores)}")
    with set_env_var("VLLM_CPU_OMP_THREADS_BIND", vllm_cpu_bind(cores[:ranks], ranks)):
        return build()


def placement() -> dict[str, Any]:
    """Where this process's in-process engines compute: the torch thread count and the CPUs they may use (the
    engines run unbound, one thread: ``OMP_NUM_THREADS=1``; every engine of a comparison runs here alike)."""
    import torch

    return {"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0)),
            "binding": "in-process (unbound), OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "")}


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> GenResult:
    """Greedy completion of token-id prompts (ignore EOS, so every output has ``max_tokens`` tokens).

    With the kvpool connector, the engine is stepped here and every step waits (``settle``) until the connector's
    pool calls and loads started so far are done: the steps then group the requests as they would with an
    instantly answering pool, whatever this machine's timing — vLLM's CPU kernels are not batch-invariant (another
    batch can change a greedy token), and the correctness tests compare against engines that never wait."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    if scheduler_connector(llm) is None:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    else:
        engine = llm.llm_engine
        ids = [f"gen-{next(_GENERATE_IDS)}" for _ in prompts]
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        finished: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            settle(llm)
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = o
        outs = [finished[rid] for rid in ids]
    wall = time.perf_counter() - t0
    ttfts: list[float] = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first = getattr(m, "first_token_latency", None) if m is not None else None
        ttfts.append(float(first) if first is not None else -1.0)
    return GenResult([list(o.outputs[0].token_ids) for o in outs], ttfts, wall,
                     [int(o.num_cached_tokens or 0) for o in outs])


def settle(llm: Any, deadline_s: float = 30.0) -> None:
    """Wait (bounded) until the in-process connector's pool calls and loads started so far are done (the workers'
    loads through ``collective_rpc`` when they run in their own processes: tensor-parallel engines)."""
    sched, worker = scheduler_connector(llm), worker_connector(llm)
    if sched is not None:
        sched.wait_idle(deadline_s)
    if worker is not None:
        worker.wait_loads(deadline_s)
    elif sched is not None and sched.tp_world > 1:
        from kvpool.connector.kv_connector import settle_worker

        llm.collective_rpc(settle_worker, args=(deadline_s,))


def settle_saves(llm: Any, deadline_s: float = 60.0) -> bool:
    """Wait (bounded) until the in-process connector's saves staged so far are written and committed (or failed):
    the saver runs in the background at a low priority and, beside an engine that keeps both cores busy, can lag
    its requests by seconds. False when the in-process saver is still busy at the deadline (workers in their own
    processes are waited for the same way, without an answer); True without the kvpool connector."""
    worker, sched = worker_connector(llm), scheduler_connector(llm)
    if worker is not None:
        return worker.wait_saves(deadline_s)
    if sched is not None and sched.tp_world > 1:  # the workers run in their own processes
        from kvpool.connector.kv_connector import worker_counters

        llm.collective_rpc(worker_counters, args=(deadline_s,))
    return True


def timed_request(llm: Any, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[int], int]:
    """(TTFT, tokens, cached prompt tokens) of one greedy request, stepping the engine here: TTFT = add_request →
    first output token; cached = what the engine reused (its own prefix cache plus what its connector loaded)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, sp)
    ttft = -1.0
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft < 0 and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            cached = max(cached, out.num_cached_tokens or 0)
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return ttft, tokens, cached


def reference_tokens(llm: Any, prompt: list[int], reused_tokens: int, max_tokens: int, request_id: str,
                     computed_by: list[int] | None = None) -> list[int]:
    """Plain vLLM's answer for the same compute split: ``llm`` (an engine without a connector, prefix caching on)
    gets the first ``reused_tokens`` of ``prompt`` into its own prefix cache — computed by a prefill of exactly
    those tokens, or of ``computed_by`` (the prompt that computed the reused blocks: a prefill of another length
    rounds bf16 differently) — then answers ``prompt``. Raises when its cache did not supply exactly that many
    (the comparison would not be for the same split)."""
    llm.reset_prefix_cache()
    if reused_tokens:
        timed_request(llm, computed_by or prompt[:reused_tokens], 1, request_id + "-prime")
    _, tokens, cached = timed_request(llm, prompt, max_tokens, request_id)
    if cached != reused_tokens:
        raise RuntimeError(f"reference reused {cached} tokens, not {reused_tokens}")
    return tokens


def scheduler_connector(llm: Any) -> Any:
    """The scheduler role of the in-process engine's kvpool connector (``SchedulerSide``) or None."""
    core = llm.llm_engine.engine_core.engine_core
    conn = core.scheduler.get_kv_connector()
    return getattr(conn, "scheduler_side", None)


def worker_connector(llm: Any) -> Any:
    """The worker role (``WorkerSide``) of the in-process engine's connector, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return getattr(get_kv_transfer_group(), "worker_side", None) if has_kv_transfer_group() else None


def connector_stats(llm: Any, *, settle_s: float = 30.0) -> dict[str, Any]:
    """Scheduler and worker counters of the in-process connector (plain dicts), read once the pool calls started
    so far (lookups, leases, releases) are done and the saves staged so far are written (at most ``settle_s`` each:
    both work in the background)."""
    import dataclasses

    sched, worker = scheduler_connector(llm), worker_connector(llm)
    out: dict[str, Any] = {}
    if sched is not None:
        sched.wait_idle(settle_s)
        out["scheduler"] = {k: v for k, v in dataclasses.asdict(sched.stats).items() if k != "history"}
        out["fingerprint"] = sched.fingerprint
        out["held_leases"] = sched.held_leases()
        out["scheduler_breaker"] = dataclasses.asdict(sched.shards.breaker.stats)
        out["save_book"] = dataclasses.asdict(sched.book.stats)
    if worker is None and sched is not None and sched.tp_world > 1:  # the workers run in their own processes
        from kvpool.connector.kv_connector import worker_counters

        ranks = [r for r in llm.collective_rpc(worker_counters, args=(settle_s,)) if r is not None]
        out["workers"] = sorted(ranks, key=lambda r: r["tp_rank"])
        out["worker"] = {k: sum(r[k] for r in ranks) for k in ranks[0] if k != "tp_rank"} if ranks else {}
    if worker is not None:
        worker.wait_saves(settle_s)
        out["worker"] = worker.stats_dict()
        out["worker_breaker"] = dataclasses.asdict(worker.shards.breaker.stats)
        if worker.saver_shards is not None:
            out["saver_breaker"] = dataclasses.asdict(worker.saver_shards.breaker.stats)
    return out


def close_llm(llm: Any) -> None:
    """Shut the engine down and release vLLM's process globals (KV connector, distributed env)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        release_engine_globals()


def release_engine_globals() -> None:
    """Drop vLLM's process-global KV connector and distributed state (after a close or a failed start)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


class EngineActorBody:
    """Ray actor body: one in-process engine in the actor's process (start with ``engine_actor(...)``)."""

    def __init__(self, spec: bytes, connector: bytes | None) -> None:
        engine_env()
        self.llm: Any = None
        self.reload(spec, connector)

    def reload(self, spec: bytes, connector: bytes | None) -> None:
        """Replace the engine (one process start serves several engines, one at a time)."""
        from kvpool.connector.config import ConnectorConfig

        if self.llm is not None:
            close_llm(self.llm)
            self.llm = None
        self.spec = msgspec.msgpack.decode(spec, type=EngineSpec)
        cfg = msgspec.msgpack.decode(connector, type=ConnectorConfig) if connector else None
        self.llm = make_llm(self.spec, cfg)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> bytes:
        return msgspec.msgpack.encode(generate(self.llm, prompts, max_tokens))

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def stats(self) -> dict[str, Any]:
        return connector_stats(self.llm)

    def close(self) -> None:
        if self.llm is not None:
            close_llm(self.llm)
            self.llm = None


def engine_actor(spec: EngineSpec, connector: Any | None, *, scheduling_strategy: Any,
                 env: dict[str, str] | None = None) -> Any:
    """Start an ``EngineActorBody`` actor (0 CPUs: the engine shares its node's core) with the engine env set."""
    import ray

    actor_cls = ray.remote(EngineActorBody)
    env_vars = {**ENGINE_ENV, **(env or {})}
    return actor_cls.options(
        num_cpus=0, scheduling_strategy=scheduling_strategy, runtime_env={"env_vars": env_vars}
    ).remote(msgspec.msgpack.encode(spec), msgspec.msgpack.encode(connector) if connector is not None else None)


def encode_args(spec: EngineSpec, connector: Any | None) -> tuple[bytes, bytes | None]:
    """Arguments of ``EngineActorBody.reload``."""
    return msgspec.msgpack.encode(spec), (msgspec.msgpack.encode(connector) if connector is not None else None)


def decode_result(raw: bytes) -> GenResult:
    return msgspec.msgpack.decode(raw, type=GenResult)
