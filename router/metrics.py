"""Router metrics (prometheus-client), all named ``kvstack_router_*``.

Why prometheus-client and not Ray's metrics export: the ingress and the Serve replicas serve ``/metrics``
themselves (``prometheus_client.generate_latest(metrics.registry)``), which the k8s PodMonitor scrapes directly
and a test can scrape without a Ray metrics agent; the names and labels are the same on a laptop and in k8s.

Who calls what: ``PolicyRunner`` calls ``observe_decision`` for every decision and ``observe_actual`` when the
actual TTFT arrives; the live view calls ``observe_stages`` with each request's timeline (first token, then its pool
calls once it finished); the ingress calls ``observe_tpot`` per finished stream and ``set_replica_load`` when load
reports arrive (the live view ``set_replica_kv`` with a report's KV occupancy; the runner ``set_kv_claimed`` as its
unreported assignments' KV changes); the live view calls ``observe_transfer`` per reported pool fetch and
``set_tier_prices`` when the calibrated tier prices change, and ``observe_loop_lag`` from its event-loop probe. The
registry is injected (tests and the simulator use their own ``CollectorRegistry``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.decision import DecisionRecord

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SIGNED_BUCKETS = (-10.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_RATIO_BUCKETS = (-0.9, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


class RouterMetrics:
    """The router's prometheus metrics on one registry (a fresh ``CollectorRegistry`` unless one is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstack_router_requests", "Requests routed", ["policy"], registry=r)
        self.decisions = Counter(
            "kvstack_router_decisions", "Routing decisions by action", ["policy", "action"], registry=r
        )
        self.decision_latency = Histogram(
            "kvstack_router_decision_latency_seconds", "Time to decide one request (policy + runner)", ["policy"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("kvstack_router_prompt_tokens", "Prompt tokens routed", ["policy"], registry=r)
        self.hit_tokens = Counter(
            "kvstack_router_prefix_hit_tokens",
            "Prompt tokens planned to be reused, by where they come from (hbm, dram, ssd)",
            ["policy", "tier"], registry=r,
        )
        self.ttft = Histogram(
            "kvstack_router_ttft_seconds", "Actual time to first token", ["policy", "action"],
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "kvstack_router_tpot_seconds", "Time per output token after the first", ["policy"],
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.predicted_ttft = Histogram(
            "kvstack_router_predicted_ttft_seconds", "Predicted TTFT of the chosen candidate", ["policy", "action"],
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.prediction_error = Histogram(
            "kvstack_router_ttft_prediction_error_seconds", "Actual − predicted TTFT of the chosen candidate",
            ["policy", "action"], buckets=_SIGNED_BUCKETS, registry=r,
        )
        self.prediction_error_ratio = Histogram(
            "kvstack_router_ttft_prediction_error_ratio", "(Actual − predicted) / predicted TTFT",
            ["policy", "action"], buckets=_RATIO_BUCKETS, registry=r,
        )
        self.regret = Histogram(
            "kvstack_router_regret_seconds", "Actual TTFT − best predicted TTFT of all alternatives", ["policy"],
            buckets=_SIGNED_BUCKETS, registry=r,
        )
        self.replica_load = Gauge(
            "kvstack_router_replica_load", "Running + waiting requests per replica, as last reported", ["replica"],
            registry=r,
        )
        self.replica_queue_delay = Gauge(
            "kvstack_router_replica_queue_delay_seconds", "Queue delay per replica, as last reported", ["replica"],
            registry=r,
        )
        self.tier_bandwidth = Gauge(
            "kvstack_router_tier_bandwidth_bytes_per_second",
            "Pool tier bandwidth the cost model prices with, bytes per second (configured until calibrated from "
            "observed transfers)",
            ["tier_class"], registry=r,
        )
        self.tier_latency = Gauge(
            "kvstack_router_tier_latency_seconds", "Pool tier fixed latency the cost model prices with",
            ["tier_class"], registry=r,
        )
        self.transfers = Counter(
            "kvstack_router_observed_transfers", "Pool fetches the replicas reported, by tier class",
            ["tier_class"], registry=r,
        )
        self.transfer_bytes = Counter(
            "kvstack_router_observed_transfer_bytes", "Bytes of the pool fetches the replicas reported",
            ["tier_class"], registry=r,
        )
        self.stage_seconds = Histogram(
            "kvstack_router_request_stage_seconds",
            "Where the time to first token went, per stage (router.decision.RequestTimeline.stages)",
            ["policy", "action", "stage"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.loop_lag = Histogram(
            "kvstack_router_event_loop_lag_seconds",
            "How late the router's event loop ran a timer that was due (a request arriving then waited as long "
            "before the ingress read it)", buckets=_LAG_BUCKETS, registry=r,
        )
        self.inflight = Gauge(
            "kvstack_router_inflight_assignments",
            "This router's assignments not yet reflected in the replica's load report (anti-herding)",
            ["replica"], registry=r,
        )
        self.replica_kv_capacity = Gauge(
            "kvstack_router_replica_kv_capacity_tokens",
            "KV cache tokens per replica (its engine's blocks × block size), as last reported", ["replica"],
            registry=r,
        )
        self.replica_kv_held = Gauge(
            "kvstack_router_replica_kv_held_tokens",
            "KV cache tokens the replica's in-flight requests hold or will hold once admitted, as last reported",
            ["replica"], registry=r,
        )
        self.kv_claimed = Gauge(
            "kvstack_router_kv_claimed_tokens",
            "KV cache tokens this router's assignments will hold that the replica's load report does not count yet "
            "(added to its held tokens when pricing the KV admission wait)", ["replica"], registry=r,
        )

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(max(0.0, seconds))

    def observe_decision(self, record: DecisionRecord) -> None:
        policy, action = record.policy, str(record.action)
        self.requests.labels(policy).inc()
        self.decisions.labels(policy, action).inc()
        self.decision_latency.labels(policy).observe(record.decision_latency_s)
        self.prompt_tokens.labels(policy).inc(record.prompt_tokens)
        self.predicted_ttft.labels(policy, action).observe(record.predicted_ttft_s)
        if record.hbm_tokens:
            self.hit_tokens.labels(policy, "hbm").inc(record.hbm_tokens)
        if record.fetched_tokens and record.fetch is not None:
            self.hit_tokens.labels(policy, record.fetch.tier).inc(record.fetched_tokens)

    def observe_actual(self, record: DecisionRecord) -> None:
        if record.actual_ttft_s is None:
            return
        policy, action = record.policy, str(record.action)
        self.ttft.labels(policy, action).observe(record.actual_ttft_s)
        if record.prediction_error_s is not None:
            self.prediction_error.labels(policy, action).observe(record.prediction_error_s)
            if record.predicted_ttft_s > 0:
                ratio = record.prediction_error_s / record.predicted_ttft_s
                self.prediction_error_ratio.labels(policy, action).observe(ratio)
        if record.regret_s is not None:
            self.regret.labels(policy).observe(record.regret_s)

    def observe_stages(self, record: DecisionRecord, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.stage_seconds.labels(record.policy, str(record.action), stage).observe(max(0.0, seconds))

    def observe_tpot(self, policy: str, seconds: float) -> None:
        self.tpot.labels(policy).observe(seconds)

    def set_replica_load(self, replica_id: str, load: int, queue_delay_s: float) -> None:
        self.replica_load.labels(replica_id).set(load)
        self.replica_queue_delay.labels(replica_id).set(queue_delay_s)

    def observe_transfer(self, tier_class: str, nbytes: int) -> None:
        self.transfers.labels(tier_class).inc()
        self.transfer_bytes.labels(tier_class).inc(nbytes)

    def set_tier_prices(self, prices: dict[str, tuple[float, float]]) -> None:
        """``tier_class -> (bandwidth GB/s as priced, i.e. times bw_util, latency seconds)``; exposed in base units
        (bytes per second)."""
        for cls, (gbps, latency) in prices.items():
            self.tier_bandwidth.labels(cls).set(gbps * 1e9)
            self.tier_latency.labels(cls).set(latency)

    def set_inflight(self, replica_id: str, count: int) -> None:
        self.inflight.labels(replica_id).set(count)

    def set_replica_kv(self, replica_id: str, capacity_tokens: int, held_tokens: int) -> None:
        self.replica_kv_capacity.labels(replica_id).set(capacity_tokens)
        self.replica_kv_held.labels(replica_id).set(held_tokens)

    def set_kv_claimed(self, replica_id: str, tokens: int) -> None:
        self.kv_claimed.labels(replica_id).set(tokens)

    def forget_replica(self, replica_id: str) -> None:
        """Drop a gone replica's series (keeps the label set bounded as replicas come and go)."""
        for g in (self.replica_load, self.replica_queue_delay, self.inflight, self.replica_kv_capacity,
                  self.replica_kv_held, self.kv_claimed):
            try:
                g.remove(replica_id)
            except KeyError:
                pass
