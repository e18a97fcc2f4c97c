"""``NixlEndpoint``'s fence on a late transfer (``kvpool.transfer.nixl``): a cancel NIXL refuses is retried for
``fence_s``; released then, the result is settled; still refused, the handle is kept for ``close()`` and the
result says ``settled=False`` (the connector then closes and remakes its endpoint: ``KnownPeers.fence``). A post
that fails part way (the peer disconnected after the request was made) is fenced the same way.

A real NIXL agent; the transfer handle is the neighbour here (NIXL's own refusal cannot be provoked on demand: on
loopback it takes every cancel, which ``test_transport_conformance`` checks against a frozen peer)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.transfer import BlockOp
from kvpool.transfer.common import Deadline, OpTable
from kvpool.transfer.nixl import NixlEndpoint, NixlOptions, _Peer

pytestmark = pytest.mark.integration


class RefusingHandle:
    """A transfer request whose release NIXL refuses ``refusals`` times (a transfer still in flight)."""

    def __init__(self, error: type[BaseException], refusals: int) -> None:
        self.error, self.refusals, self.releases = error, refusals, 0

    def release(self) -> None:
        self.releases += 1
        if self.releases <= self.refusals:
            raise self.error("the request is still in progress")


class AgentWithPolls:
    """The endpoint's real agent, answering ``check_xfer_state`` of a ``RefusingHandle`` itself, and refusing to post
    one (``transfer``) when ``post_error`` is set."""

    def __init__(self, agent: Any) -> None:
        self._agent, self.polls = agent, 0
        self.post_error: BaseException | None = None

    def transfer(self, handle: Any) -> str:
        if isinstance(handle, RefusingHandle) and self.post_error is not None:
            raise self.post_error
        return str(self._agent.transfer(handle))

    def check_xfer_state(self, handle: Any) -> str:
        if isinstance(handle, RefusingHandle):
            self.polls += 1
            return "PROC"
        return self._agent.check_xfer_state(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


@pytest.fixture
def endpoint() -> Any:
    ep = NixlEndpoint("fence-probe", options=NixlOptions(progress_thread=False, fence_s=0.4))
    real = ep._agent
    ep._agent = AgentWithPolls(real)
    yield ep
    ep._agent, ep._orphans = real, []
    ep.close()


def test_a_cancel_refused_for_a_while_is_retried_until_nixl_takes_it(endpoint: Any) -> None:
    handle = RefusingHandle(endpoint._errors[0], refusals=3)
    assert endpoint._abandon(handle) is True
    assert handle.releases == 4 and endpoint._agent.polls == 3 and endpoint._orphans == []


def test_a_cancel_refused_past_fence_s_is_unsettled_and_kept_for_close(endpoint: Any) -> None:
    handle = RefusingHandle(endpoint._errors[0], refusals=10**6)
    t = time.monotonic()
    assert endpoint._abandon(handle) is False
    assert 0.4 <= time.monotonic() - t < 2.0
    assert endpoint._orphans == [handle]


@pytest.mark.parametrize(("refusals", "settled"), [(0, True), (2, True), (10**6, False)])
def test_a_post_that_fails_part_way_is_cancelled_not_left_to_the_gc(
    endpoint: Any, monkeypatch: pytest.MonkeyPatch, refusals: int, settled: bool
) -> None:
    """NIXL raised from ``transfer`` after the request was made (on loopback: a killed peer, whose UCX get was already
    started): every op fails, and the request is released (fenced) there, or kept for ``close()`` and unsettled."""
    handle = RefusingHandle(endpoint._errors[0], refusals=refusals)
    endpoint._agent.post_error = endpoint._errors[0]("remote agent was disconnected after transfer request creation")
    peer = _Peer(meta=SimpleNamespace(agent_name="shard-x"), nixl_name="shard-x@1", regions={})
    endpoint._peers["shard-x"] = peer
    monkeypatch.setattr(endpoint, "_make_request", lambda op, p, table: handle)
    result = endpoint._run("READ", peer, OpTable([BlockOp(0, 0, 0, 0, 4096)] * 3), Deadline(5.0))
    endpoint._peers.clear()
    assert result.failed == [0, 1, 2] and result.ok == [] and "disconnected" in result.error
    assert result.settled is settled
    if settled:  # released on the (refusals + 1)-th try
        assert handle.releases == refusals + 1 and endpoint._orphans == []
    else:  # tried for fence_s, then kept for close()
        assert handle.releases > 1 and endpoint._orphans == [handle]
