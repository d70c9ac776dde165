"""The README stays short, every link of the documentation leads somewhere, and
docs/adding-a-clause.md's sample clause works exactly as the guide says."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
GUIDE = REPO / "docs" / "adding-a-clause.md"
README_MAX_LINES = 200

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """Markdown without its fenced blocks and inline code (no links there)."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move a topic into docs/"


def test_the_readme_names_the_two_commands() -> None:
    text = README.read_text()
    assert "bin/rayproof certify" in text and "bin/rayproof test" in text


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_outside_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def _sample_clause() -> tuple[str, str]:
    """The guide's sample clause: (its path as the guide names it, its text)."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.M | re.S)
    samples = [b for b in blocks if re.match(r"# (conformance/\w+/test_\w+\.py)\n", b)]
    assert len(samples) == 1, "the guide has one complete sample clause, its first line naming its file"
    path = samples[0].splitlines()[0][2:]
    return path, samples[0]


def test_the_guides_sample_clause_is_collected_with_its_id_runs_and_passes(pytester, monkeypatch) -> None:
    """Follows docs/adding-a-clause.md: the sample goes to conformance/<family>/
    (a new family folder with an __init__.py) of a checkout whose conftest
    loads the plugin, and `-k ID` runs it as a clause."""
    path, text = _sample_clause()
    cid = re.search(r'^@pytest\.mark\.clause\("([^"]+)"\)', text, re.M).group(1)
    # This test's own process may have imported the checkout's conformance
    # package; the sample's must be the one found (restored afterwards).
    for name in [m for m in sys.modules if m == "conformance" or m.startswith("conformance.")]:
        monkeypatch.delitem(sys.modules, name)
    pytester.makeconftest('pytest_plugins = ["fixtures.plugin"]')
    sample = pytester.path / path
    sample.parent.mkdir(parents=True)
    (sample.parent.parent / "__init__.py").write_text('"""The conformance clauses."""\n')
    (sample.parent / "__init__.py").write_text('"""Example clauses."""\n')
    sample.write_text(text)

    from core.catalogue import _CLAUSE_MARK
    assert _CLAUSE_MARK.findall(text) == [cid], "the clause catalogue reads the sample's id"

    out = pytester.path / "results.json"
    result = pytester.runpytest("-p", "no:cacheprovider", str(sample.parent.relative_to(pytester.path)),
                                "-k", cid, f"--rayproof-results={out}")
    result.assert_outcomes(passed=1)
    [row] = json.loads(out.read_text())["results"]
    assert row["clause"] == cid and row["outcome"] == "passed", row
    assert "MUST" in row["must"], row
    assert row["evidence"]["steps_lost"] <= row["evidence"]["checkpoint_interval"], row
