"""Serve handle calls the ingress makes to its replicas: each with a Serve request id of its own, and the
operator fan-out (one ``ControlRequest`` to every replica, each with its own deadline).

Why an id of its own: a Serve handle call made while an HTTP request is handled reuses that request's internal id,
and Serve's request router (``deployments.request_router``) matches a chosen replica to a pending call by that id.
Calls of one HTTP request made concurrently (the prompts of a batched completion) would be confused, and one
would wait forever. Calls made one after another shared it too: a control call stuck on a replica that had just
died (its target is never offered again; it waits for its deadline) could hold up the next one, to a live replica,
in the same HTTP request (the likely cause of a fault-test failure in which both timed out).

Who calls what: ``router.engine_client.RoutedEngineClient`` issues every generate call inside
``own_serve_request_id``; ``OpenAIIngress`` (``/metrics``: each replica's engine metrics;
``/kvstack/admin/reset_prefix_cache``) calls ``call_each(handle, replica_ids, op, timeout_s)``: concurrent calls,
one reply per replica in the given order, an error reply (``ok: False`` and the exception's type and message) for a
call that failed or missed its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from router.wire import ControlOp, ControlRequest


@contextlib.contextmanager
def own_serve_request_id() -> Iterator[None]:
    """A Serve handle call made inside this block gets an internal request id of its own (Ray 2.60's request
    context; the one place kvstack touches it)."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=generate_request_id()))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def _failure(replica_id: str, exc: BaseException, timeout_s: float) -> dict[str, Any]:
    why = (f"no reply within {timeout_s:g} s" if isinstance(exc, (asyncio.TimeoutError, TimeoutError))
           else f"{type(exc).__name__}: {exc}")
    return {"replica_id": replica_id, "ok": False, "error": why}


async def call_each(handle: Any, replica_ids: Sequence[str], op: ControlOp,
                    timeout_s: float) -> list[dict[str, Any]]:
    """``op`` on each replica (``handle.control.remote``, targeted by ``deployments.request_router``), all at
    once, each call under its own Serve request id and deadline: the replies in ``replica_ids``' order."""

    async def one(replica_id: str) -> dict[str, Any]:
        try:
            with own_serve_request_id():
                call = handle.control.remote(ControlRequest(target_replica=replica_id, op=op))
            return await asyncio.wait_for(call, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported per replica
            return _failure(replica_id, exc, timeout_s)

    return list(await asyncio.gather(*(one(r) for r in replica_ids)))
