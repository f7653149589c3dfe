#!/usr/bin/env bash
# Wheels of the store server's dependencies for the GPU machine (Python 3.12,
# no package index there), into .wheels/ for the device tool to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .wheels uvloop aiohttp prometheus-client xxhash
