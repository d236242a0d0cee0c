"""`archscale eval` says its plan first, shows progress per task and length (a bar on a terminal, a line per
stage otherwise, nothing with --progress false), and writes each finished length at once (an interrupt keeps it)."""

import io
import json
import sys
from pathlib import Path

import pytest

from archscale.cli import main
from archscale.eval import runner

ESSAY = Path(__file__).resolve().parents[1] / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"
TASK_FLAGS = ["--tasks", "ppl,phonebook,niah_single_1", "--min_eval_len", "3", "--max_eval_len", "5",
              "--eval_len_step", "2", "--phonebook_batch_size", "1", "--ppl_max_batches", "1",
              "--max_seq_lengths", "160", "--niah_samples", "2", "--max_length", "512", "--batch_size", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step transformer_d1 run (ctx 32) on Areopagitica with its own tokenizer (as test_eval_pipeline's)."""
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("evalprogress")
    paras = [p for p in ESSAY.read_text().split("\n\n") if p.strip()]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    train_bpe([str(d / "c.jsonl")], 320, str(d / "tok.json"))
    prepare([str(d / "c.jsonl")], str(d / "data"), str(d / "tok.json"), val_fraction=0.2, chunk_size=8192,
            progress=False, num_workers=1)
    assert main(["pretrain", "--train_data_dir", str(d / "data"), "--train_model", "transformer", "--depth", "1",
                 "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "384",
                 "--base_hps.warmup_tokens0", "128", "--eval_iters", "1", "--eval_interval", "100",
                 "--out_dir", str(d / "run"), "--progress", "false", "--precision", "fp32", "--resume", "none"]) == 0
    return d / "run"


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_an_interrupted_eval_keeps_the_lengths_it_finished(run, tmp_path, monkeypatch, capsys):
    """Ctrl-C during Phonebook's second length: the file holds ppl and Phonebook's first length, marked
    incomplete (on the old code there was no file at all)."""
    calls = []
    real = runner.ModelTextGenerator.__call__

    def interrupted_on_the_second_call(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelTextGenerator, "__call__", interrupted_on_the_second_call)
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run), "--output", str(out), *TASK_FLAGS]) == 130
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and list(doc["results"]) == ["ppl", "phonebook"]
    assert doc["results"]["ppl"]["validation"]["1x"]["loss"] > 0
    pb = doc["results"]["phonebook"]
    assert pb["partial"] is True and list(pb["lengths"]) == ["3"] and pb["lengths"]["3"]["samples"] == 4
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--output", str(out), *TASK_FLAGS, "--progress", "false"]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and list(doc["results"]["phonebook"]["lengths"]) == ["3", "5"]
    assert "partial" not in doc["results"]["phonebook"]


def test_plan_then_one_line_per_stage_off_a_terminal_and_nothing_with_progress_false(run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run), "--output", str(out), *TASK_FLAGS]) == 0
    err = capsys.readouterr().err.splitlines()
    plan = err.index(next(ln for ln in err if ln.startswith("eval plan: transformer_d1 (step 3) on cpu, batch 2")))
    assert err[plan + 1].split()[:2] == ["ppl", "1x,2x,4x:"] and "~" in err[plan + 1]
    assert err[plan + 2].split()[:4] == ["phonebook", "3,", "5", "entries:"] and "4 samples per length" in err[plan + 2]
    assert err[plan + 3].startswith("  niah_single_1  160 tokens: 2 samples per length")
    assert err[plan + 4].startswith("  estimated ~") and "GFLOP/s" in err[plan + 4]
    stages = err[plan + 5:]
    assert stages == ["ppl 1x,2x,4x: 2 samples ...", "phonebook 3 entries: 4 samples ...",
                      "phonebook 5 entries: 4 samples ...", "niah_single_1 160 tokens: 2 samples ..."], err
    assert main(["eval", "--checkpoint", str(run), "--output", str(out), *TASK_FLAGS, "--progress", "false"]) == 0
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_a_bar_per_length_with_samples_done(run, tmp_path, monkeypatch, capsys):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "e.json"), *TASK_FLAGS]) == 0
    text = tty.getvalue()
    assert "\x1b[" in text  # drawn in place
    for label, done in (("phonebook 3 entries", "4/4"), ("phonebook 5 entries", "4/4"),
                        ("niah_single_1 160 tokens", "2/2"), ("ppl 1x,2x,4x", "2/2")):
        assert label in text and done in text.split(label)[-1].split("\n")[0], label
    assert "phonebook 3 entries: 4 samples ..." not in text  # bars, not log lines
