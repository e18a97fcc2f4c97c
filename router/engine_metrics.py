"""The engines' own metrics — vLLM's ``vllm:*`` series (KV cache usage, running / waiting requests, prompt and
generation tokens, TTFT and inter-token latency histograms, prefix-cache queries and hits) — on the endpoint's
``/metrics``, as on vLLM's own server.

vLLM's ``PrometheusStatLogger`` keeps them in the replica process's default ``prometheus_client`` registry, which no
one scrapes. ``engine_metrics_text()`` (called by ``deployments.replica.VLLMReplica`` for the ``engine_metrics``
control op) is that registry's ``vllm:`` families in the text exposition format; ``merge_exposition`` (called by the
ingress's ``/metrics``, ``router.ingress``) merges the replicas' texts into one exposition with a ``replica`` label on
every sample, one family per name (a family may appear only once in a scrape), after the router's own families.
Because the Serve proxy serves ``/metrics`` of the app, this is also what the PodMonitor's ``serve`` endpoint scrapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ENGINE_PREFIX = "vllm:"


class _Families:
    """A collector over fixed metric families (what ``generate_latest`` takes)."""

    def __init__(self, families: Iterable[Any]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Any]:
        return iter(self.families)


def engine_metrics_text(prefix: str = ENGINE_PREFIX) -> str:
    """This process's families whose name starts with ``prefix`` (vLLM's engine metrics), exposition text."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(_Families(m for m in REGISTRY.collect() if m.name.startswith(prefix))).decode()


def merge_exposition(texts: Mapping[str, str], label: str = "replica", first: Any = None) -> bytes:
    """One exposition: ``first``'s families (a registry, as is), then every family of ``texts`` (source → exposition
    text) with ``label=source`` added to each sample, the same family of several sources merged into one."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Any] = {}
    for source, text in texts.items():
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, label: source}, s.value, s.timestamp, s.exemplar)
    body = generate_latest(first) if first is not None else b""
    return body + generate_latest(_Families(merged.values()))
