"""SPLIT on an engine that loads only leading prefixes: compute the head, stage the tail on this node, then load.

The router's SPLIT plan says: blocks [0, start) of the prompt are computed, blocks [start, end) come from pool
shard ``plan.shard_id``. vLLM's connector API can only add externally loaded tokens right after the tokens the
engine already has, so the replica runs it in two steps (``router.policies.pricing.HwCoeffs.split_tail``, staged,
prices exactly this):
1. at once and concurrently: the head [0, start·bs) as a request of its own (one output token, flagged so the
   connector loads nothing: ``kvpool.connector.scheduler.NO_LOAD_PARAM``; vLLM's prefix cache keeps its blocks),
   and — when the plan's shard is on another node — this node's shard ``pull``s the tail blocks from it
   (``kvpool.shard.pull``);
2. then the request itself, hinting the connector at the shard that now holds the tail (``PLAN_PARAM``): vLLM finds
   the head in its prefix cache, the connector loads [start, end) on top, the rest is computed.
Every step has a deadline; any failure (pull refused, shard gone, head aborted) only costs speed: the request
still runs, the connector loads what the pool has, and vLLM computes the rest. Tokens are the same either way.

Who calls it: ``deployments.replica.VLLMReplica.generate`` for requests whose action is ``split``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from router.wire import FetchPlanMsg

log = logging.getLogger("kvstack.replica")

PULL_DEADLINE_S = 20.0  # the tail's pull, at most (within the source lease's default 30 s)


@dataclass
class SplitOutcome:
    """What staging did: the shard to hint the connector at, and how it went (for logs, stats and tests)."""

    hint_shard: str
    head_tokens: int
    head_s: float = 0.0
    pulled: int = 0
    pull_bytes: int = 0
    pull_s: float = 0.0
    error: str = ""


@dataclass
class SplitStats:
    splits: int = 0
    heads_computed: int = 0
    blocks_pulled: int = 0
    failures: int = 0


async def stage_split(
    engine: Any,
    *,
    request_id: str,
    prompt_token_ids: list[int],
    pool_keys: list[bytes],
    plan: FetchPlanMsg,
    block_size: int,
    node_id: str,
    local_shard: Any,
    local_shard_id: str,
    fingerprint: str,
    deadline_s: float,
    cache_salt: str = "",
    tensor_parallel: int = 1,
) -> SplitOutcome:
    """Run step 1 (module docstring) and return the shard the request should load the tail from.

    ``local_shard``: an ``AsyncShardClient`` of this node's shard (None: no pull, the tail loads from the plan's
    shard); ``pool_keys``: the prompt's block keys in the pool's namespace (rank 0's: every rank's are pulled for a
    ``tensor_parallel`` engine, ``kvpool.keys.rank_interleaved``); ``cache_salt``: the request's (the head is cached
    under it, or the request would not find it)."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    from kvpool.connector.scheduler import NO_LOAD_PARAM
    from kvpool.keys import rank_interleaved

    start, end = plan.start_block, plan.end_block
    head_tokens = start * block_size
    if not 0 < start < end <= len(pool_keys) or head_tokens >= len(prompt_token_ids):
        return SplitOutcome(plan.shard_id, 0, error=f"plan [{start},{end}) does not fit the prompt")
    outcome = SplitOutcome(plan.shard_id, head_tokens)
    head_id = f"{request_id}-split-head"

    async def head() -> None:
        t0 = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args={"kv_transfer_params": {NO_LOAD_PARAM: True}})
        head_prompt = tokens_input(prompt_token_ids[:head_tokens], cache_salt=cache_salt or None)
        async for _ in engine.generate(head_prompt, params, head_id):
            pass
        outcome.head_s = time.monotonic() - t0

    async def pull() -> None:
        t0 = time.monotonic()
        keys = rank_interleaved(pool_keys[start:end], tensor_parallel)
        reply = await local_shard.pull(plan.shard_id, keys, fingerprint, deadline_s=min(deadline_s, PULL_DEADLINE_S))
        outcome.pull_s = time.monotonic() - t0
        outcome.pulled = reply.pulled
        outcome.pull_bytes = reply.bytes_moved
        if reply.present + reply.pulled == len(keys):
            outcome.hint_shard = local_shard_id
        elif reply.error:
            outcome.error = f"pull: {reply.error}"

    tasks = [asyncio.ensure_future(head())]
    if local_shard is not None and plan.node_id != node_id and plan.shard_id != local_shard_id:
        tasks.append(asyncio.ensure_future(pull()))
    elif plan.shard_id == local_shard_id:
        outcome.hint_shard = local_shard_id
    try:
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            outcome.error = f"staging not done within {deadline_s:.1f} s"
            await engine.abort(head_id)
        for task in done:
            exc = task.exception()
            if exc is not None:
                outcome.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await engine.abort(head_id)
        raise
    if outcome.error:
        log.warning("split of %s: %s (the request runs anyway; the connector loads what the pool has)", request_id,
                    outcome.error)
    return outcome
