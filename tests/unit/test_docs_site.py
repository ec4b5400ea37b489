"""The documentation: the mkdocs site under docs/ builds in strict mode (every relative link
resolves, every page is in the nav), and the README stays short and links only to pages that
exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200

# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def _prose(path: Path) -> str:
    """A Markdown file without its fenced code blocks (links there are not links)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None or target.startswith("#")


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                if isinstance(value, str):
                    pages.append(value)
                else:
                    pages.extend(_nav_pages(value))
    return pages


def _config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def _built_path(site: Path, page: str) -> Path:
    """Where mkdocs writes a page with directory URLs (its default): a.md -> a/index.html,
    index.md and x/index.md stay index.html."""
    stem = page[: -len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return site / f"{stem}.html"
    return site / stem / "index.html"


def test_mkdocs_strict_build(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").is_file()
    config = _config()
    pages = _nav_pages(config["nav"])
    assert "index.md" in pages
    for page in pages:
        assert (DOCS / page).is_file(), f"nav names {page}, which is not under docs/"
        assert _built_path(site, page).is_file(), f"{page} was not built"
    # strict mode only warns about pages left out of the nav through `validation`; check directly
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "every page under docs/ is in the nav, once"


def test_readme_is_short_and_links_to_existing_docs() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    targets = [t for t in LINK.findall(_prose(README)) if not _is_external(t)]
    assert targets, "the README links to the docs pages"
    for target in targets:
        path = target.split("#", 1)[0]
        assert path.startswith("docs/"), f"README links to {target}: only docs/ pages belong there"
        assert (ROOT / path).is_file(), f"README links to {target}, which does not exist"
    assert "docs/index.md" in {t.split("#", 1)[0] for t in targets}, "the README links to the docs' index"


def test_referenced_images_exist() -> None:
    sources = [README, *sorted(DOCS.rglob("*.md"))]
    seen = 0
    for source in sources:
        for target in IMAGE.findall(_prose(source)):
            if _is_external(target):
                continue
            seen += 1
            image = (source.parent / target.split("#", 1)[0]).resolve()
            assert image.is_file(), f"{source.relative_to(ROOT)} shows {target}, which does not exist"
            assert DOCS in image.parents, f"{source.relative_to(ROOT)} shows {target}: images live under docs/"
    assert seen, "the docs show their figures"
    for png in DOCS.rglob("*.png"):
        assert png.stat().st_size > 0, f"{png.relative_to(ROOT)} is empty"


# A module of the repository named in backticks: `tasks/trainer/loop.py`, `storage/fs.py`, ...
MODULE_PATH = re.compile(r"`((?:tasks|storage|flows|configs|bench|chaos|cli|infra|examples)/[\w./-]+\.py)`")
INTERNALS = DOCS / "internals"
CODE_LINE = re.compile(r"^Code:(.*)$", re.MULTILINE)
SECTION = re.compile(r"^## (.+)$", re.MULTILINE)


def _internals_pages() -> list[Path]:
    return [page for page in sorted(INTERNALS.glob("*.md")) if page.name != "index.md"]


def test_internals_code_lines_name_modules() -> None:
    """Each `Code:` line of the internals pages names the module(s) holding its section's code."""
    lines = 0
    bad: list[str] = []
    for page in _internals_pages():
        for match in CODE_LINE.finditer(_prose(page)):
            lines += 1
            if not MODULE_PATH.search(match.group(1)):
                bad.append(f"{page.relative_to(ROOT)}: {match.group(0)!r} names no module path")
    assert lines, "the internals pages have Code: lines"
    assert not bad, "\n".join(bad)


def test_internals_sections_are_topics_with_code_lines() -> None:
    """A section of an internals page is headed by its topic (not a module path) and its first
    line is `Code:`, naming where its code lives now."""
    bad: list[str] = []
    for page in _internals_pages():
        text = _prose(page)
        for match in SECTION.finditer(text):
            heading = match.group(1).strip()
            where = f"{page.relative_to(ROOT)}: ## {heading}"
            if re.fullmatch(r"[\w./-]+\.py", heading):
                bad.append(f"{where}: headed by a module path, not a topic")
            first = text[match.end():].lstrip("\n").split("\n", 1)[0]
            if not first.startswith("Code:"):
                bad.append(f"{where}: no Code: line under the heading")
    assert not bad, "\n".join(bad)


def test_module_paths_in_docs_exist() -> None:
    """Every module path the docs name in backticks is a file of the repository (a module that
    moved or was split leaves no stale path behind)."""
    seen = 0
    missing: list[str] = []
    for page in sorted(DOCS.rglob("*.md")):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            for path in MODULE_PATH.findall(line):
                seen += 1
                if not (ROOT / path).is_file():
                    missing.append(f"{page.relative_to(ROOT)}:{number} names `{path}`, which does not exist")
    assert seen, "the docs name modules"
    assert not missing, "\n".join(missing)
