"""A simulated engine's KV-cache admission: vLLM's block manager as it admits waiting requests and frees what
finished ones held, for ``bench.simulate`` (``SimConfig.kv_admission``).

Why: a live vLLM engine starts a request's prefill only once the blocks of its prompt can be allocated; until then
the request waits, however idle the engine's compute is (``deployments.kv_occupancy`` explains what that cost
cost_based on ``vllm bench serve``'s prefix_repetition workload). A simulator without it never shows that wait, and
its cost_based never prices one.

Who calls it: ``bench.simulate`` (the batch engine's event loop), one per replica: ``request`` when a request is
dispatched, ``admit`` for the waiting requests that fit now (first come, first served: the head of the queue
blocks the rest, as in vLLM's scheduler), ``finish`` when a request's prefill ends (its decode end becomes known),
``release`` at decode ends. Mechanism only: what the router is told is the replica's ``KvOccupancyTracker``
(``deployments.kv_occupancy``), which the simulator feeds alongside, as the live replica does.

The model: a request holds, from its admission to its decode end, its prompt's full blocks (a block several
admitted requests share is held once; the simulator's chained block ids are the keys) and the block of its prompt's
partial tail. Its output's blocks are not modelled (vLLM allocates them as it decodes and preempts a request when
it runs out; the replica's tracker counts the tokens generated so far, which the simulator's single decode event does
not grow): prompts are what admission waits on. Cached blocks no admitted request holds are evictable, so they do
not count: a cached prefix that no request holds is allocated again (vLLM's ``get_num_blocks_to_allocate``). A
request larger than the whole cache is admitted alone (vLLM would refuse it; the simulator runs it rather than
stall).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class KvHold:
    """What one request holds once admitted: its prompt's full blocks and its partial tail (tokens, a whole block)."""

    blocks: tuple[int, ...]
    tail_tokens: int
    job: Any  # the simulator's job, handed back by ``admit`` and ``release``


def hold_of(blocks: Sequence[int], prompt_tokens: int, block_tokens: int, job: Any) -> KvHold:
    """A request's hold: its full prompt blocks by id, the rest of its prompt as a whole block."""
    full = min(prompt_tokens // block_tokens, len(blocks))
    total = -(-prompt_tokens // block_tokens)
    return KvHold(tuple(blocks[:full]), max(0, total - full) * block_tokens, job)


class SimKvCache:
    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if capacity_tokens <= 0 or block_tokens <= 0:
            raise ValueError(f"need capacity_tokens > 0 and block_tokens > 0, got {capacity_tokens}, {block_tokens}")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.held_tokens = 0
        self._holders: dict[int, int] = {}  # block id -> admitted requests holding it
        self._admitted = 0
        self._waiting: deque[KvHold] = deque()
        self._ends: list[tuple[float, int, KvHold]] = []  # heap: (decode end, seq, hold) of finished prefills
        self._seq = 0

    def need_tokens(self, hold: KvHold) -> int:
        """Tokens ``hold`` allocates if admitted now: its tail and the blocks no admitted request holds."""
        holders = self._holders
        return hold.tail_tokens + self.block_tokens * sum(1 for b in hold.blocks if b not in holders)

    def request(self, hold: KvHold) -> None:
        self._waiting.append(hold)

    def admit(self) -> list[KvHold]:
        """The waiting requests that fit now, first come first served (the first that does not fit stops it)."""
        out: list[KvHold] = []
        waiting = self._waiting
        while waiting:
            hold = waiting[0]
            need = self.need_tokens(hold)
            if self._admitted and self.held_tokens + need > self.capacity_tokens:
                break
            waiting.popleft()
            holders = self._holders
            for b in hold.blocks:
                holders[b] = holders.get(b, 0) + 1
            self.held_tokens += need
            self._admitted += 1
            out.append(hold)
        return out

    def finish(self, hold: KvHold, decode_end: float) -> None:
        """``hold``'s prefill ended; it lets its KV go at ``decode_end``."""
        heapq.heappush(self._ends, (decode_end, self._seq, hold))
        self._seq += 1

    def next_end(self) -> float:
        return self._ends[0][0] if self._ends else float("inf")

    def release(self, upto: float) -> list[KvHold]:
        """Free what the requests whose decode ended by ``upto`` held; returns them in end order."""
        out: list[KvHold] = []
        ends, holders, bs = self._ends, self._holders, self.block_tokens
        while ends and ends[0][0] <= upto:
            hold = heapq.heappop(ends)[2]
            freed = hold.tail_tokens
            for b in hold.blocks:
                n = holders[b] - 1
                if n:
                    holders[b] = n
                else:
                    del holders[b]
                    freed += bs
            self.held_tokens -= freed
            self._admitted -= 1
            out.append(hold)
        return out

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_holds(self) -> tuple[KvHold, ...]:
        return tuple(self._waiting)

    def busy(self) -> bool:
        """Requests waiting or holding KV."""
        return bool(self._waiting or self._admitted)
