"""``NixlEndpoint``'s fence on a late transfer (``kvpool.transfer.nixl``): a cancel NIXL refuses is retried for
``fence_s``; released then, the result is settled; still refused, the handle is kept for ``close()`` and the
result says ``settled=False`` (the connector then closes and remakes its endpoint: ``KnownPeers.fence``).

A real NIXL agent; the transfer handle is the neighbour here (NIXL's own refusal cannot be provoked on demand: on
loopback it takes every cancel, which ``test_transport_conformance`` checks against a frozen peer)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpool.transfer.nixl import NixlEndpoint, NixlOptions

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
    """The endpoint's real agent, answering ``check_xfer_state`` of a ``RefusingHandle`` itself."""

    def __init__(self, agent: Any) -> None:
        self._agent, self.polls = agent, 0

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
