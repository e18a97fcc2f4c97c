"""KV-cache admission as the router prices it: how long a new request waits on a replica before vLLM can allocate
its blocks (the replica's half, and why, is ``deployments.kv_occupancy``).

Who calls what: ``router.replica_book.ReplicaBook`` turns each load report's ``router.hub.KvOccupancy`` into a
``KvAdmission`` (``of``: release times on the router's clock) that the replica's ``ReplicaState`` and columns carry;
``router.policies.runner.PolicyRunner`` adds this router's assignments the replica has not reported yet
(``claimed``); ``router.policies.cost_based`` adds ``wait_s(need, now)`` to a replica's queue when a request needs
more tokens than it has free (``need``: the prompt less the leading blocks its in-flight requests hold,
``pinned_blocks``: a cached prefix no request holds is allocated again).

``wait_s``: 0 when ``need`` fits in the free tokens, else the time until the soonest releases free enough (the
replica's requests end in the order it reported), at most until the last one ends.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate

import msgspec

from router.hub import KvOccupancy


def key_id(key: bytes) -> int:
    """A block key as ``KvOccupancy.pinned`` lists it: its first 8 bytes, an unsigned little-endian int."""
    return int.from_bytes(key[:8], "little")


class KvAdmission(msgspec.Struct, frozen=True):
    free_tokens: int  # capacity less what in-flight requests hold (negative: more is claimed than there is)
    release_at: tuple[float, ...] = ()  # when the replica's requests end (the router's clock), soonest first
    freed: tuple[int, ...] = ()  # tokens free by then, cumulative
    capacity_tokens: int = 0  # the replica's KV cache (``kvstack status``)
    pinned: frozenset[int] | None = None  # the held blocks' ``key_id``s (None: not reported)

    @classmethod
    def of(cls, occupancy: KvOccupancy, sent_at: float) -> KvAdmission:
        """``sent_at``: when the report was sent, on the router's clock (its releases count from then)."""
        rel = occupancy.releases
        return cls(occupancy.capacity_tokens - occupancy.held_tokens, tuple(sent_at + r.eta_s for r in rel),
                   tuple(accumulate(r.tokens for r in rel)), occupancy.capacity_tokens,
                   None if occupancy.pinned is None else frozenset(occupancy.pinned))

    def wait_s(self, need_tokens: float, now: float) -> float:
        """How long ``need_tokens`` wait on this replica from ``now`` (the module docstring)."""
        waits = admission_waits((self,), (0,), need_tokens, now)
        return waits[0][1] if waits else 0.0

    def claimed(self, tokens: int) -> KvAdmission:
        """The same occupancy with ``tokens`` more held (assignments the replica has not reported yet)."""
        return KvAdmission(self.free_tokens - tokens, self.release_at, self.freed, self.capacity_tokens, self.pinned)

    def pinned_blocks(self, keys: Sequence[bytes], upto: int) -> int:
        """How many leading blocks of ``keys[:upto]`` in-flight requests hold (0 when the replica did not say).
        Keys are chained, so a held key's whole prefix is held: the longest run is found by bisection."""
        pinned = self.pinned
        if not pinned or upto <= 0:
            return 0
        lo, hi = 0, min(upto, len(keys))  # keys[:lo] held; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key_id(keys[mid - 1]) in pinned:
                lo = mid
            else:
                hi = mid - 1
        return lo


def admission_waits(kvs: Sequence[KvAdmission | None], indices: Iterable[int], need_tokens: float,
                    now: float) -> list[tuple[int, float]]:
    """``(i, wait_s)`` for each ``kvs[i]`` (``i`` in ``indices``; each reported) on which ``need_tokens`` wait: the
    module docstring's ``wait_s``, over many replicas in one loop (``cost_based`` prices every replica short of KV
    per request)."""
    out: list[tuple[int, float]] = []
    for i in indices:
        k = kvs[i]
        assert k is not None
        short = need_tokens - k.free_tokens
        if short <= 0:
            continue
        at = k.release_at
        if not at:
            continue  # nothing in flight to wait for: the request cannot fit at all (vLLM refuses it)
        j = bisect_left(k.freed, short)
        t = at[j] if j < len(at) else at[-1]
        if t > now:
            out.append((i, t - now))
    return out
