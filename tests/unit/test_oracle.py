"""The outside oracle (bench/oracle.py): the reference server's command line from the engine settings, the verdict
logic against a scripted reference (a fake of the neighbouring vLLM server, not of the judging), the sessions."""

from __future__ import annotations

from typing import Any

from bench.oracle import Turn, judge, make_sessions, reference_command
from deployments.engine_settings import EngineSettings


def test_reference_runs_the_replicas_engine_arguments() -> None:
    engine = EngineSettings(model="/m/tiny", served_model_name="tiny", max_model_len=2048, block_size=128,
                            kv_cache_memory_bytes=1 << 24, max_num_seqs=8)
    cmd = reference_command(engine.vllm_engine_kwargs(), 9999)
    args = dict(zip(cmd[::1], cmd[1:], strict=False))
    assert args["--model"] == "/m/tiny" and args["--served-model-name"] == "tiny"
    assert args["--block-size"] == "128" and args["--max-model-len"] == "2048" and args["--seed"] == "0"
    assert args["--kv-cache-memory-bytes"] == str(1 << 24) and args["--port"] == "9999"
    assert "--enable-prefix-caching" in cmd and "--enforce-eager" in cmd and "--enable-prompt-tokens-details" in cmd


def test_reference_serves_the_same_openai_options() -> None:
    """The ingress's vLLM server options (tool parser, template kwargs) reach plain vLLM's server as its flags; vLLM's
    own parser reads them back as the ingress set them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from router.ingress_settings import OpenAIFrontendSettings

    openai = OpenAIFrontendSettings(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                    default_chat_template_kwargs={"enable_thinking": False}, max_request_body_bytes=7)
    assert set(openai.vllm_serve_kwargs()) == {"enable_auto_tool_choice", "tool_call_parser",
                                               "default_chat_template_kwargs"}
    engine = EngineSettings(model="/m/tiny", served_model_name="tiny", reasoning_parser="qwen3")
    cmd = reference_command({**engine.vllm_engine_kwargs(), **openai.vllm_serve_kwargs()}, 9999)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    assert parsed.enable_auto_tool_choice is True and parsed.tool_call_parser == "hermes"
    assert parsed.default_chat_template_kwargs == {"enable_thinking": False} and parsed.reasoning_parser == "qwen3"


class ScriptedReference:
    """Answers like a plain vLLM server whose output depends on how many prompt tokens its prefix cache held."""

    def __init__(self, tokens: list[int], text_by_cached: dict[int, str], miss: bool = False) -> None:
        self.tokens, self.text_by_cached, self.miss = tokens, text_by_cached, miss
        self.cached = 0
        self.calls: list[str] = []
        self.max_tokens_seen: list[int] = []

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokens)

    def reset(self) -> None:
        self.calls.append("reset")
        self.cached = 0

    def prime(self, token_ids: list[int]) -> None:
        self.calls.append(f"prime {len(token_ids)}")
        self.cached = len(token_ids) if not self.miss else 0

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int]:
        self.calls.append("chat")
        self.max_tokens_seen.append(max_tokens)
        return self.text_by_cached[self.cached], len(self.tokens), self.cached


class SessionReference(ScriptedReference):
    """Answers ``after_replay`` once the session's earlier turns ran on it since the last reset."""

    def __init__(self, tokens: list[int], text_by_cached: dict[int, str], after_replay: str) -> None:
        super().__init__(tokens, text_by_cached)
        self.after_replay, self.chats_since_reset = after_replay, 0

    def reset(self) -> None:
        super().reset()
        self.chats_since_reset = 0

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int]:
        text, prompt, cached = super().chat(messages, max_tokens)
        self.chats_since_reset += 1
        return (self.after_replay if self.chats_since_reset == 3 else text), prompt, cached


def _turn(text: str, cached: int, prompt: int = 300) -> Turn:
    return Turn(session=0, turn=1, action="fetch", prompt_tokens=prompt, cached_tokens=cached, text=text)


def test_verdicts() -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
    same = ScriptedReference(list(range(300)), {0: "a", 256: "a"})
    t = _turn("a", 256)
    judge(t, same, msgs, 8)
    assert t.verdict == "equal" and same.calls == ["reset", "chat", "reset", "prime 256", "chat"]

    split = ScriptedReference(list(range(300)), {0: "a", 256: "b"})
    t = _turn("b", 256)
    judge(t, split, msgs, 8)
    assert t.verdict == "split_explained" and t.reference_fresh_text == "a"

    t = _turn("c", 256)
    judge(t, ScriptedReference(list(range(300)), {0: "a", 256: "b"}), msgs, 8)
    assert t.verdict == "mismatch"

    session = SessionReference(list(range(300)), {0: "a", 256: "b"}, after_replay="c")
    t = _turn("c", 256)
    judge(t, session, msgs, 8, earlier=[msgs, msgs])
    assert t.verdict == "session_explained" and session.calls[-4:] == ["reset", "chat", "chat", "chat"]
    assert session.max_tokens_seen[-3:] == [1, 1, 8]  # earlier turns replayed with one token: the pool's blocks

    t = _turn("a", 0)
    judge(t, ScriptedReference(list(range(300)), {0: "a"}), msgs, 8)
    assert t.verdict == "equal"

    t = _turn("a", 0, prompt=299)  # kvstack rendered the messages into another prompt than vLLM
    judge(t, ScriptedReference(list(range(300)), {0: "a"}), msgs, 8)
    assert t.verdict == "prompt_differs"

    t = _turn("z", 256)  # its cache did not take the primed prefix, and nothing it answers matches
    judge(t, ScriptedReference(list(range(300)), {0: "a", 256: "b"}, miss=True), msgs, 8)
    assert t.verdict == "reference_missed"


def test_sessions_are_seeded_and_distinct() -> None:
    a, b = make_sessions(5, 3, seed=1), make_sessions(5, 3, seed=1)
    assert [s.system for s in a] == [s.system for s in b]
    assert len({s.system for s in a}) == 5 and all(len(s.users) == 3 for s in a)
    assert [s.system for s in make_sessions(5, 3, seed=2)] != [s.system for s in a]


def test_vllm_bench_serve_takes_the_documented_arguments() -> None:
    """``bench.vllm_bench_serve`` is vLLM's own parser: the command its docstring documents parses."""
    import shlex

    from bench import vllm_bench_serve

    doc = vllm_bench_serve.__doc__ or ""
    command = doc[doc.rindex("-m bench.vllm_bench_serve") + len("-m bench.vllm_bench_serve"):doc.index("Exit status")]
    args = vllm_bench_serve.parse(shlex.split(command.replace("\\\n", " ")))
    assert (args.backend, args.endpoint, args.num_prompts, args.request_rate) == ("openai-chat",
                                                                                  "/v1/chat/completions", 40, 2.0)
