"""Attention kernels and mixers against small hand-written references (explicit softmax loops).

Tolerances: fp32 throughout, 1e-5 absolute (SDPA vs an explicit softmax differ by rounding only).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.kernels import attention as attention_kernel
from archscale.kernels.attention import attend
from archscale.models.mixers.diff_attention import DifferentialAttention, lambda_init_for
from archscale.models.mixers.gmu import GMU


def naive_attention(q, k, v, scale, q_pos0=0, k_pos0=0, window=0):
    """Per query, softmax over the keys it may see; GQA by head // (H // G)."""
    B, H, Tq, _ = q.shape
    G = k.shape[1]
    out = torch.zeros(B, H, Tq, v.shape[-1])
    for h in range(H):
        g = h // (H // G)
        for i in range(Tq):
            qp = q_pos0 + i
            keys = [j for j in range(k.shape[2]) if k_pos0 + j <= qp and (not window or k_pos0 + j > qp - window)]
            s = (q[:, h, i:i + 1] @ k[:, g, keys].transpose(-1, -2)) * scale  # (B, 1, n)
            out[:, h, i] = (torch.softmax(s, dim=-1) @ v[:, g, keys])[:, 0]
    return out


@pytest.mark.parametrize("T,window", [(9, 0), (9, 3), (40, 4), (37, 5), (16, 16)])
def test_attend_matches_naive_training_shapes(T, window):
    """Covers causal SDPA, the explicit band mask (T <= 2W) and the blocked window path (T > 2W)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 6)
    got = attend(q, k, v, scale=0.3, window=window)
    torch.testing.assert_close(got, naive_attention(q, k, v, 0.3, window=window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Tq,Tk,window", [(1, 12, 0), (1, 12, 4), (5, 12, 0), (5, 8, 4), (3, 3, 2)])
def test_attend_matches_naive_with_offsets(Tq, Tk, window):
    """Decoding / chunked prefill: queries at the end of a longer key range."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, Tq, 8), torch.randn(1, 1, Tk, 8), torch.randn(1, 1, Tk, 8)
    k_pos0 = 20
    q_pos0 = k_pos0 + Tk - Tq
    got = attend(q, k, v, scale=0.5, q_pos0=q_pos0, k_pos0=k_pos0, window=window)
    ref = naive_attention(q, k, v, 0.5, q_pos0=q_pos0, k_pos0=k_pos0, window=window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 4])
def test_one_query_decode_path_matches_naive_and_is_taken(monkeypatch, window):
    """Cached decoding on CPU (one query per row, no autograd) runs `_one_query`: the naive per-query softmax to
    1e-5, with and without a window and with a per-row key mask (rows at different lengths, as serving decodes).
    With autograd on, SDPA takes the call instead (the path has no backward of its own)."""
    torch.manual_seed(3)
    calls = []
    real = attention_kernel._one_query
    monkeypatch.setattr(attention_kernel, "_one_query", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = torch.randn(3, 6, 1, 8), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 5)
    with torch.no_grad():
        got = attend(q, k, v, scale=0.4, q_pos0=31, k_pos0=20, window=window)
        lengths = torch.tensor([3, 11, 7])
        key_mask = (torch.arange(12)[None, :] <= lengths[:, None])[:, None, None, :]
        masked = attend(q, k, v, scale=0.4, key_mask=key_mask)
    torch.testing.assert_close(got, naive_attention(q, k, v, 0.4, q_pos0=31, k_pos0=20, window=window),
                               atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lengths.tolist()):
        ref = naive_attention(q[b:b + 1], k[b:b + 1, :, :n + 1], v[b:b + 1, :, :n + 1], 0.4, q_pos0=n)
        torch.testing.assert_close(masked[b:b + 1], ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
    q.requires_grad_(True)
    attend(q, k, v, scale=0.4, q_pos0=31, k_pos0=20, window=window).sum().backward()
    assert len(calls) == 2 and q.grad is not None


def test_attend_rejects_misaligned_keys():
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="keys must end"):
        attend(q, k, k, scale=1.0, q_pos0=0, k_pos0=0)


def test_blocked_window_gradients_match_dense_mask():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 30, 4, requires_grad=True) for _ in range(3))
    attend(q, k, v, scale=0.5, window=4).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    naive_attention(q, k, v, 0.5, window=4).square().sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)


def test_differential_attention_matches_formula():
    torch.manual_seed(3)
    B, H, G, T, hd = 1, 4, 2, 6, 4
    da = DifferentialAttention(hd, layer_idx=3)
    q, k, v = torch.randn(B, H, T, hd), torch.randn(B, G, T, hd), torch.randn(B, G, T, hd)
    got = da(q, k, v, lambda a, b, c: attend(a, b, c, scale=0.5))
    lam_init = 0.8 - 0.6 * math.exp(-0.9)
    assert da.lambda_init == pytest.approx(lam_init) == lambda_init_for(3)
    lam = (torch.exp((da.lambda_q1 * da.lambda_k1).sum()) - torch.exp((da.lambda_q2 * da.lambda_k2).sum())
           + lam_init)
    causal = torch.ones(T, T).tril().bool()
    for p in range(H // 2):  # pair p: heads 2p, 2p+1; K/V pair p // (H/G) of the pairs
        gp = p // (H // G)
        vv = torch.cat([v[0, 2 * gp], v[0, 2 * gp + 1]], dim=-1)  # (T, 2hd)
        maps = []
        for s in (0, 1):
            scores = (q[0, 2 * p + s] @ k[0, 2 * gp + s].T * 0.5).masked_fill(~causal, float("-inf"))
            maps.append(torch.softmax(scores, dim=-1))
        diff = maps[0] @ vv - lam * (maps[1] @ vv)
        normed = diff / torch.sqrt(diff.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 - lam_init)
        # the pair's 2hd outputs occupy heads 2p (first half) and 2p+1 (second half)
        torch.testing.assert_close(got[0, 2 * p], normed[:, :hd], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[0, 2 * p + 1], normed[:, hd:], atol=1e-5, rtol=1e-5)


def test_gmu_matches_formula():
    torch.manual_seed(4)
    gmu = GMU(6, 12)
    x, m = torch.randn(2, 5, 6), torch.randn(2, 5, 12)
    ref = (torch.nn.functional.silu(x @ gmu.in_proj.weight.T) * m) @ gmu.out_proj.weight.T
    torch.testing.assert_close(gmu(x, m), ref, atol=1e-6, rtol=1e-5)


def test_cross_attention_uses_the_kv_layers_keys():
    """In SambaY-OCO, a cross layer's output == naive attention of its own queries over layer L/2+1's K/V."""
    torch.manual_seed(5)
    cfg = ModelConfig.from_arch("sambayoco", 8, ar=8, vocab_size=50, sliding_window=4)
    model = GPT(cfg).eval()
    seen = {}
    kv_layer, cross = model.blocks[5].mixer, model.blocks[6].mixer
    kv_layer.register_forward_hook(lambda m, a, out: seen.update(kv_in=a[0]))
    cross.register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out))
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 7)))
        H, G, hd = cfg.n_head, cfg.n_query_groups, cfg.head_size
        qkv = kv_layer.attn(seen["kv_in"])
        k = qkv[..., H * hd:(H + G) * hd].view(1, 7, G, hd).transpose(1, 2)
        v = qkv[..., (H + G) * hd:].view(1, 7, G, hd).transpose(1, 2)
        q = cross.q_proj(seen["x"]).view(1, 7, H, hd).transpose(1, 2)
        y = naive_attention(q, k, v, cross.scale)
        ref = cross.proj(y.transpose(1, 2).reshape(1, 7, H * hd))
    torch.testing.assert_close(seen["out"], ref, atol=1e-5, rtol=1e-5)


def test_per_document_path_equals_dense_document_mask(monkeypatch):
    """Long-context varlen runs document by document; it must equal the dense block-diagonal mask (values, grads)."""
    import archscale.kernels.attention as ops
    torch.manual_seed(6)
    T = 40
    docs = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])
    q, k, v = (torch.randn(2, 4, T, 8, requires_grad=True) for _ in range(3))
    for window in (0, 5):
        dense = attend(q, k[:, :2], v[:, :2], scale=0.4, window=window, q_docs=docs, k_docs=docs)
        g_dense = torch.autograd.grad(dense.square().sum(), (q, k, v))
        monkeypatch.setattr(ops, "DENSE_DOC_MASK_MAX", 16)
        split = attend(q, k[:, :2], v[:, :2], scale=0.4, window=window, q_docs=docs, k_docs=docs)
        g_split = torch.autograd.grad(split.square().sum(), (q, k, v))
        monkeypatch.setattr(ops, "DENSE_DOC_MASK_MAX", 4096)
        torch.testing.assert_close(split, dense, atol=1e-5, rtol=1e-5)
        for a, b in zip(g_split, g_dense):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_ngmu_matches_formula():
    """nGMU (ArchScale's GMU with use_norm): out_proj(RMSNorm(memory * silu(in_proj(x))) * weight)."""
    torch.manual_seed(0)
    gmu = GMU(12, 20, use_norm=True)
    with torch.no_grad():
        gmu.norm.weight.uniform_(0.5, 1.5)
    x, mem = torch.randn(2, 5, 12), torch.randn(2, 5, 20)
    y = mem * F.silu(x @ gmu.in_proj.weight.T)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * gmu.norm.weight
    torch.testing.assert_close(gmu(x, mem), y @ gmu.out_proj.weight.T, rtol=1e-5, atol=1e-6)
    plain = GMU(12, 20)
    plain.load_state_dict({k: v for k, v in gmu.state_dict().items() if not k.startswith("norm")})
    assert (plain(x, mem) - gmu(x, mem)).abs().max() > 1e-3  # negative control: the norm matters


@pytest.mark.cuda
def test_flash_attn_matches_sdpa():
    """flash-attn (when installed) equals the SDPA path for causal, windowed and GQA attention in bf16."""
    if attention_kernel.flash_attn_func is None:
        pytest.skip("flash-attn is not installed")
    torch.manual_seed(0)
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16), torch.randn(2, 2, 300, 64,
                                                                                      device="cuda", dtype=torch.bfloat16)
    for window in (0, 64):
        got = attend(q, k, v, scale=0.125, window=window)
        want = naive_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), 0.125, 0, 0, window)
        torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)


def test_partial_rope_rotates_only_the_first_rotary_dims():
    """rotary_dim < head_size (Bamba / Qwen3-Next's partial RoPE): the first rd dims rotate as a rd-wide RoPE
    would, the others pass through unchanged; rotary_dim = head_size is the full rotation."""
    from archscale.models.rope import apply_rope, rope_cache

    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16)
    cos, sin = rope_cache(5, 8, 10000.0)
    y = apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(y[..., 8:], x[..., 8:], rtol=0, atol=0)
    torch.testing.assert_close(y[..., :8], apply_rope(x[..., :8], cos.unsqueeze(1), sin.unsqueeze(1)))
    assert not torch.allclose(y[..., :8], x[..., :8])  # the rotated part did move
    cfg = ModelConfig.from_arch("transformer", 2, ar=16, vocab_size=50, rotary_dim=8)
    assert GPT(cfg).rope(5, torch.device("cpu"))[0].shape == (5, 4)
