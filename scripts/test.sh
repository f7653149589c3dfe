#!/usr/bin/env bash
# Every test, real vLLM included. Fails if pytest collected nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -p no:cacheprovider -ra "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
