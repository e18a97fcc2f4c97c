"""E2E: reasoning and the stream variants of structured output and batched prompts, on a ``kvstack serve`` model
whose engines run vLLM's ``qwen3`` reasoning parser (the engine setting ``reasoning_parser``; model ``alpha`` of the
package's two-model server, ``conftest.py``), driven with the real ``openai`` SDK.

A random-weight tiny model never writes ``</think>``: with thinking on (Qwen3's default) vLLM's parser puts its whole
answer into ``reasoning``; with ``chat_template_kwargs: {"enable_thinking": false}`` the template closes the think
block in the prompt, so the answer is ``content`` and a JSON-schema constraint applies from the first token. This
module is about the OpenAI surface, ``shared_serve/test_serve_local.py`` about the cluster.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "alpha"  # the tiny dense shape, with the reasoning parser
USER = [{"role": "user", "content": "Think about the cache, then answer."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def streamed(stream) -> tuple[str, str, set[str | None]]:
    reasoning, content, finishes = "", "", set()
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
            finishes.add(choice.finish_reason)
    return reasoning, content, finishes


def test_reasoning_is_apart_from_content_streamed_or_not(client) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    message = full.choices[0].message
    assert getattr(message, "reasoning", None) and not message.content  # no </think>: all of it is reasoning
    reasoning, content, _ = streamed(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                                                    temperature=0, stream=True))
    assert reasoning == message.reasoning and content == ""  # greedy: the same split, delta by delta


def test_without_thinking_the_answer_is_content(client) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0,
                                          extra_body=NO_THINKING)
    message = full.choices[0].message
    assert message.content and not getattr(message, "reasoning", None)
    reasoning, content, _ = streamed(client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=0, stream=True, extra_body=NO_THINKING))
    assert reasoning == "" and content == message.content


def test_structured_output_streamed_follows_the_schema(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["verdict"],
              "properties": {"verdict": {"enum": ["warm", "cold"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema, "strict": True}}
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0,
                                          response_format=fmt, extra_body=NO_THINKING)
    assert json.loads(full.choices[0].message.content)["verdict"] in ("warm", "cold")
    _, content, _ = streamed(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64,
                                                            temperature=0, response_format=fmt, stream=True,
                                                            extra_body=NO_THINKING))
    assert json.loads(content) == json.loads(full.choices[0].message.content)


def test_batched_prompts_stream_one_choice_each(client) -> None:
    stream = client.completions.create(model=MODEL, prompt=["The pool holds", "A block of keys"], max_tokens=5,
                                       temperature=0, stream=True)
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert set(texts) == {0, 1} == finished
    one = client.completions.create(model=MODEL, prompt="A block of keys", max_tokens=5, temperature=0)
    assert texts[1] == one.choices[0].text  # each prompt is its own request: the same tokens alone


def test_logit_bias_reaches_the_engine(server, client) -> None:
    """A +100 bias on one token makes greedy decoding produce only that token: the engine applied it."""
    import httpx

    ids = httpx.post(server["base"][:-3] + "/tokenize", json={"model": MODEL, "prompt": " cache"},
                     timeout=30).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt="The pool holds", max_tokens=3, temperature=0,
                                    logit_bias={str(ids[-1]): 100})
    piece = httpx.post(server["base"][:-3] + "/detokenize", json={"model": MODEL, "tokens": [ids[-1]]},
                       timeout=30).json()["prompt"]
    assert out.choices[0].text == piece * 3
