"""DecisionRequestRouter: a thin Ray Serve ``RequestRouter`` that honours the ingress's routing decision.

Who calls what: Ray Serve calls ``choose_replicas`` inside the caller's process (the ingress replica's handle to
the ``VLLMReplica`` deployment) for every request. The policy already chose a replica (``router.policies``); its
Serve unique id travels in ``GenerateRequest.target_replica``. This router offers Serve that replica alone, so Serve
waits (with its backoff) until it accepts — a slow queue-length probe on a busy box, or a full replica, never sends
the request elsewhere (measured: with the other replicas offered as a second rank, 1 of 16 concurrent requests
landed on a replica it was not decided for at load average ~25). Only when the chosen replica is gone from Serve's
candidates (it died) does the request go to the least-loaded one. ``ControlRequest``s (operator calls to one
replica) are targeted the same way but never go elsewhere: while their target is not among Serve's candidates (a
replacement that already reported to the routers before this handle's replica set caught up) Serve backs off and
asks again, until the target appears or the caller's deadline cancels the call. Anything without a target goes
least-loaded.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router.wire import ControlRequest, GenerateRequest


def _request_of(pending: PendingRequest | None) -> GenerateRequest | ControlRequest | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, (GenerateRequest, ControlRequest)):
            return arg
    return None


def _load(replica: RunningReplica) -> float:
    stats: dict[str, Any] = replica.routing_stats or {}
    return float(stats.get("running", 0)) + float(stats.get("waiting", 0))


class DecisionRequestRouter(RequestRouter):
    """No ``FIFOMixin``: with it, Serve hands the replica chosen for one request to the *oldest* pending request,
    so under concurrency a decision would land on another request. The base class matches the chosen replica to
    the exact request it was chosen for, by Serve's internal request id — which handle calls made inside one
    incoming request share unless the caller gives each its own (``router.replica_calls.own_serve_request_id``:
    every generate and control call of the ingress)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _request_of(pending_request)
        target = request.target_replica if request is not None else None
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
            if isinstance(request, ControlRequest):
                return []  # Serve backs off and asks again; the caller's deadline bounds the wait
        return [sorted(candidate_replicas, key=lambda r: (_load(r), random.random()))]
