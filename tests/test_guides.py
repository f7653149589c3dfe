"""The guides run as written: every shell block of a docs page marked `<!-- runnable -->`
runs, in the page's order, in one bash session on the CPU build of vLLM, with `$MODEL` a
model made locally; what the blocks print equals the page's blocks marked
`<!-- output -->`, in order. What a page starts in the background is stopped with the
session's process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier_tools.dev.cpu_dtype import model_dtype
from kvtier_tools.dev.tinymodel import TinyLlama, make_tiny_llama

pytestmark = pytest.mark.vllm
DOCS = Path(__file__).resolve().parents[1] / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.S)
OUTPUT = re.compile(r"<!-- output -->\n```text\n(.*?)```", re.S)
PAGES = sorted(p for p in DOCS.rglob("*.md") if "<!-- runnable -->" in p.read_text())


def test_the_guides_have_runnable_blocks():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert "guides/cpu-offload.md" in names


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_a_guide_runs_as_written(page, tmp_path):
    text = page.read_text()
    script = "set -euo pipefail\n" + "\n".join(RUNNABLE.findall(text))
    model = make_tiny_llama(tmp_path / "model", TinyLlama(torch_dtype=model_dtype().dtype))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(
        os.environ,
        MODEL=str(model),
        VLLM_CPU_KVCACHE_SPACE="2",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=800)
    finally:
        _stop_group(proc.pid)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in work.glob("*.log"))
    assert proc.returncode == 0, err[-3000:] + logs
    assert out == "".join(OUTPUT.findall(text)), logs


def _stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """What the page started and did not stop: SIGTERM (vLLM shuts its engine down), then,
    after `grace_s`, SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            os.killpg(pgid, 0)  # ProcessLookupError once every process of the group is gone
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
