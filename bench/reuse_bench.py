"""``kvstack bench reuse``: TTFT of a long prompt when recomputed, held in HBM, or fetched from the pool (DRAM, SSD).

What one run does (defaults: the ``heavy`` dense tiny model, 3072-token prompts, 3 repeats):
1. Builds the tiny model if needed, starts a local Ray cluster (head + 2 worker nodes on loopback) with a pool shard
   on each worker node (NIXL, DRAM + SSD), and an in-process vLLM engine (CPU build) with the kvpool connector in
   this process (the head node: every shard is another node's).
2. Per repeat, with a fresh random prompt P: (a) ``recompute``: HBM reset, P is prefilled (and its blocks saved to
   shard a, as in production); (b) ``hbm``: P again, served from the engine's own prefix cache; (c) ``fetch_dram``:
   HBM reset, P's prefix fetched from shard a's DRAM over NIXL; (d) ``fetch_ssd``: HBM reset, P's blocks demoted to
   shard a's SSD first, fetched (promoted) from there. TTFT = add_request → first token, measured by stepping the
   engine; every case also generates ``--max-tokens`` tokens, compared with the recompute case's.
3. Prices the same cases with the cost model (``router.cost.ttft``: this box's ``cpu-2core`` profile, tiers
   ``cpu-dram`` and ``local-ssd``, ``--mfu`` / ``--bw-util``) and says whether it predicted each winner (case vs
   recompute).

Output (``--json``): ``ttft_recompute_s``, ``ttft_hbm_s``, ``ttft_fetch_dram_s``, ``ttft_fetch_ssd_s`` (medians),
``recompute_over_*`` ratios, ``bytes_moved`` (median bytes read per fetch), ``token_identical`` (every case vs the
recompute case), ``prompts_compared`` / ``mismatches`` (every case vs plain vLLM — an engine without the connector,
run after the connector engine in this process — holding the prefix that case reused in its own prefix cache,
computed as the connector engine's was: by a prefill of the whole prompt), ``placement`` (the engine's threads and CPUs), ``cost_model``
(per case: predicted seconds, predicted / actual winner, ``predicted_winner_correct``), the raw repeats and the
setup. Run under the heavy lock: ``flock /tmp/kvstack-heavy.lock timeout 900 kvstack bench reuse --json``
(~2 min with the defaults on a 2-core box).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cluster.cli_output import print_document

REPO = Path(__file__).resolve().parents[1]
CASES = ("recompute", "hbm", "fetch_dram", "fetch_ssd")
TIER_OF = {"fetch_dram": "cpu-dram", "fetch_ssd": "local-ssd"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3-next"])
    parser.add_argument("--preset", default="heavy", choices=["tiny", "heavy"])
    parser.add_argument("--model-dir", default="", help="model directory (default .kvstack/models/<arch>-<preset>)")
    parser.add_argument("--tokens", type=int, default=3072, help="prompt length")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (identity check)")
    parser.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    parser.add_argument("--gpu", default="cpu-2core", help="GPU profile (configs/specs/gpus.yaml) for the cost model")
    parser.add_argument("--mfu", type=float, default=0.5)
    parser.add_argument("--bw-util", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON result")
    parser.add_argument("--out", default="", help="also write the JSON result to this file")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 256 or args.reps < 1 or args.max_tokens < 1:
        print("error: need --tokens >= 256, --reps >= 1, --max-tokens >= 1", file=sys.stderr)
        return 2
    try:
        result = measure(args)
    except Exception as exc:  # noqa: BLE001 - report, exit 1
        print(f"kvstack bench reuse: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        print_document(text)
    else:
        print(table(result))
    return 0


def linear_state_bytes(spec: Any) -> int:
    """Bytes of one sequence's gated-delta-net state over all linear layers (bf16 conv tail + bf16 recurrent state,
    as vLLM's CPU build keeps them); 0 for dense models."""
    linear = spec.layer_types().count("linear_attention")
    conv_dim = 2 * spec.linear_key_heads * spec.linear_key_head_dim + spec.linear_value_heads * spec.linear_value_head_dim
    per_layer = (spec.conv_kernel - 1) * conv_dim * 2 + spec.linear_value_heads * spec.linear_key_head_dim * \
        spec.linear_value_head_dim * 2
    return linear * per_layer


def pool_slot_bytes(spec: Any, block: int) -> int:
    """One pool slot: a block of every full-attention layer, or a hybrid's state snapshot, whichever is larger."""
    full = spec.layer_types().count("full_attention")
    return max(full * 2 * spec.kv_heads * block * spec.head_dim * 2, linear_state_bytes(spec))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench.inproc import (EngineSpec, close_llm, connector_stats, engine_env, make_llm, placement,
                              reference_tokens, timed_request)
    from cluster.local_cluster import LocalCluster
    from cluster.tiny_models import make_tiny, preset_spec
    from kvpool.connector.config import ConnectorConfig, ShardRef
    from kvpool.keys import Namespace, block_keys
    from kvpool.shard.placement import PoolNode, build_pool, stop_shards
    from kvpool.shard.registry import shard_actor_name
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig

    engine_env()
    spec = preset_spec(args.arch, args.preset)
    model_dir = args.model_dir or str(REPO / ".kvstack" / "models" / f"tiny-{args.arch}-{args.preset}")
    marker = Path(model_dir) / "kvstack_tiny.json"
    make_tiny(spec, model_dir, force=marker.exists() and spec.digest() not in marker.read_text())
    block = 128
    slot = pool_slot_bytes(spec, block)
    n_blocks = args.tokens // block + 2
    cluster = LocalCluster(workers=2, cpus_per_worker=1).start()
    ssd_root = tempfile.mkdtemp(prefix="kvs-reuse-ssd-")
    handles: list[Any] = []
    llm = None
    try:
        names = {n.node_id: f"n{i}" for i, n in enumerate(cluster.worker_nodes)}

        def shard_config(node: PoolNode) -> ShardConfig:
            store = StoreConfig(slot_bytes=slot, dram_slots=4 * n_blocks * args.reps + 16,
                                ssd_dir=f"{ssd_root}/{names[node.node_id]}", ssd_slots=4 * n_blocks * args.reps + 16)
            return ShardConfig(shard_id=names[node.node_id], store=store, backend=args.backend)

        handles = build_pool(shard_config, nodes=names, ready_deadline_s=120.0)
        by_id = {h.shard_id: h for h in handles}
        source = by_id["n0"]
        refs = [ShardRef(h.shard_id, shard_actor_name(h.node_id), h.node_id) for h in handles]
        model_id = f"reuse-bench-{spec.digest()}"
        conn = ConnectorConfig(shards=refs, local_shard="n0", model_id=model_id, backend=args.backend)
        espec = EngineSpec(model=model_dir, kv_cache_bytes=max(64 << 20, 3 * n_blocks * slot),
                           max_model_len=args.tokens + args.max_tokens + 256,
                           max_num_batched_tokens=max(8192, args.tokens + 256))
        llm = make_llm(espec, conn)
        rng = random.Random(args.seed)
        client = source.client(deadline_s=60.0)
        reps: list[dict[str, Any]] = []
        for i in range(args.reps):
            prompt = [rng.randrange(10, spec.vocab - 10) for _ in range(args.tokens)]
            rep: dict[str, Any] = {}
            for case in CASES:
                if case != "hbm":
                    llm.reset_prefix_cache()
                if case == "fetch_ssd":
                    fp = connector_stats(llm)["fingerprint"]
                    keys = block_keys(Namespace(model_id, fp), prompt, block)
                    rep["demoted_blocks"] = client.demote(keys)
                before = connector_stats(llm)
                ttft, tokens, cached = timed_request(llm, prompt, args.max_tokens, f"{case}-{i}")
                after = connector_stats(llm)
                w0, w1 = before["worker"], after["worker"]
                s0, s1 = before["scheduler"], after["scheduler"]
                rep[case] = {
                    "ttft_s": ttft,
                    "tokens": tokens,
                    "bytes_read": w1["bytes_read"] - w0["bytes_read"],
                    "read_s": w1["read_seconds"] - w0["read_seconds"],
                    "bytes_written": w1["bytes_written"] - w0["bytes_written"],
                    "write_s": w1["write_seconds"] - w0["write_seconds"],
                    "hit_tokens": s1["hit_tokens"] - s0["hit_tokens"],
                    "reused_tokens": cached,
                    "prompt": prompt,
                    "load_failures": w1["load_failures"] - w0["load_failures"],
                }
            reps.append(rep)
        stats = {**connector_stats(llm), "placement": placement()}
        close_llm(llm)
        llm = None
        # The oracle: plain vLLM (no connector) on the same engine settings, in this same process and thread
        # placement, holding exactly the prefix each case reused in its own prefix cache.
        llm = make_llm(espec)
        for i, rep in enumerate(reps):
            for case in CASES:
                # the reused blocks were computed by the recompute case's prefill of the whole prompt
                rep[case]["reference_tokens"] = reference_tokens(llm, rep[case]["prompt"], rep[case]["reused_tokens"],
                                                                 args.max_tokens, f"ref-{case}-{i}",
                                                                 computed_by=rep[case]["prompt"])
    finally:
        if llm is not None:
            close_llm(llm)
        if handles:
            stop_shards(handles)
        cluster.shutdown()
        import shutil

        shutil.rmtree(ssd_root, ignore_errors=True)
    return summarize(args, spec, model_dir, reps, stats)


def summarize(args: argparse.Namespace, spec: Any, model_dir: str, reps: list[dict[str, Any]],
              stats: dict[str, Any]) -> dict[str, Any]:
    from configs import load_gpus, load_tiers
    from router.cost import Hardware, ttft

    med = {c: statistics.median(r[c]["ttft_s"] for r in reps) for c in CASES}
    fetched = [r[c]["bytes_read"] for r in reps for c in ("fetch_dram", "fetch_ssd")]
    identical = all(r[c]["tokens"] == r["recompute"]["tokens"] for r in reps for c in CASES)
    mismatches = [{"repeat": i, "case": c, "reused_tokens": r[c]["reused_tokens"]}
                  for i, r in enumerate(reps) for c in CASES if r[c]["tokens"] != r[c]["reference_tokens"]]
    cached = statistics.median(r["fetch_dram"]["hit_tokens"] for r in reps)
    from configs.hf_model import model_spec

    model = model_spec(model_dir, f"tiny-{args.arch}-{args.preset}").model_copy(
        update={"linear_state_bytes_per_seq": linear_state_bytes(spec)})
    hw = Hardware(model=model, gpu=load_gpus()[args.gpu], mfu=args.mfu, bw_util=args.bw_util)
    tiers = load_tiers()
    predicted = {"recompute": ttft(hw, prompt_tokens=args.tokens), "hbm": ttft(hw, prompt_tokens=args.tokens,
                                                                               cached_tokens=cached)}
    for case, tier in TIER_OF.items():
        predicted[case] = ttft(hw, prompt_tokens=args.tokens, cached_tokens=cached, tier=tiers[tier])
    cost: dict[str, Any] = {}
    for case in ("hbm", "fetch_dram", "fetch_ssd"):
        pw = case if predicted[case] < predicted["recompute"] else "recompute"
        aw = case if med[case] < med["recompute"] else "recompute"
        cost[case] = {"predicted_s": predicted[case], "predicted_recompute_s": predicted["recompute"],
                      "tier": TIER_OF.get(case, "hbm"), "predicted_winner": pw, "actual_winner": aw,
                      "predicted_winner_correct": pw == aw}
    return {
        "ttft_recompute_s": med["recompute"],
        "ttft_hbm_s": med["hbm"],
        "ttft_fetch_dram_s": med["fetch_dram"],
        "ttft_fetch_ssd_s": med["fetch_ssd"],
        "recompute_over_hbm": med["recompute"] / med["hbm"],
        "recompute_over_fetch_dram": med["recompute"] / med["fetch_dram"],
        "recompute_over_fetch_ssd": med["recompute"] / med["fetch_ssd"],
        "bytes_moved": statistics.median(fetched),
        "save_s": statistics.median(r["recompute"]["write_s"] for r in reps),
        "token_identical": identical,
        "prompts_compared": len(reps) * len(CASES),  # against plain vLLM holding the same reused prefix
        "mismatches": len(mismatches),
        "mismatched": mismatches,
        "placement": {"engine": stats.get("placement")},
        "load_failures": sum(r[c]["load_failures"] for r in reps for c in CASES),
        "cost_model": cost,
        "setup": {"arch": args.arch, "preset": args.preset, "model_dir": model_dir, "prompt_tokens": args.tokens,
                  "cached_tokens": cached, "reps": args.reps, "max_tokens": args.max_tokens, "backend": args.backend,
                  "gpu_profile": args.gpu, "mfu": args.mfu, "bw_util": args.bw_util, "model_params": model.params,
                  "layout_fingerprint": stats.get("fingerprint")},
        "repeats": [{c: {k: v for k, v in r[c].items() if k not in ("tokens", "reference_tokens", "prompt")}
                     for c in CASES} for r in reps],
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'case':<12} {'TTFT s':>9} {'recompute/x':>12}  cost model"]
    for case, key in (("recompute", "ttft_recompute_s"), ("hbm", "ttft_hbm_s"), ("fetch_dram", "ttft_fetch_dram_s"),
                      ("fetch_ssd", "ttft_fetch_ssd_s")):
        ratio = result["ttft_recompute_s"] / result[key]
        cm = result["cost_model"].get(case)
        note = "" if cm is None else (f"predicted {cm['predicted_s']:.3f}s, winner "
                                      f"{'ok' if cm['predicted_winner_correct'] else 'WRONG'}")
        lines.append(f"{case:<12} {result[key]:>9.3f} {ratio:>12.1f}  {note}")
    lines.append(f"bytes moved per fetch {result['bytes_moved']:.0f}; token identical: {result['token_identical']}; "
                 f"vs plain vLLM (same reused prefix): {result['prompts_compared']} prompts, "
                 f"{result['mismatches']} mismatches")
    return "\n".join(lines)
