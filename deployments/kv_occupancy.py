"""What a replica's in-flight requests hold of its engine's KV cache, and when they let it go: the replica's half of
KV-cache admission pricing (the router's half is ``router.kv_admission``).

Why: vLLM admits a waiting request only when the blocks of its prompt can be allocated; until then it waits for
running requests to end, however idle the engine's compute is. On ``vllm bench serve``'s prefix_repetition workload
(12 MiB of KV cache, 48 blocks of 128 tokens per replica, requests of ~18 blocks) the slow requests of cost_based
waited 0.4–1.8 s between vLLM queueing and scheduling them, with two other prefixes' requests decoding on the same
replica; the cost model priced the prefill work queued ahead, not the KV held. This module gives the routers what
they need to price that wait (``router.hub.KvOccupancy`` in every load report).

Who calls it: ``deployments.replica`` — ``start`` when a request arrives, ``generated`` per output chunk, ``end``
when it ends (finished, failed or cancelled: only a finished one updates the rates), ``occupancy`` for each load
report. One per replica, on its event loop (not thread-safe).

The model (vLLM v1's block manager as it admits and frees; blocks of ``block_size`` tokens, the router's block
keys are the engine's blocks):
- A request holds its prompt's full blocks (its block keys: a block several in-flight requests share is held once)
  and its own tail: the blocks for the rest of the prompt and the tokens it generated so far. A waiting request
  counts what it will hold once admitted.
- It ends after its remaining tokens at the replica's decode rate: seconds per output token, an EWMA over the
  finished requests' decode (first output to end). Its remaining tokens: ``max_new_tokens`` − generated, or fewer
  when the finished requests' output length (an EWMA: most requests stop before their ``max_tokens``) says it
  ends sooner (at least one more token). Until one request has finished, the rate is unknown and every request is
  taken to end now (the routers then price no wait: the behaviour without this model).
- When it ends it frees its tail and the keys that no request ending later shares (cached blocks no request holds
  are evictable: free for admission).
- The keys held are listed (``key_id``: their first 8 bytes), so that a router can tell whether a new request's
  cached prefix is held (no new blocks) or only cached (vLLM allocates an evictable cached block again).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.hub import KvOccupancy, KvRelease
from router.kv_admission import key_id

#: The most held block keys a report lists (``KvOccupancy.pinned``; 8k keys are ~80 KB of msgpack): beyond, none.
MAX_PINNED_KEYS = 8192

#: Weight of a finished request in the EWMAs of decode rate and output length.
EWMA_WEIGHT = 0.2


@dataclass(slots=True)
class _InFlight:
    keys: tuple[bytes, ...]
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0
    first_output_at: float | None = None
    first_tokens: int = 0  # tokens of the first output chunk (the prefill's): decode is timed after them


class KvOccupancyTracker:
    def __init__(self, block_size: int, capacity_tokens: int = 0) -> None:
        """``capacity_tokens``: the engine's KV cache (blocks × block size); 0 until the engine reports it
        (``set_capacity``), and ``occupancy`` answers None meanwhile."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens
        self.decode_s_per_token: float | None = None
        self.output_tokens: float | None = None  # EWMA of the finished requests' output length
        self._requests: dict[str, _InFlight] = {}

    def set_capacity(self, capacity_tokens: int) -> None:
        self.capacity_tokens = max(0, capacity_tokens)

    def start(self, request_id: str, keys: list[bytes] | tuple[bytes, ...], prompt_tokens: int,
              max_new_tokens: int) -> None:
        self._requests[request_id] = _InFlight(tuple(keys), max(0, prompt_tokens), max(0, max_new_tokens))

    def generated(self, request_id: str, tokens: int, now: float) -> None:
        """``tokens`` more output tokens of ``request_id`` arrived at ``now`` (monotonic seconds)."""
        r = self._requests.get(request_id)
        if r is None or tokens <= 0:
            return
        if r.first_output_at is None:
            r.first_output_at, r.first_tokens = now, tokens
        r.generated += tokens

    def end(self, request_id: str, now: float, finished: bool = True) -> None:
        """``request_id`` ended at ``now``: its KV is free. Only a request the engine finished (not an aborted or
        failed one) teaches the decode rate and the output length."""
        r = self._requests.pop(request_id, None)
        if r is None or r.first_output_at is None or not finished:
            return
        self.output_tokens = _ewma(self.output_tokens, r.generated)
        if r.generated > r.first_tokens:
            self.decode_s_per_token = _ewma(self.decode_s_per_token,
                                            (now - r.first_output_at) / (r.generated - r.first_tokens))

    def remaining_tokens(self, r: _InFlight) -> float:
        left = max(0, r.max_new_tokens - r.generated)
        if self.output_tokens is None:
            return left
        return min(left, max(self.output_tokens - r.generated, 1.0))

    def __len__(self) -> int:
        return len(self._requests)

    def _tail_tokens(self, r: _InFlight) -> int:
        bs = self.block_size
        total_blocks = -(-(r.prompt_tokens + r.generated) // bs)
        return max(0, total_blocks - len(r.keys)) * bs

    def occupancy(self) -> KvOccupancy | None:
        """What the in-flight requests hold and when they free it (the module docstring's model); None while the
        engine's capacity is unknown."""
        if self.capacity_tokens <= 0:
            return None
        bs = self.block_size
        rate = self.decode_s_per_token or 0.0
        holders: dict[bytes, int] = {}
        for r in self._requests.values():
            for k in r.keys:
                holders[k] = holders.get(k, 0) + 1
        held = len(holders) * bs + sum(self._tail_tokens(r) for r in self._requests.values())
        pinned = [key_id(k) for k in holders] if len(holders) <= MAX_PINNED_KEYS else None
        ending = sorted(self._requests.values(), key=self.remaining_tokens)
        releases: list[KvRelease] = []
        for r in ending:
            freed = self._tail_tokens(r)
            for k in r.keys:
                n = holders[k] - 1
                holders[k] = n
                if n == 0:
                    freed += bs
            eta = self.remaining_tokens(r) * rate
            if releases and releases[-1].eta_s == eta:
                freed += releases.pop().tokens
            releases.append(KvRelease(eta, freed))
        return KvOccupancy(capacity_tokens=self.capacity_tokens, held_tokens=held, releases=releases, pinned=pinned)


def _ewma(old: float | None, value: float) -> float:
    return value if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * value
