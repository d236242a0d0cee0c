"""fp16-mixed with dynamic loss scaling, natively (torch.amp.GradScaler) and through DeepSpeed's scaler: an
overflow skips the step and halves the scale, the scale doubles after --fp16_scale_window clean steps, the scaler
state is checkpointed (resume is bitwise), and the non-finite guard treats an overflow as a skipped step."""

from __future__ import annotations

import math

import pytest
import torch

from archscale.cli import main
from archscale.models.model import GPT
from tests.test_train import args, det, rows

S0 = 2.0 ** 16  # both scalers' initial scale


class _Overflowing(GPT):
    """GPT whose training forwards listed in `at` (1-based, over micro-batches) get infinite logit gradients: an
    fp16 overflow as a too-large loss scale makes it."""

    at: set[int] = set()
    calls = 0

    def forward(self, *a, **k):
        out = super().forward(*a, **k)
        if self.training and torch.is_grad_enabled():
            type(self).calls += 1
            if type(self).calls in self.at:
                out.register_hook(lambda g: torch.full_like(g, float("inf")))
        return out


@pytest.fixture
def overflow(monkeypatch):
    """overflow(step): the last micro-batch of that optimizer step overflows (args(): 2 micro-batches a step)."""
    import archscale.train.trainer as trainer

    _Overflowing.calls, _Overflowing.at = 0, set()
    monkeypatch.setattr(trainer, "GPT", _Overflowing)

    def at(step: int) -> None:
        _Overflowing.at.add(2 * step)
    return at


def fp16_args(data, out, *extra):
    return args(data, out, "--precision", "fp16-mixed", "--fp16_scale_window", "3", "--max_tokens", "2048",
                "--eval_interval", "4", *extra)


def scales(run) -> list[float]:
    return [float(r["loss_scale"]) for r in rows(run) if r["train_loss"]]


# Overflow at step 2 (halve, tracker reset), clean steps 3, 4, 5 (double after the third), 6, 7, 8.
EXPECTED = [S0, S0 / 2, S0 / 2, S0 / 2, S0, S0, S0, 2 * S0]


def test_native_overflow_skips_the_step_halves_the_scale_and_leaves_the_weights(dataset, tmp_path, overflow):
    from archscale.cli import parse_pretrain
    from archscale.train.distributed import DistEnv
    from archscale.train.trainer import Trainer

    cfg, explicit = parse_pretrain(fp16_args(dataset, tmp_path / "unit", "--resume", "none")[1:])
    trainer = Trainer(cfg, explicit, DistEnv(), log=lambda m: None)
    try:
        state, strategy = trainer.state, trainer.strategy
        assert strategy.scaler is not None and strategy.scaler.get_growth_interval() == 3
        trainer.train_step(state, trainer.loader)
        model, opt = strategy.model, strategy.optimizer
        before = [p.detach().clone() for p in model.parameters()]
        moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
        overflow(2)
        result = trainer.train_step(state, trainer.loader)
        assert result.overflow and not result.applied and not math.isfinite(result.grad_norm)
        assert result.finite  # the guard's view: a skipped fp16 step, not a divergence
        assert strategy.loss_scale() == S0 / 2
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.equal(m[k], opt.state[p][k]) for m, p in zip(moments, model.parameters()) for k in m)
        result = trainer.train_step(state, trainer.loader)
        assert result.applied and not result.overflow and strategy.loss_scale() == S0 / 2
    finally:
        trainer.close()


def test_native_scale_trajectory_guard_and_bitwise_resume(dataset, tmp_path, overflow):
    full = tmp_path / "full"
    overflow(2)
    # --nonfinite stop (the default) would exit 3 on a divergence: the overflow must not count as one
    assert main(fp16_args(dataset, full, "--resume", "none")) == 0
    assert scales(full) == EXPECTED
    part = tmp_path / "part"
    _Overflowing.calls = 0
    assert main(fp16_args(dataset, part, "--resume", "none", "--max_steps", "4", "--save_interval", "4")) == 0
    _Overflowing.at = set()  # the resumed process counts forwards from 1 again; the overflow is behind us
    assert main(fp16_args(dataset, part, "--resume", "auto")) == 0
    # step 5 doubles the scale only if the resumed scaler remembered its 2 clean steps since the overflow
    assert scales(part) == EXPECTED and det(part) == det(full)


@pytest.fixture(scope="module")
def one_rank_group(deepspeed_one_rank_group):
    """DeepSpeed's one-process group, shared by this module's runs (tests/conftest.py)."""


def _deepspeed_fp16_available() -> bool:
    try:
        return bool(torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def deepspeed_rule(overflow_steps: list[int], window: int, steps: int) -> list[float]:
    """DeepSpeed's DynamicLossScaler with hysteresis 1, step by step: halve on an overflow; otherwise double when
    the clean steps before this one since the last overflow are a positive multiple of `window` (so it doubles
    one step after GradScaler would: at the 4th clean step after an overflow with window 3, not the 3rd)."""
    scale, last, out = S0, -1, []
    for it in range(steps):
        if it + 1 in overflow_steps:
            scale, last = scale / 2, it
        elif (it - last - 1) > 0 and (it - last - 1) % window == 0:
            scale *= 2
        out.append(scale)
    return out


def test_deepspeed_rule_helper():
    assert deepspeed_rule([2], 3, 8) == [S0, S0 / 2, S0 / 2, S0 / 2, S0 / 2, S0, S0, S0]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["0", "2"])
def test_deepspeed_scaler_overflow_growth_and_bitwise_resume(one_rank_group, dataset, tmp_path, overflow, zero_stage,
                                                             monkeypatch):
    """Through DeepSpeed's loss scaler (hysteresis 1, loss_scale_window 3); its state lives in DeepSpeed's
    checkpoint."""
    if not _deepspeed_fp16_available():
        pytest.skip("DeepSpeed's CPU accelerator has no fp16 on this CPU (no oneDNN fp16)")
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds = ["--strategy", "deepspeed", "--zero_stage", zero_stage]
    full = tmp_path / "full"
    overflow(2)
    assert main(fp16_args(dataset, full, "--resume", "none", *ds)) == 0
    got = scales(full)
    skipped = [int(r["step"]) for r in rows(full) if r["train_loss"] and not math.isfinite(float(r["grad_norm"]))]
    assert 2 in skipped  # ZeRO-2's fp16 gradients also overflow by themselves at 2**16 on step 1 here
    assert got == deepspeed_rule(skipped, window=3, steps=8), (got, skipped)
    part = tmp_path / "part"
    _Overflowing.calls = 0
    assert main(fp16_args(dataset, part, "--resume", "none", "--max_steps", "4", "--save_interval", "4", *ds)) == 0
    _Overflowing.at = set()
    assert main(fp16_args(dataset, part, "--resume", "auto", *ds)) == 0
    assert scales(part) == got and det(part) == det(full)
