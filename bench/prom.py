"""Read an endpoint's Prometheus ``/metrics`` text and pull out the router's numbers.

Called by the live load generators (``bench.agent_cli``, ``bench.trace_cli``) before and after a run; the
difference of the counters is what the run caused. Any OpenAI-compatible endpoint works: when no
``kvstack_router_*`` metrics are present the result says ``available: false`` and the run goes on.

Recognised series (``router.metrics`` names them; matched by shape so a renamed suffix still parses):
- hit tokens by tier: a ``kvstack_router_*`` counter whose name contains ``hit`` and ``token`` with a ``tier`` label;
- decisions by action: a ``kvstack_router_*`` counter whose name contains ``decision`` with an ``action`` label;
- the replicas' save path: every ``vllm:kvpool_saver_*`` counter (the connector's ``SaveStats``, one series per
  engine, summed by name: blocks committed and dropped, saves the catch-up lane ran, ...; its breaker's as
  ``breaker_*``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

ROUTER_PREFIX = "kvstack_router_"
SAVER_PREFIX = "vllm:kvpool_saver_"  # kvpool.connector.stats: the engines' save counters, on the endpoint's /metrics


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """Counter totals of one scrape: every ``kvstack_router_*`` sample summed by (name, labels)."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return bool(self.samples)


def parse_router_metrics(text: str) -> RouterCounters:
    """All ``kvstack_router_*`` counter and gauge samples of a Prometheus text exposition, and the
    ``vllm:kvpool_saver_*`` counters."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith((ROUTER_PREFIX, SAVER_PREFIX)) or family.type not in ("counter", "gauge",
                                                                                           "untyped"):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + float(s.value)
    return RouterCounters(samples)


def _by_label(counters: RouterCounters, label: str, *needles: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (name, labels), value in counters.samples.items():
        lname = name.lower()
        if not all(n in lname for n in needles):
            continue
        lab = dict(labels)
        if label in lab:
            out[lab[label]] += value
    return dict(out)


def _saver(counters: RouterCounters) -> dict[str, float]:
    """The ``vllm:kvpool_saver_*`` counters summed over the engines, by name (prefix and ``_total`` cut)."""
    out: dict[str, float] = defaultdict(float)
    for (name, _), value in counters.samples.items():
        if name.startswith(SAVER_PREFIX):
            out[name[len(SAVER_PREFIX):].removesuffix("_total")] += value
    return dict(out)


def router_delta(before: RouterCounters | None, after: RouterCounters | None) -> dict[str, object]:
    """What happened between two scrapes: hit tokens by tier, decisions by action and the engines' save counters
    (counter differences)."""
    if after is None or not after.available:
        return {"available": False, "hit_tokens_by_tier": {}, "decisions_by_action": {}, "saver": {}}
    base = before.samples if before is not None else {}
    delta = RouterCounters({k: v - base.get(k, 0.0) for k, v in after.samples.items()})
    return {
        "available": True,
        "hit_tokens_by_tier": _by_label(delta, "tier", "hit", "token"),
        "decisions_by_action": _by_label(delta, "action", "decision"),
        "saver": _saver(delta),
    }


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics`` (the OpenAI base URL usually ends in /v1)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/metrics"


async def scrape(base_url: str, *, timeout_s: float = 5.0) -> RouterCounters | None:
    """One scrape of the endpoint's ``/metrics``; None when it has none (404, refused, timeout)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(metrics_url(base_url))
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_router_metrics(resp.text)
    except ValueError:
        return None


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts (upper bound → count) of the histogram ``name`` in an exposition, summed over its
    label sets (every replica's engine, say); empty when the exposition has no such histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name or family.type != "histogram":
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of cumulative ``buckets``, linear within the bucket that holds it, as Prometheus's
    ``histogram_quantile`` does (the +Inf bucket answers its lower bound); None without samples."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower
