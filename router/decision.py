"""Decision records and the bounded audit log.

Who calls what: ``PolicyRunner.decide`` builds one ``DecisionRecord`` per request and appends it to an
``AuditLog``; when the request's first token arrives, the ingress (or the simulator) calls
``AuditLog.record_actual`` (through ``PolicyRunner.record_actual``), which fills in the actual TTFT, the
prediction error (actual − predicted of the chosen candidate) and the regret (actual − best predicted of all
alternatives), and the live ingress adds the request's ``RequestTimeline`` (where its TTFT went). ``kvstack status``,
``/kvstack/decisions`` and tests read ``AuditLog.to_json()``.

A record is a msgspec struct (``version`` = ``DECISION_VERSION``) so it can cross processes and be exported as
JSON without hand-written converters; candidates and fetch plans are the policy contract's dataclasses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from kvpool.connector.timing import PoolRequestTiming
from router.policies.base import Action, Candidate, FetchPlan
from router.wire import ReplicaTimeline

DECISION_VERSION = 1


class RequestTimeline(msgspec.Struct, kw_only=True):
    """Where one request's time to first token went (seconds): ``ingress_s`` from the ingress receiving it to
    sending it on (body, chat template, block keys, decision); the replica's own timeline (``replica``, from the
    first chunk); ``transport_s`` the rest of the TTFT the ingress measured (Serve's routing, both hops); ``pool``
    what its pool calls on vLLM's scheduler thread cost (from the last chunk; None when the pool was not asked)."""

    ingress_s: float
    transport_s: float | None = None
    replica: ReplicaTimeline | None = None
    pool: PoolRequestTiming | None = None

    def stages(self) -> dict[str, float]:
        """The timeline as named stage durations (the stages vLLM reported; prometheus and the bench use them)."""
        out = {"ingress": self.ingress_s}
        if self.transport_s is not None:
            out["transport"] = self.transport_s
        r = self.replica
        if r is not None:
            out["plan"] = r.plan_s
            if r.queued_s >= 0:
                out["to_engine"] = r.queued_s - r.plan_s
            if r.scheduled_s >= 0 and r.queued_s >= 0:
                out["engine_wait"] = r.scheduled_s - r.queued_s
            if r.first_token_s >= 0 and r.scheduled_s >= 0:
                out["prefill"] = r.first_token_s - r.scheduled_s
            if r.first_token_s >= 0:
                out["to_replica_out"] = r.first_chunk_s - r.first_token_s
        if self.pool is not None:
            out["pool_lookup"] = self.pool.lookup_s
            out["pool_lease"] = self.pool.lease_s
            out["pool_wait"] = self.pool.wait_s
        return out


class DecisionRecord(msgspec.Struct, kw_only=True):
    """One routing decision: what was chosen, why, what every alternative was predicted to cost, and later the
    actual outcome. ``alternatives`` are the ranking's candidates best-first (the cheapest replicas and the best
    of each action), each with its predicted TTFT."""

    request_id: str
    policy: str
    action: Action
    replica_id: str
    fetch: FetchPlan | None
    predicted_ttft_s: float
    best_predicted_ttft_s: float
    alternatives: tuple[Candidate, ...]
    reason: str
    prompt_tokens: int
    block_size: int
    hbm_tokens: int
    fetched_tokens: int
    decided_at: float
    decision_latency_s: float
    tie_break: str = ""
    version: int = DECISION_VERSION
    actual_ttft_s: float | None = None
    prediction_error_s: float | None = None
    regret_s: float | None = None
    timeline: RequestTimeline | None = None
    actual_cached_tokens: int | None = None  # prompt tokens the engine reused (HBM or pool): the plan's check
    tenant: str = ""  # the API key's tenant ("" without keys): decision lists can be read per tenant

    @property
    def predicted_by_action(self) -> dict[str, float]:
        """Best predicted TTFT per action among the alternatives."""
        out: dict[str, float] = {}
        for c in self.alternatives:
            key = str(c.action)
            if key not in out or c.predicted_ttft_s < out[key]:
                out[key] = c.predicted_ttft_s
        return out

    def with_actual(self, actual_ttft_s: float) -> None:
        """Fill in the measured TTFT, the prediction error and the regret (in place)."""
        if actual_ttft_s < 0:
            raise ValueError(f"actual TTFT must be >= 0, got {actual_ttft_s}")
        self.actual_ttft_s = actual_ttft_s
        self.prediction_error_s = actual_ttft_s - self.predicted_ttft_s
        self.regret_s = actual_ttft_s - self.best_predicted_ttft_s


class AuditLog:
    """The last ``maxlen`` decisions, oldest dropped first, looked up by request id. Not thread-safe: one per
    router (the ingress runs decisions on its event loop)."""

    def __init__(self, maxlen: int = 10_000) -> None:
        if maxlen <= 0:
            raise ValueError(f"audit log maxlen must be positive, got {maxlen}")
        self.maxlen = maxlen
        self._records: deque[DecisionRecord] = deque()
        self._by_id: dict[str, DecisionRecord] = {}
        self._unexplained: dict[int, Callable[[], str]] = {}  # id(record) -> its reason, not formatted yet

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: DecisionRecord, explain: Callable[[], str] | None = None) -> None:
        """Keep ``record``; ``explain``: its reason, formatted only when the record is read (``record.reason`` is
        filled in then; formatting it costs more than the rest of a decision)."""
        if len(self._records) >= self.maxlen:
            old = self._records.popleft()
            self._unexplained.pop(id(old), None)
            if self._by_id.get(old.request_id) is old:
                del self._by_id[old.request_id]
        self._records.append(record)
        self._by_id[record.request_id] = record
        if explain is not None:
            self._unexplained[id(record)] = explain

    def _explained(self, record: DecisionRecord) -> DecisionRecord:
        explain = self._unexplained.pop(id(record), None)
        if explain is not None:
            record.reason = explain()
        return record

    def get(self, request_id: str) -> DecisionRecord | None:
        record = self._by_id.get(request_id)
        return None if record is None else self._explained(record)

    def record_actual(self, request_id: str, actual_ttft_s: float) -> DecisionRecord | None:
        """Attach the actual TTFT to the request's record; ``None`` if it already left the log."""
        record = self._by_id.get(request_id)
        if record is not None:
            record.with_actual(actual_ttft_s)
        return record

    def recent(self, n: int | None = None, tenant: str | None = None) -> list[DecisionRecord]:
        """The newest ``n`` records (all if ``None``; only ``tenant``'s when given), oldest first."""
        pool = list(self._records) if tenant is None else [r for r in self._records if r.tenant == tenant]
        if n is None or n >= len(pool):
            records = pool
        elif n <= 0:
            return []
        else:
            records = pool[-n:]
        if self._unexplained:
            for r in records:
                self._explained(r)
        return records

    def to_json(self, n: int | None = None) -> bytes:
        """The newest ``n`` records as a JSON array."""
        return msgspec.json.encode(self.recent(n))


def decode_records(data: bytes) -> list[DecisionRecord]:
    """Inverse of ``AuditLog.to_json`` (for ``kvstack status`` and tests)."""
    return msgspec.json.decode(data, type=list[DecisionRecord])
