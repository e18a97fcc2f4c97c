"""OpenAIIngress: the OpenAI-compatible HTTP front door, a Ray Serve deployment with FastAPI.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``, plus
``/kvstack/decisions`` (the recent decision records, for ``kvstack status``).

The walk (DESIGN.md): parse and validate with vLLM's OpenAI protocol models → apply the model's chat template and
tokenize once (the engine's own tokenizer) → block keys (``kvpool.keys``) → the live cluster view
(``router.live_view``) gives a ``ClusterSnapshot`` → ``PolicyRunner.decide`` picks HOLDER / FETCH / RECOMPUTE /
SPLIT and a replica → the request goes to that replica through the Serve handle (``DecisionRequestRouter`` honours
the choice) → chunks stream back as SSE or are gathered → the first token's arrival is recorded against the
prediction (regret) and fed to calibration.

Every response carries ``x-kvstack-action``, ``x-kvstack-target``, ``x-kvstack-replica`` and ``x-kvstack-router``
headers (what was decided, for which replica, where it ran — known before the body only when not streaming — and
which router decided). Bad input never reaches a replica: every client error is an OpenAI error object with a 4xx status
(``router.openai_format.ApiError``), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from router import openai_format as fmt
from router.ingress_settings import IngressSettings
from router.wire import GenerateChunk, GenerateRequest

log = logging.getLogger("kvstack.ingress")

app = FastAPI(title="kvstack", description="OpenAI-compatible endpoint with KV-cache-aware routing")


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replicas: Any, settings: dict[str, Any] | IngressSettings) -> None:
        from transformers import AutoTokenizer
        # vLLM's protocol models are imported per request below; importing them once here keeps the first
        # request from paying the multi-second import.
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: F401
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: F401

        from router.live_view import LiveView

        self.settings = settings if isinstance(settings, IngressSettings) else IngressSettings.model_validate(settings)
        self.replicas = replicas
        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.model_path)
        self.router_id = serve.get_replica_context().replica_id.unique_id
        self.view = LiveView.from_settings(self.settings)
        self.view.router_id = self.router_id
        self.view.replica_handle = replicas
        self._refresher = asyncio.get_event_loop().create_task(self.view.run())

    # -- helpers ---------------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> str:
        name = self.settings.served_model_name
        if model is not None and model != name:
            raise fmt.ApiError(404, f"The model `{model}` does not exist. Available models: {name}",
                               type_="NotFoundError", param="model", code="model_not_found")
        return name

    def _chat_tokens(self, req: Any) -> list[int]:
        messages = fmt.chat_messages(req.messages)
        kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt}
        if req.tools:
            kwargs["tools"] = [t.model_dump() if hasattr(t, "model_dump") else t for t in req.tools]
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        except Exception as exc:  # template errors are caused by the messages
            raise fmt.ApiError(400, f"cannot apply the chat template to these messages: {exc}",
                               param="messages") from None
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _completion_tokens(self, req: Any) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise fmt.ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise fmt.ApiError(400, "prompt must be a string or a list of token ids (batched prompts are not "
                                "supported; send one request per prompt)", param="prompt")

    async def _generate(self, request_id: str, token_ids: list[int], sampling: Any, stream: bool
                        ) -> tuple[AsyncIterator[GenerateChunk], Any]:
        decision, keys = self.view.decide(request_id, token_ids)
        greq = GenerateRequest(
            request_id=request_id, prompt_token_ids=token_ids, block_keys=keys, sampling=sampling,
            target_replica=decision.target_replica, action=decision.action, fetch_plan=decision.fetch_plan,
            stream=stream,
        )
        gen = self.replicas.options(stream=True).generate.remote(greq)
        return gen, decision

    async def _timed(self, gen: Any, decision: Any, started: float, ingress_s: float
                     ) -> AsyncIterator[GenerateChunk]:
        """The replica's chunks, timed: the first one's TTFT and timeline, the last one's pool timing."""
        first_at: float | None = None
        tokens = 0
        try:
            async for chunk in gen:
                if chunk.error:
                    raise fmt.ApiError(500, f"replica error: {chunk.error}", type_="InternalServerError")
                if first_at is None:
                    first_at = time.monotonic()
                    self.view.record_first_token(decision, first_at - started, chunk, ingress_s)
                if chunk.pool_timing is not None:
                    self.view.record_pool_timing(decision, chunk.pool_timing)
                tokens += len(chunk.token_ids)
                yield chunk
        finally:
            tpot = (time.monotonic() - first_at) / (tokens - 1) if first_at is not None and tokens > 1 else None
            self.view.request_done(decision, tpot)

    # -- routes ----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok", "replicas": self.view.replica_count()})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.view.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self) -> Response:
        s = self.settings
        return JSONResponse({"object": "list", "data": [
            {"id": s.served_model_name, "object": "model", "created": 0, "owned_by": "kvstack",
             "root": s.model_path, "max_model_len": s.max_model_len}]})

    @app.get("/kvstack/decisions")
    async def decisions(self, limit: int = 50) -> Response:
        return JSONResponse(self.view.recent_decisions(limit))

    @app.post("/kvstack/admin/reset_prefix_cache")
    async def reset_prefix_cache(self) -> Response:
        """Drop every replica's HBM prefix cache (benchmarks and tests: the next request must fetch or recompute)."""
        from router.wire import ControlRequest

        # One call at a time: handle calls made inside one HTTP request share Serve's internal request id, and
        # the request router matches a routing decision to its request by that id (see deployments.request_router).
        results: list[dict[str, Any]] = []
        for row in self.view.replica_rows():
            call = self.replicas.control.remote(ControlRequest(target_replica=row["replica_id"],
                                                               op="reset_prefix_cache"))
            try:
                results.append(await asyncio.wait_for(call, timeout=30.0))
            except Exception as exc:  # noqa: BLE001 - reported per replica
                results.append({"replica_id": row["replica_id"], "ok": False, "error": str(exc)})
        return JSONResponse(results)

    @app.get("/kvstack/status")
    async def status(self, decisions: int = 10) -> Response:
        """Nodes, replicas (as this router sees them), pool shards, the tier prices this router uses (calibrated or
        configured) and recent decisions (``kvstack status``)."""
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        shards = await self.view.shard_stats()
        return JSONResponse({
            "nodes": [{"ip": n["NodeManagerAddress"], "node_id": n["NodeID"], "alive": n["Alive"],
                       "cpus": n.get("Resources", {}).get("CPU", 0.0)} for n in nodes if n["Alive"]],
            "replicas": self.view.replica_rows(),
            "shards": shards,
            "tiers": self.view.calibration_rows(),
            "decisions": await self.view.all_decisions(decisions),
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await self._serve(raw, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._serve(raw, CompletionRequest, chat=False)

    async def _serve(self, raw: Request, model_cls: type, *, chat: bool) -> Response:
        started = time.monotonic()
        try:
            body = fmt.parse_json_body(await raw.body())
            req = fmt.validate(model_cls, body)
            model = self._check_model(body.get("model"))
            token_ids = self._chat_tokens(req) if chat else self._completion_tokens(req)
            max_tokens = fmt.resolve_max_tokens(req, len(token_ids), self.settings.max_model_len)
            sampling = fmt.sampling_from(req, max_tokens)
            rid = fmt.new_id("chatcmpl" if chat else "cmpl")
            gen, decision = await self._generate(rid, token_ids, sampling, bool(req.stream))
            chunks = self._timed(gen, decision, started, time.monotonic() - started)
            headers = {"x-kvstack-action": decision.action, "x-kvstack-router": self.router_id,
                       "x-kvstack-target": decision.target_replica or "",
                       "x-kvstack-replica": decision.target_replica or ""}
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(self._sse(rid, model, chunks, chat, include_usage),
                                         media_type="text/event-stream", headers=headers)
            choices: dict[int, fmt.ChoiceAccumulator] = {}
            cached = 0
            async for chunk in chunks:
                choices.setdefault(chunk.index, fmt.ChoiceAccumulator()).add(chunk)
                cached = max(cached, chunk.cached_tokens)
                headers["x-kvstack-replica"] = chunk.replica_id  # where it actually ran
            if chat:
                return JSONResponse(fmt.chat_response(rid, model, choices, len(token_ids), cached), headers=headers)
            echo = getattr(req, "echo", False) and isinstance(req.prompt, str)
            return JSONResponse(fmt.completion_response(rid, model, choices, len(token_ids), cached,
                                                        req.prompt if echo else ""), headers=headers)
        except fmt.ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as exc:  # noqa: BLE001 - an internal failure is a 500 error object, never a crash
            log.exception("request failed")
            err = fmt.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="InternalServerError")
            return JSONResponse(err.body(), status_code=500)

    async def _sse(self, rid: str, model: str, chunks: AsyncIterator[GenerateChunk], chat: bool,
                   include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        started: set[int] = set()
        prompt_tokens = cached = completion = 0
        try:
            async for c in chunks:
                prompt_tokens, cached = c.prompt_tokens, max(cached, c.cached_tokens)
                completion += len(c.token_ids)
                if chat:
                    delta: dict[str, Any] = {}
                    if c.index not in started:
                        started.add(c.index)
                        delta["role"] = "assistant"
                    if c.text or not delta:
                        delta["content"] = c.text
                    yield fmt.sse(fmt.chat_chunk(rid, model, created, c.index, delta, c.finish_reason,
                                                 fmt.chat_logprobs(c.logprobs or [])))
                else:
                    yield fmt.sse(fmt.completion_chunk(rid, model, created, c.index, c.text, c.finish_reason,
                                                       fmt.completion_logprobs(c.logprobs or [])))
            if include_usage:
                yield fmt.sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": created, "model": model, "choices": [],
                               "usage": fmt.usage(prompt_tokens, completion, cached)})
        except fmt.ApiError as err:
            yield fmt.sse(err.body())
        except Exception as exc:  # noqa: BLE001
            log.exception("stream failed")
            yield fmt.sse(fmt.ApiError(500, f"internal error: {exc}", type_="InternalServerError").body())
        yield fmt.sse("[DONE]")
