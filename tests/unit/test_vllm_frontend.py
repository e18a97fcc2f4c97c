"""router.vllm_frontend + router.engine_client: vLLM's own OpenAI serving layer (chat rendering with tools, sampling
parameters with structured outputs, the hermes tool parser, the qwen3 reasoning parser, batched prompts, echo,
streams) over the routed engine client, on a real generated tiny model's tokenizer and chat template.

The replicas are the neighbour here: a scripted Serve handle that answers every engine request with a fixed model
output (tokenized by the same tokenizer), one token per chunk, and records the request it got — so a test can
say "the model wrote a <tool_call> block" and check what vLLM's parsers made of it, and check that the sampling
parameters on the wire are the ones vLLM's request conversion built (the JSON-schema constraint of a required tool
call included). The routing view is a neighbour too (it records the decisions asked for). The whole path on real
replicas is ``tests/e2e/test_openai_agents.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from cluster.tiny_models import make_tiny, preset_spec
from router import openai_format as fmt
from router.engine_client import ROUTE_TRACE, RouteTrace
from router.ingress_settings import IngressSettings, OpenAIFrontendSettings
from router.access import AccessSettings
from router.live_view import Routed
from router.wire import GenerateChunk, GenerateRequest, decode_sampling_params

MODEL = "tiny-qwen3"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class View:
    """The routing view's neighbour: records the decisions asked for, routes every prompt to replica r1."""

    def __init__(self) -> None:
        self.decided: list[list[int]] = []
        self.done = 0

    def decide(self, request_id: str, token_ids: list[int], tenant: str = "", client_salt: str | None = None
               ) -> tuple[Routed, list[bytes]]:
        self.decided.append(token_ids)
        return Routed(None, "r1", "recompute", None, request_id), []

    def record_first_token(self, *args: Any) -> None:
        pass

    def record_pool_timing(self, *args: Any) -> None:
        pass

    def request_done(self, *args: Any) -> None:
        self.done += 1


class Call:
    def __init__(self, owner: Replicas, request: GenerateRequest) -> None:
        self.owner, self.request, self.cancelled = owner, request, False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> Any:
        return self._chunks()

    async def _chunks(self) -> Any:
        params = decode_sampling_params(self.request.sampling_params)
        ids = self.owner.tokenizer.encode(self.owner.output, add_special_tokens=False)
        sent = 0
        for index in range(params.n):
            for i, tid in enumerate(ids):
                if self.owner.cut_after is not None and sent == self.owner.cut_after:
                    return  # the replica's stream ends here, without its last chunk (the replica died)
                sent += 1
                last = i == len(ids) - 1
                await asyncio.sleep(self.owner.delay_s)
                yield GenerateChunk(index=index, text=self.owner.tokenizer.decode([tid]), token_ids=[tid],
                                    finish_reason="stop" if last else None, finished=last and index == params.n - 1,
                                    prompt_tokens=len(self.request.prompt_token_ids), cached_tokens=0,
                                    replica_id="r1")


class Replicas:
    """The replica deployment's Serve handle, scripted: every request gets ``output`` as the model's text."""

    def __init__(self) -> None:
        self.output = "hello"
        self.delay_s = 0.0
        self.cut_after: int | None = None  # end every call's stream after this many chunks, unfinished
        self.tokenizer: Any = None
        self.calls: list[Call] = []

    def options(self, **kwargs: Any) -> Replicas:
        return self

    @property
    def generate(self) -> Replicas:
        return self

    def remote(self, request: GenerateRequest) -> Call:
        call = Call(self, request)
        self.calls.append(call)
        return call


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / MODEL
    make_tiny(preset_spec("qwen3"), out)
    return out


def frontend_for(model_dir: Path, reasoning_parser: str | None = None) -> tuple[Any, View, Replicas]:
    from router.vllm_frontend import build_frontend

    from deployments.engine_settings import EngineSettings

    engine = EngineSettings(model=str(model_dir), served_model_name=MODEL, max_model_len=2048, block_size=16,
                            reasoning_parser=reasoning_parser)
    settings = IngressSettings(
        served_model_name=MODEL, model_path=str(model_dir), engine_args=engine.vllm_engine_kwargs(),
        max_model_len=2048, block_size=16, cache_salt="",
        policy="round_robin", model_spec="qwen3-0.6b", gpu_profile="cpu-2core", tiers={"hbm": "hbm"}, mfu=0.4,
        bw_util=0.7, seed=0, dtype="bfloat16", reasoning_parser=reasoning_parser,
        openai=OpenAIFrontendSettings(enable_auto_tool_choice=True, tool_call_parser="hermes"),
        access=AccessSettings())
    view, replicas = View(), Replicas()
    frontend = build_frontend(settings, view, replicas)
    replicas.tokenizer = frontend.engine_client.renderer.tokenizer
    return frontend, view, replicas


@pytest.fixture(scope="module")
def served(model_dir: Path) -> tuple[Any, View, Replicas]:
    return frontend_for(model_dir)


def run(served: tuple[Any, View, Replicas], body: dict[str, Any], *, chat: bool = True) -> Any:
    """The ingress's path for one body (``router.ingress.OpenAIIngress._generate`` minus HTTP): parse, validate,
    refuse, vLLM's serving layer; a stream is drained into its SSE payloads."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    frontend = served[0]

    async def go() -> Any:
        trace = RouteTrace()
        token = ROUTE_TRACE.set(trace)
        try:
            req = fmt.validate(ChatCompletionRequest if chat else CompletionRequest,
                               fmt.parse_json_body(json.dumps({"model": MODEL, **body}).encode()))
            fmt.refuse_unhonoured(req)
            create = frontend.chat.create_chat_completion if chat else frontend.completion.create_completion
            result = await fmt.call_vllm(create, req)
            if hasattr(result, "model_dump"):
                return result.model_dump()
            events = []
            async for line in result:
                payload = line.removeprefix("data: ").strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            return events
        finally:
            ROUTE_TRACE.reset(token)

    return asyncio.run(go())


def last_params(served: tuple[Any, View, Replicas]) -> Any:
    return decode_sampling_params(served[2].calls[-1].request.sampling_params)


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- tool calling -----------------------------------------------------------------------------------------------
def test_tools_without_tool_choice_are_auto_and_the_hermes_parser_returns_the_call(served: Any) -> None:
    served[2].output = CALL_TEXT
    out = run(served, {"messages": USER, "tools": [WEATHER], "max_tokens": 64})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert not choice["message"]["content"]
    # the tools reached the prompt through the chat template
    prompt = served[2].tokenizer.decode(served[1].decided[-1])
    assert "get_weather" in prompt and "<tools>" in prompt


def test_streamed_tool_call_deltas_assemble_to_the_same_call(served: Any) -> None:
    served[2].output = CALL_TEXT
    events = run(served, {"messages": USER, "tools": [WEATHER], "max_tokens": 64, "stream": True})
    assert events[-1] == "[DONE]"
    name, args, finish = "", "", None
    for event in events[:-1]:
        for choice in event["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                name += call.get("function", {}).get("name") or ""
                args += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"} and finish == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_choice_constrain_decoding_with_the_tools_schema(served: Any, choice: Any) -> None:
    served[2].output = CALL_TEXT
    out = run(served, {"messages": USER, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 64})
    constraint = last_params(served).structured_outputs
    assert constraint is not None  # the engine gets the tools' schema: JSON, or a structural tag around it
    spec = constraint.json if constraint.json is not None else constraint.structural_tag
    assert spec is not None and "get_weather" in json.dumps(spec)  # only the tools' names can be generated
    calls = out["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_strict_tool_constrains_its_arguments_to_its_schema(served: Any) -> None:
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    served[2].output = CALL_TEXT
    run(served, {"messages": USER, "tools": [strict], "tool_choice": "required", "max_tokens": 64})
    constraint = last_params(served).structured_outputs
    spec = constraint.json if constraint.json is not None else constraint.structural_tag
    assert '"city"' in json.dumps(spec) or '\\"city\\"' in json.dumps(spec)


def test_tool_results_and_assistant_tool_calls_in_the_history_render(served: Any) -> None:
    served[2].output = "It is sunny."
    history = [*USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = run(served, {"messages": history, "tools": [WEATHER], "max_tokens": 16})
    assert out["choices"][0]["message"]["content"] == "It is sunny."
    prompt = served[2].tokenizer.decode(served[1].decided[-1])
    assert "<tool_response>" in prompt and "sunny, 21 C" in prompt and '"city": "Paris"' in prompt


def test_parallel_tool_calls_false_keeps_the_first_call(served: Any) -> None:
    served[2].output = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")
    both = run(served, {"messages": USER, "tools": [WEATHER], "max_tokens": 64})
    assert [json.loads(c["function"]["arguments"])["city"] for c in both["choices"][0]["message"]["tool_calls"]] \
        == ["Paris", "Rome"]
    one = run(served, {"messages": USER, "tools": [WEATHER], "max_tokens": 64, "parallel_tool_calls": False})
    assert [json.loads(c["function"]["arguments"])["city"] for c in one["choices"][0]["message"]["tool_calls"]] \
        == ["Paris"]


def test_tool_choice_none_returns_text(served: Any) -> None:
    served[2].output = CALL_TEXT
    out = run(served, {"messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 64})
    assert out["choices"][0]["finish_reason"] == "stop"
    assert "<tool_call>" in out["choices"][0]["message"]["content"]


# -- structured output ----------------------------------------------------------------------------------------------
def test_json_schema_response_format_reaches_the_engine_as_a_constraint(served: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    served[2].output = '{"answer": 42}'
    out = run(served, {"messages": USER, "max_tokens": 32, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    assert json.loads(out["choices"][0]["message"]["content"]) == {"answer": 42}
    assert last_params(served).structured_outputs.json == schema
    run(served, {"messages": USER, "max_tokens": 8, "response_format": {"type": "json_object"}})
    assert last_params(served).structured_outputs.json_object is True


def test_an_invalid_schema_is_a_400_before_any_replica_is_asked(served: Any) -> None:
    before = len(served[2].calls)
    with pytest.raises(fmt.ApiError) as ei:
        run(served, {"messages": USER, "max_tokens": 8, "structured_outputs": {"regex": "(unclosed"}})
    assert ei.value.status == 400
    assert len(served[2].calls) == before


# -- completions ------------------------------------------------------------------------------------------------------
def test_batched_prompts_get_one_choice_each_routed_on_their_own_tokens(served: Any) -> None:
    served[2].output = " done"
    decided = len(served[1].decided)
    out = run(served, {"prompt": ["first prompt", "second"], "max_tokens": 4, "echo": True}, chat=False)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == ["first prompt done", "second done"]
    assert len(served[1].decided) == decided + 2
    out = run(served, {"prompt": [[11, 12, 13], [14, 15]], "max_tokens": 4}, chat=False)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert served[1].decided[-2:] == [[11, 12, 13], [14, 15]]


def test_n_choices_and_logit_bias_pass_through(served: Any) -> None:
    served[2].output = "ab"
    out = run(served, {"prompt": "x", "max_tokens": 4, "n": 2, "temperature": 0.7, "logit_bias": {"5": -100}},
              chat=False)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert last_params(served).logit_bias == {5: -100}


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"n": 3, "temperature": 0}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 100000}, None),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
])
def test_invalid_sampling_is_400(served: Any, body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        run(served, {"messages": USER, **body})
    assert ei.value.status == 400, ei.value.body()
    if param is not None:
        assert param in ei.value.message or ei.value.param == param


def test_empty_prompt_is_400(served: Any) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        run(served, {"prompt": "", "max_tokens": 4}, chat=False)
    assert ei.value.status == 400


# -- reasoning ------------------------------------------------------------------------------------------------------
def test_the_qwen3_reasoning_parser_splits_reasoning_from_content(model_dir: Path) -> None:
    served = frontend_for(model_dir, reasoning_parser="qwen3")
    served[2].output = "<think>\nthe user wants weather\n</think>\n\nIt is sunny."
    out = run(served, {"messages": USER, "max_tokens": 64})
    message = out["choices"][0]["message"]
    assert message["reasoning"].strip() == "the user wants weather"
    assert message["content"].strip() == "It is sunny."
    events = run(served, {"messages": USER, "max_tokens": 64, "stream": True})
    reasoning = "".join(c["delta"].get("reasoning") or "" for e in events[:-1] for c in e["choices"])
    content = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert reasoning.strip() == "the user wants weather" and content.strip() == "It is sunny."
    run(served, {"messages": USER, "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}})
    prompt = served[2].tokenizer.decode(served[1].decided[-1])
    assert prompt.endswith("<think>\n\n</think>\n\n")


# -- cancellation -----------------------------------------------------------------------------------------------------
def test_a_disconnect_mid_stream_cancels_the_replica_call(served: Any) -> None:
    """A client that goes away mid-stream: Starlette cancels the task iterating the stream while it waits for the
    next token; the routed client then cancels its replica call (the replica aborts the engine request)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    served[2].output = "one two three four five six seven eight nine ten"
    served[2].delay_s = 0.05

    async def go() -> None:
        req = fmt.validate(ChatCompletionRequest, {"model": MODEL, "messages": USER, "max_tokens": 32,
                                                   "stream": True})
        stream = await fmt.call_vllm(served[0].chat.create_chat_completion, req)
        got = asyncio.Event()

        async def consume() -> None:
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    got.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(got.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    done = served[1].done
    try:
        asyncio.run(go())
    finally:
        served[2].delay_s = 0.0
    assert served[2].calls[-1].cancelled
    assert served[1].done == done + 1  # the routing view closed the assignment


@pytest.mark.parametrize("stream", [True, False])
def test_a_replica_stream_cut_short_is_an_error_never_a_complete_answer(served: Any, stream: bool) -> None:
    """A replica that dies mid-request ends its call's stream without the finished chunk: the client gets an error
    (streamed: an error event, no finish reason; otherwise an error response), not a truncated answer that looks
    whole."""
    served[2].output = "one two three four five six seven eight nine ten"
    served[2].cut_after = 3
    try:
        if stream:
            out = run(served, {"messages": USER, "max_tokens": 32, "stream": True})
            assert any(isinstance(e, dict) and "error" in e for e in out), out
            assert not any(c.get("finish_reason") for e in out if isinstance(e, dict) for c in e.get("choices", []))
        else:
            with pytest.raises(fmt.ApiError) as err:
                run(served, {"messages": USER, "max_tokens": 32})
            assert err.value.status == 500 and "ended before the request finished" in str(err.value.message)
    finally:
        served[2].cut_after = None
    assert served[2].calls[-1].cancelled  # the call is cancelled (the replica, if alive, aborts the request)


def test_a_client_request_id_in_flight_twice_gets_two_engine_requests(served: Any) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    served[2].output = "a b c"

    async def one() -> str:
        req = fmt.validate(ChatCompletionRequest, {"model": MODEL, "messages": USER, "max_tokens": 8,
                                                   "stream": True, "request_id": "mine"})
        stream = await fmt.call_vllm(served[0].chat.create_chat_completion, req)
        return "".join([line async for line in stream])

    async def both() -> list[str]:
        first = asyncio.ensure_future(one())
        while len(served[2].calls) == before:  # the first is on a replica (and slow) before the second arrives
            await asyncio.sleep(0.01)
        return [await one(), await first]

    before = len(served[2].calls)
    served[2].delay_s = 0.05
    try:
        outs = asyncio.run(both())
    finally:
        served[2].delay_s = 0.0
    ids = [c.request.request_id for c in served[2].calls[before:]]
    assert len(ids) == 2 and len(set(ids)) == 2 and ids[0] == "chatcmpl-mine" and ids[1].startswith("chatcmpl-mine-")
    assert all("[DONE]" in out for out in outs)
