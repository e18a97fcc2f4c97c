"""OpenAI wire format for the ingress: request parsing/validation with vLLM's protocol models, error objects,
and response / SSE chunk builders. Pure functions (no Ray, no engine), unit-tested on their own.

Called by ``router.ingress``. Errors are ``ApiError`` (status code + OpenAI error object); nothing here raises
anything else for bad client input.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from router.wire import GenerateChunk, Sampling


class ApiError(Exception):
    """A client-visible error: HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})


def _param_path(loc: Sequence[Any]) -> str | None:
    """The request field path of a pydantic error location, without the union-member tags pydantic puts in it
    (``messages.1.ChatCompletionDeveloperMessageParam.role`` -> ``messages.1.role``, ``stop.str`` -> ``stop``)."""
    parts = [
        str(p) for i, p in enumerate(loc)
        if p != "__root__" and (i == 0 or isinstance(p, int)
                                or (isinstance(p, str) and p.isidentifier() and p.islower() and p not in _TYPE_TAGS))
    ]
    return ".".join(parts) or None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    param = _param_path(err.get("loc", ()))
    msg = err.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def _vllm_error(exc: Exception, fields: Any) -> ApiError:
    """A vLLM validation error (``VLLMValidationError`` carries ``parameter``; otherwise the message's first word
    names the field, e.g. "n must be at least 1") as a 400."""
    message = str(exc.args[0]) if exc.args else str(exc)
    param = getattr(exc, "parameter", None)
    if param is None and message.split(" ", 1)[0] in fields:
        param = message.split(" ", 1)[0]
    return ApiError(400, message, param=param, code="invalid_parameter")


def validate(model_cls: type, body: dict[str, Any]) -> Any:
    """Validate with a vLLM protocol model; any validation failure is a 400 naming the parameter."""
    from vllm.exceptions import VLLMValidationError

    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise ApiError(400, message, param=param, code="invalid_parameter") from None
    except (VLLMValidationError, ValueError) as exc:  # vLLM's "before" model validators raise these unwrapped
        raise _vllm_error(exc, getattr(model_cls, "model_fields", {})) from None
    except (TypeError, AttributeError) as exc:  # a "before" validator tripped on a wrongly typed field
        raise ApiError(400, f"invalid request body: {exc}", code="invalid_parameter") from None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


def chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts for the tokenizer's chat template; only text content is accepted. Text parts are
    joined with newlines, as vLLM does for string-content chat templates; an unknown role is a 400 (vLLM's protocol
    model accepts any role string)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        m = dict(msg) if not isinstance(msg, dict) else msg
        if m.get("role") not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: invalid value {m.get('role')!r}; supported values are "
                                f"{', '.join(CHAT_ROLES)}", param=f"messages.{i}.role", code="invalid_parameter")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):  # vLLM accepts plain strings as text parts
                    texts.append(part)
                    continue
                part = dict(part)
                if part.get("type") != "text":
                    raise ApiError(400, f"messages[{i}]: content part type {part.get('type')!r} is not supported "
                                        "(text only)", param=f"messages.{i}.content")
                texts.append(part.get("text", ""))
            content = "\n".join(texts)
        item = {"role": m.get("role"), "content": content if content is not None else ""}
        for extra in ("name", "tool_calls", "tool_call_id"):
            if m.get(extra) is not None:
                item[extra] = m[extra]
        out.append(item)
    return out


MAX_LOGPROBS = 20  # vLLM's default ModelConfig.max_logprobs, which the replicas' engines run with

# Request fields the ingress acts on (or that change nothing: ``user``, ``request_id``). Any other field of vLLM's
# protocol models that a client sets to something other than its default would be silently ignored — a 400 instead.
HANDLED_FIELDS = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
    "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stream", "stream_options", "add_generation_prompt",
    "tools", "echo", "user", "request_id",
})


def refuse_unsupported(req: Any) -> None:
    """400 for the first field the client set (to a non-default value) that kvstack does not act on, e.g.
    ``response_format``, ``logit_bias``, ``best_of``, beam search, structured outputs."""
    fields = type(req).model_fields
    for name in sorted(req.model_fields_set - HANDLED_FIELDS):
        value = getattr(req, name, None)
        info = fields.get(name)
        default = info.get_default(call_default_factory=True) if info is not None else None
        if value is None or value == default:
            continue
        raise ApiError(400, f"{name} is not supported by this endpoint; remove it (supported: "
                            f"{', '.join(sorted(HANDLED_FIELDS - {'user', 'request_id'}))})",
                       param=name, code="unsupported_parameter")


def sampling_from(req: Any, max_tokens: int) -> Sampling:
    """The wire ``Sampling`` of a validated request. A field kvstack would ignore is a 400 (``refuse_unsupported``);
    vLLM's own request -> ``SamplingParams`` conversion runs first, so a value the engine would refuse
    (temperature < 0, n = 0, top_p = 0, ...) is a 400 at the ingress and never a replica error."""
    from vllm.exceptions import VLLMValidationError

    refuse_unsupported(req)
    try:
        req.to_sampling_params(max_tokens, {})
    except (VLLMValidationError, ValueError, TypeError) as exc:
        raise _vllm_error(exc, type(req).model_fields) from None
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    logprobs: int | None = None
    if getattr(req, "top_logprobs", None) is not None and getattr(req, "logprobs", False) is True:
        logprobs = int(req.top_logprobs or 0)
    elif isinstance(getattr(req, "logprobs", None), int) and not isinstance(req.logprobs, bool):
        logprobs = int(req.logprobs)
    elif getattr(req, "logprobs", None) is True:
        logprobs = 0
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        param = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
        raise ApiError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {logprobs}", param=param,
                       code="invalid_parameter")
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        n=req.n or 1,
        seed=req.seed,
        stop=list(stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        logprobs=logprobs,
        ignore_eos=bool(getattr(req, "ignore_eos", False)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        top_k=int(req.top_k) if req.top_k is not None else 0,
        min_p=float(req.min_p) if req.min_p is not None else 0.0,
        repetition_penalty=float(req.repetition_penalty) if req.repetition_penalty is not None else 1.0,
        min_tokens=int(req.min_tokens or 0),
    )


def resolve_max_tokens(req: Any, prompt_len: int, max_model_len: int) -> int:
    """The generation budget; a prompt that leaves no room, or asks for more than fits, is a 400."""
    asked = getattr(req, "max_completion_tokens", None)
    if asked is None:
        asked = req.max_tokens
    room = max_model_len - prompt_len
    if room <= 0 or (asked is not None and asked > room):
        where = "messages" if hasattr(req, "messages") else "prompt"
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + (asked or 0)} tokens ({prompt_len} in the {where}, {asked or 0} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=where, code="context_length_exceeded",
        )
    return asked if asked is not None else room


@dataclass
class ChoiceAccumulator:
    """Collects the streamed deltas of one choice for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_logprobs(rows: Sequence[Any]) -> dict[str, Any] | None:
    if not rows:
        return None
    content = []
    for row in rows:
        top = row[0]
        content.append({
            "token": top.token, "logprob": max(top.logprob, -9999.0), "bytes": list(top.token.encode()),
            "top_logprobs": [{"token": t.token, "logprob": max(t.logprob, -9999.0), "bytes": list(t.token.encode())}
                             for t in row[1:] or row[:1]],
        })
    return {"content": content}


def completion_logprobs(rows: Sequence[Any]) -> dict[str, Any] | None:
    if not rows:
        return None
    return {
        "tokens": [r[0].token for r in rows],
        "token_logprobs": [max(r[0].logprob, -9999.0) for r in rows],
        "top_logprobs": [{t.token: max(t.logprob, -9999.0) for t in (r[1:] or r[:1])} for r in rows],
        "text_offset": [],
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(rid: str, model: str, choices: dict[int, ChoiceAccumulator], prompt_tokens: int,
                  cached_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
             "finish_reason": c.finish_reason or "stop", "logprobs": chat_logprobs(c.logprobs)}
            for i, c in sorted(choices.items())
        ],
        "usage": usage(prompt_tokens, sum(c.tokens for c in choices.values()), cached_tokens),
    }


def completion_response(rid: str, model: str, choices: dict[int, ChoiceAccumulator], prompt_tokens: int,
                        cached_tokens: int, echo_text: str = "") -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [
            {"index": i, "text": echo_text + "".join(c.text), "finish_reason": c.finish_reason or "stop",
             "logprobs": completion_logprobs(c.logprobs)}
            for i, c in sorted(choices.items())
        ],
        "usage": usage(prompt_tokens, sum(c.tokens for c in choices.values()), cached_tokens),
    }


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
