"""Shared plumbing of the live bench CLIs (``bench agent``, ``bench trace``, ``bench compare --endpoint``).

Argument groups (endpoint, budget, output), the OpenAI client, model discovery, scraping ``/metrics`` around a
run, and writing the result JSON + PNG plots. Called only from CLI ``run`` functions; imports the ``openai`` SDK
lazily. The API key comes from ``--api-key`` or, at run time, ``OPENAI_API_KEY`` (default ``EMPTY``: local
servers ignore it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import plots
from bench.loadgen import RequestRecord, summarize_records
from bench.prom import RouterCounters, router_delta, scrape
from cluster.cli_output import print_document


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--endpoint", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY or 'EMPTY')")
    g.add_argument("--label", default=None, help="series label in the result and plots (default: the endpoint)")
    g.add_argument("--request-timeout-s", type=float, default=120.0, help="per-request timeout")
    g.add_argument(
        "--extra-body", default=None, help='JSON merged into every request body, e.g. \'{"ignore_eos": true}\''
    )


def add_budget_args(p: argparse.ArgumentParser, *, default_requests: int | None, default_duration: float | None) -> None:
    g = p.add_argument_group("bounds (the run stops at whichever comes first)")
    g.add_argument("--max-requests", type=int, default=default_requests, help="at most this many requests")
    g.add_argument("--duration-s", type=float, default=default_duration, help="at most this many seconds")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="directory for result.json and PNG plots")
    g.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")
    g.add_argument("--save-requests", action="store_true", help="include every request's measurements in the JSON")


def parse_extra_body(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return body


def make_client(args: argparse.Namespace) -> Any:
    from openai import AsyncOpenAI

    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return AsyncOpenAI(base_url=args.endpoint, api_key=key, timeout=args.request_timeout_s, max_retries=0)


async def resolve_model(client: Any, model: str | None) -> str:
    if model:
        return model
    page = await client.models.list()
    data = list(getattr(page, "data", []) or [])
    if not data:
        raise RuntimeError("the endpoint lists no models; pass --model")
    return str(data[0].id)


def server_root(endpoint: str) -> str:
    """The server's root URL for an OpenAI base URL (``http://h:p/v1`` → ``http://h:p``): where ``/kvstack/*``
    and vLLM's own ``/tokenize`` live."""
    base = endpoint.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def replica_placement(endpoint: str, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
    """Where each replica's engine threads run (``/kvstack/status``: replica id, cores, threads, binding), or None
    for an endpoint that is not kvstack (plain vLLM, another server). Every bench report records it."""
    import httpx

    try:
        replicas = httpx.get(server_root(endpoint) + "/kvstack/status", timeout=timeout_s
                             ).raise_for_status().json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return [{"replica_id": r["replica_id"], **(r.get("placement") or {})} for r in replicas]


@dataclass(slots=True)
class LiveRun:
    records: list[RequestRecord]
    wall_s: float
    router: dict[str, Any]
    extra: dict[str, Any]


async def run_with_metrics(endpoint: str, body: Callable[[], Awaitable[tuple[list[RequestRecord], dict[str, Any]]]]) -> LiveRun:
    """Scrape ``/metrics``, run ``body``, scrape again; the router block is the counter difference."""
    before: RouterCounters | None = await scrape(endpoint)
    t0 = time.monotonic()
    records, extra = await body()
    wall = time.monotonic() - t0
    after = await scrape(endpoint)
    return LiveRun(records, wall, router_delta(before, after), extra)


def build_result(kind: str, label: str, endpoint: str, model: str, config: dict[str, Any], run: LiveRun, *, save_requests: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "schema": f"kvstack.bench.{kind}/v1",
        "label": label,
        "endpoint": endpoint,
        "model": model,
        "config": config,
        "started_at_unix_s": time.time() - run.wall_s,
        "wall_s": run.wall_s,
        **summarize_records(run.records, run.wall_s),
        **run.extra,
        "router": run.router,
        "placement": replica_placement(endpoint),
    }
    if save_requests:
        result["request_log"] = [{**r.to_json(), "text": r.text} for r in run.records]  # texts: output comparisons
    return result


def write_outputs(result: dict[str, Any], records: list[RequestRecord], out: Path | None, *, print_json: bool) -> None:
    """result.json plus ttft_cdf.png, ttft_by_turn.png (when turns exist), hit_tokens_by_tier.png (when known)."""
    label = result["label"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        written = [plots.ttft_cdf({label: [r.ttft_s for r in records if r.ok and r.ttft_s is not None]}, out / "ttft_cdf.png").name]
        if result.get("per_turn"):
            written.append(plots.ttft_by_turn({label: result["per_turn"]}, out / "ttft_by_turn.png").name)
        hits = result["router"].get("hit_tokens_by_tier") or {}
        if hits:
            written.append(plots.hit_tokens_by_tier({label: hits}, out / "hit_tokens_by_tier.png").name)
        result["plots"] = written
        (out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    if print_json:
        print_document(json.dumps(result, indent=2, sort_keys=True))
