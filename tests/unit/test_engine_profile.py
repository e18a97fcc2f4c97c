"""A replica's start-up engine profile (``router.hub.EngineProfile``: its device and timed cold prefills) sets the
router's prices before the replica's first request: the GPU profile detected from the device when none is
configured, and the replica's MFU fitted to the probe's prefills. The real ``LiveView`` and calibration; the hub
reply is built here."""

from __future__ import annotations

import dataclasses

import pytest

from configs import load_gpus
from configs.loader import gpu_for_device
from deployments.engine_probe import PROBE_FRACTIONS, probe_lengths
from router.cost import t_prefill
from router.hub import EngineProfile, PollReply, PrefillSample, ReplicaReport
from router.ingress_settings import IngressSettings, OpenAIFrontendSettings
from router.access import AccessSettings
from router.live_view import LiveView


def make_view(gpu_profile: str | None) -> LiveView:
    return LiveView.from_settings(IngressSettings(
        served_model_name="m", model_path="/nonexistent", engine_args={"model": "/nonexistent"}, max_model_len=4096,
        block_size=16, cache_salt="", policy="cost_based", model_spec="qwen3-14b", gpu_profile=gpu_profile, mfu=0.4,
        bw_util=0.7, seed=0, tiers={"local_dram": "cpu-dram"}, dtype="bfloat16", reasoning_parser=None,
        openai=OpenAIFrontendSettings(), access=AccessSettings()))


def probe(view: LiveView, device: str, mfu: float) -> EngineProfile:
    """What an engine with ``mfu`` on the view's (detected) GPU would measure: the cost model's own prefill time."""
    hw = view.hardware
    gpu = gpu_for_device(load_gpus(), device) or hw.gpu
    true_hw = dataclasses.replace(hw, gpu=gpu, mfu=mfu)
    return EngineProfile(device=device, prefills=[PrefillSample(n, t_prefill(true_hw.model, true_hw.gpu, n, mfu=mfu))
                                                  for n in probe_lengths(4096)])


def report(profile: EngineProfile, seq: int = 1, rid: str = "r1") -> ReplicaReport:
    return ReplicaReport(replica_id=rid, node_id="node-a", seq=seq, running=0, waiting=0, profile=profile)


def test_the_device_picks_the_gpu_profile_and_the_probe_fits_the_mfu() -> None:
    view = make_view(gpu_profile=None)
    assert view.hardware.gpu.name == "cpu-2core"  # the placeholder until a replica reports
    view.apply(PollReply(cursor=1, reports=[report(probe(view, "NVIDIA H100 80GB HBM3", mfu=0.12))]))
    assert view.hardware.gpu.name == "h100-sxm5-80gb"
    (row,) = view.replica_rows()
    assert row["gpu_profile"] == "h100-sxm5-80gb"
    assert row["mfu"] == pytest.approx(0.12, rel=0.05)  # the configured 0.4 replaced before any request


def test_a_configured_profile_is_kept_and_a_profile_is_applied_once() -> None:
    view = make_view(gpu_profile="a100-sxm4-80gb")
    view.apply(PollReply(cursor=1, reports=[report(probe(view, "NVIDIA H100 80GB HBM3", mfu=0.2))]))
    assert view.hardware.gpu.name == "a100-sxm4-80gb"
    first = view.replica_rows()[0]["mfu"]
    view.apply(PollReply(cursor=2, reports=[report(probe(view, "NVIDIA H100 80GB HBM3", mfu=0.2), seq=2)]))
    assert view.replica_rows()[0]["mfu"] == first  # every report carries it; it is observed once


def test_an_unknown_device_keeps_the_placeholder_and_still_calibrates() -> None:
    view = make_view(gpu_profile=None)
    view.apply(PollReply(cursor=1, reports=[report(probe(view, "cpu", mfu=0.03))]))
    assert view.hardware.gpu.name == "cpu-2core"
    view.apply(PollReply(cursor=2, reports=[report(probe(view, "Mystery GPU", mfu=0.03), rid="r2")]))
    assert view.hardware.gpu.name == "cpu-2core"
    assert {r["replica_id"]: round(r["mfu"], 3) for r in view.replica_rows()} == {"r1": 0.03, "r2": 0.03}


def test_probe_lengths_fit_the_model_and_give_the_fit_enough_points() -> None:
    assert len(probe_lengths(4096)) == len(PROBE_FRACTIONS) and max(probe_lengths(4096)) == 2048
    assert max(probe_lengths(512)) <= 504 and len(probe_lengths(512)) == len(PROBE_FRACTIONS)


def test_the_probe_also_fits_the_attention_rate_apart() -> None:
    """An engine whose attention costs 0.4 of its matrix products per FLOP: the probe's cold prefills of five lengths
    tell the two terms apart (the quadratic term grows faster), so the replica is priced with both before its first
    request, and ``kvstack status`` shows the scale."""
    view = make_view(gpu_profile="h100-sxm5-80gb")
    true_hw = dataclasses.replace(view.hardware, mfu=0.12, attn_scale=0.4)
    profile = EngineProfile(device="NVIDIA H100 80GB HBM3", prefills=[
        PrefillSample(n, t_prefill(true_hw.model, true_hw.gpu, n, mfu=0.12, attn_scale=0.4))
        for n in probe_lengths(4096)])
    view.apply(PollReply(cursor=1, reports=[report(profile)]))
    (row,) = view.replica_rows()
    assert row["mfu"] == pytest.approx(0.12, rel=0.03)
    assert row["attn_scale"] == pytest.approx(0.4, rel=0.03)
