"""E2E: KV reuse through the cluster pool is token-identical to recomputation — real vLLM (CPU build), real Ray
cluster, real pool shards, real NIXL.

Correctness matrix (``reuse_correctness``, one test per cell): {dense, hybrid} tiny model × {the same engine after
its HBM prefix cache was reset, another engine in another process on another Ray node (NIXL), after the blocks were
demoted DRAM → SSD}. Greedy outputs of seeded random prompts with shared prefixes must equal the outputs of a plain
engine (no connector, no prefix caching), and the pool must actually have supplied blocks.
Refusal: another dtype or another model under the same model id never loads the other layout's blocks, nor does
another checkpoint of the same shapes replaced at the same path; an unknown
layout kind stops the engine from starting, naming the kind. Rollback: a request looked up and aborted before it
was scheduled holds no lease; preempted requests release and re-acquire; a shard killed during a load, or a slot
corrupted after its lease, ends in recomputation with correct tokens.
The tiny models are checked to be context-sensitive first, so a wrong block would change the tokens.
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest

from bench.inproc import EngineSpec, connector_stats, decode_result, encode_args, engine_actor, generate
from tests.e2e.conftest import EngineSlot, Pool

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

MODELS = ["dense", "hybrid"]
MAX_TOKENS = 10
BLOCK = 128
DTYPE = "float32"  # test_many_prompts_match_plain_vllm (see its docstring)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Six prompts: all share a 2-block system prefix; three also share a document. No length is a multiple of
    the block size (a hybrid state exists at the last full boundary of each prompt)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    system, doc = toks(2 * BLOCK + 40), toks(180)
    out = [system + toks(rng.randint(20, 200)) for _ in range(3)]
    out += [system + doc + toks(rng.randint(20, 90)) for _ in range(3)]
    return [p + toks(1) if len(p) % BLOCK == 0 else p for p in out]


PROMPTS = make_prompts()


def sched_stats(llm: Any) -> dict[str, Any]:
    return connector_stats(llm)["scheduler"]


def worker_stats(llm: Any) -> dict[str, Any]:
    return connector_stats(llm)["worker"]


class Ctx:
    """Shared per-module state: references, which models primed the pool, a remote engine actor."""

    def __init__(self, pool: Pool, engines: EngineSlot, models: dict[str, str]) -> None:
        self.pool, self.engines, self.models = pool, engines, models
        self._refs: dict[str, list[list[int]]] = {}
        self._primed: set[str] = set()
        self.remote: Any = None

    def spec(self, model: str, **kw: Any) -> EngineSpec:
        return EngineSpec(model=self.models[model], kv_cache_bytes=kw.pop("kv_cache_bytes", 64 << 20),
                          max_model_len=kw.pop("max_model_len", 2048), **kw)

    def ref(self, model: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
        """Greedy outputs of a plain engine: no connector, no prefix caching (pure recomputation)."""
        key = (model, tuple(map(tuple, prompts)))
        if key not in self._refs:
            llm = self.engines.get(("plain", model), self.spec(model, prefix_caching=False))
            self._refs[key] = generate(llm, prompts, MAX_TOKENS).tokens  # type: ignore[index]
        return self._refs[key]  # type: ignore[index]

    def engine(self, model: str) -> Any:
        cfg = self.pool.config(local="a", model_id=f"e2e-{model}")
        return self.engines.get(("conn", model), self.spec(model), cfg)

    def primed(self, model: str) -> Any:
        """The connector engine, after one pass over PROMPTS saved their blocks to shard a."""
        ref = self.ref(model)
        llm = self.engine(model)
        if model not in self._primed:
            out = generate(llm, PROMPTS, MAX_TOKENS).tokens
            assert out == ref, "the saving pass itself must produce the reference tokens"
            saved = worker_stats(llm)
            assert saved["blocks_committed"] > 0
            assert saved["bytes_written_shm"] == saved["bytes_written"] > 0  # saves to the own node's shard
            self._primed.add(model)
        return llm


@pytest.fixture(scope="module")
def ctx(pool: Pool, engines: EngineSlot, tiny_models: dict[str, str]) -> Any:
    c = Ctx(pool, engines, tiny_models)
    yield c
    if c.remote is not None:
        import ray

        try:
            ray.get(c.remote.close.remote(), timeout=60)
        finally:
            ray.kill(c.remote, no_restart=True)


def run_after_hbm_reset(llm: Any) -> tuple[list[list[int]], dict[str, Any], dict[str, Any]]:
    llm.reset_prefix_cache()
    s0, w0 = sched_stats(llm), worker_stats(llm)
    out = generate(llm, PROMPTS, MAX_TOKENS).tokens
    s1, w1 = sched_stats(llm), worker_stats(llm)
    return out, {k: s1[k] - s0[k] for k in s0}, {k: w1[k] - w0[k] for k in w0}


# ---------------------------------------------------------------------------------------------- sanity
@pytest.mark.parametrize("model", MODELS)
def test_tiny_model_is_context_sensitive(ctx: Ctx, model: str) -> None:
    """Replacing the tokens of one early block changes the greedy continuation: a wrong block cannot go unnoticed."""
    rng = random.Random(99)
    other = [rng.randrange(10, 4000) for _ in range(BLOCK)]
    changed = [list(p) for p in PROMPTS]
    for p in changed:
        p[BLOCK : 2 * BLOCK] = other
    a, b = ctx.ref(model), ctx.ref(model, changed)
    assert sum(x != y for x, y in zip(a, b, strict=True)) >= len(PROMPTS) - 1


# ---------------------------------------------------------------------------------------------- the matrix
@pytest.mark.reuse_correctness
@pytest.mark.parametrize("model", MODELS)
def test_same_engine_after_hbm_reset(ctx: Ctx, model: str) -> None:
    llm = ctx.primed(model)
    out, ds, dw = run_after_hbm_reset(llm)
    assert out == ctx.ref(model)
    assert dw["blocks_loaded"] > 0 and dw["bytes_read"] > 0
    assert dw["bytes_read_shm"] == dw["bytes_read"]  # the own node's shard: through shared memory
    assert dw["load_failures"] == 0 and dw["checksum_failures"] == 0
    if model == "dense":
        # Inline loads ("Inline loads" in kvpool.connector.scheduler): the batch's first prompt loads the shared
        # system prefix in the step that schedules it, so the prompts after it in the same step find it in the
        # engine's own cache; the pool supplies it once.
        assert ds["loads_inline"] > 0 and dw["loads_inline"] == ds["loads_inline"]
        assert ds["hit_tokens"] >= 2 * BLOCK
    else:  # hybrids load in the background: every prompt waits for its own load of the shared prefix
        assert ds["loads_inline"] == 0 and dw["loads_inline"] == 0
        assert ds["hit_tokens"] >= len(PROMPTS) * 2 * BLOCK
    assert ds["leases_taken"] == ds["leases_released"] and not connector_stats(llm)["held_leases"]


@pytest.mark.reuse_correctness
@pytest.mark.parametrize("model", MODELS)
def test_other_engine_on_other_node_via_nixl(ctx: Ctx, model: str) -> None:
    import ray

    from kvpool.connector.config import ConnectorConfig

    ctx.primed(model)
    # Discovery mode: the engine finds the named shards itself; its local shard (saves) is node b's.
    cfg = ConnectorConfig(model_id=f"e2e-{model}")
    spec = ctx.spec(model)
    if ctx.remote is None:
        ctx.remote = engine_actor(spec, cfg, scheduling_strategy=ctx.pool.cluster.affinity("b"))
    else:
        ray.get(ctx.remote.reload.remote(*encode_args(spec, cfg)), timeout=300)
    out = decode_result(ray.get(ctx.remote.generate.remote(PROMPTS, MAX_TOKENS), timeout=300)).tokens
    stats = ray.get(ctx.remote.stats.remote(), timeout=60)
    assert out == ctx.ref(model)
    assert stats["worker"]["blocks_loaded"] > 0 and stats["worker"]["bytes_read"] > 0
    assert stats["worker"]["bytes_read_shm"] == 0  # another node's shard: NIXL
    assert stats["worker"]["load_failures"] == 0
    assert stats["scheduler"]["hit_tokens"] >= len(PROMPTS) * 2 * BLOCK


@pytest.mark.reuse_correctness
@pytest.mark.parametrize("model", MODELS)
def test_after_dram_to_ssd_demotion(ctx: Ctx, model: str) -> None:
    llm = ctx.primed(model)
    shard = ctx.pool.client("a")
    moved = shard.demote(shard.snapshot().keys)
    assert moved > 0 and shard.stats().ssd.blocks >= moved
    before = shard.stats().counters
    out, ds, dw = run_after_hbm_reset(llm)
    after = shard.stats().counters
    assert out == ctx.ref(model)
    assert after["hits_ssd"] > before["hits_ssd"] and after["promotions"] > before["promotions"]
    assert dw["blocks_loaded"] > 0 and dw["load_failures"] == 0


@pytest.mark.reuse_correctness
@pytest.mark.parametrize("model", MODELS)
def test_the_pool_follows_the_session(ctx: Ctx, model: str) -> None:
    """A four-turn session (each prompt = the previous prompt, its output, and a new message). Every full block the
    engine computes is saved, also on top of a prefix it fetched from the pool (turn 2) or held in HBM (turn 3):
    after an HBM reset each next turn loads every full block of the previous prompt from the pool. Every output equals
    plain vLLM's (without reuse, or replaying the session with its prefix cache: the same compute split)."""
    rng = random.Random(5)
    plain = ctx.engines.get(("plain", model), ctx.spec(model, prefix_caching=False))
    turns: list[list[int]] = []
    refs: list[list[int]] = []
    prompt = [rng.randrange(10, 4000) for _ in range(300)]
    for _ in range(4):
        turns.append(prompt)
        refs.append(generate(plain, [prompt], MAX_TOKENS).tokens[0])
        prompt = prompt + refs[-1] + [rng.randrange(10, 4000) for _ in range(rng.randint(150, 250))]
    llm = ctx.engines.get(("session", model), ctx.spec(model),
                          ctx.pool.config(local="a", model_id=f"e2e-{model}-session"))
    hits: list[int] = []
    outs: list[list[int]] = []
    for i, prompt in enumerate(turns):
        if i != 2:  # turn 3 finds turn 2's blocks in HBM; the others find only the pool
            llm.reset_prefix_cache()
        before = sched_stats(llm)["hit_tokens"]
        outs.append(generate(llm, [prompt], MAX_TOKENS).tokens[0])
        hits.append(sched_stats(llm)["hit_tokens"] - before)  # also waits for this turn's saves
    dropped = worker_stats(llm)["blocks_dropped"]  # read now: the replay below replaces this engine
    state_bs = llm.llm_engine.vllm_config.cache_config.block_size  # a hybrid's state block (see below)
    differing = [i for i in range(4) if outs[i] != refs[i]]
    if differing:
        # Reuse computes a turn in another split than a full prefill (bf16 rounds differently): such a turn must
        # equal plain vLLM replaying the session with its own prefix cache (the same blocks, computed the same way).
        replay = ctx.engines.get(("plain-session", model), ctx.spec(model))
        again = [generate(replay, [p], MAX_TOKENS).tokens[0] for p in turns]
        assert all(outs[i] == again[i] for i in differing), (differing, outs, refs, again)
    full = [len(p) // BLOCK * BLOCK for p in turns]
    if model == "hybrid":
        # A hybrid's pool prefix ends where a linear-attention state was saved: vLLM materializes the state only at
        # its mamba checkpoint boundaries (the last multiple of its hybrid block size — 256 here, not the attention
        # block's 128 — that leaves a token to compute), so that is all of a turn the next turn can load.
        from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

        full = [min(f, get_mamba_prefill_checkpoint_position(len(p), state_bs, False)) for f, p in zip(full, turns)]
    assert hits[0] == 0 and hits[1] == full[0], (hits, full)  # turn 2 loads all of turn 1's full blocks
    assert hits[3] == full[2], (hits, full)  # turn 3's blocks, computed on its HBM prefix, were saved
    assert dropped == 0


@pytest.fixture(scope="module")
def tcp_shards(ctx: Ctx, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Shards on nodes a and b over the TCP transport, without a shared arena: every save and load of an engine
    crosses the TCP server, which serves only the slots a lease or reservation granted (issue 16). Named in a Ray
    namespace of their own, beside the module's NIXL pool."""
    from kvpool.connector.config import ShardRef
    from kvpool.shard.placement import PoolNode, build_pool, stop_shards
    from kvpool.shard.registry import shard_actor_name
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig
    from tests.e2e.conftest import SLOT_BYTES

    cluster = ctx.pool.cluster
    names = {cluster.nodes[n].node_id: n for n in ("a", "b")}

    def config(node: PoolNode) -> ShardConfig:
        return ShardConfig(shard_id=f"tcp-shard-{names[node.node_id]}", backend="tcp",
                           store=StoreConfig(slot_bytes=SLOT_BYTES, dram_slots=128))

    handles = build_pool(config, nodes=names, namespace=TCP_NAMESPACE, ready_deadline_s=120.0)
    try:
        yield {names[h.node_id]: (h, ShardRef(h.shard_id, shard_actor_name(h.node_id), h.node_id)) for h in handles}
    finally:
        stop_shards(handles)


TCP_NAMESPACE = "kvstack-e2e-tcp"


@pytest.mark.reuse_correctness
def test_reuse_over_the_tcp_transport_with_grants(ctx: Ctx, tcp_shards: Any) -> None:
    """The dense engine saves to shard a over TCP (each write under its reservation's grant), then after an HBM
    reset loads its blocks back over TCP (each read under its lease's grant): the tokens equal plain vLLM's, the
    pool supplied the prefixes, and the shard refused no transfer of the engine."""
    from kvpool.connector.config import ConnectorConfig

    handle, _ = tcp_shards["a"]
    cfg = ConnectorConfig(shards=[ref for _, ref in tcp_shards.values()], local_shard=handle.shard_id,
                          model_id="e2e-dense-tcp", backend="tcp", shared_memory=False, ray_namespace=TCP_NAMESPACE)
    llm = ctx.engines.get(("conn-tcp", "dense"), ctx.spec("dense"), cfg)
    assert generate(llm, PROMPTS, MAX_TOKENS).tokens == ctx.ref("dense")
    saved = worker_stats(llm)
    assert saved["blocks_committed"] > 0 and saved["bytes_written"] > 0 and saved["bytes_written_shm"] == 0
    out, ds, dw = run_after_hbm_reset(llm)
    assert out == ctx.ref("dense")
    assert dw["blocks_loaded"] > 0 and dw["bytes_read"] > 0 and dw["bytes_read_shm"] == 0
    assert dw["load_failures"] == 0 and dw["checksum_failures"] == 0
    assert ds["hit_tokens"] >= len(PROMPTS) * 2 * BLOCK
    shard = handle.client(deadline_s=30.0)
    assert "kvstack_pool_unauthenticated_total{" not in shard.metrics_text()  # no transfer of it was refused


@pytest.mark.reuse_correctness
def test_a_tensor_parallel_engine_saves_and_loads_each_ranks_own_heads(ctx: Ctx) -> None:
    """A TP=2 dense engine (vLLM's multiprocess executor, one worker process per rank) under the model id the
    single-rank engine already saved under: its first pass hits none of those blocks (the world size is in the
    namespace) and each rank saves its own heads, rank 1 under its own keys; after an HBM reset both ranks load
    their own slots from the pool, and the tokens equal a plain TP=2 engine's (no connector, no prefix cache). Had
    a rank loaded the other's heads the tiny model's tokens would differ (``test_tiny_model_is_context_sensitive``)."""
    from kvpool.keys import Namespace, block_keys, rank_key

    ctx.primed("dense")  # the single-rank engine's blocks of the same prompts, same model id, are in shard a
    spec = ctx.spec("dense", tensor_parallel=2)
    plain = ctx.engines.get(("plain-tp2", "dense"), msgspec.structs.replace(spec, prefix_caching=False))
    ref = generate(plain, PROMPTS, MAX_TOKENS).tokens
    llm = ctx.engines.get(("conn-tp2", "dense"), spec, ctx.pool.config(local="a", model_id="e2e-dense"))
    s0 = sched_stats(llm)
    assert generate(llm, PROMPTS, MAX_TOKENS).tokens == ref
    stats = connector_stats(llm)
    assert stats["scheduler"]["hit_tokens"] == s0["hit_tokens"] == 0  # not the single-rank engine's blocks
    ranks = stats["workers"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["blocks_committed"] == ranks[1]["blocks_committed"] > 0
    assert all(r["save_failures"] == 0 and r["blocks_rejected"] == 0 for r in ranks)
    held = set(ctx.pool.client("a").snapshot().keys)
    ns = Namespace("e2e-dense", stats["fingerprint"])
    system = block_keys(ns, PROMPTS[0], BLOCK)[:2]  # the shared system prefix: saved by both ranks
    assert all(bytes(k) in held and bytes(rank_key(k, 1, 2)) in held for k in system)

    w0 = {r["tp_rank"]: r for r in connector_stats(llm)["workers"]}
    s0 = sched_stats(llm)
    llm.reset_prefix_cache()
    assert generate(llm, PROMPTS, MAX_TOKENS).tokens == ref
    after = connector_stats(llm)
    ds = {k: after["scheduler"][k] - s0[k] for k in s0}
    assert ds["loads_inline"] > 0 and ds["hit_tokens"] >= 2 * BLOCK  # see test_same_engine_after_hbm_reset
    loaded = [r["blocks_loaded"] - w0[r["tp_rank"]]["blocks_loaded"] for r in after["workers"]]
    assert loaded[0] == loaded[1] == ds["blocks_to_load"] > 0  # each rank loaded every planned block, its own slot
    assert all(r["load_failures"] == w0[r["tp_rank"]]["load_failures"] for r in after["workers"])
    assert all(r["checksum_failures"] == 0 for r in after["workers"])
    assert ds["leases_taken"] == ds["leases_released"] and not after["held_leases"]


# ---------------------------------------------------------------------------------------------- refusal
@pytest.mark.parametrize("other", ["dtype", "model"])
def test_other_layout_under_same_model_id_is_never_loaded(ctx: Ctx, other: str) -> None:
    """A float16 engine of the same model, or the hybrid model, configured with the dense model's model id: the
    pool holds the dense bf16 blocks of the very same prompts, yet nothing is loaded."""
    from kvpool.keys import Namespace, block_keys

    dense = ctx.primed("dense")
    dense_fp = connector_stats(dense)["fingerprint"]
    model = "dense" if other == "dtype" else "hybrid"
    spec = ctx.spec(model, dtype="float16" if other == "dtype" else "bfloat16")
    llm = ctx.engines.get(("other-layout", other), spec, ctx.pool.config(local="a", model_id="e2e-dense", save=False))
    generate(llm, PROMPTS, MAX_TOKENS)
    stats = connector_stats(llm)
    assert stats["fingerprint"] != dense_fp
    assert stats["scheduler"]["hit_tokens"] == 0 and stats["worker"]["loads"] == 0
    # The store's own check: the dense blocks' keys, asked for under the other layout's fingerprint, are a miss.
    keys = block_keys(Namespace("e2e-dense", dense_fp), PROMPTS[0], BLOCK)
    shard = ctx.pool.client("a")
    assert shard.lookup(keys, dense_fp).result.prefix > 0
    assert shard.lookup(keys, stats["fingerprint"]).result.prefix == 0


def test_a_checkpoint_replaced_at_the_same_path_is_a_miss(ctx: Ctx, tmp_path: Any) -> None:
    """Issue 16, item 4: a model directory whose weight files are replaced by another checkpoint of the same shapes
    (same config, same safetensors headers, other values), under the same model id and path: the pool holds the old
    checkpoint's blocks of the very same prompts, yet nothing is loaded, and the tokens are the new weights' own."""
    import dataclasses
    import shutil

    import msgspec

    from cluster.tiny_models import make_tiny, preset_spec

    path = tmp_path / "checkpoint"
    shutil.copytree(ctx.models["dense"], path)
    other = make_tiny(dataclasses.replace(preset_spec("qwen3", "tiny"), seed=1), tmp_path / "other")
    spec = EngineSpec(model=str(path), kv_cache_bytes=64 << 20, max_model_len=2048)
    old = ctx.engines.get(("checkpoint-old",), spec, ctx.pool.config(local="a", model_id="e2e-checkpoint"))
    old_out = generate(old, PROMPTS, MAX_TOKENS).tokens
    old_fp = connector_stats(old)["fingerprint"]
    assert worker_stats(old)["blocks_committed"] > 0
    ctx.engines.close()
    for f in sorted(other.glob("*.safetensors")):
        shutil.copy(f, path / f.name)  # the same names and sizes: only the values differ
    want = generate(ctx.engines.get(("checkpoint-plain",), msgspec.structs.replace(spec, prefix_caching=False)),
                    PROMPTS, MAX_TOKENS).tokens
    assert want != old_out  # the new weights compute other tokens: a stale load could not hide
    new = ctx.engines.get(("checkpoint-new",), spec,
                          ctx.pool.config(local="a", model_id="e2e-checkpoint", save=False))
    out = generate(new, PROMPTS, MAX_TOKENS).tokens
    stats = connector_stats(new)
    assert stats["fingerprint"] != old_fp
    assert stats["scheduler"]["hit_tokens"] == 0 and stats["worker"]["loads"] == 0
    assert out == want


def test_unknown_layout_kind_refuses_to_start(ctx: Ctx) -> None:
    ctx.engines.close()
    with pytest.raises(Exception) as info:
        ctx.engines.get(("unknown-kind",), ctx.spec("dense"), ctx.pool.config(local="a"),
                        connector_class=("UnknownKindKvPoolConnector", "tests.e2e.faulty_connector"))
    text, exc = "", info.value
    while exc is not None:
        text += f" {exc}"
        exc = exc.__cause__ or exc.__context__
    assert "ChunkedLocalAttentionSpec" in text and "refuses" in text
    ctx.engines.close()


# ---------------------------------------------------------------------------------------------- rollback
SLOT = 256 * 1024  # one dense tiny block: 4 layers x 64 KiB


def small_engine(ctx: Ctx) -> Any:
    """A dense engine with 10 KV blocks, whose pool already holds PROMPTS[:2]. It loads in the background (no
    inline loads): each of two requests sharing a prefix then waits for its own load of it and holds its own lease
    (inline, the second would find the prefix the first loaded in the engine's cache)."""
    ref = ctx.ref("dense")[:2]  # first: computing it may switch the engine slot
    spec = ctx.spec("dense", kv_cache_bytes=10 * SLOT, max_model_len=1024)
    llm = ctx.engines.get(("small",), spec, ctx.pool.config(local="a", model_id="e2e-dense", inline_load_max_bytes=0))
    if "small" not in ctx._primed:
        assert generate(llm, PROMPTS[:2], MAX_TOKENS).tokens == ref
        ctx._primed.add("small")
    return llm


def _drain(engine: Any, outs: dict[str, list[int]], on_step: Any = None) -> None:
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < 5000


def test_aborted_before_scheduling_holds_no_lease(ctx: Ctx) -> None:
    from vllm import SamplingParams

    llm = small_engine(ctx)
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    filler = [random.Random(7).randrange(10, 4000) for _ in range(850)]  # 7 of the 9 usable blocks, then decodes
    engine.add_request("filler", {"prompt_token_ids": filler},
                       SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    engine.step()
    lookups = sched_stats(llm)["lookups"]
    engine.add_request("late", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    # It was looked up (the pool holds its prefix) but could not be scheduled: the cache is full. Its lookup leased
    # the prefix (``lease_on_lookup``), which no load holds yet; the abort releases it.
    assert sched_stats(llm)["lookups"] > lookups and sched_stats(llm)["lookup_leases"] > 0
    assert "late" not in str(connector_stats(llm)["held_leases"]) and ctx.pool.leases()["a"] == 1
    engine.abort_request(["late"])
    engine.step()
    assert not connector_stats(llm)["held_leases"] and ctx.pool.leases()["a"] == 0
    engine.abort_request(["filler"])
    _drain(engine, {})
    assert ctx.pool.leases()["a"] == 0


def test_preempted_requests_release_and_reacquire(ctx: Ctx) -> None:
    """Two requests that load from the pool, preempted (and the HBM cache dropped) while both decode: each
    releases its lease, takes a new one when rescheduled, and completes with the reference tokens. The
    precondition — both hold a lease when preempted — depends on timing (a lookup still in flight lets vLLM
    compute a prompt itself, with no lease), so a try that misses it is run again, up to 3 tries."""
    from vllm import SamplingParams

    llm = small_engine(ctx)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    scheduler = engine.engine_core.engine_core.scheduler
    for attempt in range(3):
        llm.reset_prefix_cache()
        s0 = sched_stats(llm)
        ids = [f"t{attempt}p{i}" for i in range(2)]
        for rid, p in zip(ids, PROMPTS[:2], strict=True):
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        held: list[Any] = []

        def preempt(step: int, held: list[Any] = held, ids: list[str] = ids) -> None:
            # Once both loaded and decode (their lookups and leases run in the background: a few steps): preempt
            # everything and drop the HBM cache.
            running = {r.request_id.split("-")[0] for r in scheduler.running if r.num_output_tokens > 0}
            if not held and running >= set(ids):
                held.append(connector_stats(llm)["held_leases"])
                assert engine.reset_prefix_cache(reset_running_requests=True)

        outs: dict[str, list[int]] = {}
        _drain(engine, outs, preempt)
        s1 = sched_stats(llm)
        assert [outs[rid] for rid in ids] == ctx.ref("dense")[:2]
        assert not connector_stats(llm)["held_leases"] and ctx.pool.leases()["a"] == 0
        if held and len(held[0]) == 2:
            break
    assert held and len(held[0]) == 2, f"no try had both requests holding a lease when preempted: {held}"
    assert s1["preempted_releases"] - s0["preempted_releases"] == 2
    assert s1["leases_taken"] - s0["leases_taken"] == 4  # re-acquired after the preemption
    assert s1["leases_released"] - s0["leases_released"] == 4


@pytest.mark.parametrize(("model", "fault"), [("dense", "kill_shard"), ("hybrid", "corrupt"), ("dense", "corrupt"),
                                            ("dense", "unsettled")])
def test_failed_load_is_recomputed(ctx: Ctx, model: str, fault: str) -> None:
    """A shard killed right before the load (dense: vLLM gets the failed block ids), a leased slot corrupted
    before it is read (hybrid: the whole request is reported failed), or a NIXL read whose cancel was refused (it
    may still land: the worker fences — closes and remakes its endpoint — before vLLM recomputes into the blocks)
    — the request completes with the reference tokens, recomputed; after a fence the pool serves again."""
    from tests.e2e import faulty_connector

    node = "c" if fault == "kill_shard" else "a"
    extra = {"shared_memory": False} if fault == "unsettled" else {}  # the read goes through NIXL
    cfg = ctx.pool.config(local=node, nodes=(node,), model_id=f"e2e-{model}-{fault}", transfer_deadline_s=5.0,
                          **extra)
    ref = ctx.ref(model)  # first: computing it may switch the engine slot
    llm = ctx.engines.get(("faulty", model, fault), ctx.spec(model), cfg,
                          connector_class=("FaultyKvPoolConnector", "tests.e2e.faulty_connector"))
    assert generate(llm, PROMPTS, MAX_TOKENS).tokens == ref  # saves to the shard
    llm.reset_prefix_cache()
    faulty_connector.arm(fault)
    w0 = worker_stats(llm)
    out = generate(llm, PROMPTS, MAX_TOKENS).tokens
    w1 = worker_stats(llm)
    assert faulty_connector.FAULT["fired"], "the fault did not fire"
    assert out == ref
    assert w1["load_failures"] > w0["load_failures"]
    if model == "dense" and fault != "unsettled":  # the load that failed was an inline one (its own node's shard)
        assert w1["loads_inline"] > w0["loads_inline"]
    if fault == "corrupt":
        assert w1["checksum_failures"] > w0["checksum_failures"]
    if fault == "unsettled":
        assert w1["load_fences"] == w0["load_fences"] + 1
        assert connector_stats(llm)["worker_breaker"]["trips"] >= 1  # a read that served nothing: skipped a while
        time.sleep(2.5)  # the breaker's first backoff (2 s), then its probe goes through the remade endpoint
        assert llm.reset_prefix_cache()
        assert generate(llm, PROMPTS, MAX_TOKENS).tokens == ref  # through the remade endpoint
        w2 = worker_stats(llm)
        assert w2["blocks_loaded"] > w1["blocks_loaded"] and w2["load_failures"] == w1["load_failures"]
    assert not connector_stats(llm)["held_leases"]
    ctx.engines.close()


# ---------------------------------------------------------------------------------------------- many prompts
def mixed_prompts(n: int = 200, seed: int = 5, max_len: int = 2030) -> list[list[int]]:
    """``n`` distinct prompts in groups of 8 sharing a prefix (0..3 blocks); lengths below, at and above block
    boundaries (k·128 − 1, k·128, k·128 + 1), random short ones, and one in eight up to the context length (the
    suite's time goes into prefill: ~300 tokens a prompt on average)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < n:
        shared = [rng.randrange(10, 4000) for _ in range(rng.choice([0, 100, 127, 128, 129, 256, 383]))]
        for j in range(8):
            if j == 7:
                length = rng.randint(BLOCK, max_len)
            else:
                length = rng.choice([rng.randint(1, 3 * BLOCK), rng.randint(1, 4) * BLOCK + rng.choice([-1, 0, 1])])
            length = max(2, min(max_len, length))
            head = shared[: length - 1]
            out.append(head + [rng.randrange(10, 4000) for _ in range(length - len(head))])
    return out[:n]


@pytest.mark.reuse_correctness
def test_many_prompts_match_plain_vllm(ctx: Ctx) -> None:
    """Last in the module: its saves fill node b's shard, evicting what earlier tests saved there.

    200 prompts of mixed lengths, in batches of 8 and one by one, through the connector engine: a first pass
    (nothing in the pool yet; prompts that share a prefix may hit HBM), then after an HBM reset (the pool supplies
    the prefixes the first pass computed), then one prompt per group alone. Every output equals plain vLLM's
    without reuse (measured: all 425 do), or, for a rare near-tie, plain vLLM's for the same computation: holding
    exactly the reused prefix in its own prefix cache, or running the same passes with a cache that holds
    everything. Nothing unexplained.

    In float32: the connector's asynchronous lookups and loads put a request's prefill into other engine steps
    than a plain engine's, and in bfloat16 another batch composition rounds differently often enough to flip a
    greedy token of the tiny model now and then (CI, loaded: 1 of 425 unexplained); float32 leaves reuse errors
    as visible and takes timing out of the comparison (97 s alone here; bfloat16, with the oracle run for its
    differing outputs, 607 s: these CPUs have no bfloat16 instructions)."""
    from bench.inproc import reference_tokens

    prompts = mixed_prompts()
    batches = [prompts[i:i + 8] for i in range(0, len(prompts), 8)]
    one_by_one = [[p] for p in prompts[::8]]  # 25 prompts, one per group

    def run(llm: Any, subset: list[list[list[int]]]) -> tuple[list[list[int]], list[int]]:
        results = [generate(llm, b, MAX_TOKENS) for b in subset]
        return [t for r in results for t in r.tokens], [c for r in results for c in r.cached]

    plain = ctx.engines.get(("plain-f32", "dense"), ctx.spec("dense", dtype=DTYPE, prefix_caching=False))
    ref, _ = run(plain, batches)
    llm = ctx.engines.get(("conn-many", "dense"), ctx.spec("dense", dtype=DTYPE),
                          ctx.pool.config(local="b", nodes=("b",), model_id="e2e-dense-many"))
    passes = [run(llm, batches)]
    w0 = worker_stats(llm)
    llm.reset_prefix_cache()
    passes.append(run(llm, batches))
    w1 = worker_stats(llm)
    llm.reset_prefix_cache()
    passes.append(run(llm, one_by_one))
    assert w0["blocks_committed"] > 0, "the first pass saved nothing"
    assert w1["blocks_loaded"] > w0["blocks_loaded"] and sum(passes[1][1]) > 0, "the pool supplied nothing"
    index = [list(range(len(prompts))), list(range(len(prompts))), list(range(0, len(prompts), 8))]
    differing = [(k, j, index[k][j]) for k in range(3) for j in range(len(index[k]))
                 if passes[k][0][j] != ref[index[k][j]]]
    unexplained = []
    if differing:
        replay_out: list[list[list[int]]] = []
        oracle = ctx.engines.get(("plain-cached-f32", "dense"),
                                 ctx.spec("dense", dtype=DTYPE, kv_cache_bytes=768 << 20))
        for subset in (batches, batches, one_by_one):  # no resets: its cache keeps what the first pass computed
            replay_out.append(run(oracle, subset)[0])
        for k, j, i in differing:
            out, cached = passes[k][0][j], passes[k][1][j]
            if out == replay_out[k][j]:
                continue
            if reference_tokens(oracle, prompts[i], cached, MAX_TOKENS, f"oracle-{k}-{i}") != out:
                unexplained.append((k, i, len(prompts[i]), cached))
    compared = sum(len(x) for x in index)
    reused = sum(1 for _, cached in passes for c in cached if c)
    print(f"\nmany prompts: {len(prompts)} prompts, {compared} outputs compared ({reused} reused a prefix), "
          f"{len(differing)} differ from no-reuse plain vLLM, {len(unexplained)} unexplained")
    assert not unexplained, f"(pass, prompt, length, reused) unlike plain vLLM for the same computation: {unexplained}"
