"""router/replica_calls.py: the ingress's control fan-out to its replicas. A call stuck on a replica that just died
must not hold up the others of the same HTTP request: each call gets a Serve request id of its own (what Serve's
request router matches a chosen replica by) and its own deadline, and a failure says what happened."""

from __future__ import annotations

import asyncio
import time

from ray.serve import context as serve_context

from router.replica_calls import call_each
from router.wire import ControlRequest


class _Control:
    """A stand-in for the Serve handle's ``control`` method (the handle is the neighbour, not the thing under test):
    records the Serve request id each call was made under; ``gone`` never answers, ``broken`` fails."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def remote(self, req: ControlRequest) -> asyncio.Future:
        self.ids[req.target_replica] = serve_context._get_serve_request_context()._internal_request_id
        fut = asyncio.get_running_loop().create_future()
        if req.target_replica == "broken":
            fut.set_exception(RuntimeError("engine is dead"))
        elif req.target_replica != "gone":
            fut.set_result({"replica_id": req.target_replica, "ok": True, "op": req.op})
        return fut


class _Handle:
    def __init__(self) -> None:
        self.control = _Control()


def test_a_gone_replica_holds_up_no_other_call_and_every_failure_says_why() -> None:
    handle = _Handle()

    async def main() -> tuple[list[dict], float]:
        token = serve_context._serve_request_context.set(
            serve_context._RequestContext(_internal_request_id="the-http-request"))
        try:
            t = time.monotonic()
            out = await call_each(handle, ["gone", "live-1", "broken", "live-2"], "reset_prefix_cache", 0.3)
            return out, time.monotonic() - t
        finally:
            serve_context._serve_request_context.reset(token)

    replies, took = asyncio.run(main())
    assert [r["replica_id"] for r in replies] == ["gone", "live-1", "broken", "live-2"]
    assert replies[0] == {"replica_id": "gone", "ok": False, "error": "no reply within 0.3 s"}
    assert replies[1]["ok"] and replies[3]["ok"] and replies[1]["op"] == "reset_prefix_cache"
    assert replies[2] == {"replica_id": "broken", "ok": False, "error": "RuntimeError: engine is dead"}
    assert took < 1.0  # one deadline for all, not one per replica in turn
    ids = handle.control.ids
    assert len(set(ids.values())) == 4 and "the-http-request" not in ids.values() and all(ids.values())
