"""router.openai_format: parsing/validation with vLLM's protocol models, OpenAI error objects, and response / SSE
builders whose output the real ``openai`` SDK parses. The parse path is exercised as the ingress runs it:
``parse_json_body`` -> ``validate`` -> ``chat_messages`` -> ``resolve_max_tokens`` -> ``sampling_from``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router import openai_format as fmt
from router.wire import GenerateChunk, Sampling, TokenLogprob

MAX_MODEL_LEN = 4096
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_cls() -> type:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


@pytest.fixture(scope="module")
def completion_cls() -> type:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def ingest(model_cls: type, body: dict[str, Any], prompt_len: int = 10) -> Sampling:
    """The ingress's parse path (minus tokenization) on a JSON body."""
    req = fmt.validate(model_cls, fmt.parse_json_body(json.dumps(body).encode()))
    if hasattr(req, "messages"):
        fmt.chat_messages(req.messages)
    return fmt.sampling_from(req, fmt.resolve_max_tokens(req, prompt_len, MAX_MODEL_LEN))


# -- bodies and errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"{", b"{'model': 'x'}", b"", b"\xff\xfe{}", b'{"a": 1,}'])
def test_malformed_json_is_400_invalid_json(raw: bytes) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.parse_json_body(raw)
    err = ei.value
    assert err.status == 400
    assert err.body()["error"]["code"] == "invalid_json"
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"[]", b'[{"model": "x"}]', b'"text"', b"42", b"null", b"true"])
def test_non_object_body_is_400(raw: bytes) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.parse_json_body(raw)
    assert ei.value.status == 400 and ei.value.code == "invalid_json"
    assert "JSON object" in ei.value.message


def test_object_body_parses() -> None:
    assert fmt.parse_json_body(b'{"model": "m", "n": 2}') == {"model": "m", "n": 2}


def test_error_object_shape() -> None:
    body = fmt.ApiError(404, "no such model", type_="NotFoundError", param="model", code="model_not_found").body()
    assert body == {"error": {"message": "no such model", "type": "NotFoundError", "param": "model",
                              "code": "model_not_found"}}
    assert fmt.ApiError(400, "bad").body()["error"] == {"message": "bad", "type": "invalid_request_error",
                                                        "param": None, "code": 400}


# -- validation: every bad parameter is a 400 that names it ----------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 3, "temperature": 0}, "n"),  # vLLM: n must be 1 when sampling greedily
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 5}, "top_logprobs"),  # top_logprobs without logprobs=true
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"seed": "abc"}, "seed"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [*USER, {"content": "no role"}]}, "messages.1.role"),
    ],
)
def test_chat_invalid_parameter_is_400_naming_it(chat_cls: type, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        ingest(chat_cls, {"model": "m", "messages": USER, **extra})
    err = ei.value
    assert err.status == 400, err.body()
    assert err.param == param, err.body()
    assert err.body()["error"]["param"] == param
    assert err.message


def test_chat_missing_messages_is_400(chat_cls: type) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        ingest(chat_cls, {"model": "m"})
    assert ei.value.status == 400 and ei.value.param == "messages"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_completion_invalid_parameter_is_400_naming_it(completion_cls: type, extra: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        ingest(completion_cls, {"model": "m", "prompt": "hi", **extra})
    assert ei.value.status == 400 and ei.value.param == param, ei.value.body()


# -- context length and max_tokens -----------------------------------------------------------------------------------
def test_context_too_long_is_400_with_the_numbers(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": USER, "max_tokens": 200})
    with pytest.raises(fmt.ApiError) as ei:
        fmt.resolve_max_tokens(req, 4000, MAX_MODEL_LEN)
    err = ei.value
    assert err.status == 400 and err.code == "context_length_exceeded" and err.param == "messages"
    for number in ("4096", "4200", "4000", "200"):
        assert number in err.message


@pytest.mark.parametrize("prompt_len", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 10 * MAX_MODEL_LEN])
def test_prompt_that_leaves_no_room_is_400(chat_cls: type, prompt_len: int) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": USER})
    with pytest.raises(fmt.ApiError) as ei:
        fmt.resolve_max_tokens(req, prompt_len, MAX_MODEL_LEN)
    assert ei.value.code == "context_length_exceeded" and str(prompt_len) in ei.value.message


def test_completion_context_error_names_prompt(completion_cls: type) -> None:
    req = fmt.validate(completion_cls, {"model": "m", "prompt": "x", "max_tokens": 100})
    with pytest.raises(fmt.ApiError) as ei:
        fmt.resolve_max_tokens(req, 4000, MAX_MODEL_LEN)
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded"


def test_max_tokens_defaults_to_the_room_left(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": USER})
    assert fmt.resolve_max_tokens(req, 96, MAX_MODEL_LEN) == 4000
    assert fmt.resolve_max_tokens(req, MAX_MODEL_LEN - 1, MAX_MODEL_LEN) == 1
    assert ingest(chat_cls, {"model": "m", "messages": USER}, prompt_len=96).max_tokens == 4000


def test_max_tokens_exactly_fills_the_context(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": USER, "max_tokens": 96})
    assert fmt.resolve_max_tokens(req, MAX_MODEL_LEN - 96, MAX_MODEL_LEN) == 96


def test_max_completion_tokens_wins_over_max_tokens(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": USER, "max_tokens": 50, "max_completion_tokens": 7})
    assert fmt.resolve_max_tokens(req, 10, MAX_MODEL_LEN) == 7


def test_completion_max_tokens_defaults_to_openai_16(completion_cls: type) -> None:
    req = fmt.validate(completion_cls, {"model": "m", "prompt": "x"})
    assert fmt.resolve_max_tokens(req, 10, MAX_MODEL_LEN) == 16


# -- sampling ------------------------------------------------------------------------------------------------------
def test_chat_sampling_defaults(chat_cls: type) -> None:
    s = ingest(chat_cls, {"model": "m", "messages": USER}, prompt_len=96)
    assert s == Sampling(max_tokens=4000, temperature=1.0, top_p=1.0, n=1, seed=None, stop=[], stop_token_ids=[],
                         logprobs=None, ignore_eos=False, presence_penalty=0.0, frequency_penalty=0.0)


def test_chat_sampling_fields(chat_cls: type) -> None:
    s = ingest(chat_cls, {"model": "m", "messages": USER, "max_tokens": 12, "temperature": 0.3, "top_p": 0.5,
                          "n": 3, "seed": 1234, "stop": "END", "stop_token_ids": [7, 9], "ignore_eos": True,
                          "presence_penalty": 0.5, "frequency_penalty": -0.25, "logprobs": True, "top_logprobs": 4})
    assert s == Sampling(max_tokens=12, temperature=0.3, top_p=0.5, n=3, seed=1234, stop=["END"],
                         stop_token_ids=[7, 9], logprobs=4, ignore_eos=True, presence_penalty=0.5,
                         frequency_penalty=-0.25)


def test_greedy_temperature_zero_is_kept(chat_cls: type) -> None:
    assert ingest(chat_cls, {"model": "m", "messages": USER, "temperature": 0}).temperature == 0.0


@pytest.mark.parametrize(
    ("extra", "logprobs"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 20}, 20),
    ],
)
def test_chat_logprobs_bool_plus_top_logprobs(chat_cls: type, extra: dict[str, Any], logprobs: int | None) -> None:
    assert ingest(chat_cls, {"model": "m", "messages": USER, **extra}).logprobs == logprobs


@pytest.mark.parametrize(("value", "logprobs"), [(None, None), (0, 0), (3, 3), (20, 20)])
def test_completion_logprobs_int(completion_cls: type, value: int | None, logprobs: int | None) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    if value is not None:
        body["logprobs"] = value
    assert ingest(completion_cls, body).logprobs == logprobs


@pytest.mark.parametrize(("stop", "expected"), [("x", ["x"]), (["a", "b"], ["a", "b"]), (None, []), ([], [])])
def test_stop_str_or_list(chat_cls: type, completion_cls: type, stop: Any, expected: list[str]) -> None:
    assert ingest(chat_cls, {"model": "m", "messages": USER, "stop": stop}).stop == expected
    assert ingest(completion_cls, {"model": "m", "prompt": "p", "stop": stop}).stop == expected


def test_completion_sampling_fields(completion_cls: type) -> None:
    s = ingest(completion_cls, {"model": "m", "prompt": "p", "max_tokens": 5, "n": 2, "seed": 0,
                                "temperature": 0.7, "logprobs": 2})
    assert (s.max_tokens, s.n, s.seed, s.temperature, s.logprobs) == (5, 2, 0, 0.7, 2)


# -- chat messages -------------------------------------------------------------------------------------------------
def test_chat_messages_text_parts_joined_like_vllm(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "thanks", "name": "bob"},
    ]})
    msgs = fmt.chat_messages(req.messages)
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "first\nsecond"}  # vLLM joins text parts with newlines
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"][0]["id"] == "call_1"
    assert msgs[3] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert msgs[4] == {"role": "user", "content": "thanks", "name": "bob"}


def test_chat_messages_plain_string_parts() -> None:
    assert fmt.chat_messages([{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}]) == [
        {"role": "user", "content": "a\nb"}]


def test_chat_messages_image_part_rejected(chat_cls: type) -> None:
    req = fmt.validate(chat_cls, {"model": "m", "messages": [
        {"role": "user", "content": "look"},
        {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                     {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]},
    ]})
    with pytest.raises(fmt.ApiError) as ei:
        fmt.chat_messages(req.messages)
    assert ei.value.status == 400 and ei.value.param == "messages.1.content"
    assert "image_url" in ei.value.message


# -- responses the openai SDK parses -------------------------------------------------------------------------------
def _row(*tokens: tuple[int, str, float]) -> list[TokenLogprob]:
    return [TokenLogprob(tid, tok, lp) for tid, tok, lp in tokens]


def _choice(text_tokens: list[tuple[str, int]], finish: str, rows: list[list[TokenLogprob]] | None = None,
            index: int = 0) -> fmt.ChoiceAccumulator:
    acc = fmt.ChoiceAccumulator()
    for i, (text, tid) in enumerate(text_tokens):
        last = i == len(text_tokens) - 1
        acc.add(GenerateChunk(index=index, text=text, token_ids=[tid], finish_reason=finish if last else None,
                              logprobs=[rows[i]] if rows else None, prompt_tokens=10))
    return acc


def test_chat_response_parses_with_the_openai_sdk() -> None:
    rows = [_row((5, "Hel", -0.1), (5, "Hel", -0.1), (8, "He", -2.4)),
            _row((6, "lo", float("-inf")), (9, "lo!", -0.01), (6, "lo", float("-inf")))]
    choices = {1: _choice([("x", 3)], "stop", index=1), 0: _choice([("Hel", 5), ("lo", 6)], "length", rows)}
    body = fmt.chat_response("chatcmpl-abc", "tiny", choices, prompt_tokens=10, cached_tokens=8)
    json.dumps(body, allow_nan=False)  # -inf logprobs are clamped: the body is strict JSON
    resp = ChatCompletion.model_validate(body)
    assert resp.object == "chat.completion" and resp.id == "chatcmpl-abc" and resp.model == "tiny"
    assert [c.index for c in resp.choices] == [0, 1]
    c0 = resp.choices[0]
    assert c0.message.role == "assistant" and c0.message.content == "Hello" and c0.finish_reason == "length"
    assert c0.logprobs is not None and c0.logprobs.content is not None
    assert [t.token for t in c0.logprobs.content] == ["Hel", "lo"]
    assert c0.logprobs.content[1].logprob == -9999.0
    assert [t.token for t in c0.logprobs.content[0].top_logprobs] == ["Hel", "He"]
    assert c0.logprobs.content[0].bytes == list(b"Hel")
    assert resp.choices[1].logprobs is None and resp.choices[1].finish_reason == "stop"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (10, 3, 13)
    assert resp.usage.prompt_tokens_details is not None and resp.usage.prompt_tokens_details.cached_tokens == 8


def test_completion_response_parses_with_the_openai_sdk() -> None:
    rows = [_row((5, " a", -0.5), (5, " a", -0.5), (7, " b", -1.5)), _row((6, " c", -0.2), (6, " c", -0.2))]
    body = fmt.completion_response("cmpl-1", "tiny", {0: _choice([(" a", 5), (" c", 6)], "stop", rows)},
                                   prompt_tokens=4, cached_tokens=0, echo_text="say:")
    resp = Completion.model_validate(body)
    assert resp.object == "text_completion"
    ch = resp.choices[0]
    assert ch.text == "say: a c" and ch.finish_reason == "stop"
    assert ch.logprobs is not None
    assert ch.logprobs.tokens == [" a", " c"] and ch.logprobs.token_logprobs == [-0.5, -0.2]
    assert ch.logprobs.top_logprobs == [{" a": -0.5, " b": -1.5}, {" c": -0.2}]
    assert resp.usage is not None and resp.usage.total_tokens == 6


def test_stream_chunks_parse_and_sse_ends_with_done() -> None:
    rid, model, created = "chatcmpl-s", "tiny", 1700000000
    frames = [
        fmt.sse(fmt.chat_chunk(rid, model, created, 0, {"role": "assistant", "content": "line1\n\nline2"})),
        fmt.sse(fmt.chat_chunk(rid, model, created, 0, {"content": " data: [DONE]"}, None,
                               fmt.chat_logprobs([_row((1, "x", -0.3), (1, "x", -0.3))]))),
        fmt.sse(fmt.chat_chunk(rid, model, created, 0, {"content": ""}, "stop")),
        fmt.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                 "usage": fmt.usage(10, 3, 0)}),
        fmt.sse("[DONE]"),
    ]
    stream = b"".join(frames)
    events = stream.decode().split("\n\n")
    assert events[-1] == ""  # every event ends with a blank line
    events = events[:-1]
    assert len(events) == len(frames)
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    assert stream.endswith(b"data: [DONE]\n\n")
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[len("data: "):])) for e in events[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "line1\n\nline2 data: [DONE]"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[2].choices[0].finish_reason == "stop"
    assert chunks[3].usage is not None and chunks[3].usage.total_tokens == 13


def test_completion_stream_chunk_parses() -> None:
    frame = fmt.sse(fmt.completion_chunk("cmpl-s", "tiny", 1, 0, "tok", "length",
                                         fmt.completion_logprobs([_row((1, "tok", -0.1), (2, "tak", -1.0))])))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    c = Completion.model_validate(json.loads(frame[len(b"data: "):]))
    assert c.choices[0].text == "tok" and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.top_logprobs == [{"tak": -1.0}]


def test_error_frame_is_json() -> None:
    frame = fmt.sse(fmt.ApiError(500, "boom", type_="InternalServerError").body())
    assert json.loads(frame[len(b"data: "):]) == {"error": {"message": "boom", "type": "InternalServerError",
                                                            "param": None, "code": 500}}


# -- the replica's logprob rows, as formatted: top_logprobs holds exactly the top-k --------------------------------
def _vllm_output(token_ids: list[int], entries: list[dict[int, tuple[float, str]]]) -> Any:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    logprobs = [{tid: Logprob(lp, rank=None, decoded_token=tok) for tid, (lp, tok) in e.items()} for e in entries]
    return CompletionOutput(index=0, text="", token_ids=token_ids, cumulative_logprob=None, logprobs=logprobs)


def test_replica_logprob_rows_carry_the_top_k_including_the_sampled_token() -> None:
    from deployments.replica import VLLMReplica

    k = 3
    # token 1: sampled = the most likely (vLLM's entry holds k entries); token 2: sampled outside the top-k (k + 1)
    out = _vllm_output([10, 99], [
        {10: (-0.1, "a"), 11: (-2.0, "b"), 12: (-3.0, "c")},
        {20: (-0.2, "x"), 21: (-1.0, "y"), 22: (-2.5, "z"), 99: (-6.0, "q")},
    ])
    rows = VLLMReplica._logprobs(out, k)
    assert [r[0].token_id for r in rows] == [10, 99]  # the sampled token first
    assert [t.token_id for t in rows[0][1:]] == [10, 11, 12]
    assert [t.token_id for t in rows[1][1:]] == [20, 21, 22]
    body = fmt.chat_chunk("c", "m", 1, 0, {"content": "aq"}, None, fmt.chat_logprobs(rows))
    content = ChatCompletionChunk.model_validate(body).choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [len(c.top_logprobs) for c in content] == [k, k]
    assert [t.token for t in content[0].top_logprobs] == ["a", "b", "c"]
    assert content[1].token == "q" and math.isclose(content[1].logprob, -6.0)
    comp = fmt.completion_logprobs(rows)
    assert comp is not None and comp["top_logprobs"] == [{"a": -0.1, "b": -2.0, "c": -3.0},
                                                         {"x": -0.2, "y": -1.0, "z": -2.5}]


# -- no body crashes the parse path: every field with a wrong-typed value is a 400 ---------------------------------
WRONG_VALUES = ["x", "5", -1, 0, 10**12, 1.5, None, [], ["x"], {}, {"a": 1}, True, [1, 2]]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_wrong_typed_fields_are_400_never_a_crash(chat_cls: type, completion_cls: type, chat: bool) -> None:
    cls = chat_cls if chat else completion_cls
    base: dict[str, Any] = {"model": "m", "messages": USER} if chat else {"model": "m", "prompt": "hi"}
    crashes = []
    for name in cls.model_fields:
        for value in WRONG_VALUES:
            try:
                ingest(cls, {**base, name: value})
            except fmt.ApiError as err:
                assert err.status == 400
            except Exception as exc:  # noqa: BLE001 - what the test is looking for
                crashes.append((name, value, repr(exc)[:120]))
    assert crashes == []


def test_extra_sampling_fields_reach_the_wire(chat_cls: type, completion_cls: type) -> None:
    body = {"model": "m", "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3, "max_tokens": 8}
    for cls, extra in ((chat_cls, {"messages": USER}), (completion_cls, {"prompt": "hi"})):
        s = ingest(cls, {**body, **extra})
        assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (40, 0.05, 1.1, 3)


@pytest.mark.parametrize("extra,param", [
    ({"top_k": -7}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_extra_sampling_values_are_400(chat_cls: type, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(fmt.ApiError) as err:
        ingest(chat_cls, {"model": "m", "messages": USER, **extra})
    assert err.value.status == 400 and param in err.value.message


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"11": 5}}, "logit_bias"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
])
def test_fields_kvstack_would_ignore_are_refused_by_name(chat_cls: type, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(fmt.ApiError) as err:
        ingest(chat_cls, {"model": "m", "messages": USER, **extra})
    assert err.value.status == 400 and err.value.param == param and err.value.code == "unsupported_parameter"
    assert "not supported" in err.value.message


def test_unsupported_fields_at_their_defaults_or_null_are_fine(chat_cls: type, completion_cls: type) -> None:
    """Clients (LangChain and co.) send nulls and defaults for fields they do not use: that is not a request."""
    ingest(chat_cls, {"model": "m", "messages": USER, "logit_bias": None, "response_format": None,
                      "use_beam_search": False, "user": "alice", "parallel_tool_calls": True})
    ingest(completion_cls, {"model": "m", "prompt": "hi", "logit_bias": None, "suffix": None, "user": "bob"})
