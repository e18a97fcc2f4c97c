"""RoutedEngineClient: the vLLM ``EngineClient`` that vLLM's OpenAI serving layer in the ingress talks to; every
engine request it receives is routed and sent to the chosen replica.

Who calls what: ``router.vllm_frontend`` builds vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion`` /
``ServingTokenization`` over this client. They parse the request, render the chat (tools included), tokenize, build
``SamplingParams`` (structured outputs included) and call ``generate(engine_input, sampling_params, request_id,
...)`` once per prompt — vLLM's code, unchanged. ``generate`` then, synchronously, before any output:
1. runs vLLM's own admission checks of an engine request (``InputProcessor.process_inputs``: parameters against
   the model config, the structured-output grammar, prompt length, token ids), so a request the engine would
   refuse is a 400 from the serving layer, never an error in a started stream;
2. decides (``router.live_view.LiveView.decide``: block keys under the request's cache salt — the engine's, the
   tenant's and the client's ``cache_salt`` — HOLDER / FETCH / RECOMPUTE / SPLIT, a replica) and
   appends the decision to the HTTP request's ``RouteTrace`` (a context variable the ingress sets), which becomes
   the ``x-kvstack-*`` headers;
3. returns an async iterator of ``vllm.outputs.RequestOutput`` that sends ``router.wire.GenerateRequest`` to the
   replica through the Serve handle and rebuilds vLLM's outputs from its ``GenerateChunk``s: deltas as they come
   for a streaming request (``RequestOutputKind.DELTA``), merged into one final output otherwise
   (``FINAL_ONLY``: the replica still streams, so the first token's arrival is timed either way).
The first chunk's arrival is the request's TTFT (``LiveView.record_first_token``: regret, calibration), the last
chunk's pool timing joins the decision's timeline; a keyed tenant's tokens (prompt + generated) are charged to its
rate limit when the request ends (``router.access.AccessGate.charge``). Each replica call carries a Serve request
id of its own (``router.replica_calls.own_serve_request_id``), so the prompts of one batched request never wait on
each other's routing. Closing the iterator early (client gone, ``abort``) cancels the replica's call, which aborts
the engine request there and releases its KV blocks and pool leases.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GenerationError, VLLMValidationError
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.sampling_params import RequestOutputKind

from router import access
from router.replica_calls import own_serve_request_id
from router.wire import GenerateChunk, GenerateRequest, TokenLogprob, encode_sampling_params

SUPPORTED_TASKS = ("generate",)


@dataclass
class RouteTrace:
    """What was decided for one HTTP request (one decision per prompt) and where each prompt ran."""

    arrived: float = field(default_factory=time.monotonic)
    tenant: str = ""  # the API key's tenant (``router.access``); "" when the endpoint has no keys
    decisions: list[Any] = field(default_factory=list)  # router.live_view.Routed, in prompt order
    ran_on: dict[str, str] = field(default_factory=dict)  # request id -> replica that produced its first chunk


ROUTE_TRACE: ContextVar[RouteTrace | None] = ContextVar("kvstack_route_trace", default=None)


def _logprob_dict(entries: Sequence[TokenLogprob]) -> dict[int, Logprob]:
    return {e.token_id: Logprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token) for e in entries}


def request_output(request_id: str, prompt_text: str | None, prompt_token_ids: list[int],
                   chunk: GenerateChunk) -> RequestOutput:
    """vLLM's ``RequestOutput`` (one completion: the chunk's choice) for a replica's chunk."""
    completion = CompletionOutput(
        index=chunk.index,
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        cumulative_logprob=chunk.cumulative_logprob,
        logprobs=None if chunk.logprobs is None else [_logprob_dict(row) for row in chunk.logprobs],
        finish_reason=chunk.finish_reason,
        stop_reason=chunk.stop_reason,
    )
    prompt_logprobs = None
    if chunk.prompt_logprobs is not None:
        prompt_logprobs = [None if row is None else _logprob_dict(row) for row in chunk.prompt_logprobs]
    return RequestOutput(request_id, prompt_text, prompt_token_ids, prompt_logprobs, [completion],
                         finished=chunk.finished, num_cached_tokens=chunk.cached_tokens)


class RoutedEngineClient(EngineClient):
    """An ``EngineClient`` whose engine is the cluster: see the module docstring. ``view`` is the ingress's
    ``router.live_view.LiveView``, ``replicas`` the Serve handle of the replica deployment."""

    def __init__(self, vllm_config: Any, renderer: Any, input_processor: Any, view: Any, replicas: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = input_processor
        self.view = view
        self._streaming = replicas.options(stream=True)  # every generate call streams its chunks
        self._calls: dict[str, Any] = {}  # request id -> the replica call streaming it

    # -- state (the replicas report their own health to Serve; the client itself never dies) ----------------
    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the kvstack routed engine client does not fail as a whole")

    # -- generation ------------------------------------------------------------------------------------------
    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *, prompt_text: str | None = None,
                 lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None,
                 trace_headers: Any = None, priority: int = 0, data_parallel_rank: int | None = None,
                 session_id: str | None = None, kv_hints: Any = None, reasoning_ended: bool | None = None,
                 reasoning_parser_kwargs: dict[str, Any] | None = None) -> AsyncGenerator[RequestOutput, None]:
        if lora_request is not None:
            raise VLLMValidationError("LoRA adapters are not served by kvstack", parameter="model")
        if not isinstance(prompt, dict):
            raise NotImplementedError(f"kvstack routes rendered prompts only, not {type(prompt).__name__}")
        # vLLM's admission checks of an engine request (a copy is built and dropped; the replica's engine builds
        # its own from the same prompt and parameters).
        self.input_processor.process_inputs(request_id, prompt, sampling_params, SUPPORTED_TASKS, priority=priority)
        token_ids = list(extract_prompt_components(self.model_config, prompt).token_ids)
        if request_id in self._calls:  # a client-chosen id (request_id, X-Request-Id) already in flight
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        trace = ROUTE_TRACE.get()
        # keyed under the request's one cache salt (the engine's, the tenant's, the client's own ``cache_salt``),
        # which its engine's HBM prefix cache and the pool then use too
        routed, keys = self.view.decide(request_id, token_ids, trace.tenant if trace is not None else "",
                                        prompt.get("cache_salt"))
        if trace is not None:
            trace.decisions.append(routed)
        request = GenerateRequest(
            request_id=request_id, prompt_token_ids=token_ids, block_keys=keys,
            sampling_params=encode_sampling_params(sampling_params), priority=priority,
            reasoning_ended=reasoning_ended, reasoning_parser_kwargs=reasoning_parser_kwargs,
            target_replica=routed.target_replica, action=routed.action, fetch_plan=routed.fetch_plan,
            planned_reuse_tokens=routed.planned_reuse_tokens, pool_planned=routed.pool_planned,
            cache_salt=routed.cache_salt,
        )
        text = prompt_text if prompt_text is not None else prompt.get("prompt")
        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        arrived = trace.arrived if trace is not None else time.monotonic()
        self._calls[request_id] = None  # taken from now on (the call itself starts when the output is iterated)
        return self._outputs(request, routed, text, final_only, arrived, trace)

    async def _outputs(self, request: GenerateRequest, routed: Any, prompt_text: str | None, final_only: bool,
                       arrived: float, trace: RouteTrace | None) -> AsyncGenerator[RequestOutput, None]:
        sent = time.monotonic()
        with own_serve_request_id():
            call = self._streaming.generate.remote(request)
        self._calls[request.request_id] = call
        first_at: float | None = None
        tokens = 0
        finished = False
        merged: RequestOutput | None = None
        try:
            async for chunk in call:
                if chunk.error:
                    raise GenerationError(f"replica error: {chunk.error}")
                if first_at is None:
                    first_at = time.monotonic()
                    if trace is not None:
                        trace.ran_on[request.request_id] = chunk.replica_id
                    self.view.record_first_token(routed, first_at - arrived, chunk, sent - arrived)
                if chunk.pool_timing is not None:
                    self.view.record_pool_timing(routed, chunk.pool_timing)
                tokens += len(chunk.token_ids)
                finished = chunk.finished
                out = request_output(request.request_id, prompt_text, request.prompt_token_ids, chunk)
                if not final_only:
                    yield out
                elif merged is None:
                    merged = out
                else:
                    merged.add(out, aggregate=True)
            if not finished:
                # The replica's stream ended without its last chunk (the replica died, or its actor call was cut):
                # an error for the client, never an answer that looks complete.
                raise GenerationError(f"replica {routed.target_replica or '?'}: the stream ended before the "
                                      f"request finished ({tokens} tokens in)")
            if merged is not None:
                yield merged
        finally:
            self._calls.pop(request.request_id, None)
            if not finished:
                call.cancel()  # the client went away (or an error): the replica aborts the engine request
            tpot = (time.monotonic() - first_at) / (tokens - 1) if first_at is not None and tokens > 1 else None
            self.view.request_done(routed, tpot)
            if trace is not None and trace.tenant and first_at is not None:  # its tenant's rate limit, if any
                gate = access.installed()
                if gate is not None:
                    gate.charge(trace.tenant, len(request.prompt_token_ids) + tokens)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            call = self._calls.get(rid)
            if call is not None:
                call.cancel()

    def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        raise NotImplementedError("kvstack serves generative models only (no pooling / embeddings)")

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    # -- the rest of the protocol: engine-level operations the routed client does not offer ------------------
    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("profiling runs on the replicas' engines")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling runs on the replicas' engines")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        raise NotImplementedError("use POST /kvstack/admin/reset_prefix_cache (every replica)")

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("sleep mode is not offered by kvstack")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        raise NotImplementedError("sleep mode is not offered by kvstack")

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        raise NotImplementedError("LoRA adapters are not served by kvstack")

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("pausing generation is not offered by kvstack")

    async def resume_generation(self) -> None:
        raise NotImplementedError("pausing generation is not offered by kvstack")

    async def is_paused(self) -> bool:
        return False

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None  # kvstack's connector is told nothing by clients (client kv_transfer_params are refused)

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("KV cache memory belongs to the replicas' engines")

    def shutdown(self, timeout: float | None = None) -> None:
        self._calls.clear()

