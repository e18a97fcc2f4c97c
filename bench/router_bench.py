"""``kvstack bench router``: decision latency of the ``cost_based`` policy, with the key hashing measured apart.

For every (replicas, indexed blocks, prompt tokens) cell: a ``PrefixIndex`` holding that many block keys (random
filler spread over every replica's HBM and every shard's DRAM / SSD, plus the prompts' own prefixes: one replica
holds half of each prompt in HBM, a shard on another node three quarters in DRAM, a third node all of it on SSD),
then ``iters`` decisions, each timed in two parts:
    lookup = ``ReplicaBook.view`` (the replica list and columns the live router keeps) + ``PrefixIndex.snapshot``
             (longest-prefix walk + the ClusterSnapshot for the policy)
    rank   = ``PolicyRunner.decide`` (cost_based over every replica, tie-break, the DecisionRecord)
    decision = lookup + rank
each both in wall-clock time (``decision_p50_us`` ...: what a caller waits, including time the OS gave the core
to someone else — on a shared machine that dominates p99) and in this thread's CPU time (``decision_cpu_*``: the
cost of the code itself, what a dedicated router core would wait). The prompts repeat, so after the first decision
the index has learned their chains and a lookup reads them at O(log length) positions (``router.index``, "Learned
chains"); ``lookup_cold_*`` times the first lookup of a prompt instead (the index forgets what it learned before
each of those samples: a full walk plus learning, what a prefix nobody asked for before costs once)
and, per prompt size, ``hash_us``: ``kvpool.keys.block_keys`` over the prompt's token ids (reported apart: the
ingress hashes once per request). By default each decision is acknowledged at once and no load report
arrives between decisions; ``--inflight N`` keeps this router's last N assignments unacknowledged (a live router's
requests between decision and first token, which the runner adds to the snapshot), ``--reports-per-decision K``
applies K replica load reports between decisions (rebuilt states are paid in the next decision), and
``--hw-variants V`` gives the replicas V distinct fitted MFUs (calibrated replicas; the policy prices each
hardware object once per request). Every replica reports its KV cache's occupancy, as live ones do
(``router.kv_admission``; a 512k-token cache half free, 8 requests in flight holding 256 keys); ``--kv-short F``
gives a fraction F of them almost none free (default 0: the steady state), so that every prompt waits there and the
policy prices the wait; ``--no-kv``: no replica reports it (the router as it was before KV admission was priced).
The GC is frozen after the index is built, as a long-running router would after warm-up, so a full collection does
not walk a million keys inside a decision.

Every row also carries ``cpu_ref_us`` (best-of CPU time of ``sum(range(1000))`` on this machine, ~7 µs on a
modern desktop core with CPython 3.11) and ``host`` (``bench.host``) so runs on different or shared machines can be
compared.

Output: a JSON list of rows (``replicas``, ``indexed_blocks``, ``prompt_tokens``, ``decision_p50_us``,
``decision_p99_us``, ``hash_us``, the lookup / rank split and the cold lookup) to stdout with ``--json`` (or ``--out FILE``),
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
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from bench.host import describe_host
from cluster.cli_output import print_document


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rows as JSON to stdout")
    parser.add_argument("--out", help="also write the JSON rows to this file")
    parser.add_argument("--replicas", default="8,64,512", help="comma-separated replica counts (default 8,64,512)")
    parser.add_argument("--blocks", default="1e4,1e5,1e6", help="indexed block counts (default 1e4,1e5,1e6)")
    parser.add_argument("--prompts", default="1024,8192,32768,131072", help="prompt lengths in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM default 16)")
    parser.add_argument("--replicas-per-node", type=int, default=4)
    parser.add_argument("--iters", type=int, default=200, help="timed decisions per cell")
    parser.add_argument("--cold", type=int, default=20, help="timed first lookups (cold, see above) per cell")
    parser.add_argument("--model", default="qwen3-14b")
    parser.add_argument("--gpu", default="h100-sxm5-80gb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hw-variants", type=int, default=1,
                        help="distinct fitted MFUs among the replicas (1: one hardware object, as before calibration)")
    parser.add_argument("--inflight", type=int, default=0,
                        help="this router's unacknowledged assignments during a decision (live: one per request "
                             "between its decision and its first token)")
    parser.add_argument("--reports-per-decision", type=int, default=0,
                        help="replica load reports applied between two decisions")
    parser.add_argument("--kv-short", type=float, default=0.0,
                        help="fraction of the replicas whose KV cache is almost full (the others' half free)")
    parser.add_argument("--no-kv", dest="kv", action="store_false",
                        help="the replicas do not report their KV cache's occupancy")


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
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Cluster:
    """A simulated cluster's prefix view: replicas (4 per node by default) and one pool shard per node, fed
    through the router's real inputs: replica reports (the index and the ``ReplicaBook`` the live router keeps its
    replica list in), shard event batches, and the calibrator's MFU fits (``hw_variants`` distinct fitted MFUs:
    each one a hardware object the policy prices once per request, as a live router with calibrated replicas does)."""

    def __init__(self, n_rep: int, per_node: int, hw: Any, rng: random.Random, hw_variants: int = 1,
                 kv_short: float | None = 0.0) -> None:
        from router import cost
        from router.calibration import MFU_GRID_STEP, Calibrator
        from router.index import PrefixIndex
        from router.replica_book import ReplicaBook

        self.n_nodes = max(2, -(-n_rep // per_node))
        self.per_node = per_node
        self.now = 0.0
        calibrator = Calibrator(bw_util=hw.bw_util)
        self.book = ReplicaBook(ttl_s=1e9, calibrator=calibrator, hardware=lambda: hw)
        self.ids = [f"r{i}" for i in range(n_rep)]
        self.kv_short = kv_short
        self._kv_rng = random.Random(0x6B76)  # its own: the cluster is the same with and without --no-kv
        for i, rid in enumerate(self.ids):
            variant = i % hw_variants
            if variant:  # a fitted MFU 3 grid steps per variant away from the configured one, on enough prefills
                mfu = hw.mfu * (1 + MFU_GRID_STEP) ** (-3 * variant)  # to price it although the fleet's is faster
                for tokens in (1000, 4000, 16000, 32000, 64000) * -(-calibrator.trust_obs // 5):
                    calibrator.observe_prefill(rid, hw, tokens, 0, cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu))
            self.book.report(rid, f"node-{i // per_node}", rng.randint(0, 8), rng.randint(0, 4), self.now, None,
                             kv=self.kv_report())
            self.book.observe_ttft(rid, rng.uniform(0.0, 0.05))
        self.shards = [(f"s{j}", f"node-{j}") for j in range(self.n_nodes)]
        self.index = PrefixIndex(ttl_s=1e9, clock=self.clock)
        self._seqs: dict[str, int] = {}
        self._rng = rng

    def kv_report(self) -> Any:
        """A replica's KV occupancy as its load report carries it (None: ``--no-kv``)."""
        short, rng = self.kv_short, self._kv_rng
        if short is None:
            return None
        from router.hub import KvOccupancy, KvRelease
        from router.kv_admission import KvAdmission

        capacity = 512 * 1024
        free = rng.randrange(0, 1024) if rng.random() < short else capacity // 2
        releases = [KvRelease(0.05 * (k + 1) + rng.uniform(0.0, 0.05), capacity // 16) for k in range(8)]
        pinned = [rng.getrandbits(64) for _ in range(256)]
        occupancy = KvOccupancy(capacity_tokens=capacity, held_tokens=capacity - free, releases=releases,
                                pinned=pinned)
        return KvAdmission.of(occupancy, self.now)

    @property
    def replicas(self) -> Any:
        return self.book.states(self.now)

    def clock(self) -> float:
        return self.now

    def load_report(self) -> None:
        """One replica's load report (its running / waiting moved), as the hub delivers them between decisions."""
        i = self._rng.randrange(len(self.ids))
        self.book.report(self.ids[i], f"node-{i // self.per_node}", self._rng.randint(0, 8), self._rng.randint(0, 4),
                         self.now, None, kv=self.kv_report())

    def hbm_store(self, i: int, keys: list[bytes]) -> None:
        from router.hub import ReplicaReport

        rid, node = self.ids[i], f"node-{i // self.per_node}"
        seq = self._seqs.get(rid, 0) + 1
        self.index.apply_replica_report(
            ReplicaReport(replica_id=rid, node_id=node, seq=seq, running=0, waiting=0, stored=keys))
        self._seqs[rid] = seq

    def pool_store(self, j: int, keys: list[bytes], dram: bool) -> None:
        from kvpool.events import EVENTS_WIRE_VERSION, BlockEvent, EventBatch, EventKind, Tier

        shard, node = self.shards[j % self.n_nodes]
        tier = Tier.DRAM if dram else Tier.SSD
        after = self._seqs.get(shard, 0)
        evs = [BlockEvent(after + i + 1, EventKind.STORED, k, tier) for i, k in enumerate(keys)]
        self.index.apply_shard_batch(EventBatch(EVENTS_WIRE_VERSION, shard, "e", after, after + len(evs), evs), node)
        self._seqs[shard] = after + len(evs)

    def place_prompt(self, v: int, keys: list[bytes]) -> None:
        """Half of the prompt in one replica's HBM, 3/4 in the next node's DRAM, all of it on the SSD after."""
        i = (v * 7 + len(keys)) % len(self.ids)
        node = i // self.per_node
        self.hbm_store(i, keys[: len(keys) // 2])
        self.pool_store(node + 1, keys[: 3 * len(keys) // 4], dram=True)
        self.pool_store(node + 2, keys, dram=False)

    def fill(self, target: int) -> None:
        """Random filler keys until the index holds ``target``, each on one random holder (one batch per holder)."""
        missing = target - len(self.index)
        if missing <= 0:
            return
        n_rep = len(self.ids)
        by_holder: dict[int, list[bytes]] = {}
        for _ in range(missing):
            by_holder.setdefault(self._rng.randrange(n_rep + 2 * self.n_nodes), []).append(self._rng.randbytes(16))
        for h, keys in by_holder.items():
            if h < n_rep:
                self.hbm_store(h, keys)
            else:
                self.pool_store((h - n_rep) // 2, keys, dram=bool(h % 2))


def _measure_cold(cluster: _Cluster, requests: list[Any], samples: int) -> dict[str, Any]:
    """The first lookup of a prompt: forget the learned chains (untimed), then time ``snapshot``."""
    thread_ns, wall_ns = time.thread_time_ns, time.perf_counter_ns
    index, replicas = cluster.index, cluster.replicas
    wall: list[float] = []
    cpu: list[float] = []
    for i in range(samples):
        req = requests[i % len(requests)]
        index.forget_chains()
        c0, t0 = thread_ns(), wall_ns()
        index.snapshot(req, replicas)
        t1, c1 = wall_ns(), thread_ns()
        wall.append((t1 - t0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
    return {
        "lookup_cold_p50_us": round(_pct(wall, 0.5), 1),
        "lookup_cold_p99_us": round(_pct(wall, 0.99), 1),
        "lookup_cold_cpu_p50_us": round(_pct(cpu, 0.5), 1),
    }


def _measure(cluster: _Cluster, runner: Any, requests: list[Any], iters: int, *, inflight: int = 0,
             reports: int = 0) -> dict[str, Any]:
    """``iters`` timed decisions (after a warm-up). ``inflight``: assignments left unacknowledged (a live router
    has one per request between its decision and its first token: the runner adds them to the snapshot);
    ``reports``: replica load reports applied between two decisions (untimed, as the hub poll applies them; the
    ``ReplicaBook`` rebuilds those replicas' states on the next decision, which is timed)."""
    from router.policies.base import RouteRequest

    thread_ns, wall_ns = time.thread_time_ns, time.perf_counter_ns
    index, book = cluster.index, cluster.book
    wall: dict[str, list[float]] = {"lookup": [], "rank": [], "total": []}
    cpu: dict[str, list[float]] = {"lookup": [], "rank": [], "total": []}
    actions: Counter[str] = Counter()
    matched = 0
    warmup = 20
    pending: deque[str] = deque()
    for i in range(iters + warmup):
        base = requests[i % len(requests)]
        req = RouteRequest(f"{base.request_id}-{i}", base.prompt_tokens, base.block_size, base.block_keys)
        for _ in range(reports):
            cluster.load_report()
        c0, t0 = thread_ns(), wall_ns()
        replicas, columns = book.view(cluster.now)
        snap = index.snapshot(req, replicas, columns=columns)
        t1, c1 = wall_ns(), thread_ns()
        rec = runner.decide(req, snap)
        t2, c2 = wall_ns(), thread_ns()
        pending.append(req.request_id)
        while len(pending) > inflight:
            runner.acknowledge(pending.popleft())
        if i < warmup:
            continue
        for d, a, b, c in ((wall, t0, t1, t2), (cpu, c0, c1, c2)):
            d["lookup"].append((b - a) / 1e3)
            d["rank"].append((c - b) / 1e3)
            d["total"].append((c - a) / 1e3)
        actions[str(rec.action)] += 1
        matched = max(matched, max((h.prefix_blocks for h in snap.pool_hits), default=0))
    return {
        "decision_p50_us": round(_pct(wall["total"], 0.5), 1),
        "decision_p99_us": round(_pct(wall["total"], 0.99), 1),
        "lookup_p50_us": round(_pct(wall["lookup"], 0.5), 1),
        "lookup_p99_us": round(_pct(wall["lookup"], 0.99), 1),
        "rank_p50_us": round(_pct(wall["rank"], 0.5), 1),
        "rank_p99_us": round(_pct(wall["rank"], 0.99), 1),
        "decision_cpu_p50_us": round(_pct(cpu["total"], 0.5), 1),
        "decision_cpu_p99_us": round(_pct(cpu["total"], 0.99), 1),
        "lookup_cpu_p50_us": round(_pct(cpu["lookup"], 0.5), 1),
        "rank_cpu_p50_us": round(_pct(cpu["rank"], 0.5), 1),
        "rank_cpu_p99_us": round(_pct(cpu["rank"], 0.99), 1),
        "matched_blocks": matched,
        "actions": dict(actions),
        "inflight": inflight,
        "reports_per_decision": reports,
    }


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from configs.loader import load_gpus, load_models, load_tiers, pick
    from kvpool.keys import Namespace, block_keys, enable_jit
    from router.cost import Hardware
    from router.policies.base import RouteRequest
    from router.policies.pricing import TierMap
    from router.policies.runner import PolicyRunner, make_policy

    enable_jit()  # the router's hashing path (router.ingress turns the kernel on the same way)

    replica_counts = _ints(args.replicas, "replicas")
    block_counts = sorted(_ints(args.blocks, "blocks"))
    prompt_sizes = _ints(args.prompts, "prompts")
    bs = args.block_size
    if bs <= 0 or args.iters <= 0 or args.replicas_per_node <= 0:
        raise SystemExit("--block-size, --iters and --replicas-per-node must be positive")
    if args.cold < 0:
        raise SystemExit("--cold must be >= 0")
    if not 0.0 <= args.kv_short <= 1.0:
        raise SystemExit("--kv-short must be a fraction in [0, 1]")
    if args.hw_variants < 1 or args.inflight < 0 or args.reports_per_decision < 0:
        raise SystemExit("--hw-variants must be >= 1, --inflight and --reports-per-decision >= 0")
    hw = Hardware(
        model=pick("model", load_models(), args.model), gpu=pick("gpu", load_gpus(), args.gpu), mfu=0.5, bw_util=0.8
    )
    tier_map = TierMap.from_tiers(load_tiers())
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    ns = Namespace(args.model, "bench-layout")
    started = time.perf_counter()

    # Prompts: two per size (timed hashing over five), reused in every cell.
    prompts: dict[int, list[list[bytes]]] = {}
    hash_us: dict[int, tuple[float, float]] = {}
    for size in prompt_sizes:
        variants, times, cpu_times = [], [], []
        for v in range(5):
            tokens = nprng.integers(0, 150_000, size=size, dtype=np.uint32)
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            keys = block_keys(ns, tokens, bs)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            cpu_times.append((time.thread_time_ns() - c0) / 1e3)
            if v < 2:
                variants.append(keys)
        prompts[size] = variants
        hash_us[size] = (statistics.median(times), statistics.median(cpu_times))

    # This machine's speed, to compare runs across machines: best-of CPU time of sum(range(1000)) (~7 µs on a
    # modern desktop core with CPython 3.11; more on a shared VM).
    cpu_ref_us = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5, timer=time.thread_time)) / 2000 * 1e6
    host = describe_host()
    rows: list[dict[str, Any]] = []
    for n_rep in replica_counts:
        cluster = _Cluster(n_rep, args.replicas_per_node, hw, rng, hw_variants=args.hw_variants,
                           kv_short=args.kv_short if args.kv else None)
        for variants in prompts.values():
            for v, keys in enumerate(variants):
                cluster.place_prompt(v, keys)
        policy = make_policy("cost_based", rng=random.Random(args.seed), tier_map=tier_map)
        runner = PolicyRunner(policy, rng=random.Random(args.seed + 1), clock=cluster.clock)
        for target in block_counts:
            cluster.fill(target)
            gc.collect()
            gc.freeze()
            for size in prompt_sizes:
                requests = [RouteRequest(f"q{size}-{v}", size, bs, keys) for v, keys in enumerate(prompts[size])]
                row = {"replicas": n_rep, "indexed_blocks": len(cluster.index), "prompt_tokens": size,
                       "block_size": bs}
                if args.cold > 0:
                    row.update(_measure_cold(cluster, requests, args.cold))
                row.update(_measure(cluster, runner, requests, args.iters, inflight=args.inflight,
                                    reports=args.reports_per_decision))
                row["hw_variants"] = args.hw_variants
                row["kv_short"] = args.kv_short if args.kv else None
                row.update(hash_us=round(hash_us[size][0], 1), hash_cpu_us=round(hash_us[size][1], 1),
                           cpu_ref_us=round(cpu_ref_us, 1), host=host)
                rows.append(row)
                if not args.json:
                    print(
                        f"replicas {n_rep:4d}  blocks {row['indexed_blocks']:8d}  prompt {size:6d}  "
                        f"decision p50 {row['decision_p50_us']:8.1f} p99 {row['decision_p99_us']:8.1f} us  "
                        f"cpu p50 {row['decision_cpu_p50_us']:8.1f} p99 {row['decision_cpu_p99_us']:8.1f} us  "
                        f"(lookup cpu p50 {row['lookup_cpu_p50_us']:7.1f}, rank cpu p50 {row['rank_cpu_p50_us']:7.1f})"
                        f"  cold lookup p50 {row.get('lookup_cold_p50_us', 0.0):8.1f}"
                        f"  hash {row['hash_us']:9.1f} us  {row['actions']}",
                        file=sys.stderr,
                    )
            gc.unfreeze()
        del cluster, runner
        gc.collect()

    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print_document(text)
    print(f"router bench: {len(rows)} rows in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0
