"""The README's Quickstart, as written, on a small corpus of text files: every command runs without an error.

The commands are read from the README's Quickstart block (so the test and the README cannot drift apart), with
the edits its "On a CPU" block tells CPU users to make (flags replaced, flags added), and run in-process through
`archscale.cli.main` in a fresh folder holding `corpus/`: 16 .txt files cut from Milton's Areopagitica (the
essay shipped for NIAH's haystack), about 26,000 tokens.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from archscale.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ESSAY = ROOT / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"
# Quickstart lines the test does not run, and why
NOT_RUN = {"pip": "installs the package this test runs in", "torchrun": "needs a GPU node (8 processes)"}
EXPECTED = ["tokenizer", "prepare", "pretrain", "pretrain", "eval", "generate"]


def quickstart_blocks() -> list[str]:
    section = README.read_text(encoding="utf-8").split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def shell_commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments dropped (as bash reads them)."""
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def pairs(words: list[str]) -> list[tuple[str, str]]:
    assert len(words) % 2 == 0 and all(w.startswith("--") for w in words[::2]), words
    return list(zip(words[::2], words[1::2]))


def cpu_edits(block: str) -> dict[str, tuple[list[str], list[tuple[str, str]]]]:
    """"archscale CMD ... ADDED ...  # for REPLACED" -> {CMD: (ADDED words, REPLACED (flag, value) pairs)}."""
    edits = {}
    for line in block.splitlines():
        m = re.fullmatch(r"archscale (\S+) \.\.\. (.*?)(?: \.\.\.)?\s*(?:# for (.*))?", line.strip())
        assert m, f"the README's CPU block: cannot read {line!r}"
        edits[m[1]] = (m[2].split(), pairs(m[3].split()) if m[3] else [])
    return edits


def apply_edit(argv: list[str], added: list[str], replaced: list[tuple[str, str]]) -> list[str]:
    out = list(argv)
    for flag, value in replaced:
        i = out.index(flag)
        assert out[i + 1] == value, (flag, out[i + 1], value)
        del out[i:i + 2]
    return out + added


def quickstart_commands() -> list[list[str]]:
    """The archscale commands of the Quickstart with the CPU edits, without `archscale`: argv for cli.main."""
    main_block, cpu_block = quickstart_blocks()[:2]
    edits = cpu_edits(cpu_block)
    run = []
    for argv in shell_commands(main_block):
        if argv[0] in NOT_RUN:
            continue
        assert argv[0] == "archscale", argv
        run.append(apply_edit(argv[1:], *edits.get(argv[1], ([], []))))
    return run


def write_corpus(root: Path, n_docs: int = 16) -> None:
    paragraphs = [p for p in ESSAY.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    per = -(-len(paragraphs) // n_docs)
    root.mkdir()
    for i in range(n_docs):
        (root / f"part{i:02d}.txt").write_text("\n\n".join(paragraphs[i * per:(i + 1) * per]) + "\n", encoding="utf-8")


def test_the_quickstart_block_and_this_test_agree():
    """Every Quickstart line is run here or named in NOT_RUN with a reason; the CPU edits name flags the commands
    have, with the values they have; the order of the commands is the one the run test checks."""
    main_block, cpu_block = quickstart_blocks()[:2]
    argvs = shell_commands(main_block)
    assert [a[0] for a in argvs if a[0] != "archscale"] == list(NOT_RUN)
    assert [a[1] for a in argvs if a[0] == "archscale"] == EXPECTED
    edits = cpu_edits(cpu_block)
    assert set(edits) == {"pretrain", "eval"} and "--quick" in edits["eval"][0]
    for argv in argvs:
        if argv[0] == "archscale" and argv[1] in edits:
            apply_edit(argv, *edits[argv[1]])  # raises if a replaced flag or its value is missing
    cmds = quickstart_commands()
    assert "--dry_run" in cmds[2] and "--dry_run" not in cmds[3]
    assert all(c.count("--depth") == 1 and "8" not in c[c.index("--depth") + 1] for c in cmds if c[0] == "pretrain")


@pytest.mark.slow
def test_the_quickstart_runs_as_written_on_a_small_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus")
    for argv in quickstart_commands():
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])
        out, err = capsys.readouterr()
        if argv[0] == "prepare":
            assert "validation" in out
        if "--dry_run" in argv:  # the readable table, with the toy model's size
            assert "sambay_d4" in out and "params" in out, out
        if argv[0] == "generate":
            assert out.strip(), "generate printed nothing"
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["splits"]["validation"]["documents"] >= 1 and manifest["splits"]["train"]["documents"] >= 10
    run_dir = tmp_path / quickstart_commands()[3][quickstart_commands()[3].index("--out_dir") + 1]
    assert (run_dir / "checkpoints" / "latest").is_file()
    doc = json.loads((tmp_path / "eval.json").read_text())
    assert doc["complete"] is True and set(doc["results"]) == {"ppl", "phonebook", "niah_single_1"}
    assert list(doc["results"]["phonebook"]["lengths"]) == ["10", "20"]
