"""The trainer's promises under trouble: a non-finite step is never applied or saved, one process per run dir, a
resume that cannot fit says why before touching the run dir, foreign shards train with --varlen --eos_id."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from archscale.cli import main
from archscale.models.model import GPT
from tests.test_train import args, det, rows

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


# ---------------------------------------------------------------- non-finite steps

class _Poisoned(GPT):
    """GPT whose n-th training forward (1-based, counted over micro-batches) is made non-finite: "grad" keeps the
    loss finite but makes every gradient NaN (the grad norm is the first to know), "loss" makes the loss NaN."""

    poison: dict[int, str] = {}
    calls = 0

    def forward(self, *a, **k):
        out = super().forward(*a, **k)
        if self.training and torch.is_grad_enabled():
            type(self).calls += 1
            how = self.poison.get(type(self).calls)
            if how == "grad":
                out.register_hook(lambda g: torch.full_like(g, float("nan")))
            elif how == "loss":
                out = out * float("nan")
        return out


@pytest.fixture
def poison(monkeypatch):
    """poison(step, how) for 2 micro-batches per step (the args() runs: 256-token batches of 2 x 64)."""
    import archscale.train.trainer as trainer

    _Poisoned.calls, _Poisoned.poison = 0, {}
    monkeypatch.setattr(trainer, "GPT", _Poisoned)

    def at(step: int, how: str = "grad", micro: int = 2):
        _Poisoned.poison[2 * (step - 1) + micro] = how
    return at


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    from archscale.runs import load_run

    return {k: v.clone() for k, v in load_run(step_dir).model.state_dict().items()}


def checkpoint_names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())


@pytest.mark.parametrize("how", ["grad", "loss"])
def test_nonfinite_step_stops_exit_3_and_saves_nothing(dataset, tmp_path, capsys, poison, how):
    run = tmp_path / "run"
    poison(5, how)
    assert main(args(dataset, run, "--resume", "none", "--save_interval", "2", "--keep_last", "0")) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "step 5" in err and "step-00000004" in err and "not applied" in err, err
    assert checkpoint_names(run) == ["step-00000002", "step-00000004"]  # nothing from step 5 on
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert max(int(r["step"]) for r in rows(run)) == 4


def test_nonfinite_step_leaves_weights_and_optimizer_untouched(dataset, tmp_path, poison):
    """train_step itself: the update of a step whose gradients are NaN is not applied (weights and AdamW
    moments bitwise equal before and after), and the next finite step is applied."""
    from archscale.cli import parse_pretrain
    from archscale.train.distributed import DistEnv
    from archscale.train.trainer import Trainer

    cfg, explicit = parse_pretrain(args(dataset, tmp_path / "unit", "--resume", "none")[1:])
    trainer = Trainer(cfg, explicit, DistEnv(), log=lambda m: None)
    try:
        state = trainer.state
        trainer.train_step(state, trainer.loader)  # step 1: the optimizer has moments now
        model, opt = trainer.strategy.model, trainer.strategy.optimizer

        def snapshot():
            return ([p.detach().clone() for p in model.parameters()],
                    [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])
        before = snapshot()
        poison(2, "grad")
        result = trainer.train_step(state, trainer.loader)
        assert not result.applied and math.isnan(result.grad_norm) and math.isfinite(result.train_loss)
        after = snapshot()
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
        assert all(p.grad is None for p in model.parameters())  # the NaN gradients were dropped
        result = trainer.train_step(state, trainer.loader)
        assert result.applied and math.isfinite(result.grad_norm) and state.step == 3
        assert not all(torch.equal(a, p) for a, p in zip(before[0], model.parameters()))
    finally:
        trainer.close()


def test_nonfinite_skip_continues_and_gives_up_after_max(dataset, tmp_path, capsys, poison):
    run = tmp_path / "skip"
    poison(5, "loss")
    assert main(args(dataset, run, "--resume", "none", "--max_steps", "8", "--save_interval", "1",
                     "--keep_last", "0", "--nonfinite", "skip")) == 0
    out = capsys.readouterr().out
    assert "step 5: non-finite loss (nan)" in out and "skipped (1 in a row" in out, out
    w4, w5, w6 = (weights(run / "checkpoints" / f"step-0000000{s}") for s in (4, 5, 6))
    assert all(torch.equal(w4[k], w5[k]) for k in w4)  # the skipped step changed nothing
    assert not all(torch.equal(w5[k], w6[k]) for k in w5)  # and training went on
    assert all(torch.isfinite(v).all() for v in w6.values())
    assert [int(r["step"]) for r in rows(run)][-1] == 8

    # three in a row with --nonfinite_max 2: give up at the third, exit 3, last good checkpoint named
    again = tmp_path / "again"
    _Poisoned.calls = 0
    for s in (3, 4, 5):
        poison(s, "grad")
    assert main(args(dataset, again, "--resume", "none", "--save_interval", "1", "--nonfinite", "skip",
                     "--nonfinite_max", "2")) == 3
    err = capsys.readouterr().err.strip()
    assert "3 non-finite steps in a row" in err and "step 5" in err and len(err.splitlines()) == 1, err
    assert (again / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_nonfinite_flags_are_checked(dataset, tmp_path, capsys):
    assert main(args(dataset, tmp_path / "r", "--nonfinite", "ignore")) == 2
    assert "--nonfinite must be stop or skip" in capsys.readouterr().err
    assert main(args(dataset, tmp_path / "r", "--nonfinite_max", "0")) == 2
    assert "--nonfinite_max must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- one process per run dir

_HOLDER = """
import os, sys, time
from pathlib import Path
from archscale.cli import parse_pretrain
from archscale.train.trainer import pretrain
ready = Path(sys.argv[1])
def hold(step):
    if step == 1:
        ready.write_text(str(os.getpid()))
        time.sleep(120)  # the parent kills us long before
cfg, explicit = parse_pretrain(sys.argv[2:])
pretrain(cfg, explicit, on_step=hold)
"""


def test_second_process_on_a_run_dir_is_refused_and_a_dead_holder_is_taken_over(dataset, tmp_path, capsys):
    run, ready = tmp_path / "run", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(ready), *args(dataset, run, "--resume", "none")[1:]],
                              env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert holder.poll() is None, holder.stderr.read().decode()
            assert time.monotonic() < deadline, "the holder never reached step 1"
            time.sleep(0.1)
        config_before = (run / "config.yaml").read_bytes()
        assert main(args(dataset, run, "--resume", "auto")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"process {holder.pid}" in err and ".lock" in err, err
        assert (run / "config.yaml").read_bytes() == config_before  # the refused run wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run / ".lock").read_text().strip() == str(holder.pid)  # a stale lock file of a dead process
    assert main(args(dataset, run, "--resume", "auto")) == 0  # ... is taken over
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000025"


# ---------------------------------------------------------------- resume that cannot fit

def _tree(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


@pytest.mark.parametrize("change,fields", [
    (["--depth", "2"], ["n_layer", "n_embd"]),
    (["--train_model", "samba"], ["arch"]),
])
def test_resume_with_another_model_names_the_fields_and_writes_nothing(dataset, tmp_path, capsys, change, fields):
    run = tmp_path / "run"
    assert main(args(dataset, run, "--resume", "none", "--max_steps", "2")) == 0
    before = _tree(run)
    capsys.readouterr()
    assert main(args(dataset, run, "--resume", "auto", *change)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "model differs" in err and all(f in err for f in fields), err
    assert _tree(run) == before  # not even config.yaml was rewritten


def test_resume_with_another_batch_names_what_differs(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(args(dataset, run, "--resume", "none", "--max_steps", "2")) == 0
    before = _tree(run)
    capsys.readouterr()
    assert main(args(dataset, run, "--resume", "auto", "--base_hps.b0", "512")) == 2
    err = capsys.readouterr().err.strip()
    assert "256-token batches" in err and "512" in err and "--base_hps.b0 256 -> 512" in err, err
    assert "world size" not in err, err  # the world size did not change: do not blame it
    assert _tree(run) == before


# ---------------------------------------------------------------- --varlen on shards without a manifest

def test_varlen_eos_id_for_shards_without_manifest(dataset, tmp_path, capsys):
    import json
    import shutil

    import numpy as np

    # an EOS id that occurs in the data, so the documents (and the losses) depend on it
    eos = int(np.random.default_rng(0).integers(1, 256, size=500)[0])  # make_dataset's pattern starts with it
    ours = tmp_path / "ours"
    shutil.copytree(dataset, ours)
    manifest = json.loads((ours / "manifest.json").read_text())
    (ours / "manifest.json").write_text(json.dumps({**manifest, "eos_id": eos}))
    foreign = tmp_path / "foreign"
    shutil.copytree(dataset, foreign)
    (foreign / "manifest.json").unlink()  # lit-gpt / TinyLlama style shards
    flags = ["--resume", "none", "--varlen", "--max_steps", "5", "--vocab_size", "256"]
    assert main(args(foreign, tmp_path / "no_eos", *flags)) == 2
    assert "--eos_id" in capsys.readouterr().err
    assert main(args(foreign, tmp_path / "foreign_run", *flags, "--eos_id", str(eos))) == 0
    assert main(args(ours, tmp_path / "manifest_run", *flags)) == 0
    assert det(tmp_path / "foreign_run") == det(tmp_path / "manifest_run")
    assert main(args(foreign, tmp_path / "other_eos", *flags, "--eos_id", str(eos + 1))) == 0
    assert det(tmp_path / "other_eos") != det(tmp_path / "foreign_run")  # the flag is really used
    # an --eos_id that contradicts the manifest is refused
    assert main(args(ours, tmp_path / "clash", *flags, "--eos_id", str(eos + 1))) == 2
    assert f"eos_id {eos}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_rank_group(deepspeed_one_rank_group):
    """DeepSpeed's one-process group, shared by this module's runs (tests/conftest.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["0", "2"])
def test_nonfinite_step_under_deepspeed_is_skipped_by_the_engine(one_rank_group, dataset, tmp_path, capsys, poison,
                                                                 zero_stage, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run = tmp_path / "ds"
    poison(3, "grad")
    assert main(args(dataset, run, "--resume", "none", "--save_interval", "2", "--max_steps", "6", "--keep_last", "0",
                     "--strategy", "deepspeed", "--zero_stage", zero_stage, "--nonfinite", "skip")) == 0
    assert "step 3: non-finite gradient norm" in capsys.readouterr().out
    w2, w3 = (weights(run / "checkpoints" / f"step-0000000{s}") for s in (2, 4))
    assert all(torch.isfinite(v).all() for v in w3.values()) and not all(torch.equal(w2[k], w3[k]) for k in w2)
