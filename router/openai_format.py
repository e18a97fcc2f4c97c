"""The ingress's glue around vLLM's OpenAI serving layer: reading and parsing a request body, validating it with
vLLM's protocol models, refusing what kvstack would not honour, and turning vLLM's errors into responses.

Everything OpenAI-shaped beyond that (rendering, sampling parameters, tool calls, reasoning, response and stream
objects) is vLLM's own code, run by ``router.vllm_frontend``. Called by ``router.ingress``. Client errors are
``ApiError`` (status code + OpenAI error object); nothing here raises anything else for bad client input.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

log = logging.getLogger("kvstack.ingress")


class ApiError(Exception):
    """A client-visible error: HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


async def read_body(raw: Any, limit: int) -> bytes:
    """The request body, refused with a 413 once it passes ``limit`` bytes (read in pieces: a huge body is never
    held whole). ``raw`` is a Starlette ``Request``."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is larger than this endpoint's limit of {limit} bytes",
                       code="request_too_large")
    parts: list[bytes] = []
    size = 0
    async for piece in raw.stream():
        size += len(piece)
        if size > limit:
            raise ApiError(413, f"request body is larger than this endpoint's limit of {limit} bytes",
                           code="request_too_large")
        parts.append(piece)
    return b"".join(parts)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A JSON object; malformed JSON, a non-object, or ``NaN`` / ``Infinity`` anywhere (Python's json accepts them,
    JSON does not) is a 400."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
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


def validate(model_cls: Any, body: dict[str, Any]) -> Any:
    """Validate with a vLLM protocol model (a class, or a union such as ``TokenizeRequest``); any validation failure
    is a 400 naming the parameter."""
    from vllm.exceptions import VLLMValidationError

    try:
        if isinstance(model_cls, type):
            return model_cls.model_validate(body)
        return TypeAdapter(model_cls).validate_python(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise ApiError(400, message, param=param, code="invalid_parameter") from None
    except (VLLMValidationError, ValueError) as exc:  # vLLM's "before" model validators raise these unwrapped
        raise _vllm_error(exc, getattr(model_cls, "model_fields", {})) from None
    except (TypeError, AttributeError) as exc:  # a "before" validator tripped on a wrongly typed field
        raise ApiError(400, f"invalid request body: {exc}", code="invalid_parameter") from None


# Request fields vLLM's serving layer would act on but kvstack cannot honour as asked; set to anything but their
# default they are a 400 naming the field (never silently ignored): why, per field.
REFUSED_FIELDS: dict[str, str] = {
    "kv_transfer_params": "the KV cache is moved by kvstack's own pool connector, not by client parameters",
    "use_beam_search": "beam search is not supported by kvstack's router",
    "mm_processor_kwargs": "kvstack serves text models",
    "mm_payload": "kvstack serves text models",
}


def refuse_unhonoured(req: Any) -> None:
    """400 for the first field in ``REFUSED_FIELDS`` the client set to something other than its default."""
    fields = type(req).model_fields
    for name in sorted(req.model_fields_set & REFUSED_FIELDS.keys()):
        value = getattr(req, name, None)
        info = fields.get(name)
        default = info.get_default(call_default_factory=True) if info is not None else None
        if value is None or value == default:
            continue
        raise ApiError(400, f"{name} is not supported by this endpoint: {REFUSED_FIELDS[name]}", param=name,
                       code="unsupported_parameter")


async def call_vllm(create: Any, req: Any, raw: Any = None) -> Any:
    """``await create(req, raw)`` — a vLLM serving method (``create_chat_completion``, ``create_tokenize``...) — as
    its response object or stream; vLLM's ``ErrorResponse`` or an exception it raised becomes an ``ApiError`` with
    the status vLLM's own server answers."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    try:
        result = await create(req, raw)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM's own exception -> status mapping
        err = error_from(exc)
        if err.status >= 500:
            log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        raise err from None
    if isinstance(result, ErrorResponse):
        raise error_from(result)
    return result


def error_from(result: Any) -> ApiError:
    """vLLM's ``ErrorResponse`` or an exception vLLM's serving layer raised, as an ``ApiError`` with the status
    vLLM's own server would answer (``vllm.entrypoints.serve.exception_handling``)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    err = result if isinstance(result, ErrorResponse) else create_error_response(result)
    info = err.error
    return ApiError(int(info.code), info.message, type_=info.type, param=info.param, code=int(info.code))
