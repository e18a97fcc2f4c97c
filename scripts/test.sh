#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole suite (unit, integration, e2e).
# Extra arguments go to pytest (e.g. `scripts/test.sh tests/unit -q`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
