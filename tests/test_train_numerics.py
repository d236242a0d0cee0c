"""Numbers the trainer must get right, checked through `archscale pretrain`: gradient clipping (the global norm
the optimizer sees), label smoothing (the logged loss equals the formula) and --data_mixture (tokens per source
follow the weights)."""

import csv
import json
import math

import numpy as np
import pytest
import torch

from archscale.cli import main
from archscale.data.format import write_shard
from archscale.kernels import cross_entropy as losses


def run(data, out, *extra):
    argv = ["pretrain", "--train_data_dir", str(data), "--train_model", "transformer", "--depth", "1",
            "--ctx_len", "32", "--micro_bsz", "4", "--base_hps.b0", "128", "--max_tokens", "1280",
            "--base_hps.eta0", "3e-3", "--base_hps.warmup_tokens0", "128", "--eval_iters", "0",
            "--log_interval", "1", "--out_dir", str(out), "--progress", "false", "--precision", "fp32",
            "--resume", "none", *extra]
    assert main(argv) == 0


def rows(out):
    with open(out / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["train_loss"]]


def test_clipping_bounds_the_global_norm_the_optimizer_sees(dataset, tmp_path, monkeypatch):
    """post-clip norm = pre * min(1, 1 / (pre + 1e-6)) at every step (torch's clip_grad_norm_ rule, max 1.0); a
    high LR makes most steps clip, and the negative control (clipping removed) shows norms above 1 reach AdamW."""
    seen = []
    step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    run(dataset, tmp_path / "clip", "--base_hps.eta0", "0.05")
    pre = [float(r["grad_norm"]) for r in rows(tmp_path / "clip")]
    assert len(seen) == len(pre) == 10 and sum(p > 1 for p in pre) >= 3
    for s, p in zip(seen, pre):
        assert s == pytest.approx(p * min(1.0, 1.0 / (p + 1e-6)), rel=1e-5)
    seen.clear()
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None])))
    run(dataset, tmp_path / "noclip", "--base_hps.eta0", "0.05")
    assert max(seen) > 1.0 + 1e-3  # without clipping the optimizer does see norms above 1


def test_label_smoothing_loss_equals_the_formula(dataset, tmp_path, monkeypatch):
    """(1 - eps) * NLL + eps * mean over the vocab of -log p, on the logits of each micro-batch."""
    captured = []
    ce = losses.cross_entropy  # the plain loss the trainer calls (the C++ kernel on CPU, else F.cross_entropy)

    def spy(logits, target, label_smoothing=0.0, ignore_index=-100, **k):
        loss = ce(logits, target, label_smoothing, ignore_index, **k)
        if label_smoothing and logits.requires_grad:
            logp = torch.log_softmax(logits.detach().double(), dim=-1)
            nll = -logp.gather(-1, target[:, None]).squeeze(-1)
            captured.append((float(loss.detach()), float(((1 - 0.1) * nll - 0.1 * logp.mean(-1)).mean())))
        return loss

    monkeypatch.setattr(losses, "cross_entropy", spy)
    run(dataset, tmp_path / "ls", "--label_smoothing", "0.1")
    assert len(captured) >= 10
    for got, want in captured:
        assert got == pytest.approx(want, rel=1e-6)


def test_data_mixture_weights_tokens_per_source(tmp_path, monkeypatch):
    """Two sources with disjoint token ranges: the share of tokens the trainer draws from each is within 2% of
    the mixture weights (0.75 / 0.25)."""
    data = tmp_path / "mix"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        write_shard(data / f"alpha_{i:010d}.bin", rng.integers(1, 100, 20000), np.uint16)
        write_shard(data / f"beta_{i:010d}.bin", rng.integers(100, 200, 20000), np.uint16)
    (data / "manifest.json").write_text(json.dumps({"vocab_size": 256, "eos_id": 0, "dtype": "uint16"}))
    (tmp_path / "mix.json").write_text(json.dumps({"alpha": 3, "beta": 1}))
    from archscale.data import loader
    counts = {"alpha": 0, "beta": 0}
    nxt = loader.GlobalOrderLoader.__next__

    def spy(self):
        batch = nxt(self)
        for row in batch:
            counts["alpha" if int(row.max()) < 100 else "beta"] += row.numel()
            assert int(row.max()) < 100 or int(row.min()) >= 100  # a sample comes from one source
        return batch

    monkeypatch.setattr(loader.GlobalOrderLoader, "__next__", spy)
    run(data, tmp_path / "out", "--data_mixture", str(tmp_path / "mix.json"), "--ctx_len", "8", "--micro_bsz", "64",
        "--base_hps.b0", "4096", "--max_tokens", "49152")  # 6144 samples: the share's sampling std is 0.0055
    share = counts["alpha"] / (counts["alpha"] + counts["beta"])
    assert abs(share - 0.75) < 0.02, counts
