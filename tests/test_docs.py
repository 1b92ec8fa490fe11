"""The documentation site (docs/, mkdocs.yml) builds with ``mkdocs build --strict``.

Strict, with the link, anchor and nav checks of mkdocs.yml raised to warnings,
makes a link to a missing page, a link to a missing section or a page left out
of the navigation fail the build, and so the suite. The tests below break a
copy of the docs each way to show that the build does fail on each. The README
is not a page of the site: its links into docs/ are checked here by hand.
(The commands the pages show are checked by tests/test_readme.py.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # material's banner, not a warning
    )


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    pages = sorted(p.stem for p in (REPO / "docs").glob("*.md"))
    assert "index" in pages and "sglang-differences" in pages
    for name in pages:  # every page is in the site, the index at its root
        built = tmp_path / "site" / ("" if name == "index" else name) / "index.html"
        assert built.is_file(), f"docs/{name}.md was not built"


BREAKAGES = {
    "link to a missing page": ("index.md", "[gone](no-such-page.md)", "no-such-page.md"),
    "link to a missing anchor": ("index.md", "[gone](tuning.md#no-such-part)", "no-such-part"),
    "link out of docs/": ("index.md", "[gone](../README.md)", "README.md"),
    "page missing from the nav": ("orphan.md", "# Orphan", "orphan.md"),
}


@pytest.mark.parametrize(("page", "text", "named"), BREAKAGES.values(), ids=BREAKAGES)
def test_a_broken_docs_tree_fails_the_strict_build(
    tmp_path: Path, page: str, text: str, named: str
) -> None:
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    assert build(tmp_path / "mkdocs.yml", tmp_path / "ok").returncode == 0  # the copy builds
    path = tmp_path / "docs" / page
    path.write_text((path.read_text() if path.exists() else "") + f"\n\n{text}\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0, f"a {page} with {text!r} built"
    assert named in done.stdout + done.stderr


def headings(text: str) -> set[str]:
    """The anchors mkdocs (Python-Markdown's toc) gives a page's headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no comments in code
    return {slugify(h, "-") for h in re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)}


def test_the_readme_links_lead_somewhere() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.is_file(), f"the README links to {path}, which does not exist"
        if anchor:
            assert anchor in headings(target.read_text()), f"no section #{anchor} in {path}"


def test_every_docs_page_is_linked_from_the_readme_or_the_index() -> None:
    linked = re.findall(r"\]\(docs/([\w.-]+\.md)", (REPO / "README.md").read_text())
    linked += re.findall(r"\]\(([\w.-]+\.md)", (REPO / "docs/index.md").read_text())
    for page in (REPO / "docs").glob("*.md"):
        assert page.name == "index.md" or page.name in linked, f"nothing links to {page.name}"
