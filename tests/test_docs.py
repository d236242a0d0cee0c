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


def code_block_names(text: str) -> dict[str, set]:
    """What the doc's code blocks name: classes defined, registered mixer names, `=Name` references, test ids
    and dotted archscale paths."""
    blocks = "\n".join(re.findall(r"```(?:python|yaml)?\n(.*?)```", text, re.S))
    return {
        "classes": set(re.findall(r"^class (\w+)", blocks, re.M)),
        "mixers": set(re.findall(r'^\s*name="(\w+)"', blocks, re.M)),
        "refs": set(re.findall(r"^\s*\w+=([A-Z]\w+|[a-z]\w+_flops|[a-z_]+_available)\b", blocks, re.M)),
        "tests": set(re.findall(r"tests/(\w+\.py)::(\w+)", blocks)),
        "paths": set(re.findall(r'"(archscale(?:\.\w+)+)"', blocks)),
    }


def check_names_exist(doc: Path) -> list[str]:
    import importlib

    from archscale.models.mixers import REGISTRY

    names = code_block_names(doc.read_text())
    mixer_sources = "\n".join(p.read_text() for p in (ROOT / "src/archscale/models/mixers").glob("*.py"))
    missing = [f"class {c}" for c in names["classes"] | names["refs"]
               if not re.search(rf"^(class|def) {c}\b|^{c} = ", mixer_sources, re.M)]
    missing += [f"mixer {m}" for m in names["mixers"] if m not in REGISTRY]
    missing += [f"{f}::{t}" for f, t in names["tests"]
                if not (ROOT / "tests" / f).is_file() or f"def {t}(" not in (ROOT / "tests" / f).read_text()]
    for path in names["paths"]:
        module, _, attr = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            missing.append(path)
    return missing


def test_adding_a_mixer_code_examples_name_what_exists(tmp_path):
    """ADDING_A_MIXER.md's example must match the code it describes; the control: a stale name is caught."""
    doc = ROOT / "docs" / "ADDING_A_MIXER.md"
    assert check_names_exist(doc) == []
    names = code_block_names(doc.read_text())
    assert {"GDNOptions", "GatedDeltaNetMixer"} <= names["classes"] and "gdn" in names["mixers"] and names["tests"]
    stale = tmp_path / "stale.md"
    stale.write_text(doc.read_text().replace("class GDNOptions", "class GatedDeltaNetOptions")
                     .replace('name="gdn"', 'name="gated_deltanet"')
                     .replace("test_chunked_matches_ref", "test_chunked_matches_sequential"))
    assert sorted(check_names_exist(stale)) == ["class GatedDeltaNetOptions", "mixer gated_deltanet",
                                                "test_gated_delta.py::test_chunked_matches_sequential"]
