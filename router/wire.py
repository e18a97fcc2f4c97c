"""Typed, versioned messages between the ingress (``router.ingress``) and the replicas (``deployments.replica``).

The ingress tokenizes once and sends token ids with the routing decision; the replica streams ``GenerateChunk``s
back through a Serve handle. ``DecisionRequestRouter`` (``deployments.request_router``) reads
``GenerateRequest.target_replica`` to honour the decision. Sampling parameters travel as a typed struct of the
OpenAI fields we support and are turned into vLLM's ``SamplingParams`` on the replica (the ingress does not need
vLLM's engine types at all). One protocol, one version constant: ``WIRE_VERSION`` (the hub's reports have their
own, ``router.hub.HUB_WIRE_VERSION``); the names on it are Literals (``ActionName``, ``StorageTier``,
``ControlOp``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvpool.connector.timing import PoolRequestTiming
from kvpool.keys import BlockKey, Namespace
from router.policies.base import ActionName, StorageTier

WIRE_VERSION = 1
# Layout component of the routing namespace until the engine reports the fingerprint of the layout it registered.
DEFAULT_LAYOUT_TAG = "kvstack-engine"
# What an operator can ask one replica (``deployments.replica.VLLMReplica.control``).
ControlOp = Literal["reset_prefix_cache", "info"]


def routing_root(served_model_name: str, cache_salt: str = "", layout_fingerprint: str = DEFAULT_LAYOUT_TAG
                 ) -> BlockKey:
    """The namespace root of the block keys the ingress computes and the replicas report (must agree)."""
    return Namespace(served_model_name, layout_fingerprint, cache_salt).root()


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI sampling fields, already validated by the ingress."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    logprobs: int | None = None  # top-k logprobs per generated token
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0  # 0: all tokens (vLLM's default)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0


class FetchPlanMsg(msgspec.Struct, frozen=True, array_like=True):
    """Blocks [start_block, end_block) of the prompt's keys to pull from a pool shard's tier."""

    shard_id: str
    node_id: str
    tier: StorageTier
    start_block: int
    end_block: int


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    version: int = WIRE_VERSION
    request_id: str
    prompt_token_ids: list[int]
    block_keys: list[bytes] = []  # chained keys of the prompt's full blocks (kvpool.keys), computed by the ingress
    sampling: Sampling
    target_replica: str | None = None  # Serve replica unique id chosen by the policy
    action: ActionName = "recompute"
    fetch_plan: FetchPlanMsg | None = None
    stream: bool = True


class ControlRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An operator call to one replica (e.g. drop its HBM prefix cache), routed like a generate request."""

    version: int = WIRE_VERSION
    target_replica: str
    op: ControlOp


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float


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
    """A delta for one choice (``index``); the last chunk of a choice has ``finish_reason`` set. The first chunk of
    a request carries its ``timeline``, the last one its ``pool_timing`` (when the connector consulted the pool)."""

    version: int = WIRE_VERSION
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[list[TokenLogprob]] | None = None  # per token: the sampled token first, then the top-k
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prefix tokens the engine did not compute (HBM hit or loaded from the pool)
    replica_id: str = ""
    error: str | None = None
    timeline: ReplicaTimeline | None = None
    pool_timing: PoolRequestTiming | None = None


def check_version(version: int, what: str) -> None:
    if version != WIRE_VERSION:
        raise ValueError(f"{what}: wire version {version}, this build speaks {WIRE_VERSION}")
