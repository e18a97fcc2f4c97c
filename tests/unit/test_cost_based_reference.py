"""cost_based's tight loop (``_Group.options``, and ``rank`` over it) against the formulas written out
(``price_replica``, built from ``router.policies.pricing``'s per-action candidates): same actions, same plans, same
costs up to float rounding, on random clusters; and ``rank``'s decision is the shared pick step (``hold_back``)
over the written-out candidates."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from router.policies.base import Candidate, ClusterSnapshot, PoolHit, ReplicaColumns, RouteRequest
from router.policies.cost_based import HELD_BACK, CostBased, _candidate, _Group, hold_back, price_replica
from router.policies.pricing import Pricer
from tests.fakes.router import router_hw, router_replica, router_tier_map

HARDWARE = [router_hw(), router_hw("qwen3.5-27b", "h200-sxm5-141gb"), router_hw("qwen3-14b", "a100-sxm4-80gb", mfu=0.3)]


def _case(rng: random.Random) -> tuple[RouteRequest, list[PoolHit], list]:  # type: ignore[type-arg]
    bs = rng.choice([16, 32])
    prompt = rng.randint(1, 40_000)
    n_keys = prompt // bs if rng.random() < 0.9 else rng.randint(0, prompt // bs)
    request = RouteRequest("q", prompt, bs, [i.to_bytes(16, "big") for i in range(n_keys)])
    top = max(1, prompt // bs + 3)
    hits = [PoolHit(f"s{j}", f"node-{rng.randint(0, 3)}", rng.choice(["dram", "ssd"]), rng.randint(0, top),
                    rng.choice([0.0, rng.uniform(0, 0.05)]))
            for j in range(rng.randint(0, 5))]
    hw = rng.choice(HARDWARE)
    mixed = rng.random() < 0.4  # replicas of several hardware objects (calibrated ones: one per MFU grid point)
    replicas = [router_replica(f"r{i}", f"node-{rng.randint(0, 3)}",
                               queue_delay_s=rng.choice([0.0, rng.uniform(0, 0.2)]),
                               hbm_prefix_blocks=rng.choice([0, rng.randint(0, top)]),
                               hw=rng.choice(HARDWARE) if mixed else hw)
                for i in range(rng.randint(1, 8))]
    return request, hits, replicas


def replica_cases(rng: random.Random, n: int) -> Iterator[tuple[RouteRequest, list[tuple[PoolHit, int]], Any, int]]:
    """``n`` random cases, one item per replica: the request, its hits with their prefixes clamped to its full
    blocks (those left with any, as ``rank`` hands them to ``_Group``), the replica and its clamped HBM prefix."""
    for _ in range(n):
        request, hits, replicas = _case(rng)
        max_blocks = min(len(request.block_keys), request.prompt_tokens // request.block_size)
        clamped = [(h, min(h.prefix_blocks, max_blocks)) for h in hits if min(h.prefix_blocks, max_blocks) > 0]
        for r in replicas:
            yield request, clamped, r, min(r.hbm_prefix_blocks, max_blocks)


def _key(c: Candidate) -> tuple:  # type: ignore[type-arg]
    f = c.fetch
    plan = None if f is None else (f.shard_id, f.start_block, f.end_block)
    return (c.action.value, c.replica_id, c.reused_tokens, plan)


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("gain", [0.15, 0.0, None])
def test_options_match_the_written_out_formulas(staged: bool, gain: float | None) -> None:
    rng = random.Random(f"{staged}{gain}")
    pricer = Pricer(router_tier_map())
    splits_seen = 0
    for request, clamped, r, hb in replica_cases(rng, 400):
        group = _Group(pricer.coeffs(r.hw), float(request.prompt_tokens), request.block_size, clamped,
                       0.0 if gain is None else 1.0 - gain, staged)
        fast = [_candidate(r, plan, r.queue_delay_s + t, clamped) for t, plan in group.options(hb, r.node_id)]
        assert [_key(c) for c in fast] == [_key(c) for c in
                                           [_candidate(r, p, r.queue_delay_s + t, clamped)
                                            for t, p in group.priced(hb, r.node_id)]]
        ref = price_replica(pricer, r, request, [h for h, _ in clamped], split_min_gain=gain, split_staging=staged)
        assert sorted(map(_key, fast)) == sorted(map(_key, ref))
        by_key = {_key(c): c.predicted_ttft_s for c in ref}
        for c in fast:
            assert c.predicted_ttft_s == pytest.approx(by_key[_key(c)], rel=1e-9, abs=1e-12)
        splits_seen += sum(c.action.value == "split" for c in fast)
    if gain is not None:
        assert splits_seen > 0  # the cases reach SPLIT, so its branch is compared too


@pytest.mark.parametrize("uncertainty", [0.25, 0.0])
def test_rank_picks_what_the_pick_step_picks_from_the_written_out_candidates(uncertainty: float) -> None:
    """``rank``'s decision is ``hold_back`` over every written-out candidate of every replica (the cheapest one
    unless it is held back for the best HOLDER), and its cheapest candidate is the cheapest written-out one."""
    rng = random.Random(7)
    tiers = router_tier_map()
    pricer = Pricer(tiers)
    held_seen = 0
    for _ in range(300):
        request, hits, replicas = _case(rng)
        policy = CostBased(tier_map=tiers, rng=None, uncertainty=uncertainty)
        ranking = policy.rank(request, ClusterSnapshot(replicas, tuple(hits)))
        ref = [c for r in replicas for c in price_replica(pricer, r, request, hits, split_min_gain=0.15)]
        ref.sort(key=lambda c: c.predicted_ttft_s)
        assert min(c.predicted_ttft_s for c in ranking.candidates) == pytest.approx(
            ref[0].predicted_ttft_s, rel=1e-9, abs=1e-12)
        picked, _ = hold_back(ref, {r.replica_id: r.queue_delay_s for r in replicas}, uncertainty=uncertainty,
                              window_abs_s=policy.window_abs_s, window_rel=policy.window_rel)
        best = ranking.candidates[0]
        assert best.predicted_ttft_s == pytest.approx(picked[0].predicted_ttft_s, rel=1e-9, abs=1e-12)
        assert any(_key(c) == _key(best) and c.predicted_ttft_s == pytest.approx(best.predicted_ttft_s, rel=1e-9)
                   for c in picked if c.note != HELD_BACK)
        held_seen += picked[0] is not ref[0]
    assert held_seen > 0  # the cases reach the hold-back, so the pick is compared where it matters


def test_rank_reads_the_columns_as_it_reads_the_states() -> None:
    """A snapshot carrying its replicas as columns (the live router's) ranks exactly as one without (columns built
    from the states), with the random rotation of exact ties too (the same RNG draws)."""
    rng = random.Random(11)
    tiers = router_tier_map()
    for case in range(300):
        request, hits, replicas = _case(rng)
        seed = rng.random()
        a = CostBased(tier_map=tiers, rng=random.Random(seed)).rank(request, ClusterSnapshot(replicas, tuple(hits)))
        b = CostBased(tier_map=tiers, rng=random.Random(seed)).rank(
            request, ClusterSnapshot(replicas, tuple(hits), ReplicaColumns.of(replicas)))
        assert a.candidates == b.candidates and a.choosable == b.choosable, case
