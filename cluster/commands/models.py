"""``kvstack models make-tiny``: generate a deterministic tiny model directory (no hub access).

    kvstack models make-tiny --arch qwen3|qwen3-next --out DIR [--preset tiny|heavy] [--layers N --hidden N ...]

Prints one JSON line (out dir, model id, digest, spec, whether it was built or reused). Exit 0 ok, 1 on a build
failure, 2 on bad arguments. Heavy imports stay inside ``run`` (see ``cluster/cli.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

_SHAPE_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--layers", "layers", int),
    ("--hidden", "hidden", int),
    ("--heads", "heads", int),
    ("--kv-heads", "kv_heads", int),
    ("--head-dim", "head_dim", int),
    ("--intermediate", "intermediate", int),
    ("--vocab", "vocab", int),
    ("--max-positions", "max_positions", int),
    ("--full-attention-interval", "full_attention_interval", int),
    ("--linear-key-heads", "linear_key_heads", int),
    ("--linear-value-heads", "linear_value_heads", int),
    ("--seed", "seed", int),
    ("--initializer-range", "initializer_range", float),
    ("--qk-norm-gain", "qk_norm_gain", float),
)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    make = sub.add_parser("make-tiny", help="write a seeded tiny model + tokenizer directory")
    make.add_argument("--arch", required=True, choices=["qwen3", "qwen3-next"])
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--preset", default="tiny", choices=["tiny", "heavy"])
    make.add_argument("--force", action="store_true", help="rebuild even if DIR holds another tiny model")
    for flag, dest, kind in _SHAPE_FLAGS:
        make.add_argument(flag, dest=dest, type=kind, default=None)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) != "make-tiny":
        print("usage: kvstack models make-tiny --arch qwen3|qwen3-next --out DIR", file=sys.stderr)
        return 2
    from cluster.tiny_models import make_tiny, model_id, preset_spec

    overrides = {dest: getattr(args, dest) for _, dest, _ in _SHAPE_FLAGS}
    try:
        spec = preset_spec(args.arch, args.preset, **overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pathlib import Path

    from cluster.tiny_models import MARKER_FILE

    existed = (Path(args.out) / MARKER_FILE).exists()
    try:
        out = make_tiny(spec, args.out, force=args.force)
    except (FileExistsError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import dataclasses

    print(
        json.dumps(
            {
                "out": str(out),
                "model_id": model_id(spec),
                "digest": spec.digest(),
                "reused": existed and not args.force,
                "spec": dataclasses.asdict(spec),
            }
        )
    )
    return 0
