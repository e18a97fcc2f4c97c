"""OpenAIIngress: the OpenAI-compatible HTTP front door, a Ray Serve deployment with FastAPI.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``, ``/detokenize``, ``/v1/models``,
``/v1/models/{model}``, ``/version``, ``/health``, ``/metrics``, plus ``/kvstack/decisions``, ``/kvstack/status``
and ``/kvstack/admin/reset_prefix_cache`` (operators, ``kvstack status``).

The walk (DESIGN.md): read the body (413 past ``app.ingress.openai.max_request_body_bytes``), parse it (400 for bad
JSON, NaN/Infinity), validate with vLLM's OpenAI protocol models, refuse the fields kvstack cannot honour
(``router.openai_format.REFUSED_FIELDS``) → vLLM's own serving layer (``router.vllm_frontend``: chat rendering with
tools, tokenization, sampling parameters with structured outputs, tool-call and reasoning parsing, response and
stream objects) → for each prompt it calls the routed engine client (``router.engine_client``): block keys, the
live cluster view (``router.live_view``), ``PolicyRunner.decide`` (HOLDER / FETCH / RECOMPUTE / SPLIT and a replica),
the request to that replica through the Serve handle (``DecisionRequestRouter`` honours the choice), the replica's
chunks back as vLLM outputs; the first token's arrival is recorded against the prediction (regret, calibration).

Before any route, ``router.access.AccessMiddleware`` checks the API key (401), the admin key of ``/kvstack/*`` and
the bound on unfinished generation requests (429 with ``Retry-After``); the key's tenant rides on the request.

Every response carries ``x-kvstack-action``, ``x-kvstack-target``, ``x-kvstack-replica`` and ``x-kvstack-router``
headers (what was decided, for which replica, where it ran — known before the body only when not streaming — and
which router decided; for a batched completion, one comma-separated entry per prompt). A client that disconnects
cancels its request: the replica aborts it in the engine. Bad input never reaches a replica: every client error is
an OpenAI error object with a 4xx status, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from router import access
from router import openai_format as fmt
from router.ingress_settings import IngressSettings

log = logging.getLogger("kvstack.ingress")

app = FastAPI(title="kvstack", description="OpenAI-compatible endpoint with KV-cache-aware routing")
app.add_middleware(access.AccessMiddleware)  # API keys, the admin key, max_queued_requests (router.access)


@dataclass
class ModelRoute:
    """One model the ingress serves: its router settings, its replicas' Serve handle, its live cluster view and the
    vLLM serving objects rendering for it."""

    settings: IngressSettings
    replicas: Any
    view: Any  # router.live_view.LiveView
    frontend: Any  # router.vllm_frontend.VllmFrontend


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, routes: list[tuple[Any, dict[str, Any] | IngressSettings]], pool_keeper: Any = None) -> None:
        """``routes``: per model of the app, its replica deployment's handle and its router settings (the first
        model answers requests without a ``model``, e.g. tokenize); ``pool_keeper``: the app's ``PoolKeeper``
        handle (or None with the pool off), held so Serve deploys it with the app; its status is in
        ``/kvstack/status``."""
        from kvpool import keys
        from router.live_view import LiveView
        from router.policies import pricing
        from router.vllm_frontend import build_frontend

        self.router_id = serve.get_replica_context().replica_id.unique_id
        self.pool_keeper = pool_keeper
        self.models: dict[str, ModelRoute] = {}
        self._refreshers = []
        for replicas, raw in routes:
            settings = raw if isinstance(raw, IngressSettings) else IngressSettings.model_validate(raw)
            view = LiveView.from_settings(settings)
            view.router_id = self.router_id
            view.replica_handle = replicas
            frontend = build_frontend(settings, view, replicas)
            self.models[settings.served_model_name] = ModelRoute(settings, replicas, view, frontend)
            self._refreshers.append(asyncio.get_event_loop().create_task(view.run()))
        self.first = next(iter(self.models.values()))
        self.settings = self.first.settings  # the options every model shares (the OpenAI layer's, access)
        self.access = access.AccessGate.from_settings(self.settings.access)
        access.install(self.access)
        keys.enable_jit()  # the block-key kernel, compiled (or loaded from its cache) now, not in a request
        pricing.warm_up()  # and the cost model's SPLIT solvers (numba, now that this process opted in)

    def _route(self, model: str | None) -> ModelRoute:
        """The model a request names (the first one when it names none); the OpenAI 404 for an unknown one."""
        if not model:
            return self.first
        route = self.models.get(model)
        if route is None:
            raise fmt.ApiError(404, f"The model `{model}` does not exist. Available models: "
                                    f"{', '.join(self.models)}", type_="NotFoundError", param="model",
                               code="model_not_found")
        return route

    # -- helpers ---------------------------------------------------------------------------------------------
    async def _request(self, raw: Request, model_cls: Any) -> Any:
        """The validated vLLM protocol request of an HTTP request (``ApiError`` otherwise)."""
        body = fmt.parse_json_body(await fmt.read_body(raw, self.settings.openai.max_request_body_bytes))
        req = fmt.validate(model_cls, body)
        fmt.refuse_unhonoured(req)
        return req

    def _headers(self, trace: Any, ran_on_known: bool) -> dict[str, str]:
        decisions = trace.decisions
        targets = [d.target_replica or "" for d in decisions]
        ran = [trace.ran_on.get(d.request_id, "") for d in decisions] if ran_on_known else targets
        return {"x-kvstack-action": ",".join(d.action for d in decisions), "x-kvstack-router": self.router_id,
                "x-kvstack-target": ",".join(targets), "x-kvstack-replica": ",".join(ran)}

    @staticmethod
    async def _until_disconnect(raw: Request, work: Awaitable[Any]) -> Any:
        """``work``'s result, or cancel it when the client disconnects first (the body has been read already, so
        the only messages left are the disconnect): a cancelled engine request is aborted on its replica."""
        from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect

        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(listen_for_disconnect(raw))
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled():
            raise fmt.ApiError(499, "client disconnected", code="client_disconnected")
        return task.result()

    async def _generate(self, raw: Request, model_cls: Any, create_of: Any) -> Response:
        """A chat or completion request through its model's vLLM serving layer (``create_of(route)``), routed per
        prompt."""
        # imported here: Serve pickles this class, and a module-level ContextVar does not pickle
        from router.engine_client import ROUTE_TRACE, RouteTrace

        trace = RouteTrace(tenant=getattr(raw.state, "tenant", None) or "")  # the key's tenant (router.access)
        token = ROUTE_TRACE.set(trace)
        try:
            req = await self._request(raw, model_cls)
            create = create_of(self._route(getattr(req, "model", None)))
            result = await self._until_disconnect(raw, fmt.call_vllm(create, req, raw))
            if hasattr(result, "model_dump"):
                return JSONResponse(result.model_dump(), headers=self._headers(trace, ran_on_known=True))
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers=self._headers(trace, ran_on_known=False))
        except fmt.ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        finally:
            ROUTE_TRACE.reset(token)

    async def _vllm_json(self, raw: Request, model_cls: Any, create_of: Any) -> Response:
        """A request answered by its model's vLLM serving layer as one JSON object (tokenize, detokenize)."""
        try:
            req = await self._request(raw, model_cls)
            create = create_of(self._route(getattr(req, "model", None)))
            return JSONResponse((await fmt.call_vllm(create, req, raw)).model_dump())
        except fmt.ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)

    # -- routes ----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok", "replicas": sum(r.view.replica_count() for r in self.models.values())})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """The router's own metrics, then every replica's engine metrics (vLLM's ``vllm:*`` series with a
        ``replica`` label, ``router.engine_metrics``), as vLLM's own server shows its engine's."""
        from prometheus_client import CONTENT_TYPE_LATEST

        from router.engine_metrics import merge_exposition

        engines = {row["replica_id"]: reply["text"] for row, reply in await self._each_replica("engine_metrics")
                   if reply.get("ok")}
        if len(self.models) == 1:
            return Response(merge_exposition(engines, first=self.first.view.registry), media_type=CONTENT_TYPE_LATEST)
        from prometheus_client import generate_latest

        # several models: each model's router series with a `model` label, one family per name
        routers = {name: generate_latest(r.view.registry).decode() for name, r in self.models.items()}
        return Response(merge_exposition(routers, label="model") + merge_exposition(engines),
                        media_type=CONTENT_TYPE_LATEST)

    async def _each_replica(self, op: str, timeout_s: float = 30.0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """``op`` on every replica this router knows, with each one's reply (an error reply when it failed or missed
        its deadline): concurrent calls, each with a Serve request id of its own (``router.replica_calls``)."""
        from router.replica_calls import call_each

        out: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for route in self.models.values():
            rows = route.view.replica_rows()
            replies = await call_each(route.replicas, [row["replica_id"] for row in rows], op, timeout_s)
            out += zip(rows, replies)
        return out

    async def _model_cards(self) -> list[Any]:
        """vLLM's model cards of every model served (each model's ``OpenAIServingModels``)."""
        cards: list[Any] = []
        for route in self.models.values():
            cards += (await route.frontend.models.show_available_models()).data
        return cards

    @app.get("/v1/models")
    async def list_models(self) -> Response:
        return JSONResponse({"object": "list", "data": [card.model_dump() for card in await self._model_cards()]})

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str) -> Response:
        for card in await self._model_cards():
            if card.id == model:
                return JSONResponse(card.model_dump())
        try:
            self._route(model)
        except fmt.ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse(fmt.ApiError(404, f"The model `{model}` has no card").body(), status_code=404)

    @app.get("/version")
    async def version(self) -> Response:
        from vllm import __version__ as vllm_version

        return JSONResponse({"version": vllm_version})

    @app.post("/v1/embeddings")
    async def embeddings(self) -> Response:
        err = fmt.ApiError(404, f"The model `{self.settings.served_model_name}` is a generative model: it does not "
                                "serve embeddings", type_="NotFoundError", param="model", code="model_not_found")
        return JSONResponse(err.body(), status_code=404)

    @app.get("/kvstack/decisions")
    async def decisions(self, limit: int = 50, tenant: str | None = None) -> Response:
        """This router's recent decision records (``?tenant=`` one tenant's only)."""
        return JSONResponse([d for r in self.models.values() for d in r.view.recent_decisions(limit, tenant)])

    @app.post("/kvstack/admin/reset_prefix_cache")
    async def reset_prefix_cache(self) -> Response:
        """Drop every replica's HBM prefix cache (benchmarks and tests: the next request must fetch or recompute)."""
        return JSONResponse([reply for _, reply in await self._each_replica("reset_prefix_cache")])

    @app.get("/kvstack/status")
    async def status(self, decisions: int = 10, tenant: str | None = None) -> Response:
        """Nodes, replicas (as this router sees them, with their calibrated MFU), pool shards, the tier prices and
        model spec this router uses (calibrated or configured), the pool keeper's last pass and recent decisions
        (``?tenant=`` one tenant's only; ``kvstack status``)."""
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        first = self.first.view
        shards = await first.shard_stats()  # the pool is the app's: every model's view lists the same shards
        keeper: Any = None
        if self.pool_keeper is not None:
            try:
                keeper = await asyncio.wait_for(self.pool_keeper.status.remote(), timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - status shows what it can
                keeper = {"error": f"{type(exc).__name__}: {exc}"}
        return JSONResponse({
            "nodes": [{"ip": n["NodeManagerAddress"], "node_id": n["NodeID"], "alive": n["Alive"],
                       "cpus": n.get("Resources", {}).get("CPU", 0.0)} for n in nodes if n["Alive"]],
            "replicas": [{**row, "model": name} for name, r in self.models.items() for row in r.view.replica_rows()],
            "shards": shards,
            "tiers": first.calibration_rows(),
            "model_spec": first.hardware.model.model_dump(),  # what the cost model prices the first model with
            "models": [{"model": name, "policy": r.settings.policy, "model_spec": r.view.hardware.model.model_dump(),
                        "tiers": r.view.calibration_rows()} for name, r in self.models.items()],
            "pool_keeper": keeper,
            "decisions": [d for r in self.models.values() for d in await r.view.all_decisions(decisions, tenant)],
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await self._generate(raw, ChatCompletionRequest, lambda r: r.frontend.chat.create_chat_completion)

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._generate(raw, CompletionRequest, lambda r: r.frontend.completion.create_completion)

    @app.post("/tokenize")
    async def tokenize(self, raw: Request) -> Response:
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        return await self._vllm_json(raw, TokenizeRequest, lambda r: r.frontend.tokenization.create_tokenize)

    @app.post("/detokenize")
    async def detokenize(self, raw: Request) -> Response:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        return await self._vllm_json(raw, DetokenizeRequest, lambda r: r.frontend.tokenization.create_detokenize)
