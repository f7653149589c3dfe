"""The docs: the site builds strictly (a broken link fails), the generated blocks (config
keys, LMCache's keys, each command's --help) equal what the code prints now, and the README
stays a short page whose links lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "guides" / "cpu-offload" / "index.html").exists()


def test_the_generated_blocks_are_what_the_code_prints():
    cmd = [sys.executable, "-m", "kvtier_tools.dev.docgen", "--check"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + "\nrun: python -m kvtier_tools.dev.docgen"
    pages = "".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for block in ("config-keys", "lmcache-keys", "cli-help"):
        assert f"<!-- {block}:begin -->" in pages, block


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert missing == []


def test_a_link_to_results_is_checked_and_named_by_its_path_in_the_site():
    from types import SimpleNamespace

    import pytest
    from mkdocs.exceptions import PluginError

    from kvtier_tools.dev.mkdocs_hooks import on_page_markdown

    page = SimpleNamespace(
        file=SimpleNamespace(
            abs_src_path=str(ROOT / "docs/benchmarks/x.md"), src_path="benchmarks/x.md"
        )
    )
    config = {"docs_dir": str(ROOT / "docs")}
    text = "Run: [the run](../../results/README.md), [`results/`](../../results/)."
    assert on_page_markdown(text, page, config, None) == (
        "Run: the run (`results/README.md`), `results/`."
    )
    with pytest.raises(PluginError):
        on_page_markdown("[gone](../../results/no-such-run/README.md)", page, config, None)
