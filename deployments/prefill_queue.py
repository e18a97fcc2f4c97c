"""The prefill work waiting on a replica: its requests received that have not produced their first output, oldest
first, and how far the engine has come with the oldest. The replica's half of the routers' queue estimate (the
router's half is ``router.replica_book.ReplicaBook.queue_delay_s``).

Why the oldest one's progress: vLLM schedules waiting prefills first come, first served, so a new request's prefill
starts once the prefills ahead of it are done, and the one the engine is computing has done part of its work. A
router that prices the whole of it waits for work that is behind it: in a live overloaded run (issue 13,
``bench/reports/live_agent_overflow/attn_scale_at_4795d61``) a holder priced behind a 7.6 s cold prefill that had run
for 5.6 s waited 1.7 s, not 7.6 s.

Who calls it: ``deployments.replica`` — ``add`` when a request arrives, ``first_output`` when its first output is
out, ``drop`` when it ends without one (failed or cancelled); ``waiting`` / ``tokens`` / ``tokens_sq`` / ``head``
for each load report (``router.hub.ReplicaReport``). One per replica, on its event loop (not thread-safe). Clocks
are passed in (monotonic seconds).

The engine is taken to be at the oldest waiting request since the later of its arrival and the replica's last first
output (the engine moved on from the request that produced it). Requests of one step that share the engine's token
budget produce their first outputs together, which this reads as one after the other: the second one's elapsed time
starts late, and the router prices it as not begun (the estimate errs towards the whole prefill, the former one).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.hub import PrefillHead


@dataclass(slots=True, frozen=True)
class _Waiting:
    received: float
    tokens: int  # P − c: the prompt tokens it computes (c: the tokens its decision planned to reuse)
    tokens_sq: int  # P² − c²: the attention's share of the same work


class PrefillQueue:
    def __init__(self) -> None:
        self._waiting: dict[int, _Waiting] = {}  # handle -> its work, in arrival order
        self._next = 0
        self._last_first_output = float("-inf")
        self.tokens = 0  # Σ (P − c) over the waiting requests
        self.tokens_sq = 0  # Σ (P² − c²)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add(self, prompt_tokens: int, reused_tokens: int, now: float) -> int:
        """A request arrived with ``prompt_tokens``, of which its decision planned to reuse ``reused_tokens``
        (clamped to [0, prompt_tokens]). Returns its handle (request ids need not be unique here)."""
        reused = min(max(reused_tokens, 0), prompt_tokens)
        w = _Waiting(now, prompt_tokens - reused, prompt_tokens * prompt_tokens - reused * reused)
        handle = self._next
        self._next += 1
        self._waiting[handle] = w
        self.tokens += w.tokens
        self.tokens_sq += w.tokens_sq
        return handle

    def first_output(self, handle: int, now: float) -> None:
        """Its first output is out: its prefill is done and the engine moves on."""
        self._remove(handle)
        self._last_first_output = max(self._last_first_output, now)

    def drop(self, handle: int) -> None:
        """It ended without a first output (failed, cancelled); a handle no longer waiting is ignored."""
        self._remove(handle)

    def head(self, now: float) -> PrefillHead | None:
        """The oldest waiting request's work and how long the engine has been at it (None: nothing waits)."""
        for w in self._waiting.values():
            begun = max(w.received, self._last_first_output)
            return PrefillHead(tokens=w.tokens, tokens_sq=w.tokens_sq, elapsed_s=max(0.0, now - begun))
        return None

    def _remove(self, handle: int) -> None:
        w = self._waiting.pop(handle, None)
        if w is not None:
            self.tokens -= w.tokens
            self.tokens_sq -= w.tokens_sq
