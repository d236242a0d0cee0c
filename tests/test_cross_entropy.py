"""Chunked linear cross-entropy against the plain path (logits -> F.cross_entropy).

Tolerance: relative 1e-6 (fp32) on the loss and on every gradient tensor as a whole (norm of the difference over
the norm of the reference); the two paths differ only in summation order.
"""

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.errors import UserError
from archscale.kernels.cross_entropy import chunked_linear_cross_entropy, default_chunk_rows, select_loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def plain(hidden, weight, targets, vocab, eps, ignore):
    logits = (hidden @ weight.T)[:, :vocab]  # as GPT.forward: padded rows sliced off
    return F.cross_entropy(logits.float(), targets, label_smoothing=eps, ignore_index=ignore)


@pytest.mark.parametrize("eps,ignore,chunk", [(0.0, -100, 7), (0.1, -100, 16), (0.1, 3, 5), (0.0, -1, 64)])
def test_chunked_equals_plain_loss_and_grads(eps, ignore, chunk):
    torch.manual_seed(0)
    N, d, vocab, padded = 50, 16, 37, 48
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(padded, d, requires_grad=True)
    t = torch.randint(0, vocab, (N,))
    t[::4] = ignore  # some ignored tokens (an in-vocab id when ignore_index >= 0)
    ref = plain(h, w, t, vocab, eps, ignore)
    gh_ref, gw_ref = torch.autograd.grad(ref * 1.7, (h, w))  # a non-unit incoming gradient
    got = chunked_linear_cross_entropy(h, w, t, vocab, eps, ignore, chunk_rows=chunk)
    gh, gw = torch.autograd.grad(got * 1.7, (h, w))
    assert abs(float(got.detach()) - float(ref.detach())) <= 1e-6 * abs(float(ref))
    assert rel_err(gh, gh_ref) <= 1e-6 and rel_err(gw, gw_ref) <= 1e-6
    assert torch.count_nonzero(gw[vocab:]) == 0  # padded rows: no gradient, as the sliced logits give


def test_chunked_without_grad_and_all_ignored():
    torch.manual_seed(1)
    h, w, t = torch.randn(9, 4), torch.randn(10, 4), torch.randint(0, 10, (9,))
    assert torch.allclose(chunked_linear_cross_entropy(h, w, t, 10), plain(h, w, t, 10, 0.0, -100), rtol=1e-6)
    t[:] = -100
    assert torch.isnan(chunked_linear_cross_entropy(h, w, t, 10)) and torch.isnan(plain(h, w, t, 10, 0.0, -100))


def test_gradients_are_handed_over_once_scaled_by_the_upstream_gradient():
    """The forward's gradient buffers are scaled in place (no second weight-sized copy): a loss scaled by 0.25
    (gradient accumulation) gives a quarter of the gradients, and a second backward is a clear error."""
    torch.manual_seed(0)
    h, w = torch.randn(16, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    t = torch.randint(0, 40, (16,))
    (0.25 * F.cross_entropy(h @ w.T, t)).backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss = chunked_linear_cross_entropy(h, w, t, 40, chunk_rows=4)
    (0.25 * loss).backward(retain_graph=True)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_default_chunk_holds_about_a_hidden_state_of_logits():
    rows = default_chunk_rows(8192, 200064, 2560)
    assert rows == 128 and rows * 200064 <= 2 * 8192 * 2560
    assert default_chunk_rows(3, 10, 100) == 4  # small vocab: one chunk (a power of two >= the rows)


@pytest.mark.parametrize("tie", [False, True])
def test_model_hidden_path_equals_logits_path(tie):
    """Through GPT: mu-P logit scale, padded vocab (vocab 100 -> 128 rows), label smoothing; every parameter's grad."""
    torch.manual_seed(2)
    cfg = ModelConfig.from_arch("transformer", 2, ar=8, vocab_size=100, logit_scale=0.37, tie_embeddings=tie,
                                block_size=32)
    assert cfg.padded_vocab_size == 128
    model = GPT(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # mu-P zero-inits an untied head; make the loss depend on it
    x = torch.randint(0, 100, (2, 17))
    y = torch.randint(0, 100, (2, 17))
    y[0, :3] = -100
    plain_fn, chunked_fn = select_loss("plain", 100), select_loss("chunked", 100)
    loss_p = plain_fn(model(x), y, 0.1)
    grads_p = torch.autograd.grad(loss_p, list(model.parameters()))
    out = model(x, return_hidden=True)
    assert out[0].shape == (2, 17, cfg.n_embd) and out[1] is model.lm_head.weight
    loss_c = chunked_fn(out, y, 0.1)
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()))
    assert abs(float(loss_c.detach()) - float(loss_p.detach())) <= 1e-6 * float(loss_p.detach())
    for (name, _), a, b in zip(model.named_parameters(), grads_c, grads_p):
        assert rel_err(a, b) <= 1e-6 or b.norm() == a.norm() == 0, name


def test_select_loss():
    assert select_loss("auto", 32000).name == "plain"
    assert select_loss("auto", 200064).name == "chunked" and select_loss("auto", 200064).wants_hidden
    assert select_loss("auto", 200064, zero3=True).name == "plain"
    assert select_loss("plain", 200064).name == "plain"
    with pytest.raises(UserError, match="--loss must be"):
        select_loss("fused", 100)
    with pytest.raises(UserError, match="zero_stage 3"):
        select_loss("chunked", 100, zero3=True)


@pytest.mark.slow
def test_training_with_chunked_loss_follows_the_plain_run(dataset, tmp_path, monkeypatch):
    """The trainer's --loss flag: 8 fp32 steps with label smoothing; chunked and plain losses agree to 1e-5
    relative at every step (rounding differences grow slowly through the updates)."""
    import csv

    from archscale.cli import main
    from archscale.kernels import cross_entropy

    calls = []
    real = cross_entropy.chunked_linear_cross_entropy
    monkeypatch.setattr(cross_entropy, "chunked_linear_cross_entropy", lambda *a: calls.append(1) or real(*a))

    def run(loss):
        out = tmp_path / loss
        argv = ["pretrain", "--train_data_dir", str(dataset), "--train_model", "transformer", "--depth", "1",
                "--ctx_len", "64", "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens", "2048",
                "--eval_iters", "0", "--log_interval", "1", "--out_dir", str(out), "--progress", "false",
                "--precision", "fp32", "--label_smoothing", "0.1", "--loss", loss, "--resume", "none"]
        assert main(argv) == 0
        with open(out / "metrics.csv", newline="") as f:
            return [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]

    plain_losses = run("plain")
    assert not calls
    chunked_losses = run("chunked")
    assert len(calls) == 16 and len(plain_losses) == 8  # 8 steps of 2 micro-batches
    for a, b in zip(chunked_losses, plain_losses):
        assert abs(a - b) <= 1e-5 * b, (chunked_losses, plain_losses)
