"""The tiny models' chat template and markup tokens against the real consumers: Hugging Face ``apply_chat_template``,
vLLM's chat renderer (``parse_chat_messages`` + ``safe_apply_chat_template``, as the OpenAI endpoint renders a
request), vLLM's ``hermes`` tool-call parser and ``qwen3`` reasoning parser (alone, and composed as the server does
on a full output and token by token while streaming). One tiny ``qwen3`` model is built into a temporary directory
for the module; no engine or server is started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.tiny_models import make_tiny, preset_spec

# The template of generator version 1: plain chats must still render exactly like this.
LEGACY_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
EMPTY_THINK = "<think>\n\n</think>\n\n"


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def tools_system(system: str = "", tools: list[dict[str, Any]] = TOOLS) -> str:
    signatures = "\n".join(json.dumps(t) for t in tools)
    return turn(
        "system",
        (f"{system}\n\n" if system else "")
        + "# Tools\n\nYou may call the functions described below, one JSON signature per line inside <tools></tools>:\n"
        + f"<tools>\n{signatures}\n</tools>\n\n"
        + "To call functions, reply with one JSON object per call, each inside <tool_call></tool_call>:\n"
        + '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    )


def call(city: str, arguments: Any = None) -> dict[str, Any]:
    args = {"city": city} if arguments is None else arguments
    return {"id": f"call-{city}", "type": "function", "function": {"name": "get_weather", "arguments": args}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(preset_spec("qwen3"), tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def vllm_tok(model_dir: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(model_dir))


def render(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def request(messages: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    messages = messages or [{"role": "user", "content": "weather in Paris?"}]
    return ChatCompletionRequest(model="tiny", messages=messages, **kwargs)


# ------------------------------------------------------------------------------------------------ chat template


def test_plain_messages_render_the_previous_chatml(hf_tok: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now?"},
    ]
    chatml = "".join(turn(m["role"], m["content"]) for m in messages)
    for kwargs in ({}, {"enable_thinking": True}):
        assert render(hf_tok, messages, **kwargs) == chatml
        assert render(hf_tok, messages, add_generation_prompt=True, **kwargs) == chatml + "<|im_start|>assistant\n"
        for gen in (False, True):
            legacy = render(hf_tok, messages, add_generation_prompt=gen, chat_template=LEGACY_CHATML)
            assert render(hf_tok, messages, add_generation_prompt=gen, **kwargs) == legacy
    no_system = messages[1:]
    assert render(hf_tok, no_system) == "".join(turn(m["role"], m["content"]) for m in no_system)


def test_tools_system_block_merges_a_leading_system_message(hf_tok: Any) -> None:
    user = {"role": "user", "content": "weather in Paris?"}
    assert render(hf_tok, [user], tools=TOOLS) == tools_system() + turn("user", "weather in Paris?")
    with_system = [{"role": "system", "content": "You are terse."}, user]
    expected = tools_system("You are terse.") + turn("user", "weather in Paris?")
    assert render(hf_tok, with_system, tools=TOOLS) == expected


def test_tool_calls_and_tool_responses(hf_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        # arguments as a dict and as a JSON string (rendered as is); no content
        {"role": "assistant", "content": None, "tool_calls": [call("Paris"), call("Rome", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "call-Paris", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call-Rome", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "and Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("Oslo")]},
        {"role": "tool", "tool_call_id": "call-Oslo", "content": "snow"},
    ]
    oslo = CALL_PARIS.replace("Paris", "Oslo")
    expected = (
        tools_system()
        + turn("user", "weather in Paris and Rome?")
        + turn("assistant", f"{CALL_PARIS}\n{CALL_ROME}")
        + turn("user", "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>")
        + turn("assistant", "Sunny in Paris, rain in Rome.")
        + turn("user", "and Oslo?")
        + turn("assistant", f"Checking.\n{oslo}")
        + turn("user", "<tool_response>\nsnow\n</tool_response>")
        + "<|im_start|>assistant\n"
    )
    assert render(hf_tok, messages, tools=TOOLS, add_generation_prompt=True) == expected
    empty = [messages[0], {**messages[1], "content": ""}, *messages[2:4]]
    assert render(hf_tok, empty, tools=TOOLS) == expected[: expected.index("<|im_start|>assistant\nSunny")]


def test_reasoning_is_kept_after_the_last_user_message_only(hf_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},  # before the last query: dropped
        {"role": "assistant", "content": "<think>\nr1b\n</think>\n\na1b"},  # likewise, from the content
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": None, "reasoning_content": "\nr2\n", "tool_calls": [call("Paris")]},
        {"role": "tool", "tool_call_id": "call-Paris", "content": "sunny"},
        {"role": "assistant", "content": "<think>r3</think>\n\na3"},  # after it: kept, normalised
        {"role": "assistant", "content": "a4", "reasoning": "r4"},  # vLLM's field name
    ]
    expected = (
        turn("user", "q1")
        + turn("assistant", "a1")
        + turn("assistant", "a1b")
        + turn("user", "q2")
        + turn("assistant", f"<think>\nr2\n</think>\n\n{CALL_PARIS}")
        + turn("user", "<tool_response>\nsunny\n</tool_response>")
        + turn("assistant", "<think>\nr3\n</think>\n\na3")
        + turn("assistant", "<think>\nr4\n</think>\n\na4")
    )
    assert render(hf_tok, messages) == expected


def test_generation_prompt_and_enable_thinking(hf_tok: Any) -> None:
    user = [{"role": "user", "content": "hi"}]
    base = turn("user", "hi") + "<|im_start|>assistant\n"
    assert render(hf_tok, user, add_generation_prompt=True) == base
    assert render(hf_tok, user, add_generation_prompt=True, enable_thinking=True) == base
    assert render(hf_tok, user, add_generation_prompt=True, enable_thinking=False) == base + EMPTY_THINK
    assert render(hf_tok, user, enable_thinking=False) == turn("user", "hi")  # no generation prompt, nothing appended
    ids = hf_tok.apply_chat_template(user, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    think, end = hf_tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert think in ids and end in ids


def test_vllm_renderer_renders_an_openai_request(model_dir: Path, vllm_tok: Any, hf_tok: Any) -> None:
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    model_config = ModelConfig(model=str(model_dir))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("Paris", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call-Paris", "content": [{"type": "text", "text": "sunny"}]},
    ]
    req = request(messages, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    tool_dicts = [t.model_dump() for t in req.tools]
    params = req.build_chat_params(None, "auto").with_defaults({"tools": tool_dicts, "tokenize": False})
    content_format = resolve_chat_template_content_format(
        chat_template=params.chat_template,
        tools=tool_dicts,
        given_format=params.chat_template_content_format,
        tokenizer=vllm_tok,
        model_config=model_config,
    )
    assert content_format == "string"
    conversation, _, _ = parse_chat_messages(req.messages, model_config, content_format=content_format)
    prompt = safe_apply_chat_template(model_config, vllm_tok, conversation, **params.get_apply_chat_template_kwargs())
    expected = (
        tools_system("You are terse.", tool_dicts)  # vLLM's pydantic dump of the tools, unset fields as null
        + turn("user", "weather in Paris?")
        + turn("assistant", CALL_PARIS)
        + turn("user", "<tool_response>\nsunny\n</tool_response>")
        + "<|im_start|>assistant\n"
        + EMPTY_THINK
    )
    assert prompt == expected
    plain = request(messages[:2])
    params = plain.build_chat_params(None, "auto").with_defaults({"tokenize": False})
    conversation, _, _ = parse_chat_messages(plain.messages, model_config, content_format=content_format)
    prompt = safe_apply_chat_template(model_config, vllm_tok, conversation, **params.get_apply_chat_template_kwargs())
    assert prompt == render(hf_tok, messages[:2], add_generation_prompt=True, chat_template=LEGACY_CHATML)


# ------------------------------------------------------------------------------------------------ vLLM parsers


def test_hermes_tool_parser_extracts_calls(vllm_tok: Any, hf_tok: Any) -> None:
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser("hermes")(vllm_tok)
    req = request(tools=TOOLS)
    assert parser.adjust_request(req).skip_special_tokens is False  # hermes keeps specials when tools are given
    # What the engine hands the parser: generated ids detokenized with skip_special_tokens=True (the default).
    vocab = vllm_tok.get_vocab()
    ids = vllm_tok.encode(CALL_PARIS + "<|im_end|>", add_special_tokens=False)
    assert (ids[0], ids[-2], ids[-1]) == (vocab["<tool_call>"], vocab["</tool_call>"], vocab["<|im_end|>"])
    text = vllm_tok.decode(ids, skip_special_tokens=True)
    assert text == CALL_PARIS
    info = parser.extract_tool_calls(text, req)
    assert info.tools_called and info.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    info = parser.extract_tool_calls("Let me check.\n" + CALL_PARIS, req)
    assert info.content == "Let me check.\n" and len(info.tool_calls) == 1

    # What the template renders for an assistant's calls is what hermes parses back.
    rendered = render(hf_tok, [{"role": "assistant", "content": "", "tool_calls": [call("Paris"), call("Rome")]}])
    body = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    info = ToolParserManager.get_tool_parser("hermes")(vllm_tok).extract_tool_calls(body, req)
    assert [json.loads(c.function.arguments)["city"] for c in info.tool_calls] == ["Paris", "Rome"]


def test_qwen3_reasoning_parser_splits_think(vllm_tok: Any) -> None:
    from vllm.reasoning import ReasoningParserManager

    cls = ReasoningParserManager.get_reasoning_parser("qwen3")
    parser = cls(vllm_tok)
    vocab = vllm_tok.get_vocab()
    # The parser finds its markers in the vocabulary: </think> (and <tool_call>, an implicit end) end reasoning.
    assert {vocab["</think>"], vocab["<tool_call>"]} <= set(parser.reasoning_end_token_ids)
    assert (parser.reasoning_start_str, parser.reasoning_end_str) == ("<think>", "</think>")
    req = request()
    assert parser.extract_reasoning("<think>abc</think>def", req) == ("abc", "def")
    ids = vllm_tok.encode("<think>abc</think>def", add_special_tokens=False)
    assert parser.is_reasoning_end(ids) and not parser.is_reasoning_end(ids[: ids.index(vocab["</think>"])])
    # Thinking on (the default) and no </think>: everything is reasoning; off: everything is content.
    assert parser.extract_reasoning("def", req) == ("def", None)
    off = cls(vllm_tok, chat_template_kwargs={"enable_thinking": False})
    assert off.extract_reasoning("def", req) == (None, "def")


def test_server_composes_hermes_and_qwen3_parsers_for_this_tokenizer(vllm_tok: Any, hf_tok: Any) -> None:
    from vllm.parser.parser_manager import ParserManager

    # The startup check: constructs the composed parser with this tokenizer and raises if it lacks what they need.
    cls = ParserManager.get_parser(
        tool_parser_name="hermes",
        reasoning_parser_name="qwen3",
        enable_auto_tools=True,
        model_name="tiny",
        tokenizer=vllm_tok,
    )
    assert cls is not None
    req = request(tools=TOOLS)
    parser = cls(vllm_tok, req.tools)
    reasoning, content, calls = parser.parse("<think>abc</think>\n\n" + CALL_PARIS, req, enable_auto_tools=True)
    assert (reasoning, content) == ("abc", None)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    off = cls(vllm_tok, req.tools, chat_template_kwargs={"enable_thinking": False})
    reasoning, content, calls = off.parse("Sunny.", req, enable_auto_tools=True)
    assert (reasoning, content, calls) == (None, "Sunny.", None)


@pytest.mark.parametrize("thinking", [True, False])
def test_composed_parsers_stream_token_by_token(vllm_tok: Any, thinking: bool) -> None:
    from vllm.parser.parser_manager import ParserManager

    cls = ParserManager.get_parser(
        tool_parser_name="hermes", reasoning_parser_name="qwen3", enable_auto_tools=True, tokenizer=vllm_tok
    )
    assert cls is not None
    req = request(tools=TOOLS, stream=True, chat_template_kwargs={"enable_thinking": thinking})
    parser = cls(vllm_tok, req.tools, chat_template_kwargs={"enable_thinking": thinking})
    prompt = vllm_tok.apply_chat_template(
        [{"role": "user", "content": "weather in Paris?"}],
        add_generation_prompt=True,
        enable_thinking=thinking,
        return_dict=False,
    )
    assert parser.is_reasoning_end(prompt) is not thinking  # the empty <think></think> of the prompt ends reasoning
    output = ("<think>abc</think>\n\n" if thinking else "") + "Checking. " + CALL_PARIS
    ids = vllm_tok.encode(output, add_special_tokens=False)
    deltas = [
        parser.parse_delta(
            vllm_tok.decode([i]), [i], req, prompt_token_ids=prompt if n == 0 else None, finished=n == len(ids) - 1
        )
        for n, i in enumerate(ids)
    ]
    reasoning = "".join(d.reasoning or "" for d in deltas if d is not None)
    content = "".join(d.content or "" for d in deltas if d is not None)
    calls = [c.function for d in deltas if d is not None for c in d.tool_calls if c.function is not None]
    assert reasoning == ("abc" if thinking else "")
    assert content.strip() == "Checking."
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments or "" for c in calls)) == {"city": "Paris"}
