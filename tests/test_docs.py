"""The documentation stays a front door: the product speaks of itself, the two entry pages stay short,
and every relative link in README.md and docs/ leads somewhere that exists (a file, and a heading where the
link names one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
ARCHITECTURE_MAX_LINES = 150

# "issue" with a number after it (a space or "#" between, any case): how the project's history was tracked, not
# what the product is. (This file spells its own samples in two pieces, so that it passes its own check.)
HISTORY_REFERENCE = re.compile(r"issue ?#?[0-9]+", re.IGNORECASE)
# [text](target): inline links; images too. Targets with a scheme (https:, mailto:) are left alone.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".json", ".sh", ""}


def product_files() -> list[Path]:
    """What users and contributors read: the code, the tests, the benchmarks, the README and docs/."""
    files = [ROOT / "README.md"]
    for folder in ("src", "tests", "benchmarks", "docs", "examples"):
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
                  and not any(part.endswith(".egg-info") for part in p.parts)]  # built by pip from README
    return files


def history_references(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for match in HISTORY_REFERENCE.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        in_code = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = (page.parent / file_part).resolve() if file_part else page
                where = f"{page.relative_to(ROOT)}:{number}: link {target!r}"
                if not resolved.exists():
                    shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
                    broken.append(f"{where}: no such file {shown}")
                elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    broken.append(f"{where}: {resolved.relative_to(ROOT)} has no heading with anchor #{anchor}")
    return broken


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_history_references_in_the_product():
    found = history_references(product_files())
    assert not found, ("name the feature, not the issue that asked for it:\n" + "\n".join(found))


def test_readme_fits_two_screens():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail to docs/features/<name>.md")


def test_architecture_page_stays_a_map():
    lines = len((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines())
    assert lines <= ARCHITECTURE_MAX_LINES, (
        f"docs/architecture.md has {lines} lines, at most {ARCHITECTURE_MAX_LINES}: reasons go to docs/decisions.md")


def test_relative_links_lead_somewhere():
    broken = broken_links(doc_pages())
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_feature_page_is_linked_from_another_page():
    pages = doc_pages()
    texts = {page: page.read_text(encoding="utf-8") for page in pages}
    orphans = [page.name for page in sorted((ROOT / "docs" / "features").glob("*.md"))
               if not any(f"{page.name})" in text or f"{page.name}#" in text
                          for other, text in texts.items() if other != page)]
    assert not orphans, f"feature pages no other page links to: {orphans}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The detectors themselves: a history reference and a dead link or anchor are found, with file:line."""
    reference = "Iss" + "ue #21"
    (tmp_path / "a.md").write_text("# Title\n\nSee [b](b.md), [t](#title), [x](#nowhere), [gone](missing.md).\n"
                                   f"Fixed in {reference}.\n```\n[in code](ignored.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert history_references([tmp_path / "a.md"]) == [f"a.md:4: {reference!r} in 'Fixed in {reference}.'"]
        broken = broken_links([tmp_path / "a.md"])
    finally:
        ROOT = saved
    assert len(broken) == 2, broken
    assert broken[0].startswith("a.md:3: link '#nowhere'") and "no heading" in broken[0]
    assert broken[1].startswith("a.md:3: link 'missing.md'") and "no such file" in broken[1]
    assert slug("ZeRO: memory and step time") == "zero-memory-and-step-time"
    assert slug("Cross-mesh resharding: naive, send/recv, scatter-gather") == \
        "cross-mesh-resharding-naive-sendrecv-scatter-gather"
    assert slug("Pipeline schedules: autopar vs torch.distributed.pipelining") == \
        "pipeline-schedules-autopar-vs-torchdistributedpipelining"
