"""mkdocs hook (mkdocs.yml `hooks:`): links from the docs to the records in results/.

The records and the runs' READMEs live beside the docs, not in the site: a page links to
them relatively (`[the run](../../results/<run>/README.md)`), which a reader of the
repository follows, and which mkdocs --strict would refuse as a link to no page. For the site
this hook turns each such link into the path it names, as code, after checking that the
path exists: a link to a record that is not there fails the build, as a broken link does.
"""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+results/[^)#\s]*)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError

    here = Path(page.file.abs_src_path).parent
    root = Path(config["docs_dir"]).resolve().parent

    def named(match: re.Match) -> str:
        target = (here / match.group(2)).resolve()
        if not target.exists() or root not in target.parents:
            raise PluginError(f"{page.file.src_path}: no {match.group(2)} in the repository")
        path = str(target.relative_to(root)) + ("/" if target.is_dir() else "")
        text = match.group(1)
        return f"`{path}`" if text.strip("`") == path else f"{text} (`{path}`)"

    return LINK.sub(named, markdown)
