"""Conformance suite over every routing policy, the cases where each cost_based action must win, the fast pricing
against ``router.cost``, the runner (tie-breaks, records) and anti-herding with two routers."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import msgspec
import pytest

from configs.schema import TierSpec
from router import cost
from router.decision import AuditLog
from router.metrics import RouterMetrics
from router.policies.base import (
    Action,
    Candidate,
    ClusterSnapshot,
    NoReplicasError,
    PoolHit,
    Ranking,
    ReplicaColumns,
    RouteRequest,
    RoutingPolicy,
)
from router.policies.cost_based import HELD_BACK, hold_back
from router.policies.pricing import DRAM_LOCAL, DRAM_REMOTE, SSD_LOCAL, SSD_REMOTE, HwCoeffs, Pricer, TierMap
from router.policies.runner import (
    POLICIES,
    PolicyError,
    PolicyRunner,
    UnknownPolicyError,
    make_policy,
)
from tests.fakes.router import (
    RouterClock,
    router_cluster,
    router_hw,
    router_replica,
    router_request,
    router_tier_map,
)

ALL = sorted(POLICIES)


def build(name: str, seed: int = 0, tier_map: TierMap | None = None) -> RoutingPolicy:
    return make_policy(name, rng=random.Random(seed), tier_map=tier_map or router_tier_map())


# ---- snapshots every policy must handle ----------------------------------------------------------------------


def _snapshots() -> list[tuple[str, RouteRequest, ClusterSnapshot]]:
    hybrid = router_hw(model="qwen3.5-27b", gpu="h200-sxm5-141gb", mfu=0.4, bw_util=0.7)
    a100 = router_hw(gpu="a100-sxm4-80gb", mfu=0.45)
    mixed = [
        router_replica("r0", "node-0", running=3, waiting=1, queue_delay_s=0.2, hbm_prefix_blocks=100),
        router_replica("r1", "node-0", running=0, queue_delay_s=0.0, hbm_prefix_blocks=10),
        router_replica("r2", "node-1", running=7, waiting=4, queue_delay_s=1.5, hbm_prefix_blocks=0),
        router_replica("r3", "node-2", running=1, queue_delay_s=0.05, hw=a100),
        router_replica("r4", "node-2", running=2, queue_delay_s=0.1, hbm_prefix_blocks=2000, hw=a100),
    ]
    hits = (
        PoolHit("s0", "node-0", "dram", 300),
        PoolHit("s0", "node-0", "ssd", 1000),
        PoolHit("s1", "node-1", "dram", 50, queue_delay_s=0.01),
        PoolHit("s3", "node-3", "ssd", 2048, queue_delay_s=0.002),
    )
    return [
        ("single replica", router_request(4096), router_cluster(1)),
        ("single replica with hits", router_request(4096), router_cluster(1, hits=hits[:2])),
        ("idle cluster", router_request(8192), router_cluster(8, replicas_per_node=4)),
        ("mixed loads and prefixes", router_request(32768), ClusterSnapshot(mixed, hits)),
        ("mixed, no pool hits", router_request(32768), ClusterSnapshot(mixed)),
        ("zero-length prompt", router_request(0), ClusterSnapshot(mixed, hits)),
        ("prompt shorter than a block", router_request(7), ClusterSnapshot(mixed, hits)),
        ("hits longer than the prompt", router_request(800), ClusterSnapshot(mixed, hits)),
        ("hybrid model", router_request(16384), router_cluster(4, hits=hits, hw=hybrid, hbm_prefix_blocks=64)),
        ("block size 64", router_request(20000, block_size=64), ClusterSnapshot(mixed, hits)),
    ]


SNAPSHOTS = _snapshots()


def _check_ranking(policy: RoutingPolicy, request: RouteRequest, cluster: ClusterSnapshot, ranking: Ranking) -> None:
    assert isinstance(ranking, Ranking)
    assert ranking.candidates, "a policy must return at least one candidate"
    by_id = {r.replica_id: r for r in cluster.replicas}
    full_blocks = min(len(request.block_keys), max(request.prompt_tokens, 0) // request.block_size)
    for c in ranking.candidates:
        assert c.replica_id in by_id
        r = by_id[c.replica_id]
        assert isinstance(c.action, Action)
        assert math.isfinite(c.predicted_ttft_s)
        assert c.predicted_ttft_s >= r.queue_delay_s - 1e-12
        assert 0 <= c.reused_tokens <= max(request.prompt_tokens, 0)
        hbm = min(r.hbm_prefix_blocks, full_blocks)
        if c.action in (Action.FETCH, Action.SPLIT):
            plan = c.fetch
            assert plan is not None
            assert 0 <= plan.start_block < plan.end_block <= full_blocks
            hit = [h for h in cluster.pool_hits if (h.shard_id, h.tier) == (plan.shard_id, plan.tier)]
            assert hit and hit[0].prefix_blocks >= plan.end_block and hit[0].node_id == plan.node_id
            if c.action is Action.FETCH:
                assert plan.start_block == hbm, "FETCH moves exactly the part beyond the replica's HBM prefix"
            else:
                assert plan.start_block > hbm, "SPLIT computes a non-empty head"
        else:
            assert c.fetch is None
            if c.action is Action.HOLDER:
                assert hbm > 0 and c.reused_tokens == hbm * request.block_size
            else:
                assert c.reused_tokens == 0
    if type(policy).tie_break:
        k = len(ranking.candidates) if ranking.choosable is None else ranking.choosable
        ttfts = [c.predicted_ttft_s for c in ranking.candidates[:k]]
        assert ttfts == sorted(ttfts), "tie_break policies rank the choosable candidates best-first by predicted TTFT"
        held = ranking.candidates[k:]
        assert [c.predicted_ttft_s for c in held] == sorted(c.predicted_ttft_s for c in held)
        assert all(c.note == HELD_BACK and c.action is not Action.HOLDER for c in held)
        assert all(c.note != HELD_BACK for c in ranking.candidates[:k])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("case", SNAPSHOTS, ids=[s[0] for s in SNAPSHOTS])
def test_policy_returns_valid_candidates(name: str, case: tuple[str, RouteRequest, ClusterSnapshot]) -> None:
    _, request, cluster = case
    before = (list(cluster.replicas), list(cluster.pool_hits), list(request.block_keys))
    policy = build(name)
    for _ in range(3):  # stateful policies (round robin) too
        _check_ranking(policy, request, cluster, policy.rank(request, cluster))
    assert before == (list(cluster.replicas), list(cluster.pool_hits), list(request.block_keys)), "inputs mutated"


@pytest.mark.parametrize("name", ALL)
def test_policy_is_deterministic_given_its_rng(name: str) -> None:
    def run(seed: int) -> list[tuple[str, str, float]]:
        policy = build(name, seed)
        runner = PolicyRunner(policy, rng=random.Random(seed + 1), clock=RouterClock())
        out = []
        for i in range(40):
            _, request, cluster = SNAPSHOTS[i % len(SNAPSHOTS)]
            rec = runner.decide(dataclasses.replace(request, request_id=f"q{i}"), cluster)
            out.append((rec.replica_id, str(rec.action), rec.predicted_ttft_s))
        return out

    assert run(7) == run(7)


@pytest.mark.parametrize("name", ALL)
def test_policy_rejects_empty_cluster(name: str) -> None:
    with pytest.raises(NoReplicasError):
        build(name).rank(router_request(1024), ClusterSnapshot(()))
    runner = PolicyRunner(build(name), rng=random.Random(0))
    with pytest.raises(NoReplicasError):
        runner.decide(router_request(1024), ClusterSnapshot(()))


def test_make_policy_errors_are_clear() -> None:
    with pytest.raises(UnknownPolicyError, match="known policies: always_fetch, cost_based"):
        make_policy("fastest")
    with pytest.raises(TypeError, match="needs tier_map"):
        make_policy("cost_based", rng=random.Random(0))
    with pytest.raises(TypeError, match="no option 'bogus'"):
        make_policy("round_robin", rng=random.Random(0), bogus=1)
    p = make_policy("prefix_affinity", rng=random.Random(0), tier_map=router_tier_map(), balance_abs_threshold=3)
    assert p.abs_threshold == 3  # type: ignore[attr-defined]


# ---- baselines behave as named --------------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    policy = build("round_robin")
    cluster = router_cluster(4)
    picks = [policy.rank(router_request(256), cluster).candidates[0].replica_id for _ in range(8)]
    assert sorted(picks[:4]) == ["r0", "r1", "r2", "r3"] and picks[:4] == picks[4:]


def test_least_loaded_picks_the_lighter_of_two() -> None:
    reps = [router_replica(f"r{i}", running=i) for i in range(6)]
    policy = build("least_loaded", seed=3)
    for _ in range(50):
        ranking = policy.rank(router_request(512), ClusterSnapshot(reps))
        a, b = ranking.candidates
        assert int(a.replica_id[1:]) < int(b.replica_id[1:])
    assert policy.rank(router_request(512), ClusterSnapshot(reps[:1])).candidates[0].replica_id == "r0"


def test_prefix_affinity_prefers_holder_until_imbalanced() -> None:
    policy = make_policy("prefix_affinity", rng=random.Random(0), balance_abs_threshold=4, balance_rel_threshold=1.5)
    request = router_request(4096)
    holder = router_replica("hot", running=3, hbm_prefix_blocks=200)
    idle = router_replica("idle", "node-1", running=1)
    chosen = policy.rank(request, ClusterSnapshot([holder, idle])).candidates[0]
    assert (chosen.replica_id, chosen.action) == ("hot", Action.HOLDER)
    busy = msgspec.structs.replace(holder, running=6)  # 6 − 1 > 4 and 6 > 1.5 × 1
    ranking = policy.rank(request, ClusterSnapshot([busy, idle]))
    assert ranking.candidates[0].replica_id == "idle" and "imbalance guard" in ranking.reason
    cold = policy.rank(router_request(4096, salt="x"), router_cluster(3, running=2))
    assert cold.candidates[0].action is Action.RECOMPUTE


def test_always_fetch_fetches_whenever_a_pool_prefix_exists() -> None:
    # Even where recomputing is far cheaper (a 3-block prompt from remote SSD with a 50 ms latency).
    slow = TierSpec(name="slow", bandwidth_gbps=0.35, latency_s=0.05)
    tm = TierMap(slow, slow, slow, slow)
    policy = make_policy("always_fetch", rng=random.Random(0), tier_map=tm)
    ranking = policy.rank(router_request(48), router_cluster(2, hits=(PoolHit("s9", "node-9", "ssd", 3),)))
    assert ranking.candidates[0].action is Action.FETCH
    cb = make_policy("cost_based", rng=random.Random(0), tier_map=tm)
    assert cb.rank(router_request(48), router_cluster(2, hits=(PoolHit("s9", "node-9", "ssd", 3),))).candidates[
        0
    ].action is Action.RECOMPUTE


# ---- cost_based: each action wins where it should --------------------------------------------------------------


def _decide(tier_map: TierMap, request: RouteRequest, cluster: ClusterSnapshot, **kw: object) -> Ranking:
    return make_policy("cost_based", rng=random.Random(0), tier_map=tier_map, **kw).rank(request, cluster)


def test_long_prefix_on_a_slow_tier_recomputes() -> None:
    base = router_tier_map()
    remote_block = TierSpec(name="remote-block", bandwidth_gbps=0.35)
    tm = dataclasses.replace(base, ssd_local=remote_block, ssd_remote=remote_block)
    ranking = _decide(tm, router_request(8192), router_cluster(4, hits=(PoolHit("s0", "node-0", "ssd", 512),)))
    best = ranking.candidates[0]
    assert best.action is Action.RECOMPUTE, ranking.reason
    fetch = [c for c in ranking.candidates if c.action is Action.FETCH]
    assert fetch and fetch[0].predicted_ttft_s > 5 * best.predicted_ttft_s


def test_overloaded_hot_holder_loses_to_a_fetch_elsewhere() -> None:
    hot = router_replica("hot", "node-0", running=30, queue_delay_s=5.0, hbm_prefix_blocks=2048)
    cold = router_replica("cold", "node-1", running=0, queue_delay_s=0.0)
    hit = PoolHit("s1", "node-1", "dram", 2048)
    ranking = _decide(router_tier_map(), router_request(32768 + 100), ClusterSnapshot([hot, cold], (hit,)))
    best = ranking.candidates[0]
    assert (best.action, best.replica_id) == (Action.FETCH, "cold"), ranking.reason
    assert best.fetch is not None and (best.fetch.shard_id, best.fetch.start_block, best.fetch.end_block) == (
        "s1", 0, 2048)
    # The same holder without its queue wins outright.
    calm = msgspec.structs.replace(hot, running=0, queue_delay_s=0.0)
    assert _decide(router_tier_map(), router_request(32768 + 100), ClusterSnapshot([calm, cold], (hit,))).candidates[
        0
    ].action is Action.HOLDER


def _latency_tiers() -> TierMap:
    return TierMap(
        dram_local=TierSpec(name="cpu-dram", bandwidth_gbps=120, latency_s=0.0005),
        dram_remote=TierSpec(name="rdma-pool", bandwidth_gbps=50, latency_s=0.003),
        ssd_local=TierSpec(name="local-ssd", bandwidth_gbps=10, latency_s=0.005),
        ssd_remote=TierSpec(name="remote-ssd", bandwidth_gbps=10, latency_s=0.008),
    )


def test_short_context_recomputes() -> None:
    # Two blocks over RDMA: 3 ms latency + 5 MB lose to a prefill of 32 tokens (under 2 ms).
    hit = PoolHit("s1", "node-9", "dram", 2)
    ranking = _decide(_latency_tiers(), router_request(32), router_cluster(2, hits=(hit,)))
    assert ranking.candidates[0].action is Action.RECOMPUTE, ranking.reason
    # ... while the same tier wins for a long context (the latency is paid once).
    hit = PoolHit("s1", "node-9", "dram", 512)
    long = _decide(_latency_tiers(), router_request(8192), router_cluster(2, hits=(hit,)))
    assert long.candidates[0].action is Action.FETCH, long.reason


def test_fast_tier_and_long_context_fetches() -> None:
    hit = PoolHit("s0", "node-0", "dram", 2048)
    ranking = _decide(_latency_tiers(), router_request(32768), router_cluster(2, hits=(hit,)))
    best = ranking.candidates[0]
    assert best.action is Action.FETCH and best.replica_id == "r0", ranking.reason  # r0 shares node-0
    assert "fetch blocks [0,2048) from s0/dram (cpu-dram, same node)" in ranking.reason
    recompute = min(c.predicted_ttft_s for c in ranking.candidates if c.action is Action.RECOMPUTE)
    assert best.predicted_ttft_s < recompute / 10


def test_split_wins_when_fetch_and_compute_are_comparable() -> None:
    # A tier where fetching the prefix takes about as long as computing it: overlap halves the time.
    hw = router_hw()
    prompt = 8192
    t_pre = cost.t_prefill(hw.model, hw.gpu, prompt, mfu=hw.mfu)
    gbps = cost.fetch_bytes(hw.model, prompt) / t_pre / hw.bw_util / cost.GB
    slow = TierSpec(name="nfs", bandwidth_gbps=gbps)
    tm = dataclasses.replace(router_tier_map(), ssd_remote=slow)
    ranking = _decide(tm, router_request(prompt), router_cluster(2, hits=(PoolHit("s7", "node-7", "ssd", 512),)))
    best = ranking.candidates[0]
    assert best.action is Action.SPLIT, ranking.reason
    assert best.fetch is not None and 0 < best.fetch.start_block < 512 and best.fetch.end_block == 512
    assert best.predicted_ttft_s < 0.7 * t_pre
    assert "split on" in ranking.reason and "max(compute" in ranking.reason
    no_split = _decide(tm, router_request(prompt), router_cluster(2, hits=(PoolHit("s7", "node-7", "ssd", 512),)),
                       allow_split=False)
    assert no_split.candidates[0].action in (Action.FETCH, Action.RECOMPUTE)


def test_only_the_part_beyond_hbm_is_fetched() -> None:
    r = router_replica("r0", "node-0", hbm_prefix_blocks=1000)
    hit = PoolHit("s1", "node-1", "dram", 2000)
    ranking = _decide(router_tier_map(), router_request(2000 * 16), ClusterSnapshot([r], (hit,)), allow_split=False)
    fetch = next(c for c in ranking.candidates if c.action is Action.FETCH)
    assert fetch.fetch is not None and (fetch.fetch.start_block, fetch.fetch.end_block) == (1000, 2000)
    hw = r.hw
    tier = router_tier_map().dram_remote
    expected = cost.t_fetch(hw.model, tier, 1000 * 16, bw_util=hw.bw_util) + cost.t_prefill(
        hw.model, hw.gpu, 32000, mfu=hw.mfu, cached_tokens=32000
    )
    assert fetch.predicted_ttft_s == pytest.approx(expected, rel=1e-9)


def test_cost_based_lists_the_best_of_every_action() -> None:
    _, request, cluster = SNAPSHOTS[3]
    ranking = _decide(router_tier_map(), request, cluster, max_candidates=1)
    actions = {c.action for c in ranking.candidates}
    assert {Action.HOLDER, Action.FETCH, Action.RECOMPUTE} <= actions
    assert "ttft = queue" in ranking.reason and ranking.extra["ttft_s"] == ranking.candidates[0].predicted_ttft_s


def test_cost_based_scales_to_many_replicas_and_hits() -> None:
    reps = [router_replica(f"r{i}", f"node-{i // 8}", queue_delay_s=0.001 * (i % 5)) for i in range(1000)]
    hits = tuple(PoolHit(f"s{j}", f"node-{j}", "dram" if j % 2 else "ssd", 100 + j) for j in range(125))
    ranking = _decide(router_tier_map(), router_request(4096), ClusterSnapshot(reps, hits))
    # 125 shards, 8 replicas per node: the best is a replica sharing the node of the longest DRAM hit (s123).
    best = ranking.candidates[0]
    assert best.action is Action.FETCH and best.fetch is not None
    assert best.fetch.shard_id == "s123" and best.replica_id in {f"r{i}" for i in range(123 * 8, 124 * 8)}


# ---- pricing equals router.cost --------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_scale", [1.0, 0.3])
@pytest.mark.parametrize("model,gpu", [("qwen3-14b", "h100-sxm5-80gb"), ("qwen3.5-27b", "b200-sxm-192gb")])
def test_fast_pricing_matches_cost_model(model: str, gpu: str, attn_scale: float) -> None:
    hw = dataclasses.replace(router_hw(model=model, gpu=gpu, mfu=0.37, bw_util=0.66, gpus=2), attn_scale=attn_scale)
    tm = _latency_tiers()
    co = HwCoeffs(hw, tm)
    for prompt, cached in [(1, 0), (4096, 1024), (131072, 65536), (50000, 0)]:
        assert co.prefill(prompt, cached) == pytest.approx(
            cost.t_prefill(hw.model, hw.gpu, prompt, mfu=hw.mfu, gpus=hw.gpus, cached_tokens=cached,
                           attn_scale=attn_scale), rel=1e-12
        )
        assert co.fetch(DRAM_REMOTE, cached) == pytest.approx(
            cost.t_fetch(hw.model, tm.dram_remote, cached, bw_util=hw.bw_util), rel=1e-12
        )
        if cached:
            assert co.prefill(prompt, cached) + co.fetch(SSD_LOCAL, cached) + 0.25 == pytest.approx(
                cost.ttft(hw, prompt_tokens=prompt, cached_tokens=cached, tier=tm.ssd_local, queue_delay_s=0.25),
                rel=1e-12,
            )


@pytest.mark.parametrize("prefix", [64, 1024, 8192])
@pytest.mark.parametrize("gbps", [0.35, 2.0, 10.0, 50.0])
def test_split_matches_cost_ttft_split(prefix: int, gbps: float) -> None:
    hw = router_hw()
    tier = TierSpec(name="t", bandwidth_gbps=gbps, latency_s=0.002)
    co = HwCoeffs(hw, TierMap(tier, tier, tier, tier))
    bs = 16
    prompt = prefix * bs + 300
    ref, h_ref = cost.ttft_split(hw, prompt_tokens=prompt, cached_tokens=prefix * bs, tier=tier)
    suffix = co.prefill(prompt, prefix * bs)
    got = co.split(DRAM_REMOTE, hbm_tokens=0, prefix_tokens=prefix * bs, block_size=bs, extra_latency_s=0.0,
                   staged=False)
    if got is None:  # the meeting point rounds to "no fetch" or "no compute": the bisection agrees it is an edge
        assert h_ref < bs or h_ref > prefix * bs - bs
        return
    k, overlap = got
    one_block = co.prefill((k + 1) * bs, k * bs)
    assert ref - 1e-12 <= overlap + suffix <= ref + one_block + 1e-12
    assert abs(k * bs - h_ref) <= bs


def test_tier_map_defaults() -> None:
    tm = router_tier_map()
    assert (tm.dram_local.name, tm.dram_remote.name, tm.ssd_local.name) == ("cpu-dram", "rdma-pool", "local-ssd")
    assert tm.ssd_remote.bandwidth_gbps == min(tm.ssd_local.bandwidth_gbps, tm.dram_remote.bandwidth_gbps)
    assert tm.tier("dram", True) is tm.dram_local and tm.tier("ssd", False) is tm.ssd_remote
    with pytest.raises(KeyError, match="known"):
        TierMap.from_tiers({"x": tm.dram_local})


def test_pricer_caches_by_identity() -> None:
    pricer = Pricer(router_tier_map())
    hw = router_hw()
    assert pricer.coeffs(hw) is pricer.coeffs(hw)
    other = dataclasses.replace(hw, mfu=0.25)
    assert pricer.coeffs(other).lin == pytest.approx(2 * pricer.coeffs(hw).lin)


# ---- the runner -------------------------------------------------------------------------------------------------


def test_runner_builds_a_record_with_alternatives_and_metrics() -> None:
    audit = AuditLog(100)
    metrics = RouterMetrics()
    clock = RouterClock()
    runner = PolicyRunner(build("cost_based"), rng=random.Random(0), audit=audit, metrics=metrics, clock=clock)
    _, request, cluster = SNAPSHOTS[3]
    rec = runner.decide(request, cluster)
    assert rec.policy == "cost_based" and rec.request_id == request.request_id
    assert rec.decision_latency_s > 0 and rec.decided_at == clock.t
    assert rec.best_predicted_ttft_s <= rec.predicted_ttft_s
    assert {a.action for a in rec.alternatives} >= {Action.RECOMPUTE}
    assert audit.get(request.request_id) is rec
    assert rec.hbm_tokens + rec.fetched_tokens <= request.prompt_tokens
    done = runner.record_actual(request.request_id, rec.predicted_ttft_s + 0.5)
    assert done is rec and rec.regret_s == pytest.approx(rec.predicted_ttft_s + 0.5 - rec.best_predicted_ttft_s)
    assert metrics.registry.get_sample_value(
        "kvstack_router_decisions_total", {"policy": "cost_based", "action": str(rec.action)}
    ) == 1.0


class _Liar(RoutingPolicy):
    name = "liar"

    def __init__(self, candidates: tuple) -> None:
        self.candidates = candidates

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        return Ranking(self.candidates)


def test_runner_rejects_a_policy_that_breaks_the_contract() -> None:
    from router.policies.base import Candidate

    with pytest.raises(PolicyError, match="no candidates"):
        PolicyRunner(_Liar(()), rng=random.Random(0)).decide(router_request(64), router_cluster(1))
    ghost = (Candidate(Action.RECOMPUTE, "ghost", 0.1),)
    with pytest.raises(PolicyError, match="ghost"):
        PolicyRunner(_Liar(ghost), rng=random.Random(0)).decide(router_request(64), router_cluster(1))


def test_runner_breaks_exact_ties_by_the_least_recently_chosen_replica() -> None:
    """Among tied replicas the runner takes the one it chose least recently (at random among those it never chose):
    without in-flight accounting, 400 fresh prompts on 8 idle replicas go round, 50 each, where coin flips left them
    uneven; two runners with other seeds start the round elsewhere."""
    runner = PolicyRunner(build("cost_based"), rng=random.Random(1), anti_herding=False)
    order = [runner.decide(router_request(2048, request_id=f"q{i}"), router_cluster(8)).replica_id for i in range(400)]
    assert Counter(order) == {f"r{i}": 50 for i in range(8)}
    assert all(order[i] == order[i % 8] for i in range(400)) and len(set(order[:8])) == 8
    rec = runner.decide(router_request(2048), router_cluster(8))
    assert rec.tie_break.startswith("least recently chosen") and rec.replica_id == order[0]
    other = PolicyRunner(build("cost_based", seed=5), rng=random.Random(7), anti_herding=False)
    firsts = [other.decide(router_request(2048, request_id=f"o{i}"), router_cluster(8)).replica_id for i in range(8)]
    assert sorted(firsts) == sorted(order[:8]) and firsts != order[:8]


# ---- anti-herding: two routers, own indexes, shared load reports ----------------------------------------------------


def _two_routers(name: str, anti_herding: bool, **opts: object) -> tuple[PolicyRunner, PolicyRunner]:
    """Two routers with their own policy, RNG and pending assignments. Without anti-herding: no in-flight
    accounting, no random tie-break, and cost_based without its RNG rotation (the herd a naive router forms)."""

    def one(seed: int) -> PolicyRunner:
        ctx: dict[str, object] = {"tier_map": router_tier_map(), **opts}
        if anti_herding or name != "cost_based":
            ctx["rng"] = random.Random(seed)
        policy = make_policy(name, **ctx)
        if name == "cost_based" and not anti_herding:
            policy._rng = None  # type: ignore[attr-defined]
        return PolicyRunner(policy, rng=random.Random(100 + seed), anti_herding=anti_herding, clock=RouterClock(),
                            tie_break=anti_herding)

    return one(1), one(2)


def test_two_cost_based_routers_do_not_herd() -> None:
    snapshot = router_cluster(8, replicas_per_node=2)  # both routers see the same stale load report: all idle
    for anti_herding in (False, True):
        a, b = _two_routers("cost_based", anti_herding)
        counts: Counter[str] = Counter()
        for i in range(16):
            counts[a.decide(router_request(8192, request_id=f"a{i}"), snapshot).replica_id] += 1
            counts[b.decide(router_request(8192, request_id=f"b{i}"), snapshot).replica_id] += 1
        if anti_herding:
            assert len(counts) == 8 and max(counts.values()) <= 4, counts  # 32 requests, 8 replicas: 4 each
        else:
            assert counts.most_common(1)[0][1] == 32, counts  # the herd: everyone on one replica


def test_two_prefix_affinity_routers_spill_a_hot_prefix() -> None:
    hot = router_replica("hot", "node-0", hbm_prefix_blocks=256)
    others = [router_replica(f"r{i}", f"node-{i}") for i in range(1, 4)]
    snapshot = ClusterSnapshot([hot, *others])
    for anti_herding in (False, True):
        a, b = _two_routers("prefix_affinity", anti_herding, balance_abs_threshold=2, balance_rel_threshold=1.0)
        counts: Counter[str] = Counter()
        for i in range(12):
            counts[a.decide(router_request(4096, request_id=f"a{i}"), snapshot).replica_id] += 1
            counts[b.decide(router_request(4096, request_id=f"b{i}"), snapshot).replica_id] += 1
        if anti_herding:
            # Each router keeps hot − least ≤ threshold + 1 = 3 over its own 12 requests: hot ≤ 5 per router.
            assert counts["hot"] <= 10 and min(counts[f"r{i}"] for i in range(1, 4)) >= 4, counts
        else:
            assert counts["hot"] == 24, counts


def test_inflight_assignments_expire_and_are_acknowledged() -> None:
    clock = RouterClock()
    runner = PolicyRunner(build("cost_based"), rng=random.Random(0), clock=clock, inflight_ttl_s=1.0)
    snapshot = router_cluster(2)
    rec = runner.decide(router_request(4096, request_id="x"), snapshot)
    assert runner.inflight(rec.replica_id) == 1
    runner.acknowledge("x")
    assert runner.inflight(rec.replica_id) == 0
    rec = runner.decide(router_request(4096, request_id="y"), snapshot)
    nxt = runner.decide(router_request(4096, request_id="z"), snapshot)
    assert nxt.replica_id != rec.replica_id, "its own pending request makes the other replica cheaper"
    clock.advance(1.5)
    assert runner.inflight(rec.replica_id) == 0 and runner.inflight(nxt.replica_id) == 0
    runner.decide(router_request(4096, request_id="w"), snapshot)
    runner.acknowledge_replica("r0", clock.t + 1)
    runner.acknowledge_replica("r1", clock.t + 1)
    assert runner.inflight("r0") == runner.inflight("r1") == 0


def test_the_inflight_view_keeps_the_columns_in_step_and_decides_as_without_them() -> None:
    """The runner's in-flight view patches the queues column with the queue delays it adds, so a policy reading the
    columns decides as one reading the states: two runners, one given columns, make the same decisions."""
    clock = RouterClock()
    reps = [router_replica(f"r{i}", f"node-{i // 2}", queue_delay_s=0.01 * (i % 3)) for i in range(6)]
    plain = ClusterSnapshot(reps, (PoolHit("s0", "node-1", "dram", 40),))
    with_cols = ClusterSnapshot(reps, plain.pool_hits, ReplicaColumns.of(reps))
    a = PolicyRunner(build("cost_based"), rng=random.Random(3), clock=clock)
    b = PolicyRunner(build("cost_based"), rng=random.Random(3), clock=clock)
    for i in range(12):
        ra = a.decide(router_request(4096, request_id=f"q{i}"), plain)
        rb = b.decide(router_request(4096, request_id=f"q{i}"), with_cols)
        assert (ra.replica_id, ra.action, ra.predicted_ttft_s) == (rb.replica_id, rb.action, rb.predicted_ttft_s)
        view = b._with_inflight(with_cols, clock.t)
        assert view.columns == ReplicaColumns.of(view.replicas) and with_cols.columns == ReplicaColumns.of(reps)
    assert sum(a.inflight(f"r{i}") for i in range(6)) == 12  # every decision still in flight: the views had load


@pytest.mark.parametrize("seed", range(25))
def test_cost_based_equals_brute_force_pricing(seed: int) -> None:
    """The grouped, vectorised cost_based finds the same best and the same best-per-action as pricing every
    (replica, hit) pair one by one with the plain pricing helpers."""
    from router.policies.pricing import fetch_candidate, local_candidate

    rng = random.Random(seed)
    hws = [router_hw(), router_hw(gpu="a100-sxm4-80gb", mfu=0.4), router_hw(model="qwen3.5-27b", mfu=0.3)]
    n_nodes = rng.randint(1, 6)
    prompt = rng.choice([16, 700, 4096, 20000])
    request = router_request(prompt)
    full = prompt // 16
    reps = [
        router_replica(f"r{i}", f"node-{rng.randrange(n_nodes)}", running=rng.randint(0, 5),
                       queue_delay_s=rng.choice([0.0, 0.0, rng.uniform(0, 0.5)]),
                       hbm_prefix_blocks=rng.choice([0, 0, rng.randint(0, full + 5)]), hw=rng.choice(hws))
        for i in range(rng.randint(1, 20))
    ]
    hits = tuple(
        PoolHit(f"s{j}", f"node-{rng.randrange(n_nodes + 2)}", rng.choice(["dram", "ssd"]), rng.randint(0, full + 5),
                queue_delay_s=rng.choice([0.0, rng.uniform(0, 0.05)]))
        for j in range(rng.randint(0, 8))
    )
    cluster = ClusterSnapshot(reps, hits)
    tm = _latency_tiers()
    ranking = _decide(tm, request, cluster, allow_split=False)
    pricer = Pricer(tm)
    brute: dict[Action, float] = {}
    every: list[Candidate] = []
    for r in reps:
        options = [local_candidate(pricer, r, request)]
        options += [c for h in hits if (c := fetch_candidate(pricer, r, h, request)) is not None]
        if r.hbm_prefix_blocks and min(r.hbm_prefix_blocks, full):  # RECOMPUTE is always an option too
            options.append(msgspec.structs.replace(options[0], action=Action.RECOMPUTE, reused_tokens=0,
                                               predicted_ttft_s=r.queue_delay_s + pricer.coeffs(r.hw).prefill(prompt, 0)))
        for c in options:
            brute[c.action] = min(brute.get(c.action, math.inf), c.predicted_ttft_s)
        every += options
    got: dict[Action, float] = {}
    for c in ranking.candidates:
        got[c.action] = min(got.get(c.action, math.inf), c.predicted_ttft_s)
    assert min(got.values()) == pytest.approx(min(brute.values()), rel=1e-9)
    # The decision is the pick (hold_back, with the policy's defaults) over every (replica, hit) candidate.
    every.sort(key=lambda c: c.predicted_ttft_s)
    defaults = make_policy("cost_based", tier_map=tm)
    picked, _ = hold_back(every, {r.replica_id: r.queue_delay_s for r in reps}, uncertainty=defaults.uncertainty,
                          window_abs_s=defaults.window_abs_s, window_rel=defaults.window_rel)
    assert ranking.candidates[0].action is picked[0].action
    assert ranking.candidates[0].predicted_ttft_s == pytest.approx(picked[0].predicted_ttft_s, rel=1e-9)
    assert got.keys() == brute.keys()
    for action, value in brute.items():
        assert got[action] == pytest.approx(value, rel=1e-9), action


@pytest.mark.parametrize("prefix", [2, 4, 5, 8, 64, 1024, 8192])
@pytest.mark.parametrize("gbps,local_gbps", [(0.35, 50.0), (2.0, 5.0), (10.0, 0.5), (50.0, 50.0)])
@pytest.mark.parametrize("hbm_blocks", [0, 3])
@pytest.mark.parametrize("remote", [True, False])
def test_staged_split_is_the_best_block_boundary(prefix: int, gbps: float, local_gbps: float, hbm_blocks: int,
                                                 remote: bool) -> None:
    """The staged SPLIT's closed form picks the boundary a brute force over every interior block picks, and its
    floor (``SplitTail.floor``, what ``_Group.options`` skips a SPLIT on unsolved) is at most its cost."""
    hw = router_hw()
    slow = TierSpec(name="slow", bandwidth_gbps=gbps, latency_s=0.003)
    near = TierSpec(name="near", bandwidth_gbps=local_gbps, latency_s=0.001)
    co = HwCoeffs(hw, TierMap(near, slow, near, slow))
    bs, extra = 16, 0.002
    cls, pull_cls, load_cls = (DRAM_REMOTE, DRAM_REMOTE, DRAM_LOCAL) if remote else (DRAM_LOCAL, -1, DRAM_LOCAL)
    h0, c = hbm_blocks * bs, prefix * bs

    def f(k: int) -> float:
        t = k * bs
        tail = (c - t) * co.kvb + co.state
        head = co.prefill(t, h0)
        pull = co.lat[pull_cls] + extra + tail * co.spb[pull_cls] if remote else 0.0
        load = co.lat[load_cls] + (0.0 if remote else extra) + tail * co.spb[load_cls]
        return max(head, pull) + load

    interior = range(hbm_blocks + 1, prefix)
    got = co.split(cls, h0, c, bs, extra)
    floor = co.split_tail(cls, extra).floor
    assert all(floor <= f(j) * (1 + 1e-12) for j in interior)
    if not interior:
        assert got is None
        return
    assert got is not None
    k, total = got
    assert k in interior
    assert total == pytest.approx(f(k), rel=1e-12)
    assert total <= min(f(j) for j in interior) * (1 + 1e-9)


def test_split_tails_without_a_shard_queue_are_the_ones_computed() -> None:
    """``HwCoeffs`` keeps the shard-queue-free tails it hands out (most hits) made once per hardware: each equals the
    one computed for the call, and a shard queue goes into the pull (from another node) or else the load."""
    tiers = router_tier_map()
    co = HwCoeffs(router_hw(), tiers)
    for staged in (False, True):
        for cls in (DRAM_LOCAL, DRAM_REMOTE, SSD_LOCAL, SSD_REMOTE):
            kept = co.split_tail(cls, 0.0, staged)
            assert kept is co.split_tail(cls, 0.0, staged)
            assert kept == co._split_tail(cls, 0.0, staged)
            queued = co.split_tail(cls, 0.01, staged)
            assert queued.floor > kept.floor
            if staged and cls in (DRAM_REMOTE, SSD_REMOTE):
                assert queued.pull and queued.p_lat == pytest.approx(kept.p_lat + 0.01) and queued.l_lat == kept.l_lat
            else:
                assert not queued.pull and queued.l_lat == pytest.approx(kept.l_lat + 0.01)


def test_staged_split_pays_for_loading_the_tail_again() -> None:
    """The staged SPLIT (what the replicas run) costs more than the ideal overlap, by about the local load."""
    hw = router_hw()
    prompt = 8192
    t_pre = cost.t_prefill(hw.model, hw.gpu, prompt, mfu=hw.mfu)
    gbps = cost.fetch_bytes(hw.model, prompt) / t_pre / hw.bw_util / cost.GB
    tm = dataclasses.replace(router_tier_map(), ssd_remote=TierSpec(name="nfs", bandwidth_gbps=gbps))
    cluster = router_cluster(2, hits=(PoolHit("s7", "node-7", "ssd", 512),))
    staged = _decide(tm, router_request(prompt), cluster, split_min_gain=0.0)
    ideal = _decide(tm, router_request(prompt), cluster, split_min_gain=0.0, split_staging=False)
    s, i = staged.candidates[0], ideal.candidates[0]
    assert s.action is Action.SPLIT and i.action is Action.SPLIT, (staged.reason, ideal.reason)
    assert i.predicted_ttft_s < s.predicted_ttft_s
    assert "to the node's shard" in staged.reason and "load blocks" in staged.reason
    assert "load blocks" not in ideal.reason
