"""``deployments.split_staging``: the replica's two-step SPLIT, with fake neighbours (engine, node shard).

The real thing runs in ``tests/e2e/shared_serve/test_serve_local.py`` (real vLLM, real shards, real NIXL pull)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deployments.split_staging import stage_split
from kvpool.shard.wire import PullReply
from router.wire import FetchPlanMsg

BS = 4
TOKENS = list(range(100, 100 + 6 * BS + 3))
KEYS = [bytes([i]) * 16 for i in range(6)]


class FakeEngine:
    def __init__(self, head_s: float = 0.0) -> None:
        self.head_s = head_s
        self.calls: list[tuple[list[int], Any, str]] = []
        self.aborted: list[str] = []

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str) -> AsyncIterator[Any]:
        self.calls.append((prompt["prompt_token_ids"], params, request_id))
        await asyncio.sleep(self.head_s)
        yield object()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeShard:
    def __init__(self, reply: PullReply | None = None, error: Exception | None = None) -> None:
        self.reply, self.error = reply, error
        self.calls: list[tuple[str, list[bytes], float]] = []

    async def pull(self, source: str, keys: list[bytes], fingerprint: str, *, deadline_s: float) -> PullReply:
        self.calls.append((source, list(keys), deadline_s))
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


def reply(pulled: int, present: int = 0, failed: int = 0, error: str = "") -> PullReply:
    return PullReply("local", "e", pulled + present + failed, present, pulled, failed, 0, pulled * 100, 0.01, error)


def run(engine: FakeEngine, shard: FakeShard | None, plan: FetchPlanMsg, deadline_s: float = 5.0) -> Any:
    return asyncio.run(stage_split(
        engine, request_id="r1", prompt_token_ids=TOKENS, pool_keys=KEYS, plan=plan, block_size=BS,
        node_id="node-b", local_shard=shard, local_shard_id="local", fingerprint="fp", deadline_s=deadline_s))


def test_head_is_computed_without_pool_loads_while_the_tail_is_pulled_here() -> None:
    engine, shard = FakeEngine(), FakeShard(reply(pulled=4))
    out = run(engine, shard, FetchPlanMsg("remote", "node-a", "dram", 2, 6))
    (head, params, rid), = engine.calls
    assert head == TOKENS[: 2 * BS] and rid == "r1-split-head" and params.max_tokens == 1
    assert params.extra_args == {"kv_transfer_params": {"kvpool_no_load": True}}
    assert shard.calls == [("remote", KEYS[2:6], 5.0)]
    assert out.hint_shard == "local" and out.pulled == 4 and not out.error


def test_a_partial_or_failed_pull_leaves_the_tail_on_the_plans_shard() -> None:
    out = run(FakeEngine(), FakeShard(reply(pulled=2, failed=2, error="checksum")),
              FetchPlanMsg("remote", "node-a", "dram", 2, 6))
    assert out.hint_shard == "remote" and "checksum" in out.error
    out = run(FakeEngine(), FakeShard(error=RuntimeError("shard gone")), FetchPlanMsg("remote", "node-a", "dram", 2, 6))
    assert out.hint_shard == "remote" and "shard gone" in out.error
    out = run(FakeEngine(), FakeShard(reply(pulled=1, present=3)), FetchPlanMsg("remote", "node-a", "dram", 2, 6))
    assert out.hint_shard == "local" and not out.error  # already held here counts


def test_a_tail_on_this_node_is_not_pulled() -> None:
    shard = FakeShard(reply(pulled=4))
    out = run(FakeEngine(), shard, FetchPlanMsg("local", "node-b", "ssd", 1, 5))
    assert shard.calls == [] and out.hint_shard == "local" and not out.error


def test_staging_past_its_deadline_aborts_the_head_and_moves_on() -> None:
    engine = FakeEngine(head_s=5.0)
    out = run(engine, FakeShard(reply(pulled=4)), FetchPlanMsg("remote", "node-a", "dram", 2, 6), deadline_s=0.2)
    assert engine.aborted == ["r1-split-head"] and "within 0.2 s" in out.error
    assert out.hint_shard == "local"  # the pull finished; only the head was too slow


@pytest.mark.parametrize("start,end", [(0, 4), (4, 4), (2, 7), (6, 6)])
def test_a_plan_that_does_not_fit_the_prompt_stages_nothing(start: int, end: int) -> None:
    engine, shard = FakeEngine(), FakeShard(reply(pulled=4))
    out = run(engine, shard, FetchPlanMsg("remote", "node-a", "dram", start, end))
    assert engine.calls == [] and shard.calls == [] and "does not fit" in out.error and out.hint_shard == "remote"
