"""Incremental decoding: prefill the prompt into an `InferenceCache`, then one position per step.

Greedy at temperature 0; otherwise temperature, then top-k, then nucleus (top-p) filtering before sampling.
"""

from __future__ import annotations

import torch

from archscale.models.cache import InferenceCache


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next ids (B,)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"generate wants token ids of shape (B, T) with T >= 1, got {tuple(idx.shape)}")
    if max_new_tokens <= 0:
        return idx
    cache = InferenceCache(capacity=idx.shape[1] + max_new_tokens)
    logits = model(idx, cache=cache, last_only=True)[:, -1]
    out = [idx]
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out.append(nxt[:, None])
        if (eos_id is not None and bool(done.all())) or step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.cat(out, dim=1)
