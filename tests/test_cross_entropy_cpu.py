"""kernels/cross_entropy.py's plain loss (`cross_entropy`): the C++ kernel (where it built) and torch's path
against F.cross_entropy in float64 (an oracle neither shares), values within 1e-6 relative and gradients within
1e-6 of their largest entry; label smoothing, ignored tokens, strided rows (a sliced padded vocab), bf16 logits,
an upstream gradient other than 1, and the same result on 1 and 2 threads."""

import pytest
import torch
import torch.nn.functional as F

from archscale.kernels import scan_cpu
from archscale.kernels.cross_entropy import CROSS_ENTROPY, cross_entropy

IMPLS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not scan_cpu.available(),
                                                                 reason="the CPU kernel did not build"))]


def problem(n=67, v=301, seed=0, ignore=None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen) * 4
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore is not None:
        targets[::5] = ignore
    return logits, targets


def loss_and_grad(fn, logits, targets, upstream=1.0, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, targets, **kw)
    (loss * upstream).backward()
    return loss.detach().double(), x.grad.double()


def oracle(logits, targets, upstream=1.0, label_smoothing=0.0, ignore_index=-100):
    return loss_and_grad(lambda x, t: F.cross_entropy(x.double(), t, label_smoothing=label_smoothing,
                                                      ignore_index=ignore_index), logits, targets, upstream)


def assert_matches(got, want):
    (loss, grad), (want_loss, want_grad) = got, want
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    assert (grad - want_grad).abs().max() <= 1e-6 * want_grad.abs().max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [None, -100, 7])
@pytest.mark.parametrize("upstream", [1.0, 0.37])
def test_matches_float64_loss_and_grads(impl, eps, ignore, upstream):
    logits, targets = problem(ignore=ignore)
    kw = dict(label_smoothing=eps, ignore_index=-100 if ignore is None else ignore)
    got = loss_and_grad(lambda x, t, **k: cross_entropy(x, t, impl=impl, **k), logits, targets, upstream, **kw)
    assert_matches(got, oracle(logits, targets, upstream, **kw))


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_rows_and_bf16(impl):
    logits, targets = problem(v=320)
    targets = targets % 300
    sliced = lambda x, t: cross_entropy(x[:, :300], t, impl=impl)  # noqa: E731  (a padded vocab sliced off)
    got = loss_and_grad(sliced, logits, targets)
    want = loss_and_grad(lambda x, t: F.cross_entropy(x[:, :300].double(), t), logits, targets)
    assert_matches(got, want)
    assert got[1][:, 300:].abs().max() == 0
    half = logits.bfloat16()
    got = loss_and_grad(lambda x, t: cross_entropy(x, t, impl=impl), half, targets)
    want = loss_and_grad(lambda x, t: F.cross_entropy(x.double(), t), half, targets)
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    assert (got[1] - want[1]).abs().max() <= 1e-2 * want[1].abs().max()  # the gradient comes back in bf16


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_kernel_is_auto_on_cpu_and_thread_count_invariant():
    logits, targets = problem(n=513, v=1000)
    assert CROSS_ENTROPY.resolve(logits=logits) == "cpu"
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(loss_and_grad(lambda x, t: cross_entropy(x, t, impl="cpu"), logits, targets))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_kernel_edge_cases():
    logits, targets = problem()
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, impl="cpu")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    bad = targets.clone()
    bad[3] = logits.shape[1]
    with pytest.raises(RuntimeError, match="out of bounds"):
        cross_entropy(logits, bad, impl="cpu")
    ignored = torch.full_like(targets, -100)
    assert torch.isnan(cross_entropy(logits, ignored, impl="cpu"))  # as F.cross_entropy
