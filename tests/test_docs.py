"""The repository's text refers only to what its readers can open: ArchScale's paper and repository, not our
internal design notes ("the seed", "spec §N", ../shared)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "seed" alone is also a random seed, so only the phrasings that meant the design notes are forbidden
FORBIDDEN = re.compile(r"spec §|§\s?\d|\bthe spec's\b|\bseed's\b|\bseed-compatible\b|\bthe seed (does|parsed|forces)\b"
                       r"|\.\./shared|archscale-spec", re.I)


def test_no_text_cites_internal_documents():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    hits = []
    for path in files:
        if not path.is_file() or path.suffix not in (".md", ".py", ".yaml", ".sh", ".txt") or "egg-info" in str(path):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:40])


def test_relative_links_in_the_docs_resolve():
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                bad.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not bad, bad
