"""router.openai_format: the ingress's glue around vLLM's serving layer — reading a body under a size limit, parsing
JSON (NaN/Infinity refused), validating with vLLM's protocol models (400 naming the field), refusing what kvstack
cannot honour, and turning vLLM's errors into OpenAI error objects with vLLM's statuses. What vLLM's serving layer
itself does with a request is tested over a real tiny model in ``test_vllm_frontend.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router import openai_format as fmt

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_cls() -> type:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


@pytest.fixture(scope="module")
def completion_cls() -> type:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


class Body:
    """A Starlette request's body side: headers and the streamed pieces (the neighbour of ``read_body``)."""

    def __init__(self, pieces: list[bytes], declared: int | None = None) -> None:
        self.pieces = pieces
        self.headers = {} if declared is None else {"content-length": str(declared)}
        self.read = 0

    async def stream(self) -> Any:
        for piece in self.pieces:
            self.read += 1
            yield piece


# -- bodies and errors ---------------------------------------------------------------------------------------------
def test_body_under_the_limit_is_read_whole() -> None:
    assert asyncio.run(fmt.read_body(Body([b"ab", b"cd"]), limit=4)) == b"abcd"


def test_body_over_the_limit_is_413_without_reading_it_all() -> None:
    body = Body([b"x" * 10] * 100)
    with pytest.raises(fmt.ApiError) as ei:
        asyncio.run(fmt.read_body(body, limit=25))
    assert ei.value.status == 413 and ei.value.code == "request_too_large"
    assert body.read == 3  # stopped at the piece that crossed the limit
    declared = Body([b"x"], declared=10**9)
    with pytest.raises(fmt.ApiError) as ei:
        asyncio.run(fmt.read_body(declared, limit=1000))
    assert ei.value.status == 413 and declared.read == 0  # the declared length alone refuses it


@pytest.mark.parametrize("raw", [b"{", b"{'model': 'x'}", b"", b"\xff\xfe{}", b'{"a": 1,}'])
def test_malformed_json_is_400_invalid_json(raw: bytes) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.parse_json_body(raw)
    err = ei.value
    assert err.status == 400
    assert err.body()["error"]["code"] == "invalid_json"
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"top_p": Infinity}', b'{"a": [1, -Infinity]}'])
def test_nan_and_infinity_are_400(raw: bytes) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.parse_json_body(raw)
    assert ei.value.status == 400 and "not a JSON number" in ei.value.message


@pytest.mark.parametrize("raw", [b"[]", b'[{"model": "x"}]', b'"text"', b"42", b"null", b"true"])
def test_non_object_body_is_400(raw: bytes) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.parse_json_body(raw)
    assert ei.value.status == 400 and ei.value.code == "invalid_json"
    assert "JSON object" in ei.value.message


def test_object_body_parses() -> None:
    assert fmt.parse_json_body(b'{"model": "m", "n": 2, "x": 1e308}') == {"model": "m", "n": 2, "x": 1e308}


def test_error_object_shape() -> None:
    body = fmt.ApiError(404, "no such model", type_="NotFoundError", param="model", code="model_not_found").body()
    assert body == {"error": {"message": "no such model", "type": "NotFoundError", "param": "model",
                              "code": "model_not_found"}}
    assert fmt.ApiError(400, "bad").body()["error"] == {"message": "bad", "type": "invalid_request_error",
                                                        "param": None, "code": 400}


# -- validation with vLLM's protocol models ---------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"seed": "abc"}, "seed"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [*USER, {"content": "no role"}]}, "messages.1.role"),
    ({"top_logprobs": 5}, "top_logprobs"),  # top_logprobs without logprobs=true (a vLLM model validator)
])
def test_invalid_fields_are_400_naming_them(chat_cls: type, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(fmt.ApiError) as ei:
        fmt.validate(chat_cls, {"model": "m", "messages": USER, **extra})
    assert ei.value.status == 400 and ei.value.param == param, ei.value.body()


def test_union_protocol_models_validate(chat_cls: type) -> None:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

    chat = fmt.validate(TokenizeRequest, {"model": "m", "messages": USER})
    plain = fmt.validate(TokenizeRequest, {"model": "m", "prompt": "hello"})
    assert hasattr(chat, "messages") and plain.prompt == "hello"
    with pytest.raises(fmt.ApiError) as ei:
        fmt.validate(TokenizeRequest, {"model": "m"})
    assert ei.value.status == 400


WRONG_VALUES = ["x", "5", -1, 0, 10**12, 1.5, None, [], ["x"], {}, {"a": 1}, True, [1, 2]]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_wrong_typed_fields_are_400_never_a_crash(chat_cls: type, completion_cls: type, chat: bool) -> None:
    cls = chat_cls if chat else completion_cls
    base: dict[str, Any] = {"model": "m", "messages": USER} if chat else {"model": "m", "prompt": "hi"}
    crashes = []
    for name in cls.model_fields:
        for value in WRONG_VALUES:
            try:
                fmt.refuse_unhonoured(fmt.validate(cls, {**base, name: value}))
            except fmt.ApiError as err:
                assert err.status == 400
            except Exception as exc:  # noqa: BLE001 - what the test is looking for
                crashes.append((name, value, repr(exc)[:120]))
    assert crashes == []


# -- what kvstack cannot honour ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_fields_kvstack_cannot_honour_are_refused_by_name(chat_cls: type, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(fmt.ApiError) as err:
        fmt.refuse_unhonoured(fmt.validate(chat_cls, {"model": "m", "messages": USER, **extra}))
    assert err.value.status == 400 and err.value.param == param and err.value.code == "unsupported_parameter"
    assert "not supported" in err.value.message


def test_agent_framework_fields_and_nulls_are_accepted(chat_cls: type, completion_cls: type) -> None:
    """What agent frameworks send — tools without tool_choice, response_format, logit_bias, nulls for what they do
    not use — is not refused by the glue (vLLM's serving layer acts on it)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fmt.refuse_unhonoured(fmt.validate(chat_cls, {
        "model": "m", "messages": USER, "tools": tools, "response_format": {"type": "json_object"},
        "logit_bias": {"11": 5}, "parallel_tool_calls": True, "use_beam_search": False, "cache_salt": None,
        "kv_transfer_params": None, "user": "alice"}))
    fmt.refuse_unhonoured(fmt.validate(completion_cls, {"model": "m", "prompt": ["a", "b"], "echo": True,
                                                        "logit_bias": None, "suffix": None}))


def test_cache_salt_is_accepted_as_vllm_accepts_it(chat_cls: type) -> None:
    """A request's own cache_salt is honoured (folded into its block keys, ``kvpool.keys.request_salt``); vLLM's
    validator refuses an empty one with a 400 naming it."""
    fmt.refuse_unhonoured(fmt.validate(chat_cls, {"model": "m", "messages": USER, "cache_salt": "tenant-a"}))
    with pytest.raises(fmt.ApiError) as err:
        fmt.validate(chat_cls, {"model": "m", "messages": USER, "cache_salt": ""})
    assert err.value.status == 400 and err.value.param == "cache_salt"


# -- vLLM's errors ------------------------------------------------------------------------------------------------
def test_vllm_errors_keep_vllm_statuses_and_parameters() -> None:
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMValidationError

    err = fmt.error_from(VLLMValidationError("max_tokens must be at least 1", parameter="max_tokens"))
    assert (err.status, err.param) == (400, "max_tokens") and "max_tokens" in err.message
    assert fmt.error_from(NotImplementedError("no")).status == 501
    assert fmt.error_from(RuntimeError("boom")).status == 500
    from http import HTTPStatus

    not_found = fmt.error_from(create_error_response("no model", "NotFoundError", HTTPStatus.NOT_FOUND))
    assert not_found.status == 404 and not_found.body()["error"]["type"] == "NotFoundError"


def test_call_vllm_turns_error_responses_and_exceptions_into_api_errors() -> None:
    from http import HTTPStatus

    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    async def answer(req: Any, raw: Any) -> Any:
        return {"ok": req}

    async def refuse(req: Any, raw: Any) -> Any:
        return create_error_response("bad tool_choice", status_code=HTTPStatus.BAD_REQUEST, param="tool_choice")

    async def explode(req: Any, raw: Any) -> Any:
        raise ValueError("prompt is empty")

    assert asyncio.run(fmt.call_vllm(answer, 1)) == {"ok": 1}
    with pytest.raises(fmt.ApiError) as ei:
        asyncio.run(fmt.call_vllm(refuse, 1))
    assert (ei.value.status, ei.value.param) == (400, "tool_choice")
    with pytest.raises(fmt.ApiError) as ei:
        asyncio.run(fmt.call_vllm(explode, 1))
    assert ei.value.status == 400 and "empty" in ei.value.message
    assert json.loads(json.dumps(ei.value.body()))["error"]["code"] == 400
