"""vLLM's engine arguments as a mapping (``app.engine``), parsed by vLLM's own command-line parser.

A mapping of ``AsyncEngineArgs`` keywords (``tensor_parallel_size: 2``, ``structured_outputs_config: {...}``) means
what the same keys mean in a ``vllm serve --config FILE``: ``cli_args`` turns it into ``vllm serve`` flags by vLLM's
config-file rules (a bool is ``--flag`` / ``--no-flag``, a mapping is JSON, a list is its items), and
``parse_engine_args`` parses those flags with vLLM's parser into the ``AsyncEngineArgs`` a ``vllm serve`` with them
would build — so an unknown key, a value of the wrong type or out of vLLM's choices is the error vLLM gives, naming
the key, and nested configs become vLLM's config objects exactly as on vLLM's own server.

Who calls it: ``deployments.engine_settings.EngineSettings`` checks its arguments at config load
(``check_engine_args``) and the replica builds its engine from them (``parse_engine_args``); the ingress parses the
same flags with vLLM's ``vllm serve`` parser (``router.vllm_frontend``), so its renderer's model config is the engines'
own; ``bench.oracle`` starts plain vLLM's server with ``cli_args``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any


class EngineArgsError(ValueError):
    """vLLM refuses an engine argument; the message names the key (``app.engine.<key>``)."""


def cli_args(kwargs: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` flags for these keywords, by the rules of vLLM's ``--config`` YAML loader (None: left out)."""
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(dict(value))]
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """Every ``AsyncEngineArgs`` keyword of the installed vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def check_names(keys: Iterable[str], *, prefix: str = "app.engine") -> None:
    """EngineArgsError for a key that is not an engine argument of this vLLM (with the closest names)."""
    names = engine_arg_names()
    for key in keys:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise EngineArgsError(f"{prefix}.{key}: not an engine argument of vLLM{hint}")


def _raising_parser_class() -> type:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class RaisingParser(FlexibleArgumentParser):
        def error(self, message: str):  # type: ignore[override]  # argparse would print usage and exit
            raise EngineArgsError(message)

    return RaisingParser


@functools.cache
def _engine_parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.add_cli_args(_raising_parser_class()(prog="kvstack-engine", exit_on_error=False))


def _name_the_key(message: str, prefix: str) -> str:
    """vLLM's message names a flag (``argument --tensor-parallel-size/-tp: invalid int value``): say the key."""
    match = re.search(r"argument (--[a-z0-9-]+)", message)
    if match is None:
        return f"{prefix}: {message}"
    key = match.group(1)[2:].replace("-", "_")
    return f"{prefix}.{key}: {message}"


def _parsed_namespace(kwargs: Mapping[str, Any], prefix: str) -> Any:
    import argparse

    check_names(kwargs, prefix=prefix)
    try:
        return _engine_parser().parse_args(cli_args(kwargs))
    except (EngineArgsError, argparse.ArgumentError, TypeError, ValueError) as exc:
        raise EngineArgsError(_name_the_key(str(exc), prefix)) from None


def check_engine_args(kwargs: Mapping[str, Any], *, prefix: str = "app.engine") -> None:
    """Raise EngineArgsError if vLLM's parser refuses these keywords: unknown keys, wrong types, values outside
    vLLM's choices, nested configs vLLM's config classes refuse. No model file is read and nothing starts (the
    model may not exist yet: a tiny model is generated later, a hub model is downloaded by the engine)."""
    _parsed_namespace(kwargs, prefix)


def parse_engine_args(kwargs: Mapping[str, Any], *, prefix: str = "app.engine") -> Any:
    """The ``AsyncEngineArgs`` that ``vllm serve`` builds from these keywords (``model`` required; vLLM resolves
    it here, offline to its cached path); EngineArgsError naming the key when vLLM refuses one."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    namespace = _parsed_namespace(kwargs, prefix)
    try:
        return AsyncEngineArgs.from_cli_args(namespace)
    except (TypeError, ValueError) as exc:
        raise EngineArgsError(_name_the_key(str(exc), prefix)) from None
