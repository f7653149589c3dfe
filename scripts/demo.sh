#!/usr/bin/env bash
# The main job: vLLM + kvtier, one long prompt twice; prints cold/warm TTFT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvtier demo "$@"
