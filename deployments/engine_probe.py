"""The start-up probe of a replica's engine: its device and a few timed cold prefills, for the routers' cost model.

Contract: ``probe_engine(engine, max_model_len, enabled)`` returns a ``router.hub.EngineProfile`` — the device
(``torch.cuda.get_device_name(0)``, or ``cpu``) and, when ``enabled``, ``PROBE_FRACTIONS`` cold prefills of random
prompts up to ``min(PROBE_MAX_TOKENS, max_model_len)`` tokens (after one untimed warm-up), each timed to its one
output token; the prefix cache is reset afterwards so the probe's blocks hold no HBM. Every prefill has a deadline;
on one missed the profile carries what was measured. Called once by ``deployments.replica.VLLMReplica.__init__``
after its engine started and before it publishes: the routers detect the GPU profile from the device and fit the
replica's MFU to the prefills (``router.live_view``), instead of pricing with static numbers until enough real
requests came (the ``cpu-2core`` numbers were ~10x optimistic).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import Any

from router.hub import EngineProfile, PrefillSample

log = logging.getLogger(__name__)

PROBE_FRACTIONS = (0.1, 0.25, 0.45, 0.7, 1.0)  # five lengths: the MFU fit needs five observations
PROBE_MAX_TOKENS = 2048
WARM_UP_TOKENS = 64
PREFILL_DEADLINE_S = 60.0


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no CUDA runtime: a CPU engine
        pass
    return "cpu"


def probe_lengths(max_model_len: int) -> list[int]:
    limit = max(16, min(PROBE_MAX_TOKENS, max_model_len - 8))
    return sorted({max(16, int(limit * f)) for f in PROBE_FRACTIONS})


async def _timed_prefill(engine: Any, token_ids: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    started = time.perf_counter()
    async for _ in engine.generate({"prompt_token_ids": token_ids}, params, request_id=f"kvstack-probe-{uuid.uuid4()}"):
        pass
    return time.perf_counter() - started


async def probe_engine(engine: Any, max_model_len: int, enabled: bool = True) -> EngineProfile:
    device = device_name()
    if not enabled:
        return EngineProfile(device=device)
    vocab = engine.model_config.get_vocab_size()
    rng = random.Random(uuid.uuid4().int)  # never the same prompt twice: every probe prefill is cold
    samples: list[PrefillSample] = []
    try:
        await asyncio.wait_for(_timed_prefill(engine, [rng.randrange(vocab) for _ in range(WARM_UP_TOKENS)]),
                               PREFILL_DEADLINE_S)
        for n in probe_lengths(max_model_len):
            seconds = await asyncio.wait_for(_timed_prefill(engine, [rng.randrange(vocab) for _ in range(n)]),
                                             PREFILL_DEADLINE_S)
            samples.append(PrefillSample(n, seconds))
    except asyncio.TimeoutError:
        log.warning("engine probe: a prefill missed its %.0f s deadline; %d samples kept", PREFILL_DEADLINE_S,
                    len(samples))
    finally:
        await engine.reset_prefix_cache()
    log.info("engine probe on %s: %s", device, ", ".join(f"{s.tokens} tok {s.seconds * 1e3:.0f} ms" for s in samples))
    return EngineProfile(device=device, prefills=samples)
