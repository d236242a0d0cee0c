"""Eval tasks are a registry: a new task is one file (here written into a temporary folder named by
ARCHSCALE_EVAL_TASKS, the documented plugin path) and `archscale eval` / `archscale report` pick it up: its flag
in --help, its protocol default, its plan line, its result in the JSON, its summary line and its report panel.
The shared modules name no task (a check with its negative control)."""

import ast
import json
import re
import struct
from pathlib import Path

import pytest

from archscale.cli import main
from archscale.eval.tasks import ENV, all_tasks, by_name
from serving_fixtures import make_run

SRC = Path(__file__).resolve().parents[1] / "src" / "archscale"
DOC = SRC.parents[1] / "docs" / "EVALUATION.md"


def doc_task_file() -> str:
    """The complete task file of docs/EVALUATION.md's "Adding an eval task" (so the page's code is what runs)."""
    section = DOC.read_text().split("## Adding an eval task", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("evalregistry"))  # a 2-step transformer_d1 with its own tokenizer


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    (folder / "echo.py").write_text(doc_task_file())
    monkeypatch.setenv(ENV, str(folder))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk: width, height


def test_a_new_task_is_one_file(plugin, run, tmp_path, capsys):
    from archscale.eval_cli import eval_parser

    assert "--echo_words" in eval_parser().format_help() and "words in the echo prompt" in eval_parser().format_help()
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "echo,ppl", "--output", str(out),
                 "--extrapolation", "1", "--ppl_max_batches", "1", "--echo_label", "mine"]) == 0
    std = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and list(doc["results"]) == ["ppl", "echo"]  # built-ins first, then plugins
    echo = doc["results"]["echo"]
    from archscale.eval.loading import load_eval_model

    tok = load_eval_model(str(run), device="cpu").tokenizer
    assert echo["prompt_tokens"] == len(tok.encode("The The The ", eos=False)) > 0 and echo["label"] == "mine"
    assert isinstance(echo["continuation"], str) and doc["settings"]["echo_words"] == 3 and "echo" in doc["time_s"]
    assert f"echo: {echo['prompt_tokens']} prompt tokens" in std.out.splitlines()
    assert "  echo  3 words, 4 new tokens" in std.err.splitlines() and "echo 3 words ..." in std.err.splitlines()
    png = tmp_path / "report.png"
    assert main(["report", str(out), "--out", str(png)]) == 0
    width, _ = png_size(png)
    assert width == 5 * 110 * len([t for t in all_tasks() if t.panel]) == 5 * 110 * 6  # its panel beside the five
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    by_name()["echo"].panel.draw(ax, [doc], ["run"], ["C0"])  # what that panel shows: this file's result
    assert [b.get_height() for b in ax.patches] == [echo["prompt_tokens"]] and ax.get_title() == "Echo"
    plt.close(fig)


def test_a_task_files_protocol_defaults_and_quick(plugin):
    from archscale.eval import protocol
    from archscale.eval_cli import eval_parser

    def echo_words(*flags):
        args = eval_parser().parse_args(["--checkpoint", "x", "--tasks", "echo", "--output", "o.json", *flags])
        return protocol.resolve(args, 32, False, {"echo"})[0]["echo_words"]

    assert (echo_words(), echo_words("--protocol", "archscale"), echo_words("--quick"),
            echo_words("--quick", "--echo_words", "7")) == (3, 5, 2, 7)


def test_without_the_variable_the_task_is_gone_and_a_broken_file_is_one_line(tmp_path, monkeypatch, capsys):
    from archscale.eval_cli import eval_parser

    monkeypatch.delenv(ENV, raising=False)
    assert "echo" not in by_name() and "--echo_words" not in eval_parser().format_help()
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "echo", "--output", str(tmp_path / "o.json")]) == 2
    assert "unknown task 'echo'" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("TASK = 1\n")
    monkeypatch.setenv(ENV, str(bad))
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "ppl", "--output", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must define TASK = EvalTask" in err[0] and str(bad) in err[0]
    monkeypatch.setenv(ENV, str(tmp_path / "missing"))
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "ppl", "--output", str(tmp_path / "o.json")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


SHARED = ("eval/runner.py", "eval_cli.py", "eval/estimate.py", "eval/report.py", "eval/protocol.py")


def task_names_in(source: str, names: set[str]) -> list[str]:
    """String constants in `source` that are a task's name, or the prefix of a file's several names ("niah_")."""
    prefixes = {n.split("_")[0] + "_" for t in all_tasks() if len(t.names) > 1 for n in t.names}
    return sorted({node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and (node.value in names or node.value in prefixes)})


def test_the_shared_eval_modules_name_no_task():
    names = set(by_name())
    assert {"ppl", "phonebook", "niah_single_1", "lm_eval", "reason"} <= names
    for rel in SHARED:
        assert task_names_in((SRC / rel).read_text(), names) == [], rel
    # negative control: the if-chains the registry replaced are seen
    assert task_names_in('if "ppl" in plans:\n    pass\nniah = [t for t in x if t.startswith("niah_")]\n',
                         names) == ["niah_", "ppl"]


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def test_reason_through_eval_is_archscale_reasons_runner_and_resumes(run, tmp_path, monkeypatch, capsys):
    """`eval --tasks reason` draws the samples `archscale reason --checkpoint` draws (same seeds, same scoring), keeps
    them beside --output, and a rerun samples nothing (its completer is never called)."""
    run, data = str(run), str(Path(__file__).parent / "data" / "reason" / "gsm8k.jsonl")
    assert main(["reason", "--task", "gsm8k", "--data", data, "--checkpoint", run, "--samples", "2", "--max_tokens",
                 "6", "--temperature", "1.0", "--seed", "11", "--output", str(tmp_path / "r.json")]) == 0
    out = tmp_path / "e.json"
    flags = ["eval", "--checkpoint", str(run), "--tasks", "reason", "--reason_data", data, "--reason_samples", "2",
             "--reason_max_tokens", "6", "--reason_temperature", "1.0", "--seed", "11", "--output", str(out)]
    assert main(flags) == 0
    ours, theirs = read_jsonl(tmp_path / "e.reason-gsm8k.items.jsonl"), read_jsonl(tmp_path / "r.items.jsonl")
    assert [r["completions"] for r in ours] == [r["completions"] for r in theirs] and len(ours) == len(read_jsonl(
        Path(data)))
    summary = json.loads(out.read_text())["results"]["reason"]["gsm8k"]
    reason_summary = json.loads((tmp_path / "r.json").read_text())["results"]["reason"]["gsm8k"]
    assert summary["pass@k"] == reason_summary["pass@k"] and summary["items"] == reason_summary["items"]
    assert any(line.startswith("reason gsm8k: ") for line in capsys.readouterr().out.splitlines())

    def no_sampling(*a, **k):
        def complete(jobs, n, on_done):
            raise AssertionError(f"sampled again: {jobs}")
        return complete

    monkeypatch.setattr("archscale.reason.runner.model_completer", no_sampling)
    assert main(flags) == 0
    assert json.loads(out.read_text())["results"]["reason"]["gsm8k"]["pass@k"] == summary["pass@k"]
