#!/usr/bin/env bash
# Wheels of the store server's dependencies for the GPU machine (Python 3.12,
# no package index there), into .wheels/ for the device tool to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .wheels uvloop aiohttp prometheus-client xxhash
# `bash scripts/gpu_wheels.sh pd`: what scripts/pd_gpu_bench.sh needs, into .wheels-pd/
# (installed there with --no-deps: torch and numpy are on the machine already).
if [ "${1:-}" = pd ]; then
    .venv/bin/python -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d .wheels-pd xxhash nixl==1.5.1 nixl-cu13==1.5.1
fi
