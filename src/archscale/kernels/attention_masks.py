"""Attention masks for the CUDA kernels, built once per batch layout: FlexAttention block masks and flash-attn's
cu_seqlens, both derived from document ids (variable-length training) and the causal / sliding-window rule.

The rule is `attention.attention_mask`'s: query at absolute position p sees key at position k iff k <= p,
p - k < W with a window W, and (with document ids) both belong to the same document. A FlexAttention block mask
stores only which 128 x 128 tiles are empty, full or partial (O((T/128)^2) bytes, never a dense T x T mask), and
lets the kernel skip the empty tiles: work scales with the tokens a document or a window really attends to.

Layouts repeat: every attention layer of one forward (and both maps of differential attention) sees the same
`doc_ids` tensor, so the masks are cached by the identity of that tensor (held by weak reference, so a freed
tensor whose id is reused can never hit a stale entry) and the shapes. The builders run eagerly even inside a
compiled block (`torch.compiler.disable`): the cache is plain Python.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except Exception:  # pragma: no cover - torch < 2.5
    create_block_mask = flex_attention = None

CACHE_SIZE = 16  # layouts kept: (full, window) x (one doc layout per forward) with room for eval and decoding
_CACHE: "OrderedDict[tuple, tuple[Any, Any]]" = OrderedDict()


def _cached(kind: str, docs: Optional[torch.Tensor], key: tuple, build: Callable[[], Any]) -> Any:
    """build() once per (kind, docs identity, key); an entry whose docs tensor was freed never matches."""
    full_key = (kind, id(docs) if docs is not None else None, *key)
    hit = _CACHE.get(full_key)
    if hit is not None and (docs is None or hit[0]() is docs):
        _CACHE.move_to_end(full_key)
        return hit[1]
    value = build()
    _CACHE[full_key] = (weakref.ref(docs) if docs is not None else None, value)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def clear_cache() -> None:
    _CACHE.clear()


def mask_mod_for(q_pos0: int, k_pos0: int, window: int, q_docs: Optional[torch.Tensor],
                 k_docs: Optional[torch.Tensor]) -> Callable:
    """FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool of the causal (windowed, document) rule."""
    offset = q_pos0 - k_pos0  # query i sits at key index i + offset

    def mask_mod(b, h, q_idx, kv_idx):
        q_at = q_idx + offset
        keep = kv_idx <= q_at
        if window:
            keep = keep & (q_at - kv_idx < window)
        if q_docs is not None:
            keep = keep & (q_docs[b, q_idx] == k_docs[b, kv_idx])
        return keep

    return mask_mod


@torch.compiler.disable
def block_mask_for(Tq: int, Tk: int, q_pos0: int, k_pos0: int, window: int, q_docs: Optional[torch.Tensor],
                   k_docs: Optional[torch.Tensor], device: torch.device):
    """The (cached) FlexAttention BlockMask; batch-specific with document ids, broadcast over the batch without.
    On CUDA the mask is built by a compiled kernel, tile by tile (the eager builder evaluates every (q, k) pair)."""
    B = q_docs.shape[0] if q_docs is not None else None
    key = (id(k_docs) if k_docs is not None else None, B, Tq, Tk, q_pos0, k_pos0, window, str(device))

    def build():
        return create_block_mask(mask_mod_for(q_pos0, k_pos0, window, q_docs, k_docs), B, None, Tq, Tk,
                                 device=device, _compile=torch.device(device).type == "cuda")

    if k_docs is not q_docs:  # only a shared docs tensor (training: queries and keys alike) is a cacheable layout
        return build()
    return _cached("flex", q_docs, key, build)


@torch.compiler.disable
def cu_seqlens_for(docs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, T) document ids -> flash-attn's (cu_seqlens int32 (n_docs + 1,), max_seqlen) over the B*T tokens
    flattened row by row: a document starts at every row start and wherever the id changes (cached: the
    max_seqlen read is one host sync per layout, not per layer)."""
    def build():
        B, T = docs.shape
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        idx = starts.flatten().nonzero().flatten()
        cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    return _cached("cu_seqlens", docs, (tuple(docs.shape), str(docs.device)), build)


_COMPILED_FLEX: dict[str, Callable] = {}


def flex_kernel(device_type: str) -> Callable:
    """flex_attention compiled on CUDA (the eager version materialises the scores: a reference, not a kernel);
    eager elsewhere (CPU tests: forward only, FlexAttention has no CPU backward)."""
    if device_type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention)
    return _COMPILED_FLEX["cuda"]
