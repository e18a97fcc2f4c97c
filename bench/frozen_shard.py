"""``kvstack bench frozen-shard``: the engine's step time and its outputs while a pool shard is frozen (SIGSTOP).

What one run does (defaults: the dense ``tiny`` model, phases of 12 requests, one at a time):
1. Builds the tiny model if needed, starts a local Ray cluster (head + 2 worker nodes on loopback) with a pool shard
   on each worker node (NIXL, DRAM + SSD) and an in-process vLLM engine (CPU build) with the kvpool connector,
   saving to shard ``n0`` and looking up both.
2. ``freeze_experiment``: a stream of requests whose prompts share system prefixes (``in_flight`` at a time, the
   engine stepped here, every ``engine.step()`` that ran the model timed; a step that ran nothing sleeps 1 ms, as
   vLLM's engine-core loop does, and is counted in ``idle_steps``). Phase ``healthy``: the prefixes are computed
   and saved to ``n0`` (the saves settled first: ``warm_saves_settled``; the saver runs at a low priority and,
   beside an engine that keeps the cores busy, can lag by seconds), then fetched back; phase ``healthy_miss``: as
   many requests with prefixes of their own (pool misses: the same work as the frozen phase's, the step-time
   reference). Phase ``frozen``: ``n0`` — the shard that holds every saved block and receives every save — is
   SIGSTOPped; the same prefixes come again: lookups and leases on it time out, its breaker opens, saves to it
   fail; the engine must keep stepping at its healthy pace and every request must complete. Phase ``thawed``:
   SIGCONT, then one request at a time until the pool supplies a prefix again (``recovery_s``: from SIGCONT to
   that request's end; bounded by the breaker's backoff).
3. Plain vLLM (no connector) answers every prompt for the same compute split (``wrong_outputs``: the engine under
   test runs with vLLM's prefix caching off, so the pool is its only reuse); each request's greedy tokens must
   equal it.

Output (``--json``): per phase ``step_s`` (p50 / p99 / max / count), ``request_s`` (p50 / max), ``requests``,
``pool_hit_requests``; ``step_p50_ratio`` / ``step_p99_ratio`` (frozen over healthy_miss: goal ≤ 1.2),
``wrong_outputs`` (must be 0; null with ``--in-flight`` > 1), ``recovery_s``, ``warm_saves_settled``, the
connector's counters over the frozen phase (lookup failures, breaker trips, loads skipped, save failures). The fault
suite (``tests/faults/test_frozen_shard.py``) runs ``freeze_experiment`` on its own cluster. Run under the heavy
lock: ``flock /tmp/kvstack-heavy.lock timeout 900 kvstack bench frozen-shard --json`` (~3 min on a 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.cli_output import print_document

REPO = Path(__file__).resolve().parents[1]
BLOCK = 128
RECOVERY_TIMEOUT_S = 150.0  # the breaker's longest backoff (60 s) and a probe, with room


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=12, help="requests per phase")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="requests at once (>1: outputs are not compared — vLLM's CPU kernels are not "
                             "batch-invariant, and the references run one request at a time)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=3, help="distinct shared system prefixes")
    parser.add_argument("--prefix-blocks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON result")
    parser.add_argument("--out", default="", help="also write the JSON result to this file")


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        print_document(text)
    else:
        print(f"step p50 frozen/healthy {result['step_p50_ratio']:.2f}, p99 {result['step_p99_ratio']:.2f}; "
              f"wrong outputs {result['wrong_outputs']}; recovery {result['recovery_s']:.1f} s", file=sys.stderr)
    return 0 if not result["wrong_outputs"] else 1


def make_prompts(n: int, *, prefixes: int, prefix_blocks: int, seed: int, tag: str, fresh: bool = False,
                 vocab: int = 4000) -> list[list[int]]:
    """``n`` prompts over ``prefixes`` shared system prefixes (``prefix_blocks`` full blocks + a few tokens) and a
    tail of their own: the same seed gives the same prefixes (the phases share them), ``tag`` other tails;
    ``fresh``: prefixes of their own (nothing to reuse, the same lengths)."""
    rng = random.Random(f"{seed}-{tag}" if fresh else seed)
    systems = [[rng.randrange(10, vocab) for _ in range(prefix_blocks * BLOCK + 17)] for _ in range(prefixes)]
    tails = random.Random(f"{seed}-{tag}")
    return [systems[i % prefixes] + [tails.randrange(10, vocab) for _ in range(tails.randint(20, 150))]
            for i in range(n)]


@dataclass
class Stream:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # vLLM's num_cached_tokens (what was promised)
    reused: dict[str, int] = field(default_factory=dict)  # tokens the pool supplied (the connector's timing)
    request_s: dict[str, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)  # steps that ran the model (produced outputs)
    idle_steps: int = 0  # steps that ran nothing


def stream(llm: Any, prompts: dict[str, list[int]], max_tokens: int, in_flight: int,
           deadline_s: float = 600.0) -> Stream:
    """Run ``prompts`` (request id → tokens) with at most ``in_flight`` at once, stepping the engine here."""
    from vllm import SamplingParams

    from kvpool.connector.timing import from_params

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = list(prompts.items())
    started: dict[str, float] = {}
    out = Stream()
    end = time.monotonic() + deadline_s
    while todo or engine.has_unfinished_requests():
        while todo and len(started) - len(out.request_s) < in_flight:
            rid, prompt = todo.pop(0)
            started[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        t0 = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - t0
        if outs:
            out.step_s.append(took)
        else:  # nothing ran (every request waits on the pool): yield as vLLM's engine-core loop does
            out.idle_steps += 1
            time.sleep(0.001)
        for o in outs:
            out.cached[o.request_id] = max(out.cached.get(o.request_id, 0), o.num_cached_tokens or 0)
            if o.finished:
                timing = from_params(o.kv_transfer_params)
                out.reused[o.request_id] = timing.loaded_tokens if timing is not None else 0
                out.tokens[o.request_id] = list(o.outputs[0].token_ids)
                out.request_s[o.request_id] = time.perf_counter() - started[o.request_id]
        if time.monotonic() > end:
            raise RuntimeError(f"requests still unfinished after {deadline_s} s: {sorted(set(started) - set(out.tokens))}")
    return out


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    return {"p50": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1],
            "count": len(xs)}


def _phase(s: Stream) -> dict[str, Any]:
    return {"step_s": _quantiles(s.step_s), "idle_steps": s.idle_steps, "request_s": _quantiles(list(s.request_s.values())),
            "requests": len(s.tokens), "pool_hit_requests": sum(1 for c in s.reused.values() if c > 0)}


def _counters(llm: Any) -> dict[str, int]:
    from bench.inproc import connector_stats

    stats = connector_stats(llm, settle_s=60.0)
    sched, worker = stats.get("scheduler", {}), stats.get("worker", {})
    keys = ("lookups", "lookup_failures", "lookups_not_yet", "leases_taken", "leases_failed", "hit_tokens")
    out = {k: int(sched.get(k, 0)) for k in keys}
    out.update({k: int(worker.get(k, 0)) for k in ("load_failures", "loads_skipped", "save_failures",
                                                   "blocks_dropped", "blocks_committed")})
    for role in ("scheduler_breaker", "worker_breaker", "saver_breaker"):
        out.update({f"{role}_{k}": int(v) for k, v in stats.get(role, {}).items()})
    return out


def freeze_experiment(llm: Any, shard_pid: int, *, requests: int, in_flight: int, max_tokens: int,
                      prefixes: int, prefix_blocks: int, seed: int) -> dict[str, Any]:
    """The three phases on ``llm`` (an in-process engine with the kvpool connector and vLLM's prefix caching off —
    the pool is its only reuse, so every request's compute split is known — saving to the shard whose process is
    ``shard_pid``). Returns the measurements and every request's prompt, tokens, pool-reused tokens and the
    prompt that computed them (``outputs``), for ``wrong_outputs``."""
    phases: dict[str, Stream] = {}
    prompts: dict[str, list[int]] = {}

    def run_phase(name: str, n: int, fresh: bool = False) -> Stream:
        made = make_prompts(n, prefixes=n if fresh else prefixes, prefix_blocks=prefix_blocks, seed=seed, tag=name,
                            fresh=fresh)
        batch = {f"{name}-{i}": p for i, p in enumerate(made)}
        prompts.update(batch)
        return stream(llm, batch, max_tokens, in_flight)

    # healthy: compute and save the prefixes, fetch them back from the pool; then as many requests with prefixes
    # of their own (misses: the same work as the frozen phase's recomputes, the step-time reference)
    from bench.inproc import settle_saves

    warm = run_phase("warm", prefixes)
    warm_saved = settle_saves(llm)  # the prefixes in the pool before they are asked for again
    phases["healthy"] = run_phase("healthy", requests)
    phases["healthy_miss"] = run_phase("healthy_miss", requests, fresh=True)
    before = _counters(llm)
    os.kill(shard_pid, signal.SIGSTOP)
    try:
        phases["frozen"] = run_phase("frozen", requests)
    finally:
        os.kill(shard_pid, signal.SIGCONT)
    thawed_at = time.perf_counter()
    recovery_s = -1.0
    thawed = Stream()
    attempt = 0
    while time.perf_counter() - thawed_at < RECOVERY_TIMEOUT_S:
        s = run_phase(f"thawed{attempt}", 1)
        attempt += 1
        thawed.step_s += s.step_s
        thawed.idle_steps += s.idle_steps
        thawed.tokens.update(s.tokens)
        thawed.cached.update(s.cached)
        thawed.reused.update(s.reused)
        thawed.request_s.update(s.request_s)
        if any(c > 0 for c in s.reused.values()):
            recovery_s = time.perf_counter() - thawed_at
            break
        time.sleep(0.5)
    phases["thawed"] = thawed
    after = _counters(llm)
    healthy, frozen = phases["healthy_miss"].step_s, phases["frozen"].step_s
    warm_prompts = [prompts[f"warm-{j}"] for j in range(prefixes)]
    outputs = {rid: {"prompt": prompts[rid], "tokens": toks, "reused": s.reused.get(rid, 0),
                     "computed_by": warm_prompts[int(rid.rsplit("-", 1)[1]) % prefixes]}  # when cached
               for s in (warm, *phases.values()) for rid, toks in s.tokens.items()}
    return {
        "phases": {name: _phase(s) for name, s in phases.items()},
        "step_p50_ratio": statistics.median(frozen) / max(1e-9, statistics.median(healthy)),
        "step_p99_ratio": _quantiles(frozen)["p99"] / max(1e-9, _quantiles(healthy)["p99"]),
        "recovery_s": recovery_s,
        "warm_saves_settled": warm_saved,
        "frozen_counters": {k: after[k] - before.get(k, 0) for k in after},
        "outputs": outputs,
    }


def wrong_outputs(llm: Any, outputs: dict[str, dict[str, Any]], max_tokens: int) -> list[str]:
    """Request ids whose tokens differ from plain vLLM's for the same compute split: ``llm`` (no connector, prefix
    caching on) holds the prefix the request reused from the pool (``reused``: the tokens its load supplied — vLLM's
    ``num_cached_tokens`` also counts promised blocks that failed to load and were recomputed) in its own prefix
    cache, computed as the pool's blocks were (by a prefill of ``computed_by``, the prompt that computed them, cut
    to the reused length), then answers the prompt (``bench.inproc.reference_tokens``)."""
    from bench.inproc import reference_tokens

    wrong: list[str] = []
    for rid, o in outputs.items():
        computed_by = o["computed_by"][: o["reused"]] if o["reused"] else None
        ref = reference_tokens(llm, o["prompt"], o["reused"], max_tokens, f"ref-{rid}", computed_by=computed_by)
        if o["tokens"] != ref:
            wrong.append(rid)
    return wrong


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from bench.inproc import EngineSpec, close_llm, engine_env, make_llm, placement
    from cluster.local_cluster import LocalCluster
    from cluster.tiny_models import make_tiny, preset_spec
    from kvpool.connector.config import ConnectorConfig, ShardRef
    from kvpool.shard.placement import PoolNode, build_pool, stop_shards
    from kvpool.shard.registry import shard_actor_name
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig

    engine_env()
    spec = preset_spec("qwen3", "tiny")
    model_dir = str(REPO / ".kvstack" / "models" / "tiny-qwen3")
    marker = Path(model_dir) / "kvstack_tiny.json"
    make_tiny(spec, model_dir, force=marker.exists() and spec.digest() not in marker.read_text())
    cluster = LocalCluster(workers=2, cpus_per_worker=1).start()
    ssd_root = tempfile.mkdtemp(prefix="kvs-frozen-ssd-")
    handles: list[Any] = []
    llm = None
    try:
        names = {n.node_id: f"n{i}" for i, n in enumerate(cluster.worker_nodes)}

        def shard_config(node: PoolNode) -> ShardConfig:
            store = StoreConfig(slot_bytes=256 * 1024, dram_slots=256, ssd_dir=f"{ssd_root}/{names[node.node_id]}",
                                ssd_slots=256)
            return ShardConfig(shard_id=names[node.node_id], store=store, backend="nixl")

        handles = build_pool(shard_config, nodes=names, ready_deadline_s=120.0)
        by_id = {h.shard_id: h for h in handles}
        refs = [ShardRef(h.shard_id, shard_actor_name(h.node_id), h.node_id) for h in handles]
        conn = ConnectorConfig(shards=refs, local_shard="n0", model_id=f"frozen-bench-{spec.digest()}")
        espec = EngineSpec(model=model_dir, max_model_len=2048, prefix_caching=False)
        pid = ray.get(by_id["n0"].actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
        llm = make_llm(espec, conn)
        result = freeze_experiment(llm, pid, requests=args.requests, in_flight=args.in_flight,
                                   max_tokens=args.max_tokens, prefixes=args.prefixes,
                                   prefix_blocks=args.prefix_blocks, seed=args.seed)
        close_llm(llm)
        llm = make_llm(EngineSpec(model=model_dir, max_model_len=2048))
        compared = args.in_flight == 1
        result["wrong_outputs"] = len(wrong_outputs(llm, result["outputs"], args.max_tokens)) if compared else None
        result["requests"] = len(result.pop("outputs"))
        result["placement"] = placement()
        result["setup"] = vars(args) | {"model": model_dir, "frozen_shard": "n0", "lookup_deadline_s":
                                        conn.lookup_deadline_s, "lease_deadline_s": conn.lease_deadline_s}
    finally:
        if llm is not None:
            close_llm(llm)
        if handles:
            stop_shards(handles)
        cluster.shutdown()
        import shutil

        shutil.rmtree(ssd_root, ignore_errors=True)
    return result
