"""vLLM's own load generator (``vllm bench serve``) through its Python entry point, against any endpoint.

The CPU build's dist is not named ``vllm``, so the ``vllm`` CLI cannot find its own version; this runs the same
code (``vllm.benchmarks.serve``: its arguments, its datasets, its report) from ``python -m bench.vllm_bench_serve``.
Every argument is vLLM's. Against ``make serve``'s endpoint, e.g.::

    .venv/bin/python -m bench.vllm_bench_serve --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/chat/completions --model tiny-qwen3 --tokenizer .kvstack/models/tiny-qwen3 \\
        --dataset-name random --random-input-len 512 --random-output-len 32 --num-prompts 40 --request-rate 2

Exit status 1 when any request failed (vLLM's report lists them), 0 otherwise.
"""

from __future__ import annotations

import sys
from typing import Any


def parse(argv: list[str]) -> Any:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m bench.vllm_bench_serve", description=__doc__)
    add_cli_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import main as vllm_bench_serve

    result = vllm_bench_serve(parse(sys.argv[1:] if argv is None else argv))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
