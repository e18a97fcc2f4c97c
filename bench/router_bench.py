"""``kvstack bench router``: decision latency of the ``cost_based`` policy, with the key hashing measured apart.

For every (replicas, indexed blocks, prompt tokens) cell: a ``PrefixIndex`` holding that many block keys (random
filler spread over every replica's HBM and every shard's DRAM / SSD, plus the prompts' own prefixes: one replica
holds half of each prompt in HBM, a shard on another node three quarters in DRAM, a third node all of it on SSD),
then ``iters`` decisions, each timed in two parts:
    lookup = ``PrefixIndex.snapshot`` (longest-prefix walk + the ClusterSnapshot for the policy)
    rank   = ``PolicyRunner.decide`` (cost_based over every replica, tie-break, the DecisionRecord)
    decision = lookup + rank
and, per prompt size, ``hash_us``: ``kvpool.keys.block_keys`` over the prompt's token ids (reported apart: the
ingress hashes once per request). Each decision is acknowledged at once (steady state: no in-flight
assignments piling up in the runner). The GC is frozen after the index is built, as a long-running router would
after warm-up, so a full collection does not walk a million keys inside a decision.

Every row also carries ``cpu_ref_us`` (best-of time of ``sum(range(1000))`` on this machine, ~7 µs on a modern
desktop core) so runs on different or shared machines can be compared.

Output: a JSON list of rows (``replicas``, ``indexed_blocks``, ``prompt_tokens``, ``decision_p50_us``,
``decision_p99_us``, ``hash_us`` and the lookup / rank split) to stdout with ``--json`` (or ``--out FILE``),
else a table. Run it under the heavy lock: ``flock /tmp/kvstack-heavy.lock kvstack bench router --json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import timeit
from collections import Counter
from collections.abc import Sequence
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rows as JSON to stdout")
    parser.add_argument("--out", help="also write the JSON rows to this file")
    parser.add_argument("--replicas", default="8,64,512", help="comma-separated replica counts (default 8,64,512)")
    parser.add_argument("--blocks", default="1e4,1e5,1e6", help="indexed block counts (default 1e4,1e5,1e6)")
    parser.add_argument("--prompts", default="1024,8192,32768,131072", help="prompt lengths in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM default 16)")
    parser.add_argument("--replicas-per-node", type=int, default=4)
    parser.add_argument("--iters", type=int, default=200, help="timed decisions per cell")
    parser.add_argument("--model", default="qwen3-14b")
    parser.add_argument("--gpu", default="h100-sxm5-80gb")
    parser.add_argument("--seed", type=int, default=0)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise SystemExit(f"--{what}: need positive numbers, got {text!r}")
    return values


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from configs.loader import load_gpus, load_models, load_tiers, pick
    from kvpool.keys import Namespace, block_keys
    from router.cost import Hardware
    from router.events import REPLICA_EVENTS_VERSION, ReplicaBlockEvent, ReplicaEventBatch, ReplicaEventKind
    from router.index import PrefixIndex
    from router.policies.base import ReplicaState, RouteRequest
    from kvpool.events import EVENTS_WIRE_VERSION, BlockEvent, EventBatch, EventKind, Tier
    from router.policies.pricing import TierMap
    from router.policies.runner import PolicyRunner, make_policy

    replica_counts = _ints(args.replicas, "replicas")
    block_counts = sorted(_ints(args.blocks, "blocks"))
    prompt_sizes = _ints(args.prompts, "prompts")
    bs = args.block_size
    if bs <= 0 or args.iters <= 0 or args.replicas_per_node <= 0:
        raise SystemExit("--block-size, --iters and --replicas-per-node must be positive")
    hw = Hardware(
        model=pick("model", load_models(), args.model), gpu=pick("gpu", load_gpus(), args.gpu), mfu=0.5, bw_util=0.8
    )
    tier_map = TierMap.from_tiers(load_tiers())
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    ns = Namespace(args.model, "bench-layout")
    started = time.perf_counter()

    # Prompts: a few per size, hashed once (hash_us), reused in every cell.
    prompts: dict[int, list[list[bytes]]] = {}
    hash_us: dict[int, float] = {}
    for size in prompt_sizes:
        variants, times = [], []
        for _ in range(2):
            tokens = nprng.integers(0, 150_000, size=size, dtype=np.uint32)
            t0 = time.perf_counter_ns()
            keys = block_keys(ns, tokens, bs)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            variants.append(keys)
        prompts[size] = variants
        hash_us[size] = statistics.median(times)

    # This machine's speed, to compare runs across machines: best-of time of sum(range(1000)) (~7 µs on a
    # modern desktop core with CPython 3.11; more on a shared VM).
    cpu_ref_us = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    rows: list[dict[str, Any]] = []
    for n_rep in replica_counts:
        n_nodes = max(2, -(-n_rep // args.replicas_per_node))
        replicas = [
            ReplicaState(f"r{i}", f"node-{i // args.replicas_per_node}", rng.randint(0, 8), rng.randint(0, 4),
                         rng.uniform(0.0, 0.2), 0, hw)
            for i in range(n_rep)
        ]
        shards = [(f"s{j}", f"node-{j}") for j in range(n_nodes)]
        clock_t = [0.0]
        index = PrefixIndex(ttl_s=1e9, clock=lambda: clock_t[0])
        seqs: dict[str, int] = {}

        def hbm_store(replica: ReplicaState, keys: list[bytes]) -> None:
            after = seqs.get(replica.replica_id, 0)
            ev = ReplicaBlockEvent(after + 1, ReplicaEventKind.STORED, keys)
            index.apply_replica_batch(ReplicaEventBatch(REPLICA_EVENTS_VERSION, replica.replica_id, replica.node_id,
                                                        "e", after, after + 1, [ev]))
            seqs[replica.replica_id] = after + 1

        def pool_store(shard: str, node: str, keys: list[bytes], tier: Tier) -> None:
            after = seqs.get(shard, 0)
            evs = [BlockEvent(after + i + 1, EventKind.STORED, k, tier) for i, k in enumerate(keys)]
            index.apply_shard_batch(EventBatch(EVENTS_WIRE_VERSION, shard, "e", after, after + len(evs), evs), node)
            seqs[shard] = after + len(evs)

        # The prompts' prefixes: half in one replica's HBM, 3/4 in a remote shard's DRAM, all on a third's SSD.
        for size, variants in prompts.items():
            for v, keys in enumerate(variants):
                holder = replicas[(v * 7 + size) % n_rep]
                hbm_store(holder, keys[: len(keys) // 2])
                s_dram = shards[(int(holder.node_id.split("-")[1]) + 1) % n_nodes]
                pool_store(s_dram[0], s_dram[1], keys[: 3 * len(keys) // 4], Tier.DRAM)
                s_ssd = shards[(int(holder.node_id.split("-")[1]) + 2) % n_nodes]
                pool_store(s_ssd[0], s_ssd[1], keys, Tier.SSD)

        policy = make_policy("cost_based", rng=random.Random(args.seed), tier_map=tier_map)
        runner = PolicyRunner(policy, rng=random.Random(args.seed + 1), clock=lambda: clock_t[0])
        for target in block_counts:
            # Filler: random keys, each held by one random holder, in one batch per holder.
            missing = target - len(index)
            if missing > 0:
                by_holder: dict[int, list[bytes]] = {}
                n_holders = n_rep + 2 * n_nodes
                for _ in range(missing):
                    by_holder.setdefault(rng.randrange(n_holders), []).append(rng.randbytes(16))
                for h, keys in by_holder.items():
                    if h < n_rep:
                        hbm_store(replicas[h], keys)
                    else:
                        sid, node = shards[(h - n_rep) // 2]
                        pool_store(sid, node, keys, Tier.DRAM if h % 2 else Tier.SSD)
            gc.collect()
            gc.freeze()
            for size in prompt_sizes:
                lookup, rank, total = [], [], []
                actions: Counter[str] = Counter()
                matched = 0
                requests = [RouteRequest(f"q{size}-{v}", size, bs, keys) for v, keys in enumerate(prompts[size])]
                for i in range(args.iters + 20):
                    req = requests[i % len(requests)]
                    t0 = time.perf_counter_ns()
                    snap = index.snapshot(req, replicas)
                    t1 = time.perf_counter_ns()
                    rec = runner.decide(req, snap)
                    t2 = time.perf_counter_ns()
                    runner.acknowledge(req.request_id)
                    if i < 20:
                        continue  # warm-up
                    lookup.append((t1 - t0) / 1e3)
                    rank.append((t2 - t1) / 1e3)
                    total.append((t2 - t0) / 1e3)
                    actions[str(rec.action)] += 1
                    matched = max(matched, max((h.prefix_blocks for h in snap.pool_hits), default=0))
                row = {
                    "replicas": n_rep,
                    "indexed_blocks": len(index),
                    "prompt_tokens": size,
                    "block_size": bs,
                    "decision_p50_us": round(_pct(total, 0.5), 1),
                    "decision_p99_us": round(_pct(total, 0.99), 1),
                    "lookup_p50_us": round(_pct(lookup, 0.5), 1),
                    "lookup_p99_us": round(_pct(lookup, 0.99), 1),
                    "rank_p50_us": round(_pct(rank, 0.5), 1),
                    "rank_p99_us": round(_pct(rank, 0.99), 1),
                    "hash_us": round(hash_us[size], 1),
                    "matched_blocks": matched,
                    "actions": dict(actions),
                    "cpu_ref_us": round(cpu_ref_us, 1),
                }
                rows.append(row)
                if not args.json:
                    print(
                        f"replicas {n_rep:4d}  blocks {row['indexed_blocks']:8d}  prompt {size:6d}  "
                        f"decision p50 {row['decision_p50_us']:8.1f} p99 {row['decision_p99_us']:8.1f} us  "
                        f"(lookup p50 {row['lookup_p50_us']:7.1f}, rank p50 {row['rank_p50_us']:7.1f})  "
                        f"hash {row['hash_us']:9.1f} us  {dict(actions)}",
                        file=sys.stderr,
                    )
            gc.unfreeze()
        del index, runner
        gc.collect()

    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    print(f"router bench: {len(rows)} rows in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0
