"""The docs hold together: every relative link in README.md, CHANGELOG.md and docs/*.md reaches
a file that exists and, where it names an anchor, a heading of that file (GitHub's anchor rules);
and every figure under the README's "Headline figures" links to its section of
docs/benchmarks.md, which shows the same numbers, dates and commands. Text only: no vLLM, no
build."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
REF_LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\[([^\]]+)\]")
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(\S+)\s*$")
CODE_SPAN = re.compile(r"`[^`]*`")
# A figure: a number with its % or x, a time (18:06), a thousands-grouped count (583,048). A
# number inside a word (Qwen3, 27b, 344k, 3rd) is a name, not a figure.
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*(?:%|x)?(?!\w)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
RELEASE = re.compile(r"0\.3\d(?:\.\d+)?")
# A command the README names: the section it links to must give it verbatim.
COMMAND = re.compile(r"^(?:bash|hybrid-alloc|pytest|cargo|python|PYTHONPATH=)\s|^benches/")


def blocks(text: str) -> list[str]:
    """The file's blocks (paragraphs, tables, ...) split on blank lines, fenced code left out."""
    out: list[str] = []
    fence = False
    cur: list[str] = []
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            if cur:
                out.append("\n".join(cur))
                cur = []
            continue
        if fence:
            continue
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text as rendered (links, images and code as their text),
    lower-cased, everything but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = INLINE_LINK.sub(r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[tuple[int, str, int]]:
    """(level, anchor, line index) of each heading, duplicates numbered as GitHub does (-1, -2)."""
    out: list[tuple[int, str, int]] = []
    seen: Counter[str] = Counter()
    fence = False
    for i, line in enumerate(path.read_text().split("\n")):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r" {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$", line)
        if m:
            base = github_anchor(m.group(2))
            n = seen[base]
            seen[base] += 1
            out.append((len(m.group(1)), base if n == 0 else f"{base}-{n}", i))
    return out


def links(block: str, defs: dict[str, str]) -> list[str]:
    """The targets a block links to, inline or by reference, in order; code spans left out."""
    text = CODE_SPAN.sub("", block)
    found = [(m.start(), m.group(2)) for m in INLINE_LINK.finditer(text)]
    found += [(m.start(), defs[m.group(2).lower()]) for m in REF_LINK.finditer(text) if m.group(2).lower() in defs]
    return [t for _, t in sorted(found)]


def definitions(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for line in text.split("\n") if (m := REF_DEF.match(line))}


def test_every_relative_link_in_the_docs_reaches_a_file_and_a_heading() -> None:
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        defs = definitions(text)
        targets = [t for b in blocks(text) for t in links(b, defs)] + list(defs.values())
        for target in targets:
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {a for _, a, _ in headings(dest)}:
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def sections(path: Path) -> dict[str, str]:
    """Anchor -> the text from its heading to the next heading of the same or a higher level."""
    lines = path.read_text().split("\n")
    heads = headings(path)
    out = {}
    for k, (level, anchor, start) in enumerate(heads):
        end = next((i for lv, _, i in heads[k + 1 :] if lv <= level), len(lines))
        out[anchor] = "\n".join(lines[start:end])
    return out


def figures(text: str) -> set[str]:
    """The figures a text states: its numbers (release numbers and lone digits are not figures)
    and its dates, read from the rendered text (a link as its text)."""
    text = REF_LINK.sub(r"\1", INLINE_LINK.sub(r"\1", text))
    nums = {n for n in NUMBER.findall(text) if not RELEASE.fullmatch(n) and not re.fullmatch(r"\d", n)}
    return nums | set(DATE.findall(text))


def commands(text: str) -> set[str]:
    spans = (" ".join(s.strip("`").split()) for s in re.findall(r"`[^`]+`", text))
    return {s for s in spans if COMMAND.match(s)}


def flat(text: str) -> str:
    """The text on one line, single-spaced (a command may wrap, or continue a line with \\)."""
    return " ".join(text.replace("\\\n", " ").split())


def headline_claims() -> list[tuple[str, list[str]]]:
    """Each paragraph and table row of the README's "Headline figures" (its ### parts included),
    with the docs/benchmarks.md anchors it links to: its own links; for a table row without any,
    those of the paragraph that introduces the table; for a paragraph without any right after a
    table (its notes), those of the table's rows."""
    text = README.read_text()
    start = text.index("\n## Headline figures")
    end = text.find("\n## ", start + 1)
    defs = definitions(text)

    def anchors_of(part: str) -> list[str]:
        targets = (t.split("#", 1) for t in links(part, defs) if "#" in t)
        return [anchor for path, anchor in targets if path.endswith("benchmarks.md")]

    claims: list[tuple[str, list[str]]] = []
    intro: list[str] = []
    table: list[str] = []
    for block in blocks(text[start:end]):
        if block.startswith("#") or all(REF_DEF.match(line) for line in block.split("\n")):
            continue
        if block.startswith("|"):
            rows = [r for r in block.split("\n") if not re.fullmatch(r"\|[-| :]+\|", r)]
            table = []
            for row in rows:
                claims.append((row, anchors_of(row) or intro))
                table += [a for a in claims[-1][1] if a not in table]
            continue
        own = anchors_of(block)
        claims.append((block, own or table))
        intro, table = own, []
    return claims


def test_the_readme_parser_finds_the_headline_figures() -> None:
    """The test below reads what it should: the headline table's rows and both hit-aware tables."""
    rows = [row for row, _ in CLAIMS]
    assert sum(1 for r in rows if r.startswith("|")) >= 15
    assert any("KV time per running request" in r for r in rows)


CLAIMS = headline_claims()


@pytest.mark.parametrize(("row", "anchors"), CLAIMS, ids=[" ".join(r.split())[:48] for r, _ in CLAIMS])
def test_each_headline_figure_is_its_benchmark_sections(row: str, anchors: list[str]) -> None:
    stated, named = figures(row), commands(row)
    if not stated and not named:
        return
    text = sections(BENCHMARKS)
    assert anchors, f"README figures with no link to their docs/benchmarks.md section: {row!r}"
    assert all(a in text for a in anchors), f"{anchors} not all headings of docs/benchmarks.md"
    shown = "\n".join(text[a] for a in anchors)
    missing = sorted(stated - figures(shown))
    assert not missing, f"README: {row!r}\nfigures not in docs/benchmarks.md#{'/#'.join(anchors)}: {missing}"
    absent = sorted(c for c in named if c not in flat(shown))
    assert not absent, f"README: {row!r}\ncommands not in docs/benchmarks.md#{'/#'.join(anchors)}: {absent}"
