"""Faults in the SSD tier: a bit flipped in a block's bytes on disk, and a slab file truncated under the shard —
real files under a real shard on a real local Ray cluster, a real vLLM engine (CPU build) with the kvpool connector,
NIXL.

The pool first holds every prompt's blocks (a first pass saved them; then all demoted DRAM → SSD). The fault hits
the second block of every prompt on disk. The second pass must be served correctly: the shard finds the damage when
it promotes the block for a lease (its checksum, or a short read), counts it, drops the block and leases only the
blocks before it; vLLM computes the rest (and the connector saves what the shard lost again). (A truncated slab
also loses blocks that lie after the cut, of any prompt.) Every request's greedy tokens equal plain vLLM's for the
same compute split (``bench.frozen_shard.wrong_outputs``; the engine runs with vLLM's prefix caching off: the pool
is its only reuse).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.frozen_shard import BLOCK, make_prompts, stream, wrong_outputs
from bench.inproc import EngineSpec, connector_stats
from kvpool.events import Tier
from kvpool.keys import Namespace, block_keys

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8


def damage(infos: list[Any], mode: str) -> None:
    if mode == "bitflip":
        for info in infos:
            with open(info.path, "r+b") as f:
                f.seek(info.offset + 1000)
                byte = f.read(1)
                f.seek(info.offset + 1000)
                f.write(bytes([byte[0] ^ 0x10]))
    else:  # truncate the slab at the first damaged block: it and every block after it are gone from disk
        first = min(infos, key=lambda i: i.offset)
        os.truncate(first.path, first.offset + 100)


@pytest.mark.parametrize("mode", ["bitflip", "truncate"])
def test_damaged_ssd_blocks_are_misses_never_data(pool: Any, engines: Any, tiny_models: dict[str, str],
                                                  mode: str) -> None:
    model_id = f"faults-ssd-{mode}"
    cfg = pool.config(local="a", nodes=("a",), model_id=model_id)
    llm = engines.get(("ssd", mode), EngineSpec(model=tiny_models["dense"], max_model_len=2048,
                                                prefix_caching=False), cfg)
    prompts = make_prompts(4, prefixes=4, prefix_blocks=3, seed=11, tag=mode)
    first = stream(llm, {f"first-{i}": p for i, p in enumerate(prompts)}, MAX_TOKENS, in_flight=1)
    stats = connector_stats(llm)  # the saves are committed
    client = pool.client("a")
    keys = [block_keys(Namespace(model_id, stats["fingerprint"]), p, BLOCK) for p in prompts]
    assert client.demote([k for ks in keys for k in ks]) > 0
    infos = [client.entry_info(ks[1]) for ks in keys]
    assert all(i is not None and i.tier is Tier.SSD for i in infos)
    before = client.stats().counters
    damage(infos, mode)

    second = stream(llm, {f"second-{i}": p for i, p in enumerate(prompts)}, MAX_TOKENS, in_flight=1)
    after = client.stats().counters
    assert len(second.tokens) == 4  # every request completed
    assert after.get("checksum_failures_ssd", 0) - before.get("checksum_failures_ssd", 0) >= 4  # counted
    if mode == "bitflip":  # each damaged block dropped, never served; the block before it was
        assert all(second.reused[f"second-{i}"] == BLOCK for i in range(4))
        # the lease came back short on the engine's own shard: the blocks it had saved there and the shard lost
        # were saved again by the requests that recomputed them (a fresh, checksum-verified copy in DRAM)
        assert connector_stats(llm)["save_book"]["lost"] >= 4
        assert all(client.entry_info(ks[1]).tier is Tier.DRAM for ks in keys)
    assert all(second.reused[f"second-{i}"] <= BLOCK for i in range(4))  # nothing from or after a damaged block
    outputs = {rid: {"prompt": prompts[int(rid.split("-")[1])], "tokens": s.tokens[rid], "reused": s.reused[rid],
                     "computed_by": prompts[int(rid.split("-")[1])]}
               for s in (first, second) for rid in s.tokens}
    plain = engines.get(("plain", "dense"), EngineSpec(model=tiny_models["dense"], max_model_len=2048))
    assert wrong_outputs(plain, outputs, MAX_TOKENS) == []
    engines.close()
