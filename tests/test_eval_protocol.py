"""Evaluation that means what ArchScale's means: `ppl` equals the run's own logged validation loss (document masking
for --varlen runs), and the `--protocol archscale` settings (validation sample selection, extrapolation factors,
Phonebook books and strict scoring) against ArchScale's definitions reimplemented here from its source."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from archscale.cli import main
from tests.test_train import rows
from tests.test_varlen import EOS, docs_dataset


def _train(tmp: Path, varlen: bool) -> Path:
    data = docs_dataset(tmp / "data", doc_len=(10, 60), n_tokens=12000)
    argv = ["pretrain", "--train_data_dir", str(data), "--train_model", "transformer", "--depth", "1",
            "--ctx_len", "64", "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens", "1024",
            "--base_hps.warmup_tokens0", "256", "--eval_iters", "3", "--eval_interval", "100",
            "--out_dir", str(tmp / "run"), "--progress", "false", "--precision", "fp32", "--resume", "none"]
    if varlen:
        argv += ["--varlen", "--reset_position_ids"]
    assert main(argv) == 0
    return tmp / "run"


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "plain"])
def test_ppl_equals_the_runs_logged_validation_loss(tmp_path, varlen):
    """The same blocks (ctx + 1 tokens, micro_bsz per batch, eval_iters batches) give the trainer's val_loss at the
    last step; on a --varlen run only the document-masked forward does (the plain one differs by > 1e-3)."""
    import torch

    from archscale.eval.loading import load_eval_model
    from archscale.eval.ppl import validation_extrapolation

    run = _train(tmp_path, varlen)
    logged = [float(r["val_loss"]) for r in rows(run) if r["val_loss"]][-1]
    out = tmp_path / "e.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--extrapolation", "1", "--batch_size", "2",
                 "--ppl_max_batches", "3", "--output", str(out), "--device", "cpu"]) == 0
    v = json.loads(out.read_text())["results"]["ppl"]["validation"]
    assert v["1x"]["loss"] == pytest.approx(logged, rel=1e-6, abs=1e-6)
    assert v["masking"] == (f"documents (eos_id {EOS})" if varlen else "none")
    em = load_eval_model(run, device="cpu", need_tokenizer=False)
    em.forward = lambda model, x: model(x)  # what `eval` did before it read the run's masking
    plain = validation_extrapolation(em, tmp_path / "data", [1], 2, 3)["1x"]["loss"]
    if varlen:
        assert abs(plain - logged) > 1e-3, (plain, logged)
    else:
        assert plain == pytest.approx(logged, rel=1e-6)
