"""What the pool calls cost one request: the connector's report to the replica.

Who calls what: the connector's scheduler role (``kvpool.connector.scheduler.SchedulerSide.request_finished``) returns
it, as builtins under ``TIMING_PARAM``, in the finished request's ``kv_transfer_params`` — vLLM's own channel from
``request_finished`` to the request's final ``RequestOutput``. The replica decodes it with ``from_params`` and sends
it to the ingress on the last ``router.wire.GenerateChunk``; the ingress keeps it in the request's decision record
(the per-request timeline). No vLLM import here: the router imports this module.
"""

from __future__ import annotations

from typing import Any

import msgspec

TIMING_VERSION = 1
TIMING_PARAM = "kvpool_timing"  # key of PoolRequestTiming in a finished request's kv_transfer_params


class PoolRequestTiming(msgspec.Struct, frozen=True, kw_only=True):
    """One request's pool calls (on the connector's pool-call threads, never vLLM's scheduler thread): lookups (each
    one parallel round trip over the shards; a lease taken in that round trip counts here) and a lease of its own
    round trip, in seconds; the tokens it loaded from the pool;
    ``not_yet``: the scheduler steps it was skipped because its lookup was still in flight; ``wait_s``: what it
    waited on the pool before its loads were handed to the worker, from vLLM's first ask (``LoadSpec.wait_s``)."""

    lookups: int = 0
    lookup_s: float = 0.0
    lease_s: float = 0.0
    loaded_tokens: int = 0
    not_yet: int = 0
    wait_s: float = 0.0
    version: int = TIMING_VERSION


def to_params(timing: PoolRequestTiming) -> dict[str, Any]:
    return {TIMING_PARAM: msgspec.to_builtins(timing)}


def from_params(params: dict[str, Any] | None) -> PoolRequestTiming | None:
    """The timing in a final output's ``kv_transfer_params``; None when absent or not ours."""
    raw = (params or {}).get(TIMING_PARAM)
    if not isinstance(raw, dict):
        return None
    try:
        return msgspec.convert(raw, PoolRequestTiming)
    except msgspec.ValidationError:
        return None
