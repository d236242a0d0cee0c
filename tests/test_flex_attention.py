"""The CUDA attention paths, checked on CPU where they can run: FlexAttention's forward (block masks for
documents, windows, both, GQA, offsets; differential attention's two maps) and flash-attn varlen's packing (against
a pure-PyTorch stand-in with flash-attn's documented semantics). Backward runs only on CUDA (cuda-marked tests).

Reference: an explicit softmax per query over the keys the rule allows. Tolerance: fp32, 1e-5 absolute.
"""

import pytest
import torch

from archscale.kernels import attention as attention_kernel
from archscale.kernels.attention import attend, flash_varlen_attend, flex_attend
from archscale.models.mixers.diff_attention import DifferentialAttention
from archscale.kernels import attention_masks
from archscale.kernels.attention_masks import cu_seqlens_for

pytestmark = [pytest.mark.skipif(attention_masks.flex_attention is None, reason="FlexAttention needs torch >= 2.5"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


def naive(q, k, v, scale, q_pos0=0, k_pos0=0, window=0, docs_q=None, docs_k=None):
    """Per (row, head, query): softmax over the allowed keys; GQA by head // (H // G)."""
    B, H, Tq, _ = q.shape
    G = k.shape[1]
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(B):
        for i in range(Tq):
            p = q_pos0 + i
            keys = [j for j in range(k.shape[2]) if k_pos0 + j <= p and (not window or p - (k_pos0 + j) < window)
                    and (docs_q is None or docs_q[b, i] == docs_k[b, j])]
            for h in range(H):
                g = h // (H // G)
                s = (q[b, h, i] @ k[b, g, keys].T) * scale
                out[b, h, i] = torch.softmax(s, dim=-1) @ v[b, g, keys]
    return out


def docs_of(lengths_per_row, device="cpu"):
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths_per_row]).to(device)


CASES = {  # name: (H, G, window, document lengths per row or None)
    "docs": (4, 4, 0, [[10, 20, 7], [37]]),
    "window": (4, 4, 5, None),
    "docs+window": (4, 4, 6, [[3, 30, 4], [12, 25]]),
    "gqa+docs": (4, 2, 0, [[1, 35, 1], [20, 17]]),
    "gqa+docs+window": (6, 2, 4, [[9, 9, 19], [37]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flex_forward_matches_naive(name):
    H, G, window, lengths = CASES[name]
    torch.manual_seed(0)
    B, T = 2, 37
    q, k, v = torch.randn(B, H, T, 8), torch.randn(B, G, T, 8), torch.randn(B, G, T, 16)
    docs = docs_of(lengths) if lengths else None
    got = flex_attend(q, k, v, 0.3, window=window, q_docs=docs, k_docs=docs)
    torch.testing.assert_close(got, naive(q, k, v, 0.3, window=window, docs_q=docs, docs_k=docs),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Tq,Tk,window", [(5, 12, 0), (5, 8, 4), (7, 7, 3)])
def test_flex_forward_with_offsets(Tq, Tk, window):
    """Chunked prefill: queries at the end of a longer key range (block mask with a position offset)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, Tq, 8), torch.randn(1, 2, Tk, 8), torch.randn(1, 2, Tk, 8)
    k_pos0 = 20
    q_pos0 = k_pos0 + Tk - Tq
    got = flex_attend(q, k, v, 0.5, q_pos0=q_pos0, k_pos0=k_pos0, window=window)
    torch.testing.assert_close(got, naive(q, k, v, 0.5, q_pos0, k_pos0, window), atol=1e-5, rtol=1e-5)


def test_attend_dispatches_to_flex_and_reuses_the_block_mask(monkeypatch):
    """ARCHSCALE_ATTN_IMPL=flex sends attend through the CUDA path on CPU: differential attention's two maps and
    a second layer with the same doc ids build one block mask; new doc ids (a new batch) build another."""
    monkeypatch.setenv("ARCHSCALE_ATTN_IMPL", "flex")
    attention_masks.clear_cache()
    built = []
    real = attention_masks.create_block_mask
    monkeypatch.setattr(attention_masks, "create_block_mask", lambda *a, **kw: built.append(a[1:]) or real(*a, **kw))
    torch.manual_seed(2)
    B, H, G, T, hd = 2, 4, 2, 21, 8
    da = DifferentialAttention(hd, layer_idx=2)
    q, k, v = torch.randn(B, H, T, hd), torch.randn(B, G, T, hd), torch.randn(B, G, T, hd)
    docs = docs_of([[5, 16], [11, 10]])

    def core(a, b, c):
        return attend(a, b, c, scale=0.4, q_docs=docs, k_docs=docs)

    with torch.no_grad():
        got = da(q, k, v, core)
        da(q, k, v, core)  # the next layer: same layout
        ref = da(q, k, v, lambda a, b, c: naive(a, b, c, 0.4, docs_q=docs, docs_k=docs))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert built == [(B, None, T, T)]
    with torch.no_grad():
        attend(q, k, v, scale=0.4, q_docs=docs.clone(), k_docs=docs.clone())  # distinct tensors: not cached
        docs2 = docs.clone()
        attend(q, k, v, scale=0.4, q_docs=docs2, k_docs=docs2)
    assert len(built) == 3


def test_cache_never_matches_a_freed_docs_tensor():
    """The cache is keyed by id(docs); a later tensor may reuse a freed one's id but must not hit its entry."""
    attention_masks.clear_cache()
    made, ids = [], set()
    for n in range(20):
        docs = torch.full((1, 8), n)
        ids.add(id(docs))
        made.append(attention_masks._cached("t", docs, (), lambda: n))
        del docs
    assert made == list(range(20))
    assert len(ids) < 20  # CPython did reuse an id: the check above was a real one


def flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size):
    """flash-attn's varlen semantics: packed (total, heads, d) sequences delimited by cu_seqlens; causal, with a
    (left, right) window; GQA by head // (H // G)."""
    assert causal and q.dtype == k.dtype and cu_q.dtype == torch.int32 and max_q == max_k
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert e - s <= max_q
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        left = window_size[0]
        out[s:e] = naive(qs, ks, vs, softmax_scale, window=left + 1 if left >= 0 else 0)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("window,dv", [(0, 8), (4, 8), (0, 16)])
def test_flash_varlen_packing(monkeypatch, window, dv):
    monkeypatch.setattr(attention_kernel, "flash_attn_varlen_func", flash_varlen_reference)
    attention_masks.clear_cache()
    torch.manual_seed(3)
    B, H, G, T = 2, 4, 2, 19
    q, k, v = torch.randn(B, H, T, 8), torch.randn(B, G, T, 8), torch.randn(B, G, T, dv)
    docs = docs_of([[4, 15], [19]])
    got = flash_varlen_attend(q, k, v, 0.5, docs, window)
    torch.testing.assert_close(got, naive(q, k, v, 0.5, window=window, docs_q=docs, docs_k=docs), atol=1e-5, rtol=1e-5)


def test_cu_seqlens_restart_at_every_row():
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    cu, max_len = cu_seqlens_for(docs)
    assert cu.tolist() == [0, 2, 5, 6, 10, 15] and cu.dtype == torch.int32 and max_len == 5
