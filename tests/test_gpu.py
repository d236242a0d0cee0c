"""CUDA-only checks (`make test-gpu`, and `benchmarks/gpu_check.sh`, whose built-in runner executes them where
pytest is not installed: so no fixtures here, only marks). On a CPU machine every test is skipped.

Reference for attention: the SDPA paths (`ARCHSCALE_ATTN_IMPL=sdpa`: dense block-diagonal masks), themselves
tested against explicit softmax on CPU. Tolerances: fp32 1e-4, bf16 2e-2 absolute (stated per test).
"""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.kernels import attention as attention_kernel
from archscale.kernels.attention import attend
from archscale.kernels.cross_entropy import chunked_linear_cross_entropy

CASES = {  # name: (H, G, window, document lengths per row or None)
    "docs": (4, 4, 0, [[100, 200, 73], [373]]),
    "window": (4, 4, 50, None),
    "docs+window": (4, 4, 64, [[30, 300, 43], [120, 253]]),
    "gqa+docs": (4, 2, 0, [[1, 371, 1], [200, 173]]),
    "gqa+docs+window": (6, 2, 40, [[90, 90, 193], [373]]),
}


@contextlib.contextmanager
def attn_impl(name):
    old = os.environ.get("ARCHSCALE_ATTN_IMPL")
    os.environ["ARCHSCALE_ATTN_IMPL"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ARCHSCALE_ATTN_IMPL")
        else:
            os.environ["ARCHSCALE_ATTN_IMPL"] = old


def docs_of(lengths_per_row):
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(r)]) for r in lengths_per_row]).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attend_forward_backward_matches_sdpa_reference(name, dtype):
    """attend on CUDA (FlexAttention, or flash-attn varlen where installed) vs the SDPA dense-mask path: outputs
    and q/k/v gradients; fp32 1e-4, bf16 2e-2 absolute."""
    H, G, window, lengths = CASES[name]
    torch.manual_seed(4)
    B, T = 2, 373
    base = [torch.randn(B, n, T, 64, device="cuda", dtype=dtype) for n in (H, G, G)]
    docs = docs_of(lengths) if lengths else None
    results = []
    for impl in ("auto", "sdpa"):
        with attn_impl(impl):
            q, k, v = (t.clone().requires_grad_() for t in base)
            out = attend(q, k, v, scale=0.125, window=window, q_docs=docs, k_docs=docs)
            out.float().square().sum().backward()
            results.append([out, q.grad, k.grad, v.grad])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_long_document_mask_builds_no_dense_mask():
    """At 8K positions with documents (and a window), the CUDA path never calls the dense-mask or per-document code."""
    def refuse(*a, **kw):
        raise AssertionError("dense / per-document path used on CUDA")

    saved = attention_kernel.attention_mask, attention_kernel._per_document
    attention_kernel.attention_mask = attention_kernel._per_document = refuse
    try:
        T = 8192
        q, k, v = (torch.randn(1, 4, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        docs = (torch.arange(T, device="cuda") // 1000)[None]
        for window in (0, 512):
            attend(q, k, v, scale=0.125, window=window, q_docs=docs, k_docs=docs).sum().backward()
        attend(q, k, v, scale=0.125, window=512).sum().backward()
    finally:
        attention_kernel.attention_mask, attention_kernel._per_document = saved


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["transformerls", "sambayda"])
def test_cuda_varlen_model_matches_sdpa_reference(arch):
    """A document-masked forward+backward of a whole model (windows; differential attention's two maps) on the
    CUDA kernels equals the SDPA reference path: loss 1e-5 relative, gradients 1e-4 relative (fp32)."""
    torch.manual_seed(5)
    cfg = ModelConfig.from_arch(arch, 8, ar=16, vocab_size=128, block_size=256, sliding_window=32)
    model = GPT(cfg).cuda()
    x = torch.randint(1, 128, (2, 257), device="cuda")
    x[0, 40], x[0, 170], x[1, 99] = 0, 0, 0
    docs = (x[:, :-1] == 0).long().cumsum(1) - (x[:, :-1] == 0).long()
    results = []
    for impl in ("auto", "sdpa"):
        with attn_impl(impl):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[:, :-1], doc_ids=docs).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (la, ga), (lb, gb) = results
    assert abs(float(la - lb)) <= 1e-5 * float(lb)
    for a, b in zip(ga, gb):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-9


@pytest.mark.cuda
def test_cuda_compiled_block_with_documents_matches_eager():
    """Regional compile (inductor) of a windowed, document-masked model on CUDA equals eager (fp32, 1e-4 rel.)."""
    from archscale.train.parallelize import apply_compile

    torch.manual_seed(6)
    cfg = ModelConfig.from_arch("transformerls", 4, ar=16, vocab_size=128, block_size=256, sliding_window=32)
    model = GPT(cfg).cuda()
    x = torch.randint(1, 128, (2, 257), device="cuda")
    x[:, 77] = 0
    docs = (x[:, :-1] == 0).long().cumsum(1) - (x[:, :-1] == 0).long()

    def run():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[:, :-1], doc_ids=docs).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref = run()
    apply_compile(model)
    got = run()
    assert abs(float(got[0] - ref[0])) <= 1e-4 * float(ref[0])
    for a, b in zip(got[1], ref[1]):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-9


@pytest.mark.cuda
def test_cuda_chunked_cross_entropy_matches_plain():
    """The chunked loss on CUDA (the torch path; Liger's when installed is checked by LossFn on CUDA tensors) vs
    F.cross_entropy on sliced logits: fp32, loss 1e-6 and gradients 1e-5 relative (GPU matmul reduction order)."""
    torch.manual_seed(7)
    h = torch.randn(1000, 64, device="cuda", requires_grad=True)
    w = torch.randn(1088, 64, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (1000,), device="cuda")
    t[::7] = -100
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = F.cross_entropy((h @ w.T)[:, :1000], t, label_smoothing=0.1)
    g_ref = torch.autograd.grad(ref, (h, w))
    got = chunked_linear_cross_entropy(h, w, t, 1000, 0.1, -100, chunk_rows=96)
    g = torch.autograd.grad(got, (h, w))
    assert abs(float(got - ref)) <= 1e-6 * float(ref)
    for a, b in zip(g, g_ref):
        assert float((a - b).norm()) <= 1e-5 * float(b.norm())
