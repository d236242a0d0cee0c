"""`archscale eval` / `archscale report` end to end on a tiny trained checkpoint: extrapolation numbers against a
direct computation, every task through the CLI, the report PNG, and one-line errors."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from archscale.cli import main

ESSAY = Path(__file__).resolve().parents[1] / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step transformer_d1 run (ctx 32) on Areopagitica with its own BPE tokenizer recorded in the manifest."""
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("evalrun")
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


def rewrite_config(step, cfg):
    """Edit a checkpoint's config.yaml and keep its COMPLETE marker's recorded size and sha256 in step (an
    internally consistent checkpoint whose config no longer fits its weights)."""
    import hashlib

    (step / "config.yaml").write_text(yaml.safe_dump(cfg))
    marker = json.loads((step / "COMPLETE").read_text())
    if "config.yaml" in marker.get("files", {}):
        data = (step / "config.yaml").read_bytes()
        marker["files"]["config.yaml"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (step / "COMPLETE").write_text(json.dumps(marker))


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return [line for line in err if line.startswith("error:")]


def test_extrapolation_2x_equals_direct_computation(run, tmp_path):
    from archscale.data.loader import validation_batches
    from archscale.eval.generate import load_model

    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--extrapolation", "1,2", "--batch_size", "2",
                 "--ppl_max_batches", "2", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    v = doc["results"]["ppl"]["validation"]
    assert doc["train_length"] == 32 and v["1x"]["context"] == 32 and v["2x"]["context"] == 64
    assert v["samples"] == 4 and v["2x"]["tokens"] == 4 * 64
    model, cfg = load_model(run)
    sums = {1: 0.0, 2: 0.0}
    with torch.no_grad():
        for b in validation_batches(Path(cfg["pretrain"]["train_data_dir"]), block_size=65, micro_bsz=2, max_batches=2):
            for k in (1, 2):  # an independent forward on each prefix (no reliance on causality)
                x, y = b[:, :32 * k], b[:, 1:32 * k + 1]
                sums[k] += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
    assert v["1x"]["loss"] == pytest.approx(sums[1] / (4 * 32), rel=1e-5)
    assert v["2x"]["loss"] == pytest.approx(sums[2] / (4 * 64), rel=1e-5)
    assert v["2x"]["ppl"] == pytest.approx(torch.tensor(v["2x"]["loss"]).exp().item(), rel=1e-6)


def test_sliding_window_file_ppl(run, tmp_path):
    from archscale.eval.loading import load_eval_model
    from archscale.eval.ppl import sliding_window_ppl

    text = "They, who to states and governors of the Commonwealth direct their speech."
    f = tmp_path / "t.txt"
    f.write_text(text)
    em = load_eval_model(run, device="cpu")
    ids = [em.tokenizer.eos_id] + em.tokenizer.encode(text, eos=False)
    assert len(ids) <= 64
    whole = sliding_window_ppl(em, str(f), window=64, stride=64)  # one window: a plain forward pass
    with torch.no_grad():
        x = torch.tensor([ids])
        direct = float(F.cross_entropy(em.model(x[:, :-1])[0], x[0, 1:], reduction="mean"))
    assert whole["tokens"] == len(ids) - 1 and whole["loss"] == pytest.approx(direct, rel=1e-5)
    slid = sliding_window_ppl(em, str(f), window=8, stride=4)
    assert slid["tokens"] == len(ids) - 1 and slid["loss"] != pytest.approx(direct, rel=1e-6)


@pytest.mark.slow
def test_cli_all_tasks_then_report(run, tmp_path, capsys):
    out = tmp_path / "all.json"
    argv = ["eval", "--checkpoint", str(run), "--tasks", "ppl,phonebook,niah_single_1,lm_eval:archscale_mc",
            "--output", str(out), "--min_eval_len", "3", "--max_eval_len", "5", "--eval_len_step", "2",
            "--phonebook_batch_size", "1", "--max_seq_lengths", "160", "--niah_samples", "2",
            "--lm_eval_limit", "4", "--ppl_max_batches", "1"]
    # phonebook (~180 tokens) and NIAH (160) are beyond 4x the training length (128): a one-line error, before
    # any task runs, until --max_length allows them
    assert main(argv) == 2
    (err,) = error_line(capsys)
    assert "4x the training length 32" in err and "--max_length" in err and not out.exists()
    assert main(argv + ["--max_length", "512"]) == 0
    doc = json.loads(out.read_text())
    r = doc["results"]
    assert set(r) == {"ppl", "phonebook", "niah_single_1", "lm_eval"}
    assert doc["checkpoint"].endswith("step-00000003") and doc["step"] == 3 and doc["model"]["n_layer"] == 1
    assert doc["settings"]["tasks"].startswith("ppl") and doc["tokenizer"].endswith("tok.json")
    assert set(r["phonebook"]["lengths"]) == {"3", "5"} and r["phonebook"]["lengths"]["3"]["samples"] == 4
    assert 0.0 <= r["niah_single_1"]["lengths"]["160"]["score"] <= 1.0
    assert 0.0 <= r["lm_eval"]["tasks"]["archscale_mc"]["acc"] <= 1.0
    png = tmp_path / "summary.png"
    assert main(["report", str(out), str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("case", ["missing", "unknown_task", "too_long", "mismatch", "no_config", "no_tokenizer",
                                  pytest.param("unknown_lm_eval_task", marks=pytest.mark.slow)])
def test_one_line_errors(run, tmp_path, capsys, case):
    out = tmp_path / "r.json"
    ckpt = run
    tasks = "ppl"
    extra = []
    if case == "missing":
        ckpt = tmp_path / "nope"
    elif case == "unknown_task":
        tasks = "ppl,bogus"
    elif case == "unknown_lm_eval_task":
        tasks = "lm_eval:no_such_task_anywhere"
    elif case == "too_long":
        extra = ["--extrapolation", "1,8"]
    else:
        copy = tmp_path / "copy"
        shutil.copytree(run, copy)
        step = next((copy / "checkpoints").glob("step-*"))
        cfg = yaml.safe_load((step / "config.yaml").read_text())
        if case == "mismatch":
            cfg["model"]["n_embd"] *= 2
            rewrite_config(step, cfg)
        elif case == "no_config":
            (step / "config.yaml").unlink()
        else:  # the tokenizer comes from the data manifest; ppl on shards needs none, phonebook does
            cfg["pretrain"]["train_data_dir"] = str(tmp_path / "gone")
            rewrite_config(step, cfg)
            tasks = "phonebook"
        ckpt = copy
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", tasks, "--output", str(out), *extra]) == 2
    errs = error_line(capsys)
    assert len(errs) == 1 and "\n" not in errs[0]
    expect = {"missing": "no such file", "unknown_task": "unknown task 'bogus'",
              "unknown_lm_eval_task": "no_such_task_anywhere", "too_long": "--extrapolation 8x",
              "mismatch": "do not match its saved config (ValueError: Size mismatch", "no_config": "missing file config.yaml",
              "no_tokenizer": "--tokenizer"}[case]
    assert expect in errs[0], errs[0]
    assert not out.exists()
