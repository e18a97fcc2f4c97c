"""Faults of the pool's capacity and of its shards' lives, under a stream of requests with shared prefixes through a
real vLLM engine (CPU build) with the kvpool connector, on a real local Ray cluster with real shards and NIXL:

1. a full pool: DRAM all reserved by another writer, the tiny SSD tier full of what DRAM demoted — saves find no
   room, leases find nothing they can promote; serving goes on, the pool serves again once room is back;
2. blocks evicted between the lookup and the lease: the lease returns fewer blocks than the lookup promised; the
   request loads what it was leased and recomputes the rest;
3. a lease that expires while its load waits: the shard's sweeper frees it and the slots are rewritten before the
   worker reads them; the checksums after the transfer turn the read into a failed load (recomputed), never data;
4. a shard restarted under the same name while the engine holds the old one's handle and transfer metadata: no read
   reaches the old epoch; the connector finds the new shard by name, re-adds its peer, and the pool serves again.

Cases 1-3 run on extra shards of their own on node c (``extra`` below: tiny stores the faults can fill); the
fault is injected from outside the connector (a client of the shard, or ``tests.faults.pool_fault_connector``'s hooks
between the lookup and the lease and before a load). Every request runs one at a time (vLLM's CPU kernels are not
batch-invariant; the references run alone) with its wall time bounded; its greedy tokens must equal plain vLLM's
for the same compute split (``bench.frozen_shard.wrong_outputs``; vLLM's prefix caching is off: the pool is the
engine's only reuse).

What these cases found in the connector (fixed with them): an engine never saved a block again once it had saved it
(the save book's "saved" outlived the shard's copy: an evicted block, a restarted shard's whole content — case 4
never recovered); saves the saver never attempted (the shard's breaker open while it restarts) spent the blocks'
retry budget; a request's ``loaded_tokens`` counted leased blocks whose load then failed (case 3); and the worker
asked a shard's breaker twice per load, refusing its own half-open probe — after a restart under the same name
(a new epoch: its metadata is fetched) loads from the shard failed forever.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from bench.frozen_shard import BLOCK, Stream, make_prompts, stream, wrong_outputs
from bench.inproc import EngineSpec, connector_stats
from kvpool.keys import Namespace, block_keys
from tests.faults import pool_fault_connector as hooks

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 8
HOOKED = ("HookedKvPoolConnector", "tests.faults.pool_fault_connector")
FULL_DRAM, FULL_SSD = 12, 6  # case 1's shard: a tiny DRAM tier over a tinier SSD tier
TIGHT_DRAM = 32  # cases 2 and 3: DRAM only, so a reservation of every slot evicts every unpinned block
LEASE_TTL_S = 2.0  # cases 2 and 3: the connector's lease TTL (a healthy load reads within milliseconds)
TIGHT_MODEL = "faults-tight"  # cases 2 and 3: the model id of their engine on the "tight" shard
REQUEST_S = 30.0  # no request of a healthy or faulted phase takes longer (a prefill of ~500 tokens: ~1 s here)


# ---------------------------------------------------------------------------------------------- fixtures, helpers
class Extra:
    """Shards of this module on node c, named so the connector finds them (outside the registry's prefix: the
    pool's discovery never lists them)."""

    def __init__(self, pool: Any, tmp: Any) -> None:
        from kvpool.shard.wire import ShardConfig
        from kvpool.store import StoreConfig
        from tests.e2e.conftest import SLOT_BYTES

        self.pool, self.handles = pool, {}
        full = StoreConfig(slot_bytes=SLOT_BYTES, dram_slots=FULL_DRAM, ssd_dir=str(tmp / "full"), ssd_slots=FULL_SSD,
                           shared_arena=True)
        tight = StoreConfig(slot_bytes=SLOT_BYTES, dram_slots=TIGHT_DRAM, shared_arena=True)
        for name, store in (("full", full), ("tight", tight)):
            self.handles[name] = start_shard(pool.handles["c"].node_id, f"kvstack-faults-{name}",
                                             ShardConfig(shard_id=f"faults-{name}", store=store, backend="nixl"))

    def config(self, name: str, **kw: Any) -> Any:
        from kvpool.connector.config import ConnectorConfig, ShardRef

        h = self.handles[name]
        return ConnectorConfig(shards=[ShardRef(h.shard_id, f"kvstack-faults-{name}", h.node_id)],
                               local_shard=h.shard_id, **kw)

    def client(self, name: str) -> Any:
        return self.handles[name].client(deadline_s=30.0)


def start_shard(node_id: str, actor_name: str, cfg: Any) -> Any:
    """One named shard on ``node_id`` (``kvpool.shard.placement``'s mechanism, as ``build_pool`` uses it); retried
    while the name is still held by a shard just killed (Ray frees a killed actor's name asynchronously)."""
    from kvpool.shard.placement import _start_shards
    from kvpool.shard.wire import SHARD_NAMESPACE

    end = time.monotonic() + 60.0
    while True:
        try:
            (h,) = _start_shards(lambda _nid, _ip: cfg, include=lambda n: n["NodeID"] == node_id,
                                 actor_name=lambda _nid: actor_name, namespace=SHARD_NAMESPACE, ready_deadline_s=120.0)
            return h
        except ValueError:  # "actor name already taken": the killed one's name is not free yet
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def extra(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extra]:
    from kvpool.shard.placement import stop_shards

    ex = Extra(pool, tmp_path_factory.mktemp("faults-ssd"))
    try:
        yield ex
    finally:
        stop_shards(list(ex.handles.values()))


class Run:
    """Every request of one test: prompts, results, and the prompt that computed each one's reused blocks."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.outputs: dict[str, dict[str, Any]] = {}
        self.request_s: dict[str, float] = {}

    def go(self, prompts: dict[str, list[int]], computed_by: dict[str, list[int]] | None = None) -> Stream:
        """Run ``prompts`` one at a time, each once the saves of the one before are committed;
        ``computed_by[rid]``: the prompt whose prefill computed the pool blocks that request may reuse (default:
        itself)."""
        out = Stream()
        for rid, prompt in prompts.items():
            s = stream(self.llm, {rid: prompt}, MAX_TOKENS, in_flight=1, deadline_s=300.0)
            connector_stats(self.llm)  # its saves are committed before the next request looks up
            self.outputs[rid] = {"prompt": prompt, "tokens": s.tokens[rid], "reused": s.reused[rid],
                                 "computed_by": (computed_by or {}).get(rid, prompt)}
            for name in ("tokens", "reused", "request_s"):
                getattr(out, name).update(getattr(s, name))
        self.request_s.update(out.request_s)
        return out

    def check(self, engines: Any, tiny_models: dict[str, str]) -> None:
        """Every request completed, within ``REQUEST_S``, with plain vLLM's tokens for the same compute split."""
        assert all(len(o["tokens"]) == MAX_TOKENS for o in self.outputs.values())
        assert max(self.request_s.values()) < REQUEST_S, self.request_s
        plain = engines.get(("plain", "dense"), EngineSpec(model=tiny_models["dense"], max_model_len=2048))
        assert wrong_outputs(plain, self.outputs, MAX_TOKENS) == []
        engines.close()

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.outputs), "max_request_s": round(max(self.request_s.values()), 2),
                "pool_hits": sum(1 for o in self.outputs.values() if o["reused"])}


def phase(tag: str, n: int, *, prefixes: int, seed: int) -> dict[str, list[int]]:
    """``n`` prompts over ``prefixes`` shared prefixes of 3 blocks (``seed`` picks the prefixes, ``tag`` the
    tails), keyed ``<tag>-<i>``; prompt i uses prefix ``i % prefixes``."""
    return {f"{tag}-{i}": p for i, p in
            enumerate(make_prompts(n, prefixes=prefixes, prefix_blocks=3, seed=seed, tag=tag))}


def engine(engines: Any, key: str, tiny_models: dict[str, str], cfg: Any) -> Any:
    spec = EngineSpec(model=tiny_models["dense"], max_model_len=2048, prefix_caching=False)  # the pool: only reuse
    return engines.get(("pool-faults", key), spec, cfg, connector_class=HOOKED)


def tight_case(engines: Any, extra: Extra, tiny_models: dict[str, str], warm: dict[str, list[int]]
               ) -> tuple[Any, Any, Run, dict[str, int]]:
    """Cases 2 and 3: the engine on the DRAM-only "tight" shard with the short lease TTL (one engine for both),
    its client, a ``Run`` after the ``warm`` prompts (their blocks saved) and the counters then. Its leases start at
    the allocation (``lease_on_lookup`` off), so a fault fits between the lookup and the lease (case 2); with the
    default, the lookup's own job leases, and what it could not pin is never offered
    (``tests/unit/test_scheduler_async.py``)."""
    llm = engine(engines, "tight", tiny_models,
                 extra.config("tight", model_id=TIGHT_MODEL, lease_ttl_s=LEASE_TTL_S, lease_on_lookup=False))
    run = Run(llm)
    run.go(warm)
    return llm, extra.client("tight"), run, counters(llm)


def counters(llm: Any) -> dict[str, int]:
    """The connector's counters, flat (``<role>.<name>``), once its pool calls and saves so far are done."""
    stats = connector_stats(llm)
    return {f"{role}.{k}": int(v) for role in ("scheduler", "worker", "save_book")
            for k, v in stats.get(role, {}).items() if isinstance(v, (int, float))}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def keys_of(llm: Any, model_id: str, prompt: list[int]) -> list[bytes]:
    fp = connector_stats(llm)["fingerprint"]
    return [bytes(k) for k in block_keys(Namespace(model_id, fp), prompt, BLOCK)]


# ---------------------------------------------------------------------------------------------- 1. a full pool
def test_full_pool_refuses_saves_and_serving_goes_on(pool: Any, extra: Extra, engines: Any,
                                                     tiny_models: dict[str, str]) -> None:
    t_start = time.perf_counter()
    model_id = "faults-full"
    llm = engine(engines, "full", tiny_models, extra.config("full", model_id=model_id))
    client = extra.client("full")
    run = Run(llm)
    warm = phase("warm", 2, prefixes=2, seed=21)
    run.go(warm)
    healthy = phase("healthy", 2, prefixes=2, seed=21)
    s = run.go(healthy, {rid: warm[f"warm-{i}"] for i, rid in enumerate(healthy)})
    assert all(s.reused[rid] == 3 * BLOCK for rid in healthy)  # the pool served before the fault

    # another writer reserves every DRAM slot: DRAM's blocks are demoted until the 6-slot SSD is full, the rest evicted
    hog = client.reserve(FULL_DRAM).reservation
    st = client.stats()
    assert len(hog.slots) == FULL_DRAM and st.dram.free == 0 and st.dram.blocks == 0 and st.ssd.free == 0
    # the victims of one reserve move together: those that find no SSD slot are evicted (from DRAM) at once
    assert st.counters["evictions_ssd"] + st.counters["evictions_dram"] > 0
    c1 = counters(llm)
    try:
        full = {**phase("full", 2, prefixes=2, seed=21), **phase("fresh", 2, prefixes=1, seed=22)}
        s = run.go(full)
        c2 = counters(llm)
    finally:
        client.abort(hog.reservation_id)
    d = delta(c2, c1)
    assert all(v == 0 for v in s.reused.values())  # nothing could be promoted into a full DRAM: all recomputed
    assert d.get("worker.blocks_no_room", 0) > 0 and d.get("save_book.failed", 0) > 0  # saves refused, counted
    assert d.get("worker.blocks_committed", 0) == 0
    # the pool held the prefix in SSD; the lookup's lease got nothing (no DRAM to promote into): nothing was offered
    assert d.get("scheduler.lookup_leases_empty", 0) > 0 and d.get("scheduler.loads_planned", 0) == 0

    # room again: the fresh prefix (whose saves were refused) is saved by the next request computing it, then served
    recovered_at = time.perf_counter()
    fresh_prompt = full["fresh-0"]
    recovery_s, computer, i = -1.0, None, 0
    while time.perf_counter() - recovered_at < 60.0:
        rid = f"recover-{i}"
        prompt = phase("recover", i + 1, prefixes=1, seed=22)[rid]
        s = run.go({rid: prompt}, {rid: computer} if computer is not None else None)
        connector_stats(llm)  # its saves are written
        if s.reused[rid]:
            recovery_s = time.perf_counter() - recovered_at
            break
        if computer is None and client.entry_info(keys_of(llm, model_id, fresh_prompt)[0]) is not None:
            computer = prompt
        i += 1
    assert recovery_s > 0
    assert prompt[: 3 * BLOCK] == fresh_prompt[: 3 * BLOCK]
    c3 = counters(llm)
    assert delta(c3, c2).get("save_book.retried", 0) > 0  # the refused blocks were planned again, and saved
    print({"case": "full pool", **run.summary(), "fault_counters": d, "recovery_s": round(recovery_s, 2),
           "shard": {k: v for k, v in client.stats().counters.items() if v}})
    run.check(engines, tiny_models)
    print({"case": "full pool", "test_s": round(time.perf_counter() - t_start, 1)})


# ---------------------------------------------------------------------------------------------- 2. evicted early
def test_blocks_evicted_between_lookup_and_lease_are_recomputed(pool: Any, extra: Extra, engines: Any,
                                                                tiny_models: dict[str, str]) -> None:
    t_start = time.perf_counter()
    model_id = TIGHT_MODEL
    warm = phase("warm", 2, prefixes=2, seed=31)
    llm, client, run, c0 = tight_case(engines, extra, tiny_models, warm)
    promised: dict[str, int] = {}

    def evict_all_but_first(sched: Any, request: Any, n_ext: int) -> bool:
        """Between the lookup (it promised n_ext tokens) and the lease: pin every block this test saved except the
        promised ones after the first (leases of this test's own), take every other slot with a reservation (DRAM
        only: every unpinned block is evicted), give both back. Of the promised blocks, the shard now holds only
        the first."""
        match = sched._matches.get(request.request_id)
        if match is None or match.end - match.start < 2:
            return False
        fp = sched.fingerprint
        keys = [bytes(k) for k in sched._keys(sched._reqs[request.request_id])[match.start:match.end]]
        known = {bytes(k) for o in run.outputs.values()
                 for k in block_keys(Namespace(model_id, fp), o["prompt"], BLOCK)}
        pins = [client.lease([k], fp, 30.0).lease.lease_id for k in sorted(known - set(keys[1:]))]
        hog = client.reserve(TIGHT_DRAM).reservation
        client.abort(hog.reservation_id)
        for lease_id in pins:
            if lease_id:
                client.release(lease_id)
        assert client.lookup(keys, fp).result.prefix == 1
        promised[request.request_id.rsplit("-", 1)[0]] = n_ext  # vLLM suffixes the request ids it was given
        return True

    hooks.arm("before_lease", evict_all_but_first)
    try:
        evicted = phase("evicted", 2, prefixes=2, seed=31)
        s = run.go(evicted, {rid: warm[f"warm-{i}"] for i, rid in enumerate(evicted)})
    finally:
        hooks.disarm()
    c1 = counters(llm)
    d = delta(c1, c0)
    assert promised == {rid: 3 * BLOCK for rid in evicted}  # the lookup promised the 3 prefix blocks, each time
    assert all(s.reused[rid] == BLOCK for rid in evicted)  # the lease gave 1 block: loaded; the other 2 recomputed
    assert d.get("scheduler.leases_short", 0) == 2 and d.get("worker.blocks_loaded", 0) == 0
    assert d.get("worker.blocks_failed", 0) == 4  # the 2 blocks per request that were not leased: recomputed
    # the connector saw the local shard lose blocks it had saved: the recomputed blocks were saved again
    assert d.get("save_book.lost", 0) == 4
    assert all(client.lookup(keys_of(llm, model_id, p)[:3], connector_stats(llm)["fingerprint"]).result.prefix == 3
               for p in evicted.values())
    # the pool still serves: a new prefix is saved and served
    after = phase("after", 2, prefixes=1, seed=32)
    s = run.go(after, {"after-1": after["after-0"]})
    assert s.reused["after-1"] == 3 * BLOCK
    print({"case": "evicted between lookup and lease", **run.summary(), "fault_counters": d,
           "shard": {k: v for k, v in client.stats().counters.items() if v}})
    run.check(engines, tiny_models)
    print({"case": "evicted between lookup and lease", "test_s": round(time.perf_counter() - t_start, 1)})


# ---------------------------------------------------------------------------------------------- 3. lease expired
def test_lease_expired_before_the_load_is_never_data(pool: Any, extra: Extra, engines: Any,
                                                     tiny_models: dict[str, str]) -> None:
    from kvpool.transfer.base import BlockOp

    t_start = time.perf_counter()
    warm = phase("warm-ttl", 1, prefixes=1, seed=41)
    llm, client, run, c0 = tight_case(engines, extra, tiny_models, warm)
    expired0 = client.stats().counters["leases_expired"]
    rewritten: dict[str, Any] = {}

    def expire_and_rewrite(worker: Any, specs: list[Any]) -> bool:
        """On the loader thread, before the read: wait until the shard's sweeper expired the lease, take every slot
        (the expired blocks are evicted), write garbage into the leased slots, give the slots back."""
        spec = next((sp for sp in specs if sp.blocks and sp.blocks[0].remote is not None), None)
        if spec is None:
            return False
        t0 = time.monotonic()
        while client.stats().counters["leases_expired"] == expired0:
            assert time.monotonic() - t0 < 20.0, "the lease did not expire"
            time.sleep(0.1)
        rewritten["waited_s"] = time.monotonic() - t0
        hog = client.reserve(TIGHT_DRAM).reservation
        try:
            leased = [b.remote.offset for b in spec.blocks if b.remote is not None]
            assert set(leased) <= set(hog.offsets)  # the expired lease's slots now belong to another writer
            worker._ensure_peer(spec.shard_id, spec.agent_name, spec.shard_epoch)
            garbage = np.random.default_rng(1).integers(0, 256, hog.slot_bytes, dtype=np.uint8)
            rewritten["keep"] = garbage
            region = worker.endpoint.register(memoryview(garbage))
            ops = [BlockOp(spec.region_id, off, region, 0, hog.slot_bytes) for off in leased]
            res = worker.endpoint.write(spec.agent_name, ops, 10.0)
            assert not res.failed, res
            rewritten["slots"] = len(leased)
        finally:
            client.abort(hog.reservation_id)
        return True

    hooks.arm("before_load", expire_and_rewrite)
    try:
        expired = phase("expired", 1, prefixes=1, seed=41)
        s = run.go(expired, {"expired-0": warm["warm-ttl-0"]})
    finally:
        hooks.disarm()
    assert hooks.fired("before_load"), "the fault did not fire"
    c1 = counters(llm)
    d = delta(c1, c0)
    expired_n = client.stats().counters["leases_expired"] - expired0
    assert expired_n >= 1  # the shard's sweeper expired the lease
    assert d.get("worker.checksum_failures", 0) == rewritten["slots"] == 3  # rewritten slots: never data
    assert d.get("worker.load_failures", 0) == 1 and d.get("worker.blocks_loaded", 0) == 0
    assert s.reused["expired-0"] == 0  # the request's timing: nothing came from the pool (all 3 recomputed)
    # serving goes on: a new prefix is saved and served
    after = phase("after-ttl", 2, prefixes=1, seed=42)
    s = run.go(after, {"after-ttl-1": after["after-ttl-0"]})
    assert s.reused["after-ttl-1"] == 3 * BLOCK
    connector_stats(llm)
    assert client.stats().leases == 0 and all(n == 0 for n in pool.leases().values())
    print({"case": "lease expired before the load", **run.summary(), "fault_counters": d,
           "leases_expired": expired_n, "waited_for_expiry_s": round(rewritten["waited_s"], 2)})
    run.check(engines, tiny_models)
    print({"case": "lease expired before the load", "test_s": round(time.perf_counter() - t_start, 1)})


# ---------------------------------------------------------------------------------------------- 4. restarted
def test_shard_restarted_under_its_name_is_never_read_through_the_old_epoch(
        pool: Any, engines: Any, tiny_models: dict[str, str], tmp_path: Any) -> None:
    import ray

    from kvpool.shard.placement import stop_shards
    from kvpool.shard.registry import shard_actor_name
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig
    from tests.e2e.conftest import SLOT_BYTES
    from tests.e2e.faulty_connector import _wait_gone

    t_start = time.perf_counter()
    model_id = "faults-restart"
    # NIXL for the loads and the saves (no shared-memory shortcut to the own node's shard): the metadata at stake
    cfg = pool.config(local="b", nodes=("b",), model_id=model_id, shared_memory=False)
    llm = engine(engines, "restart", tiny_models, cfg)
    old = pool.handles["b"]
    run = Run(llm)
    warm = phase("warm-rs", 2, prefixes=2, seed=51)
    run.go(warm)
    healthy = phase("healthy-rs", 2, prefixes=2, seed=51)
    s = run.go(healthy, {rid: warm[f"warm-rs-{i}"] for i, rid in enumerate(healthy)})
    assert all(s.reused[rid] == 3 * BLOCK for rid in healthy)  # loads from b: the engine holds b's metadata
    old_epoch = old.client().info().epoch
    c0 = counters(llm)

    pid = ray.get(old.actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
    ray.kill(old.actor, no_restart=True)
    _wait_gone(pid)
    store = StoreConfig(slot_bytes=SLOT_BYTES, dram_slots=256, ssd_dir=str(tmp_path / "b"), ssd_slots=256,
                        shared_arena=True)
    new = start_shard(old.node_id, shard_actor_name(old.node_id), ShardConfig(shard_id=old.shard_id, store=store,
                                                                             backend="nixl"))
    restarted_at = time.perf_counter()
    pool.handles["b"] = new
    try:
        assert new.client().info().epoch != old_epoch
        # the same prefixes again, then until the pool serves a prefix again (from the new shard)
        recovery_s, i, computers = -1.0, 0, {}
        while time.perf_counter() - restarted_at < 40.0:
            rid = f"restarted-{i}"
            prompt = phase("restarted", i + 1, prefixes=2, seed=51)[rid]
            j = i % 2
            s = run.go({rid: prompt}, {rid: computers[j]} if j in computers else None)
            connector_stats(llm)
            if s.reused[rid]:
                recovery_s = time.perf_counter() - restarted_at
                break
            if j not in computers and new.client().entry_info(keys_of(llm, model_id, prompt)[0]) is not None:
                computers[j] = prompt
            i += 1
        c1 = counters(llm)
        d = delta(c1, c0)
        stats = connector_stats(llm)
        breakers = {k: stats[k] for k in stats if "breaker" in k}
        assert recovery_s > 0, (d, breakers)  # the pool served again, from the new epoch
        # every role's breaker opened on the dead shard and closed again on the new one (its half-open probe)
        assert all(b["trips"] >= 1 and b["recoveries"] >= 1 for b in breakers.values()), breakers
        assert d.get("save_book.skipped", 0) > 0 and d.get("save_book.given_up", 0) == 0  # no retry spent meanwhile
        assert d.get("save_book.lost", 0) > 0  # the new shard's misses: the old shard's blocks are saved again
        assert d.get("worker.checksum_failures", 0) == 0  # nothing was read through the old epoch's metadata
        assert d.get("worker.blocks_loaded", 0) >= 3 and new.client().stats().counters["hits_dram"] >= 3
        assert d.get("scheduler.lookup_failures", 0) > 0  # the fault counted
        assert new.client().stats().leases == 0
        print({"case": "shard restarted under its name", **run.summary(), "fault_counters": d,
               "recovery_s": round(recovery_s, 2), "breakers": breakers})
    finally:
        pool.handles["b"] = old  # dead: the pool fixture skips it; the new one is stopped here
        stop_shards([new])
    run.check(engines, tiny_models)
    print({"case": "shard restarted under its name", "test_s": round(time.perf_counter() - t_start, 1)})
