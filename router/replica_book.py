"""ReplicaBook: the live replicas' loads and the ``ReplicaState`` list the policies read, kept up to date by the
load reports and first tokens instead of rebuilt on every request.

Who calls what (one per ``router.live_view.LiveView``, on the ingress's event loop):
- ``report(...)`` for every replica report the hub delivers (load, node, placement, KV admission); ``forget`` for a
  replica that is gone; ``observe_ttft`` when a request's first token arrives (the mean TTFT the queue model uses);
  ``touch(replica_id)`` after its calibration moved (MFU or fixed overhead); ``touch_all()`` after the base hardware
  changed (a detected GPU profile).
- ``view(now)`` per decision: the cached list of the live replicas (heard from within ``ttl_s``) as the policies
  see them (load, queue delay, calibrated hardware; ``hbm_prefix_blocks`` 0, the index fills it in per request) and
  the same replicas as ``ReplicaColumns`` (what ``PrefixIndex.snapshot`` passes on to the policy); ``states(now)``
  the list alone. Only replicas touched since the last call are rebuilt (in place in the list and the columns when
  few changed); a replica falling silent past the TTL drops out on the first call after it expires. The list and
  the columns are shared: callers must not mutate them.

The queue delay a replica's state carries is ``Calibrator.overhead_s`` (the fitted fixed cost of a request) plus
the prefill of the work waiting there: the replica reports its waiting requests' (received, no first token yet)
Σ (P − c) and Σ (P² − c²) (P prompt tokens, c the tokens their decisions planned to reuse), priced with the
replica's calibrated hardware: vLLM schedules waiting prefills first come, first served, so a new request's
prefill starts after theirs (running requests in decode share the batch with it, so they do not count). The
oldest of them is the one the engine is computing: the time its engine has been at it (``ReplicaReport.head``,
``deployments.prefill_queue``; aged by the report's age when it arrives) comes off, at most its own prefill. That
queue is as of the report's arrival and kept until the next report (they come every ``stats_interval_s``, 0.5 s,
far shorter than the prefills this matters for). Without it, overloaded live runs priced holders and fetches behind
the whole of a long cold prefill that had mostly run (issue 13: cost_based's whole-TTFT error 0.18–0.31 at the
median and 0.43–0.90 at p90 over five runs; replayed with the progress taken off, 0.13–0.21 and 0.36–0.56:
``bench.queue_replay``). A replica that does not report its work (0 tokens with requests waiting) costs one mean
TTFT per waiting request, the older estimate, which counts every waiting request's own queueing again (issue 13:
it over-predicted holders and fetches behind long first turns).
The hardware is ``Calibrator.hardware`` (replicas whose fitted MFUs agree share one object: the policy prices each
hardware object once per request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.calibration import Calibrator
from router.cost import Hardware, effective_flops, work_flops
from router.hub import PrefillHead, ReplicaPlacement
from router.kv_admission import KvAdmission
from router.policies.base import ReplicaColumns, ReplicaState, kv_free_tokens


@dataclass(slots=True)
class ReplicaLoad:
    node_id: str
    running: int
    waiting: int
    last_seen: float
    mean_ttft_s: float = 0.0  # EWMA of observed TTFTs: what one queued request ahead costs, roughly
    placement: ReplicaPlacement | None = None  # the CPUs its engine threads are bound to
    waiting_tokens: int = 0  # the waiting requests' prefill work, Σ (P − c) and Σ (P² − c²) (ReplicaReport)
    waiting_tokens_sq: int = 0
    kv: KvAdmission | None = None  # its KV cache's admission (its last report's; None: not reported)
    head: PrefillHead | None = None  # the oldest waiting request, its progress as of the report (None: not reported)


class ReplicaBook:
    def __init__(self, *, ttl_s: float, calibrator: Calibrator, hardware: Callable[[], Hardware]) -> None:
        """``hardware``: the base hardware the replicas are priced with (read when a state is rebuilt)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.calibrator = calibrator
        self._hardware = hardware
        self.loads: dict[str, ReplicaLoad] = {}
        self._states: dict[str, ReplicaState] = {}  # live replicas, in report order
        self._dirty: dict[str, None] = {}  # replicas whose state must be rebuilt, in report order
        self._list: list[ReplicaState] | None = None  # the states as a list (None: rebuild from _states)
        self._columns = ReplicaColumns.of(())  # _list as columns (rebuilt with it, patched in place with it)
        self._position: dict[str, int] = {}  # replica id -> its index in _list
        self._expires_at = float("inf")  # when the oldest listed replica falls out of the TTL

    # ---- what changes a state ----------------------------------------------------------------------------------
    def report(self, replica_id: str, node_id: str, running: int, waiting: int, now: float,
               placement: ReplicaPlacement | None, waiting_work: tuple[int, int] = (0, 0),
               kv: KvAdmission | None = None, head: PrefillHead | None = None) -> None:
        """``waiting_work``: the waiting requests' prefill work as the replica reports it (0, 0: not reported);
        ``kv``: its KV cache's admission (None: not reported); ``head``: the oldest waiting request and how long its
        engine has been at it, as of ``now`` (None: not reported)."""
        prev = self.loads.get(replica_id)
        self.loads[replica_id] = ReplicaLoad(node_id, running, waiting, now, prev.mean_ttft_s if prev else 0.0,
                                             placement or (prev.placement if prev else None), *waiting_work, kv,
                                             head)
        self._dirty[replica_id] = None

    def observe_ttft(self, replica_id: str, ttft_s: float) -> None:
        load = self.loads.get(replica_id)
        if load is not None:
            load.mean_ttft_s = ttft_s if load.mean_ttft_s == 0 else 0.8 * load.mean_ttft_s + 0.2 * ttft_s
            self._dirty[replica_id] = None

    def touch(self, replica_id: str) -> None:
        if replica_id in self.loads:
            self._dirty[replica_id] = None

    def touch_all(self) -> None:
        self._dirty.update(dict.fromkeys(self.loads))

    def forget(self, replica_id: str) -> None:
        self.loads.pop(replica_id, None)
        self._dirty.pop(replica_id, None)
        if self._states.pop(replica_id, None) is not None:
            self._list = None

    # ---- what the policies read --------------------------------------------------------------------------------
    def queue_delay_s(self, replica_id: str, load: ReplicaLoad, hw: Hardware) -> float:
        """Predicted wait before a new request's prefill on this replica (the module docstring's model)."""
        overhead = self.calibrator.overhead_s(replica_id)
        if load.waiting <= 0:
            return overhead
        if load.waiting_tokens > 0:
            flops = effective_flops(hw.gpu, hw.mfu, hw.gpus)
            queue = work_flops(hw.model, load.waiting_tokens, load.waiting_tokens_sq, hw.attn_scale) / flops
            head = load.head
            if head is not None and head.elapsed_s > 0:  # the part of the oldest prefill its engine has done
                queue -= min(head.elapsed_s, work_flops(hw.model, head.tokens, head.tokens_sq, hw.attn_scale) / flops)
            return overhead + queue
        return overhead + load.waiting * load.mean_ttft_s

    def live(self, now: float) -> dict[str, ReplicaLoad]:
        """The loads of the replicas heard from within the TTL."""
        ttl = self.ttl_s
        return {rid: load for rid, load in self.loads.items() if now - load.last_seen <= ttl}

    def states(self, now: float) -> list[ReplicaState]:
        return self.view(now)[0]

    def view(self, now: float) -> tuple[list[ReplicaState], ReplicaColumns]:
        if now > self._expires_at:  # somebody may have fallen silent: drop the expired, find the next expiry
            ttl = self.ttl_s
            for rid, load in self.loads.items():
                if now - load.last_seen > ttl and self._states.pop(rid, None) is not None:
                    self._list = None
            self._dirty = {rid: None for rid in self._dirty if now - self.loads[rid].last_seen <= ttl}
            self._expires_at = min((self.loads[rid].last_seen for rid in self._states), default=float("inf")) + ttl
        if self._dirty:
            base = self._hardware()
            calibrator = self.calibrator
            in_place = self._list is not None and len(self._dirty) * 4 <= len(self._list)
            for rid in self._dirty:
                load = self.loads[rid]
                hw = calibrator.hardware(rid, base)
                state = ReplicaState(rid, load.node_id, load.running, load.waiting, self.queue_delay_s(rid, load, hw),
                                     0, hw, load.kv)
                old = self._states.get(rid)
                self._states[rid] = state
                if old is None:
                    in_place = False
                    self._list = None
                    self._expires_at = min(self._expires_at, load.last_seen + self.ttl_s)
                elif in_place:  # a few changed: replace them in the list and its columns, which keep their order
                    lst = self._list
                    assert lst is not None
                    i = self._position[rid]
                    lst[i] = state
                    cols = self._columns
                    cols.nodes[i], cols.hws[i], cols.hw_ids[i] = state.node_id, hw, id(hw)
                    cols.queues[i] = state.queue_delay_s
                    cols.kv[i] = state.kv
                    cols.kv_free[i] = kv_free_tokens(state.kv)
            self._dirty.clear()
            if not in_place:
                self._list = None
        if self._list is None:
            self._list = list(self._states.values())
            self._position = {rid: i for i, rid in enumerate(self._states)}
            self._columns = ReplicaColumns.of(self._list)
        return self._list, self._columns
