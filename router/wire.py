"""Typed, versioned messages between the ingress (``router.ingress``) and the replicas (``deployments.replica``).

The ingress renders and tokenizes once (vLLM's own OpenAI serving layer, ``router.vllm_frontend``) and sends token
ids with the routing decision; the replica streams ``GenerateChunk``s back through a Serve handle.
``DecisionRequestRouter`` (``deployments.request_router``) reads ``GenerateRequest.target_replica`` to honour the
decision. Sampling parameters are the ``vllm.SamplingParams`` that vLLM's own request conversion built at the
ingress (structured outputs, logit bias, stop strings... all of it), carried as vLLM's own msgpack encoding of that
struct (``encode_sampling_params`` / ``decode_sampling_params``), so the engine gets exactly what vLLM's server
would give it. A chunk carries one choice's delta with everything vLLM's ``CompletionOutput`` has that the serving
layer reads (text, token ids, logprobs with ranks, finish and stop reason), so the ingress rebuilds vLLM's
``RequestOutput`` from it (``router.engine_client``). One protocol, one version constant: ``WIRE_VERSION`` (the
hub's reports have their own, ``router.hub.HUB_WIRE_VERSION``); the names on it are Literals (``ActionName``,
``StorageTier``, ``ControlOp``).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Literal

import msgspec

from kvpool.connector.timing import PoolRequestTiming
from kvpool.keys import BlockKey, Namespace
from router.policies.base import ActionName, StorageTier

WIRE_VERSION = 3  # 2: vLLM's SamplingParams on the wire, vLLM's logprob entries in chunks; 3: a request's cache salt
# Layout component of the routing namespace until the engine reports the fingerprint of the layout it registered.
DEFAULT_LAYOUT_TAG = "kvstack-engine"
# What an operator can ask one replica (``deployments.replica.VLLMReplica.control``).
ControlOp = Literal["reset_prefix_cache", "info", "engine_metrics"]


@functools.lru_cache(maxsize=4096)
def routing_root(served_model_name: str, cache_salt: str = "", layout_fingerprint: str = "") -> BlockKey:
    """The namespace root of the block keys the ingress computes and the replicas report (must agree); cached, as
    every request asks for its salt's root (one per tenant and client salt in use). ``layout_fingerprint`` "": no
    engine registered a layout yet (the pool off), ``DEFAULT_LAYOUT_TAG`` stands in for it."""
    layout_fingerprint = layout_fingerprint or DEFAULT_LAYOUT_TAG
    return Namespace(served_model_name, layout_fingerprint, cache_salt).root()


@functools.cache
def _sampling_codec() -> tuple[Any, Any]:
    """vLLM's msgpack encoder (everything inline in one buffer) and its ``SamplingParams`` decoder, built once per
    process (not per request)."""
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackEncoder(size_threshold=sys.maxsize), MsgpackDecoder(SamplingParams)


def encode_sampling_params(params: Any) -> bytes:
    """vLLM's ``SamplingParams`` as vLLM's own msgpack encoding (``vllm.v1.serial_utils``, what its API server sends
    its engine core), everything inline in one buffer."""
    buffers = _sampling_codec()[0].encode(params)
    if len(buffers) != 1:
        raise ValueError(f"sampling parameters encoded to {len(buffers)} buffers, expected one")
    return bytes(buffers[0])


def decode_sampling_params(raw: bytes) -> Any:
    """The ``SamplingParams`` of ``encode_sampling_params``; a malformed buffer raises ``msgspec.DecodeError``."""
    return _sampling_codec()[1].decode(raw)


class FetchPlanMsg(msgspec.Struct, frozen=True, array_like=True):
    """Blocks [start_block, end_block) of the prompt's keys to pull from a pool shard's tier."""

    shard_id: str
    node_id: str
    tier: StorageTier
    start_block: int
    end_block: int


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One engine request: the prompt's token ids (one prompt of a batched completion is one request), its block
    keys and the routing decision. The replica always streams deltas; the ingress merges them for a client that
    did not ask for a stream."""

    version: int = WIRE_VERSION
    request_id: str
    prompt_token_ids: list[int]
    block_keys: list[bytes] = []  # chained keys of the prompt's full blocks (kvpool.keys), computed by the ingress
    sampling_params: bytes  # encode_sampling_params(vLLM's SamplingParams for this request)
    priority: int = 0
    reasoning_ended: bool | None = None  # vLLM's structured-output reasoning state (a reasoning parser is set)
    reasoning_parser_kwargs: dict[str, Any] | None = None
    target_replica: str | None = None  # Serve replica unique id chosen by the policy
    action: ActionName = "recompute"
    fetch_plan: FetchPlanMsg | None = None
    planned_reuse_tokens: int = 0  # prompt tokens the decision expects the engine not to compute (HBM + fetched)
    # the policy planned the pool loads: a recompute loads nothing from the pool, a holder only what vLLM's cache
    # lacks of its planned prefix (deployments.replica.connector_params)
    pool_planned: bool = False
    # kvpool.keys.request_salt of the engine's salt, the tenant and the client's cache_salt: the salt block_keys
    # were computed under; the replica gives it to vLLM (its HBM prefix cache) and so to the pool connector
    cache_salt: str = ""


class ControlRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An operator call to one replica (e.g. drop its HBM prefix cache), routed like a generate request."""

    version: int = WIRE_VERSION
    target_replica: str
    op: ControlOp


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One entry of vLLM's per-position logprob dict (``vllm.logprobs.Logprob`` with its token id)."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ReplicaTimeline(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's time to first token went on its replica, in seconds from the replica receiving it (vLLM's
    own engine-core timestamps; one machine's monotonic clock): ``plan_s`` the replica's preparation (a SPLIT's
    head and staging), then vLLM queued it, first scheduled it (after the pool lookups and the load wait), produced
    the first token, and the replica sent the first chunk. -1: vLLM did not report that step."""

    plan_s: float
    queued_s: float = -1.0
    scheduled_s: float = -1.0
    first_token_s: float = -1.0
    first_chunk_s: float


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A delta for one choice (``index``) — vLLM's ``CompletionOutput`` fields — plus the request's state. The last
    chunk of a choice has ``finish_reason`` set, the request's last chunk ``finished``. The first chunk of a request
    carries its ``timeline`` (and ``prompt_logprobs`` when asked for), the last one its ``pool_timing`` (when the
    connector consulted the pool)."""

    version: int = WIRE_VERSION
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[list[TokenLogprob]] | None = None  # per generated token: vLLM's entries (sampled + top-k)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finished: bool = False
    prompt_tokens: int = 0
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    cached_tokens: int = 0  # prefix tokens the engine did not compute (HBM hit or loaded from the pool)
    replica_id: str = ""
    error: str | None = None
    timeline: ReplicaTimeline | None = None
    pool_timing: PoolRequestTiming | None = None


def check_version(version: int, what: str) -> None:
    if version != WIRE_VERSION:
        raise ValueError(f"{what}: wire version {version}, this build speaks {WIRE_VERSION}")
