"""Tensor-parallel engines key each rank's heads apart (issue 16, item 4): ``kvpool.keys.rank_key`` /
``rank_interleaved``, the world size in the layout digest, the connector accepting TP and refusing PP with a reason.
``vllm.config.ParallelConfig`` is vLLM's own. The scheduler's rank-interleaved lookups and leases are in
``test_scheduler_async.py``; a real TP=2 engine saving and loading through real shards in
``tests/e2e/test_reuse_correctness.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpool.connector.layout import model_digest
from kvpool.connector.worker import check_parallelism
from kvpool.keys import Namespace, block_keys, rank_interleaved, rank_key
from kvpool.layout import LayoutError


def test_a_single_rank_engine_is_accepted() -> None:
    from vllm.config import ParallelConfig

    assert check_parallelism(ParallelConfig()) == 1


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_engines_are_accepted_with_their_world_size(tp: int) -> None:
    from vllm.config import ParallelConfig

    config = ParallelConfig()
    config.tensor_parallel_size = tp  # as the engine's config holds it
    assert check_parallelism(config) == tp


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (4, 2)])
def test_pipeline_parallel_engines_are_refused_with_the_reason(tp: int, pp: int) -> None:
    from vllm.config import ParallelConfig

    config = ParallelConfig()
    config.tensor_parallel_size, config.pipeline_parallel_size = tp, pp
    with pytest.raises(LayoutError) as err:
        check_parallelism(config)
    assert f"pipeline_parallel_size={pp}" in str(err.value) and "app.pool.enabled: false" in str(err.value)


def test_rank_zero_keeps_the_routers_key_and_every_other_rank_gets_its_own() -> None:
    keys = block_keys(Namespace("m", "fp"), list(range(64)), 16)
    for world in (1, 2, 4):
        assert [rank_key(k, 0, world) for k in keys] == keys  # what the router computes and indexes
    twos = [[rank_key(k, r, 2) for r in range(2)] for k in keys]
    fours = [[rank_key(k, r, 4) for r in range(4)] for k in keys]
    every = [k for row in twos + fours for k in row[1:]] + keys
    assert len(set(every)) == len(every)  # ranks, worlds and blocks never share a key
    assert all(len(k) == 16 for k in every)
    assert rank_key(keys[0], 1, 2) == rank_key(bytearray(keys[0]), 1, 2)  # deterministic, any bytes-like
    with pytest.raises(ValueError):
        rank_key(keys[0], 2, 2)
    with pytest.raises(ValueError):
        rank_key(keys[0], -1, 2)


def test_interleaved_keys_are_block_major() -> None:
    keys = block_keys(Namespace("m", "fp"), list(range(48)), 16)
    assert rank_interleaved(keys, 1) == keys
    assert rank_interleaved(keys, 2) == [rank_key(k, r, 2) for k in keys for r in range(2)]
    assert rank_interleaved(keys, 3)[3 * 2 : 3 * 3] == [rank_key(keys[2], r, 3) for r in range(3)]
    assert rank_interleaved([], 4) == []


def test_the_world_size_is_in_the_layout_digest_and_a_single_rank_digest_is_unchanged() -> None:
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec="spec")])
    one = model_digest("{}", cfg, "auto")
    assert model_digest("{}", cfg, "auto", tensor_parallel=1) == one
    assert len({one, model_digest("{}", cfg, "auto", tensor_parallel=2),
                model_digest("{}", cfg, "auto", tensor_parallel=4)}) == 3
