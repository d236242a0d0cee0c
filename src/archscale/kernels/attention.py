"""The attention kernel behind every attention mixer: causal (optionally sliding-window) softmax attention on
absolute positions, with grouped K/V heads.

`attend(q, k, v, scale=, q_pos0=, k_pos0=, window=, q_docs=, k_docs=)` picks a path.

On CUDA (no per-document Python loop, no dense T x T mask):
- document-masked training (`q_docs`): flash-attn's `flash_attn_varlen_func` when installed (half precision),
  with cu_seqlens from the document ids; else FlexAttention with a block mask of the documents (and window);
- no documents: flash-attn's `flash_attn_func` when installed (half precision), `window_size=(W-1, 0)`;
  else SDPA's causal fast path when queries and keys cover the same positions and no window cuts in; else
  (sliding windows, chunked prefill) FlexAttention with a causal/window block mask;
- one query (decoding): SDPA, with a (1, Tk) mask when a window cuts in.
FlexAttention runs compiled, its block masks built once per batch layout (`kernels/attention_masks.py`).

On CPU (FlexAttention has no CPU backward):
- SDPA with `is_causal` when queries and keys cover the same positions and no window cuts in (training);
- SDPA on non-overlapping query blocks of W against their 2W keys when a window is much shorter than the
  sequence (sliding-window training costs O(T*W), not O(T^2));
- one query per row (cached decoding, fp32, no autograd): two batched products and a softmax (`_one_query`),
  which read the cache at close to the memory's rate where the CPU flash kernel, built for many queries, reached
  a fifth of it (`docs/BENCHMARKS.md`, the decode bound); a window or a per-row key mask is applied the same way;
- SDPA with an explicit boolean mask otherwise (chunked prefill), and for variable-length
  (document-masked) training, where the mask is also block-diagonal over documents; past
  `DENSE_DOC_MASK_MAX` positions, one causal call per document instead (no T x T mask at long context).

`ARCHSCALE_ATTN_IMPL=flash|flex|sdpa` forces a path (`ATTENTION`, a `dispatch.Dispatch`): flash falls back where
it cannot run; flex runs the FlexAttention path on any device (forward only on CPU: the tests' parity checks); sdpa
keeps CUDA on the CPU paths above (the reference to compare kernels against). Any other value is a one-line error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from archscale.kernels.attention_masks import block_mask_for, cu_seqlens_for, flex_attention, flex_kernel
from archscale.kernels.dispatch import Dispatch, Impl

try:  # optional CUDA kernels
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # type: ignore
except Exception:  # pragma: no cover - not installable without CUDA
    flash_attn_func = flash_attn_varlen_func = None

# `enable_gqa` arrived in torch 2.5.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def attention_mask(tq: int, tk: int, q_pos0: int, k_pos0: int, window: int, device) -> torch.Tensor:
    """(tq, tk) bool, True where query q_pos0+i may see key k_pos0+j: j <= i and, with a window, i - j < W."""
    qp = torch.arange(q_pos0, q_pos0 + tq, device=device)[:, None]
    kp = torch.arange(k_pos0, k_pos0 + tk, device=device)[None, :]
    mask = kp <= qp
    if window:
        mask &= kp > qp - window
    return mask


def _one_query(q, k, v, scale, mask=None):
    """One query per row and head, on CPU without autograd: softmax(q k^T * scale) v as two batched products.
    q (B, H, 1, d), k (B, G, Tk, d), v (B, G, Tk, dv); the H / G query heads of a group share its K/V (read once
    for all of them); mask: bool, broadcastable to (B, 1, 1, Tk), True where a key is seen."""
    B, H, _, d = q.shape
    G, Tk = k.shape[1], k.shape[2]
    qg = q.reshape(B, G, H // G, d)                                      # a group's query heads as rows
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)          # (B, G, H/G, Tk)
    if mask is not None:
        scores.masked_fill_(~mask.reshape(mask.shape[0], 1, 1, Tk), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)                  # (B, G, H/G, dv)
    return out.reshape(B, H, 1, v.shape[-1])


def _takes_one_query(q, k, v, mask, causal) -> bool:
    """Cached decoding on CPU at fp32 without autograd, with no mask or a per-key one."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.dim() == 4 and q.shape[-2] == 1 and q.device.type == "cpu" and q.dtype == torch.float32
            and not causal and not grad and (mask is None or mask.shape[-2] == 1))


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q (..., H, Tq, d), k/v (..., G, Tk, d): grouped heads read in place on CPU, expanded elsewhere."""
    if _takes_one_query(q, k, v, mask, causal):
        return _one_query(q, k, v, scale, mask)
    H, G = q.shape[-3], k.shape[-3]
    if H != G:
        if q.device.type == "cpu" and _SDPA_HAS_GQA:
            # The CPU flash kernel reads the shared K/V heads in place: faster than expanding them.
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)
        k = k.repeat_interleave(H // G, dim=-3)
        v = v.repeat_interleave(H // G, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _blocked_window(q, k, v, scale, window):
    """Sliding-window attention over T >> W: query block b (W queries) sees keys of blocks b-1 and b."""
    B, H, T, d = q.shape
    G, dv, W = k.shape[1], v.shape[-1], window
    nb = -(-T // W)
    pad = nb * W - T
    q = F.pad(q, (0, 0, 0, pad)).view(B, H, nb, W, d).transpose(1, 2).reshape(B * nb, H, W, d)
    # keys: one block of zeros in front, then windows of 2W keys with stride W
    kk = F.pad(k, (0, 0, W, pad)).unfold(2, 2 * W, W)  # (B, G, nb, d, 2W)
    vv = F.pad(v, (0, 0, W, pad)).unfold(2, 2 * W, W)
    kk = kk.permute(0, 2, 1, 4, 3).reshape(B * nb, G, 2 * W, d)
    vv = vv.permute(0, 2, 1, 4, 3).reshape(B * nb, G, 2 * W, dv)
    i = torch.arange(W, device=q.device)[:, None]
    j = torch.arange(2 * W, device=q.device)[None, :]
    band = (j > i) & (j <= i + W)  # key j of the 2W sits at absolute (b-1)W + j; query i at bW + i
    mask = band.expand(nb, W, 2 * W).clone()
    mask[0, :, :W] = False  # block 0 has no previous block (those keys are padding)
    mask = mask.unsqueeze(1).repeat(B, 1, 1, 1)  # (B*nb, 1, W, 2W)
    out = _sdpa(q, kk, vv, scale, mask=mask)  # (B*nb, H, W, dv)
    out = out.view(B, nb, H, W, dv).transpose(1, 2).reshape(B, H, nb * W, dv)
    return out[:, :, :T]


# Above this many positions, document-masked attention runs document by document (O(T) memory, causal kernels)
# instead of materialising a (B, T, T) boolean mask (1 GiB at 32K).
DENSE_DOC_MASK_MAX = 4096


def _per_document(q, k, v, scale, docs, window):
    """Block-diagonal causal attention as one causal (or windowed) call per document of each row."""
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    for b in range(q.shape[0]):
        _, counts = torch.unique_consecutive(docs[b], return_counts=True)
        s = 0
        for n in counts.tolist():
            out[b:b + 1, :, s:s + n] = attend(q[b:b + 1, :, s:s + n], k[b:b + 1, :, s:s + n],
                                              v[b:b + 1, :, s:s + n], scale=scale, window=window)
            s += n
    return out


def flex_attend(q, k, v, scale, q_pos0=0, k_pos0=0, window=0, q_docs=None, k_docs=None):
    """The FlexAttention path: one kernel call with a block mask of the causal / window / document rule."""
    mask = block_mask_for(q.shape[2], k.shape[2], q_pos0, k_pos0, window, q_docs, k_docs, q.device)
    return flex_kernel(q.device.type)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flash_varlen_attend(q, k, v, scale, docs, window=0):
    """flash-attn's varlen kernel over the B*T tokens as one packed batch of documents (training shapes)."""
    if v.shape[-1] != q.shape[-1]:  # flash-attn wants equal head dims: split wide values
        return torch.cat([flash_varlen_attend(q, k, vi, scale, docs, window) for vi in v.split(q.shape[-1], -1)],
                         dim=-1)
    B, H, T, d = q.shape
    cu, max_len = cu_seqlens_for(docs)
    packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[-1]) for t in (q, k, v)]
    out = flash_attn_varlen_func(*packed, cu, cu, max_len, max_len, softmax_scale=scale, causal=True,
                                 window_size=(window - 1, 0) if window else (-1, -1))
    return out.view(B, T, H, v.shape[-1]).transpose(1, 2)


def _flash_unavailable(x, k, q_docs=None, k_docs=None, **_) -> str:
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16):
        return "needs CUDA tensors in half precision"
    if (flash_attn_func if q_docs is None else flash_attn_varlen_func) is None:
        return "needs the flash-attn package"
    if q_docs is not None and (x.shape[2] != k.shape[2] or q_docs is not k_docs):
        return "takes documents only in training shapes (queries = keys, one docs tensor)"
    return ""


def _flex_unavailable(x, k, window=0, q_docs=None, **_) -> str:
    if flex_attention is None:
        return "needs FlexAttention (torch >= 2.5)"
    Tq, Tk = x.shape[2], k.shape[2]
    if Tq == 1 or (q_docs is None and Tq == Tk and (not window or window >= Tk)):
        return "is not needed: no mask cuts in, SDPA's kernels take the call"
    return ""


# `ARCHSCALE_ATTN_IMPL` is a preference: a path that cannot take a call falls back to SDPA (strict=False)
ATTENTION = Dispatch("attention", (
    Impl("flash", _flash_unavailable),
    Impl("flex", _flex_unavailable, in_auto=lambda x, **_: x.is_cuda),  # no CPU backward: named only there
    Impl("sdpa"),
), env_var="ARCHSCALE_ATTN_IMPL", strict=False)


def _flash_attend(q, k, v, scale, q_pos0, k_pos0, window, docs):
    if docs is not None:
        return flash_varlen_attend(q, k, v, scale, docs, window)
    if v.shape[-1] != q.shape[-1]:  # flash-attn wants equal head dims: split wide values
        return torch.cat([attend(q, k, vi, scale=scale, q_pos0=q_pos0, k_pos0=k_pos0, window=window)
                          for vi in v.split(q.shape[-1], dim=-1)], dim=-1)
    # flash-attn aligns causal masks bottom-right, which is our position convention
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=True, window_size=(window - 1, 0) if window else (-1, -1))
    return out.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, q_pos0: int = 0, k_pos0: int = 0,
           window: int = 0, q_docs: torch.Tensor | None = None, k_docs: torch.Tensor | None = None,
           key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, Tq, d), k (B, G, Tk, d), v (B, G, Tk, dv) -> (B, H, Tq, dv). Queries sit at absolute positions
    q_pos0.., keys at k_pos0..; each query sees keys at or before its position (and, with window W, the W-1
    before it). The keys must end at the last query's position (what training and cached decoding give).
    With q_docs (B, Tq) / k_docs (B, Tk) document ids, a query sees only keys of its own document.
    `key_mask` (B, 1, Tq, Tk) bool replaces all of that (rows decoding at different positions)."""
    if key_mask is not None:
        return _sdpa(q, k, v, scale, mask=key_mask)
    Tq, Tk = q.shape[2], k.shape[2]
    if q_pos0 + Tq != k_pos0 + Tk:
        raise ValueError(f"keys must end where queries end (q {q_pos0}+{Tq}, k {k_pos0}+{Tk})")
    impl = ATTENTION.resolve(x=q, k=k, window=window, q_docs=q_docs, k_docs=k_docs)
    if impl == "flash":
        return _flash_attend(q, k, v, scale, q_pos0, k_pos0, window, q_docs)
    if impl == "flex":
        return flex_attend(q, k, v, scale, q_pos0, k_pos0, window, q_docs, k_docs)
    if q_docs is not None:
        if Tq == Tk and Tq > DENSE_DOC_MASK_MAX:
            return _per_document(q, k, v, scale, q_docs, window)
        mask = attention_mask(Tq, Tk, q_pos0, k_pos0, window, q.device)
        mask = mask & (q_docs[:, :, None] == k_docs[:, None, :])  # (B, Tq, Tk): block-diagonal causal
        return _sdpa(q, k, v, scale, mask=mask.unsqueeze(1))
    no_cut = not window or window >= Tk
    if Tq == Tk and no_cut:
        return _sdpa(q, k, v, scale, causal=True)
    if Tq == 1 and no_cut:
        return _sdpa(q, k, v, scale)  # one query at the end sees every key
    if Tq == Tk and window and Tk > 2 * window:
        return _blocked_window(q, k, v, scale, window)
    mask = attention_mask(Tq, Tk, q_pos0, k_pos0, window, q.device)
    return _sdpa(q, k, v, scale, mask=mask)
