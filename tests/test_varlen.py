"""Variable-length training: packed documents with document masking equal the documents run separately.

Tolerance 2e-5 absolute on fp32 logits (RoPE is shift-invariant, so a document at positions 9.. without
position reset gives the same logits as alone at 0.., up to rounding); gradients within 5e-5 of each tensor's
largest entry, plus 1e-6 (sums over many positions, e.g. the differential-attention lambdas).
"""

import pytest
import torch

from archscale import GPT
from archscale.config import ARCHITECTURES
from archscale.models.varlen import document_ids, document_positions
from tests.test_architectures import tiny

EOS = 0
ARCHS = sorted(ARCHITECTURES)


def test_document_ids_and_positions():
    idx = torch.tensor([[5, 0, 7, 8, 0, 0, 3], [1, 2, 3, 4, 5, 6, 0]])
    docs = document_ids(idx, EOS)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]]  # EOS closes its own document
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]


def docs_pair(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 97, (9,), generator=g)
    a[-1] = EOS
    b = torch.randint(1, 97, (12,), generator=g)
    return a, b


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_separate_logits_and_grads(arch):
    torch.manual_seed(0)
    model = GPT(tiny(arch, window=5)).eval()
    a, b = docs_pair(1)
    packed = torch.cat([a, b])[None]
    docs = document_ids(packed, EOS)
    w = torch.randn(1, len(a) + len(b), 97, generator=torch.Generator().manual_seed(2))

    out = model(packed, doc_ids=docs)
    (out * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone_a, alone_b = model(a[None]), model(b[None])
    ((alone_a * w[:, :len(a)]).sum() + (alone_b * w[:, len(a):]).sum()).backward()

    torch.testing.assert_close(out[:, :len(a)], alone_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, len(a):], alone_b, atol=2e-5, rtol=1e-4)
    for n, p in model.named_parameters():  # relative to the tensor's largest entry (wte grads reach ~1e4)
        err = (packed_grads[n] - p.grad).abs().max().item()
        assert err <= 5e-5 * p.grad.abs().max().item() + 1e-6, (n, err)

    # the control: without document masking the second document sees the first, far beyond the masked error
    # (a small random Mamba forgets fast, so its leak is only ~1e-4 here; attention leaks ~1e-2)
    with torch.no_grad():
        leaky = model(packed)
        masked_err = (out[:, len(a):] - alone_b).abs().max().item()
    assert (leaky[:, len(a):] - alone_b).abs().max().item() > 20 * max(masked_err, 1e-6)


@pytest.mark.parametrize("arch", ["transformer", "samba"])
def test_rows_with_different_boundaries(arch):
    """Each row of a batch has its own documents; position reset gives positions 0.. inside every document."""
    torch.manual_seed(3)
    model = GPT(tiny(arch, window=5)).eval()
    a, b = docs_pair(4)
    rows = torch.stack([torch.cat([a, b]), torch.cat([b[:9], a, b[9:]])])
    rows[1, 8] = EOS
    docs = document_ids(rows, EOS)
    with torch.no_grad():
        out = model(rows, doc_ids=docs, position_ids=document_positions(docs))
        torch.testing.assert_close(out[1, :9], model(rows[1:, :9])[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[0, 9:], model(b[None])[0], atol=2e-5, rtol=1e-4)
