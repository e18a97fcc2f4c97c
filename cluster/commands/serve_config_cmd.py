"""``kvstack serve-config``: the standard Ray Serve config file for a kvstack config, for ``serve run FILE`` or
``serve deploy FILE`` against an existing Ray cluster (the same endpoint as ``kvstack serve``, pool included).

    kvstack serve-config [--config FILE] [--model ID_OR_PATH] [--set KEY=VALUE ...] --out FILE|-

Takes the same config flags as ``kvstack serve`` (``cluster.commands.serve.add_config_arguments``); the document is
``cluster.serve_config.serve_config_document`` (also what a KubeRay ``serveConfigV2`` holds). A config that names a
tiny model generates it first (at the config's model path), so the file serves as written. Exit 0 ok, 2 on a bad
config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    from cluster.commands.serve import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--out", required=True, help="the Serve config file to write (- for stdout)")


def run(args: argparse.Namespace) -> int:
    import yaml

    from cluster.commands.serve import load_config
    from cluster.serve_config import serve_config_document

    cfg = load_config(args, "serve-config")
    if cfg is None:
        return 2
    if cfg.tiny_model is not None:
        from cluster.tiny_models import ensure_configured

        ensure_configured(cfg.tiny_model.arch, cfg.tiny_model.preset, cfg.app.first.engine.model)
    text = "# Ray Serve config written by `kvstack serve-config`: serve run THIS_FILE (an existing Ray cluster)\n"
    text += yaml.safe_dump(serve_config_document(cfg), sort_keys=False)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"kvstack serve-config: wrote {args.out}", file=sys.stderr)
    return 0
