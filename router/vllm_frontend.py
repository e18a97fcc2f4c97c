"""vLLM's OpenAI serving layer, built for the ingress over kvstack's routed engine client.

Contract: ``build_frontend(settings, view, replicas)`` returns a ``VllmFrontend`` holding vLLM's own serving
objects — ``OpenAIServingModels``, ``OpenAIServingChat``, ``OpenAIServingCompletion``, ``ServingTokenization`` —
constructed the way ``vllm serve`` constructs them (``vllm.entrypoints.launchers.api_server.app_state``), from:
- a ``VllmConfig`` holding the model config of the engines and their structured-outputs config (the reasoning
  parser), built without an engine as vLLM's own GPU-less render server builds it
  (``vllm.entrypoints.launchers.render``);
- vLLM's serve arguments: the engines' own arguments (``IngressSettings.engine_args``, parsed by vLLM's CLI parser
  as ``vllm serve`` parses them, ``router.vllm_args``), with the ingress's ``OpenAIFrontendSettings`` (same names as
  the flags) laid over them and checked by vLLM's ``validate_parsed_serve_args``;
- ``router.engine_client.RoutedEngineClient`` as the engine client, so each engine request is routed.
So tool calling (parsers, ``tool_choice`` constraints), reasoning, structured outputs, batched prompts, echo,
logprobs, streaming deltas and usage are vLLM's code. Called once by ``router.ingress.OpenAIIngress.__init__``; an
unknown parser name or a bad option fails there, naming it. Heavy vLLM imports happen inside ``build_frontend``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from router.ingress_settings import IngressSettings


@dataclass(frozen=True)
class VllmFrontend:
    args: argparse.Namespace
    engine_client: Any  # router.engine_client.RoutedEngineClient
    models: Any  # OpenAIServingModels
    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    tokenization: Any  # ServingTokenization


def serve_args(settings: IngressSettings) -> argparse.Namespace:
    """``vllm serve`` arguments for this ingress, parsed by vLLM's own parser: the engines' arguments (so the model
    config, tokenizer and structured-output settings are theirs) and the OpenAI options."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from router.vllm_args import cli_args

    parser = make_arg_parser(FlexibleArgumentParser(prog="kvstack-ingress"))
    args = parser.parse_args(cli_args(settings.engine_args))
    args.served_model_name = [settings.served_model_name]
    args.enable_prompt_tokens_details = True  # usage.prompt_tokens_details.cached_tokens: the cache's effect
    for name, value in settings.openai.vllm_serve_kwargs(only_changed=False).items():
        if not hasattr(args, name):
            raise ValueError(f"app.ingress.openai.{name} is not a `vllm serve` option of this vLLM version")
        setattr(args, name, value)
    validate_parsed_serve_args(args)
    return args


def _vllm_config(args: argparse.Namespace) -> Any:
    import vllm.envs as envs
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig

    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # nothing is computed here (as vLLM's render server does)
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache here either (silences the CPU platform's check)
    return VllmConfig(model_config=model_config,
                      structured_outputs_config=engine_args.create_structured_outputs_config())


def build_frontend(settings: IngressSettings, view: Any, replicas: Any) -> VllmFrontend:
    from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers import renderer_from_config
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.v1.engine.input_processor import InputProcessor

    from router.engine_client import RoutedEngineClient

    args = serve_args(settings)
    vllm_config = _vllm_config(args)
    renderer = renderer_from_config(vllm_config)
    client = RoutedEngineClient(vllm_config, renderer, InputProcessor(vllm_config, renderer), view, replicas)
    models = OpenAIServingModels(
        engine_client=client,
        base_model_paths=[BaseModelPath(name=settings.served_model_name, model_path=settings.model_path)],
    )
    reasoning_parser = vllm_config.structured_outputs_config.reasoning_parser or None
    # What several of vLLM's objects must agree on, given once: the renderer validates tool_choice with the tool
    # parser that the chat server parses outputs with, and renders with the template the tokenizer endpoint uses.
    template = dict(
        request_logger=None,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=resolve_default_chat_template_kwargs(args),
        trust_request_chat_template=args.trust_request_chat_template,
    )
    tools = dict(
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser,
        tool_strict_level=args.tool_strict_level,
    )
    usage = dict(
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
    )
    online_renderer = OnlineRenderer(
        model_config=vllm_config.model_config, renderer=renderer, **template, **tools,
        trust_request_mm_kwargs=args.trust_request_mm_kwargs, reasoning_parser=reasoning_parser,
        log_error_stack=args.log_error_stack,
    )
    online_renderer.warmup()
    chat = OpenAIServingChat(
        engine_client=client, models=models, response_role=args.response_role, online_renderer=online_renderer,
        **template, **tools, **usage, reasoning_parser=reasoning_parser or "",
    )
    completion = OpenAIServingCompletion(client, models, online_renderer=online_renderer, request_logger=None,
                                         **usage)
    tokenization = ServingTokenization(models, online_renderer, **template)
    return VllmFrontend(args, client, models, chat, completion, tokenization)
