"""The README is the front door: its table of guides links every guide in docs/, and every guide a document or a
comment names (`docs/<name>.md`) exists, so a guide renamed or moved leaves no reference behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"docs/[A-Za-z0-9_.-]+\.md")
SOURCES = ("console", "core", "jobs", "runs", "approvals", "external", "slackapp", "evals", "demo", "tests", "bench")


def test_the_readme_links_every_guide():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", readme))
    guides = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")}
    assert guides - linked == set(), "guides the README's table does not link"
    assert linked - guides == set(), "links in the README to guides that do not exist"


def test_every_guide_named_exists():
    files = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md")]
    files += [path for source in SOURCES for path in (ROOT / source).rglob("*.py")]
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in NAMED.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / name).is_file()
    }
    assert missing == set()
