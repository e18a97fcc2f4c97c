"""cost_based leaves the HBM holder only when that pays for the model's uncertainty (``cost_based.hold_back``).

The situation measured live (issue 13, no HBM pressure, no queue): a revisit whose previous turn's replica holds
1,280 of the prompt's tokens in HBM, an idle other replica, and a pool hit of 1,024 tokens on the other replica's
node. The router is the one ``kvstack serve`` builds from ``configs/local.yaml`` (tiny-qwen3 on the ``cpu-2core``
profile, the box's loopback tiers, the live policy options), through the real ``LiveView``; no Ray. With nothing
waiting, a replica's queue delay is its calibrated fixed overhead (``LiveView.queue_delay_s``), fitted per replica
from its own prefills; two replicas' fits differ by noise (the calibrator prices fits within
``router.calibration.SAME_SPEED_BAND`` of each other alike; these tests switch that off, so the margin alone must
hold). Here they differ by 0.1 s, more than the HOLDER's advantage in prefill (~0.07 s): without the margin the FETCH
elsewhere looks 7% cheaper and wins (what the live run showed: 35 of 36 revisits fetched 1,024 tokens while the
holder had 1,280).
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import pytest

from cluster.serve_config import DEFAULT_CONFIG, load_serve_config
from deployments.app import ingress_settings
from router.cost import prefill_flops
from router.live_view import LiveView
from router.policies.base import Action, ClusterSnapshot, PoolHit, RouteRequest
from router.policies.cost_based import HELD_BACK, CostBased
from tests.fakes.router import router_keys

BS = 128  # configs/local.yaml engine.block_size
PROMPT = 1400  # a third turn: 10 full blocks
HOLDER_BLOCKS = 10  # 1,280 tokens in the holder's HBM
POOL_BLOCKS = 8  # 1,024 tokens in the pool


def live_view(overheads: dict[str, float]) -> LiveView:
    """The router ``kvstack serve`` runs with the embedded default config, each replica's fixed overhead fitted
    from 24 prefills (the calibrator's own line: seconds = overhead + FLOPs / (MFU · peak)), enough for its own fit
    to price it even where its sibling's is faster (``Calibrator.trust_obs``)."""
    cfg = load_serve_config(DEFAULT_CONFIG)
    assert (cfg.app.router.policy, cfg.app.router.model_spec, cfg.app.router.gpu_profile) == (
        "cost_based", "tiny-qwen3", "cpu-2core")
    assert cfg.app.engine.block_size == BS
    view = LiveView.from_settings(ingress_settings(cfg.app))
    # Priced each by its own fit: the calibrator prices fits within ``SAME_SPEED_BAND`` of each other alike, so the
    # fits' noise reaches the pick only past the band; here the margin is what must hold, whatever the fits say.
    view.calibrator.same_speed_band = 0.0
    hw = view.hardware
    flops_per_s = hw.mfu * hw.gpu.bf16_tflops * 1e12
    for rid, overhead in overheads.items():
        for tokens in (200, 400, 700, 1000, 1300, 1600) * 4:
            seconds = overhead + prefill_flops(hw.model, tokens) / flops_per_s
            view.calibrator.observe_prefill(rid, hw, tokens, 0, seconds)
        assert view.calibrator.trusted(rid) and view.calibrator.overhead_s(rid) == pytest.approx(overhead, rel=1e-6)
    return view


def snapshot(view: LiveView, *, holder_waiting: int = 0, holder_blocks: int = HOLDER_BLOCKS,
             hit: PoolHit | None = None) -> ClusterSnapshot:
    now = time.monotonic()
    view.book.report("holder", "node-1", 0, holder_waiting, now, None)
    view.book.report("idle", "node-2", 0, 0, now, None)
    for rid in ("holder", "idle"):
        view.book.loads[rid].mean_ttft_s = 1.0
        view.book.touch(rid)
    states = {r.replica_id: r for r in view.book.states(now)}  # queue delay as the live router computes it
    holder = msgspec.structs.replace(states["holder"], hbm_prefix_blocks=holder_blocks)
    hit = hit or PoolHit("shard-2", "node-2", "dram", POOL_BLOCKS)
    return ClusterSnapshot([holder, states["idle"]], (hit,))


def request(i: int = 0) -> RouteRequest:
    return RouteRequest(f"turn-3-{i}", PROMPT, BS, router_keys(PROMPT // BS))


def test_a_fetch_elsewhere_within_the_uncertainty_loses_to_the_holder() -> None:
    view = live_view({"holder": 0.40, "idle": 0.30})
    snap = snapshot(view)
    policy = view.runner.policy
    assert isinstance(policy, CostBased) and policy.uncertainty == 0.25
    # Without the margin (the pick before issue 13): the FETCH of 1,024 tokens onto the idle replica is the cheapest
    # prediction, although the holder reuses 1,280.
    naive = CostBased(tier_map=view.tier_map, rng=None, uncertainty=0.0, window_rel=0.0, window_abs_s=0.0,
                      allow_split=policy.allow_split, split_staging=policy.split_staging).rank(request(), snap)
    fetch = naive.candidates[0]
    holder = next(c for c in naive.candidates if c.action is Action.HOLDER)
    assert (fetch.action, fetch.replica_id, fetch.reused_tokens) == (Action.FETCH, "idle", 1024), naive.reason
    assert (holder.replica_id, holder.reused_tokens) == ("holder", 1280)
    assert 0.9 * holder.predicted_ttft_s < fetch.predicted_ttft_s < holder.predicted_ttft_s  # within the uncertainty
    # The policy the live router runs: the holder.
    record = view.runner.decide(request(), snap)
    assert (record.action, record.replica_id, record.hbm_tokens, record.fetched_tokens) == (
        Action.HOLDER, "holder", 1280, 0), record.reason
    assert record.best_predicted_ttft_s == pytest.approx(fetch.predicted_ttft_s)  # the regret shows what it costs
    held = [c for c in record.alternatives if c.note == HELD_BACK]
    assert held and held[0].action is Action.FETCH and held[0].replica_id == "idle"
    reason = view.audit.get(record.request_id).reason  # type: ignore[union-attr]
    assert reason.startswith("holder holder:") and "held back" in reason


def test_a_queue_on_the_holder_still_pays_for_the_fetch() -> None:
    view = live_view({"holder": 0.40, "idle": 0.30})
    snap = snapshot(view, holder_waiting=3)  # three requests ahead, ~1 s each
    record = view.runner.decide(request(), snap)
    assert (record.action, record.replica_id, record.fetched_tokens) == (Action.FETCH, "idle", 1024), record.reason
    holder = next(c for c in record.alternatives if c.action is Action.HOLDER)
    assert record.predicted_ttft_s < 0.75 * holder.predicted_ttft_s


def test_the_holders_own_queue_does_not_count_against_fetching_on_top_of_its_prefix() -> None:
    # The holder has 8 blocks, its node's shard 10: fetching the 2 beyond saves ~0.06 s of prefill for ~5 ms of
    # transfer, 12% of the whole TTFT with the overhead (0.40 s) but more than 25% of the work; the overhead is in
    # both predictions. The same 10 blocks fetched onto the idle replica (same overhead) is held back.
    view = live_view({"holder": 0.40, "idle": 0.40})
    snap = snapshot(view, holder_blocks=POOL_BLOCKS, hit=PoolHit("shard-1", "node-1", "dram", HOLDER_BLOCKS))
    record = view.runner.decide(request(), snap)
    assert (record.action, record.replica_id, record.hbm_tokens, record.fetched_tokens) == (
        Action.FETCH, "holder", 1024, 256), record.reason
    holder = next(c for c in record.alternatives if c.action is Action.HOLDER)
    assert 0.8 * holder.predicted_ttft_s < record.predicted_ttft_s
    held = {(c.action, c.replica_id) for c in record.alternatives if c.note == HELD_BACK}
    assert held == {(Action.FETCH, "idle"), (Action.RECOMPUTE, "holder")}


@pytest.mark.parametrize("fetch_minus_holder_s", [-2e-4, 2e-4])
def test_a_near_tie_goes_to_the_holder_even_through_the_runners_tie_break(fetch_minus_holder_s: float) -> None:
    # The idle replica's overhead set so that the FETCH there is predicted 0.2 ms cheaper / dearer than the HOLDER:
    # inside the runner's tie window (0.5 ms), which used to pick either at random. With no uncertainty margin at
    # all, the near-tie rule alone (the policy's window) gives every decision to the holder.
    view = live_view({"holder": 0.40, "idle": 0.30})
    naive = CostBased(tier_map=view.tier_map, rng=None, uncertainty=0.0, window_rel=0.0, window_abs_s=0.0)
    cands = naive.rank(request(), snapshot(view)).candidates
    gap = next(c for c in cands if c.action is Action.HOLDER).predicted_ttft_s - cands[0].predicted_ttft_s
    view = live_view({"holder": 0.40, "idle": 0.30 + gap + fetch_minus_holder_s})
    view.runner.policy = CostBased(tier_map=view.tier_map, uncertainty=0.0)
    view.runner.anti_herding = False
    snap = snapshot(view)
    ranking = view.runner.policy.rank(request(), snap)
    fetch = next(c for c in ranking.candidates if c.action is Action.FETCH)
    holder = next(c for c in ranking.candidates if c.action is Action.HOLDER)
    assert fetch.predicted_ttft_s - holder.predicted_ttft_s == pytest.approx(fetch_minus_holder_s, abs=1e-9)
    picks = Counter((r.action, r.replica_id) for r in (view.runner.decide(request(i), snap) for i in range(200)))
    assert picks == {(Action.HOLDER, "holder"): 200}
