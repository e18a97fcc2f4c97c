"""A small OpenAI-compatible HTTP server on 127.0.0.1 (FastAPI + uvicorn in a thread): the neighbour endpoint the
load generator talks to (tests/integration/test_agent_loadgen.py).

It serves what the load generator reads from kvstack's endpoint: ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (streamed as SSE with a usage chunk and ``[DONE]``, or whole), and ``/metrics`` in the router's
exposition format (the real ``router.metrics.RouterMetrics``). It is not kvstack: it "reuses" a prefix when an
earlier prompt shared it (64-unit chunks) and reports that as an HBM hit.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any


class FakeOpenAIServer:
    """Start with ``with FakeOpenAIServer(...) as srv:``; ``srv.base_url`` is the OpenAI base URL (…/v1).

    ``received`` holds every request body in arrival order with its arrival time (``_t``, monotonic seconds);
    ``max_concurrent`` the most streams open at once; ``fail_every`` = k answers every k-th request with a 500.
    """

    CHUNK = 64

    def __init__(
        self,
        *,
        model: str = "fake-model",
        token_delay_s: float = 0.002,
        base_ttft_s: float = 0.005,
        ttft_per_new_unit_s: float = 2e-6,
        fail_every: int = 0,
        metrics: bool = True,
    ) -> None:
        self.model = model
        self.token_delay_s = token_delay_s
        self.base_ttft_s = base_ttft_s
        self.ttft_per_new_unit_s = ttft_per_new_unit_s
        self.fail_every = fail_every
        self.metrics_enabled = metrics
        self.received: list[dict[str, Any]] = []
        self.max_concurrent = 0
        self._open = 0
        self._seen: set[int] = set()
        self._count = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0
        from router.metrics import RouterMetrics

        self.router_metrics = RouterMetrics()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- prompt bookkeeping: longest previously seen prefix, in chunks of CHUNK units (words or token ids)
    def _reuse(self, units: list[Any]) -> int:
        hit, parent, matching = 0, 0, True
        for i in range(0, len(units) - len(units) % self.CHUNK, self.CHUNK):
            parent = hash((parent, tuple(units[i : i + self.CHUNK])))
            if matching and parent in self._seen:
                hit += self.CHUNK
            else:
                matching = False
                self._seen.add(parent)
        return hit

    @staticmethod
    def _chat_units(body: dict[str, Any]) -> list[str]:
        parts = [json.dumps(body.get("tools", []), sort_keys=True)]
        for m in body.get("messages", []):
            content = m.get("content") or ""
            parts.append(f"<{m.get('role')}>")
            parts.append(content if isinstance(content, str) else json.dumps(content))
            if m.get("tool_calls"):
                parts.append(json.dumps(m["tool_calls"], sort_keys=True))
        return " ".join(parts).split()

    def _app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]}

        @app.get("/metrics")
        async def metrics() -> Any:
            if not self.metrics_enabled:
                return PlainTextResponse("not found", status_code=404)
            from prometheus_client import generate_latest

            return PlainTextResponse(generate_latest(self.router_metrics.registry).decode())

        async def handle(request: Request, chat: bool) -> Any:
            body = await request.json()
            body["_t"] = time.monotonic()
            self.received.append(body)
            self._count += 1
            if self.fail_every and self._count % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
            if body.get("model") != self.model:
                return JSONResponse({"error": {"message": f"unknown model {body.get('model')!r}"}}, status_code=404)
            if chat:
                units: list[Any] = self._chat_units(body)
            else:
                prompt = body.get("prompt")
                units = list(prompt) if isinstance(prompt, list) else str(prompt).split()
            hit = self._reuse(units)
            m = self.router_metrics
            m.decisions.labels(policy="fake", action="holder" if hit else "recompute").inc()
            m.hit_tokens.labels(policy="fake", tier="hbm").inc(hit)
            n_out = max(1, int(body.get("max_tokens") or 16))
            ttft = self.base_ttft_s + self.ttft_per_new_unit_s * (len(units) - hit)
            rid = f"fake-{self._count}"
            if not body.get("stream"):
                await asyncio.sleep(ttft + self.token_delay_s * n_out)
                text = " ".join(f"t{i}" for i in range(n_out))
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                usage = {"prompt_tokens": len(units), "completion_tokens": n_out, "total_tokens": len(units) + n_out}
                obj = "chat.completion" if chat else "text_completion"
                return {"id": rid, "object": obj, "created": 0, "model": self.model, "choices": [choice],
                        "usage": usage}
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events() -> Any:
                self._open += 1
                self.max_concurrent = max(self.max_concurrent, self._open)
                try:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [first]}) + "\n\n"
                    await asyncio.sleep(ttft)
                    for i in range(n_out):
                        if i:
                            await asyncio.sleep(self.token_delay_s)
                        piece = f"t{i} "
                        ch = {"index": 0, "finish_reason": "length" if i == n_out - 1 else None}
                        ch.update({"delta": {"content": piece}} if chat else {"text": piece})
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [ch]}) + "\n\n"
                    if include_usage:
                        usage = {"prompt_tokens": len(units), "completion_tokens": n_out,
                                 "total_tokens": len(units) + n_out}
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self._open -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

        # This module uses postponed annotations and Request is imported here, not at module level: give FastAPI
        # the class itself, or it cannot resolve the name and treats ``request`` as a query parameter.
        for endpoint, path in ((chat_completions, "/v1/chat/completions"), (completions, "/v1/completions")):
            endpoint.__annotations__["request"] = Request
            app.post(path)(endpoint)

        return app

    def start(self, timeout_s: float = 15.0) -> FakeOpenAIServer:
        import uvicorn

        from cluster.local_cluster import free_port

        self.port = free_port()
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fake-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake OpenAI server did not start on port {self.port} within {timeout_s}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not stop")

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
