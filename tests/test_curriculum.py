"""`--curriculum seqlen:...`: the length at each step follows the schedule, tokens per step stay constant, resume
mid-curriculum is exact, and every mixer (with --varlen) trains on the cut sequences as on separate ones."""

from __future__ import annotations

import math

import pytest
import torch

from archscale.cli import main
from archscale.errors import UserError
from archscale.train.curriculum import cut_batch, parse_curriculum
from tests.test_train import args, det, rows

# ctx 64, start 8, 8 steps: raw(s) = 8 + 56 s/8 (linear) or 8 + 56 sqrt(s/8) (root), rounded down to a divisor of 64
LINEAR = [8, 8, 16, 16, 32, 32, 32, 32, 64, 64]
ROOT = [8, 16, 32, 32, 32, 32, 32, 32, 64, 64]


def test_lengths_follow_the_schedule():
    lin = parse_curriculum("seqlen:start=8,steps=8", 64)
    root = parse_curriculum("seqlen:start=8,steps=8,schedule=root", 64)
    assert [lin.length_at(s) for s in range(10)] == LINEAR
    assert [root.length_at(s) for s in range(10)] == ROOT
    assert root.raw_length(2) == pytest.approx(8 + 56 * math.sqrt(2 / 8))
    # non-power-of-two context: finer steps (divisors of 96 >= 12: 12, 16, 24, 32, 48, 96)
    c = parse_curriculum("seqlen:start=12,steps=6", 96)
    assert [c.length_at(s) for s in range(7)] == [12, 24, 32, 48, 48, 48, 96]
    assert parse_curriculum("none", 64) is None


@pytest.mark.parametrize("spec,match", [
    ("seqlen", "use --curriculum none"), ("lengths:start=8,steps=2", "use --curriculum none"),
    ("seqlen:start=8", "start and steps must be integers"), ("seqlen:start=8,steps=2,pace=3", "bad item"),
    ("seqlen:start=8,steps=2,schedule=cubic", "linear or root"), ("seqlen:start=7,steps=2", "divides --ctx_len 64"),
    ("seqlen:start=128,steps=2", "divides"), ("seqlen:start=8,steps=0", "steps >= 1"),
])
def test_bad_specs_are_one_line_errors(spec, match):
    with pytest.raises(UserError, match=match):
        parse_curriculum(spec, 64)


def test_cut_batch_keeps_every_input_target_pair():
    batch = torch.arange(2 * 17).reshape(2, 17)
    x, y = cut_batch(batch, 4)
    assert x.shape == y.shape == (8, 4)
    assert torch.equal(y, x + 1)  # every target is its input's next token in the block
    assert sorted(x.flatten().tolist()) == sorted(batch[:, :-1].flatten().tolist())
    full_x, full_y = cut_batch(batch, 16)
    assert torch.equal(full_x, batch[:, :-1]) and torch.equal(full_y, batch[:, 1:])


@pytest.fixture
def input_shapes(monkeypatch):
    """The shape of every training forward's input (the model as the trainer builds it)."""
    import archscale.train.trainer as trainer
    from archscale.models.model import GPT

    seen: list[tuple[int, int]] = []

    class Recording(GPT):
        def forward(self, idx, *a, **k):
            if self.training and torch.is_grad_enabled():
                seen.append(tuple(idx.shape))
            return super().forward(idx, *a, **k)
    monkeypatch.setattr(trainer, "GPT", Recording)
    return seen


def curriculum_args(data, out, *extra):
    return args(data, out, "--max_tokens", "3072", "--curriculum", "seqlen:start=8,steps=8", "--eval_interval", "4",
                *extra)


def test_trainer_uses_the_schedule_with_constant_tokens_and_resumes_exactly(dataset, tmp_path, input_shapes):
    full = tmp_path / "full"
    assert main(curriculum_args(dataset, full, "--resume", "none")) == 0
    steps = [r for r in rows(full) if r["train_loss"]]
    assert [int(r["seq_len"]) for r in steps] == LINEAR + [64, 64]  # 12 steps of 256 tokens
    # 2 micro-batches per step of 2 x 64 tokens, cut into 128 / L sequences of L
    assert input_shapes == [(128 // L, L) for L in LINEAR + [64, 64] for _ in range(2)]
    assert [int(r["tokens"]) for r in steps] == [256 * s for s in range(1, 13)]  # constant tokens per step
    part = tmp_path / "part"
    assert main(curriculum_args(dataset, part, "--resume", "none", "--max_steps", "4", "--save_interval", "4")) == 0
    assert main(curriculum_args(dataset, part, "--resume", "auto")) == 0  # from step 4, mid-curriculum
    assert det(part) == det(full) and [r["seq_len"] for r in rows(part)] == [r["seq_len"] for r in rows(full)]
    plain = tmp_path / "plain"
    assert main(args(dataset, plain, "--resume", "none", "--max_tokens", "3072", "--eval_interval", "4")) == 0
    assert det(plain) != det(full)  # the curriculum changes training (a no-op cut would not)
    assert det(plain)[0] == det(full)[0]  # ... but not the init's validation (always at --ctx_len)


def test_bad_curriculum_flag_exits_2(dataset, tmp_path, capsys):
    assert main(args(dataset, tmp_path / "r", "--curriculum", "seqlen:start=7,steps=3")) == 2
    assert "divides --ctx_len 64" in capsys.readouterr().err


def test_every_mixer_trains_on_cut_sequences_as_on_separate_ones():
    """For every architecture, with --varlen documents: the trainer's cut batch gives, row for row, the logits of
    each length-L piece run on its own (nothing leaks across the cut), and a finite gradient for every parameter."""
    from archscale.config import ARCHITECTURES
    from archscale.train.config import PretrainConfig
    from archscale.train.trainer import make_forward
    from tests.test_architectures import tiny

    cfg = PretrainConfig(varlen=True)
    forward = make_forward(cfg, eos_id=0)
    for arch in sorted(ARCHITECTURES):
        torch.manual_seed(0)
        model = tiny(arch, block_size=32)
        from archscale.models.model import GPT

        model = GPT(model)
        batch = torch.randint(0, 97, (2, 33))
        batch[0, 5] = 0  # an EOS: a document boundary inside the first piece
        x, y = cut_batch(batch, 16)
        logits = forward(model, x)
        for i in range(x.shape[0]):
            alone = forward(model, x[i:i + 1])
            torch.testing.assert_close(logits[i:i + 1], alone, rtol=1e-4, atol=1e-5, msg=arch)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        assert math.isfinite(float(loss)), arch
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()), arch
