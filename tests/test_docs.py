"""The README and docs/ as a reader meets them: every relative link lands on a file and, with an
``#anchor``, on a heading of it; docs/code-map.md lists every module of the shipped folders, in
tree order, and nothing else; the README stays a front door; no lab-notebook history (work
session numbers, issue numbers, commit hashes, "previous run") leaks into what users read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
CODE_MAP = ROOT / "docs" / "code-map.md"
SHIPPED = ("tokenlake", "engines", "scheduler", "serve", "benchmarks", "cli")
MAX_README_LINES = 300

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks (a ``# comment`` in a bash block is no heading)."""
    return FENCE.sub("", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation but '-' and '_' dropped, lower
    case, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, a repeated one suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(page.read_text())):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_slug_matches_github_examples():
    """Against anchors GitHub renders for such headings."""
    assert github_slug("What the numbers do not say") == "what-the-numbers-do-not-say"
    assert github_slug("The `tokenlake` command") == "the-tokenlake-command"
    assert github_slug("Serving, SGLang and Ray") == "serving-sglang-and-ray"
    assert github_slug("Metrics (Prometheus)") == "metrics-prometheus"
    assert github_slug("`csrc/`") == "csrc"


def test_docs_exist_and_readme_links_each():
    names = {p.name for p in DOCS}
    expected = {"architecture.md", "goodput.md", "serving.md", "sglang.md", "ray.md"}
    expected |= {"benchmarks.md", "code-map.md"}
    assert expected <= names, f"missing: {expected - names}"
    linked = {Path(t.split("#")[0]).name for t in relative_links(README)}
    assert names <= linked, f"docs the README does not link: {names - linked}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, broken


def test_link_check_catches_a_broken_link(tmp_path):
    """The checker itself fails on a missing file and on a missing heading."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[a](#title) [b](#nope) [c](missing.md)\n```\n# not [d](x.md)\n```\n"
    )
    assert anchors(page) == {"title"}
    assert relative_links(page) == ["#title", "#nope", "missing.md"]


def shipped_modules() -> list[str]:
    files = []
    for folder in SHIPPED:
        files += [
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts
        ]
    return files


def code_map_entries() -> list[str]:
    """The module each ``- `path` — what`` line of the code map names, in its order."""
    entries = []
    for line in CODE_MAP.read_text().splitlines():
        m = re.match(r"- `([^`]+)` — \S", line)
        if m:
            entries.append(m.group(1))
    return entries


def test_code_map_lists_every_module():
    listed = set(code_map_entries())
    missing = sorted(set(shipped_modules()) - listed)
    assert not missing, f"modules without a line in docs/code-map.md: {missing}"


def test_code_map_names_only_what_exists():
    ghosts = []
    for entry in code_map_entries():
        for path in re.sub(r"\{([^}]*)\}", lambda m: m[1].split(",")[0], entry).split(", "):
            if not (ROOT / path.strip("`")).exists():
                ghosts.append(entry)
    assert not ghosts, f"lines of docs/code-map.md naming nothing that exists: {ghosts}"


def test_code_map_is_in_tree_order():
    listed = [e for e in code_map_entries() if e.endswith(".py") and e.split("/")[0] in SHIPPED]
    assert len(listed) == len(set(listed)), "a module listed twice"
    for folder in SHIPPED:
        mine = [e for e in listed if e.split("/")[0] == folder]
        assert mine == sorted(mine), f"{folder}/ not in tree order"


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines"


NOTEBOOK = {
    "a commit hash": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    "an issue number": r"\bissues?\s*#?\d+|(?<![\w(&/])#\d+\b",
    "a work session": r"\b(this|previous|earlier|\d+(?:st|nd|rd|th)|second|third|fourth|fifth|"
    r"sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth)\s+session\b",
    "a numbered session": r"\bsession\s+#?\d+",
    "a previous run": r"\bprevious\s+(run|table|session|result)s?\b",
    "the team's notes": r"\.\./shared|\bissue notes\b|\bsession notes?\b",
}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_lab_notebook_history(page):
    text = page.read_text()
    found = [
        f"{what}: {m.group(0)!r}"
        for what, pattern in NOTEBOOK.items()
        for m in re.finditer(pattern, text, re.I if what != "a commit hash" else 0)
    ]
    assert not found, found


@pytest.mark.parametrize(
    "line",
    [
        "measured at commit 404e7f9",
        "as in issue 13",
        "see #33",
        "re-measured in the eleventh session",
        "this session's rules",
        "the previous run's seed 0",
        "see ../shared/DESIGN.md",
    ],
)
def test_notebook_patterns_catch(line):
    assert any(
        re.search(p, line, re.I if what != "a commit hash" else 0) for what, p in NOTEBOOK.items()
    ), line


@pytest.mark.parametrize(
    "line",
    [
        "a session's next turn",
        "`--eviction session`",
        "195 sessions over private contexts",
        "1,000 requests at 262,654 tokens",
        "a decade",
    ],
)
def test_notebook_patterns_spare_workload_words(line):
    assert not any(
        re.search(p, line, re.I if what != "a commit hash" else 0) for what, p in NOTEBOOK.items()
    ), line


CITATION = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def code_citations() -> list[tuple[str, str, str | None]]:
    """Every ``docs/PAGE.md#anchor`` the shipped code cites: (file, page, anchor)."""
    found = []
    for folder in SHIPPED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for page, anchor in CITATION.findall(path.read_text()):
                found.append((str(path.relative_to(ROOT)), page, anchor or None))
    return found


def test_code_cites_docs_that_exist_not_a_note_outside_the_repository():
    """The code points to docs/ sections (anchors checked), never to a design note that the
    repository does not hold."""
    citations = code_citations()
    assert len(citations) > 10
    broken = [
        (f, page, anchor)
        for f, page, anchor in citations
        if not (ROOT / "docs" / page).exists()
        or (anchor and anchor not in anchors(ROOT / "docs" / page))
    ]
    assert not broken, broken
    outside = [
        str(p.relative_to(ROOT))
        for folder in SHIPPED
        for p in (ROOT / folder).rglob("*.py")
        if re.search(r"DESIGN(\.md| §)", p.read_text())
    ]
    assert not outside, outside
