"""Greedy decoding for the evaluation tasks: one helper, so every task decodes the same way.

`greedy_batch` groups prompts of equal token length into batches (no padding, so a batch gives exactly the
tokens each prompt would give alone) and decodes each batch greedily. It uses `model.generate` (KV / SSM
caches) when the model has one, and otherwise a plain loop that re-runs the full forward for every new token.
Neither path truncates the prompt to the training length: long-context tasks deliberately go beyond it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch


@torch.no_grad()
def _full_forward_greedy(model, idx: torch.Tensor, max_new_tokens: int, eos_id: int | None) -> torch.Tensor:
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        nxt = model(idx)[:, -1, :].float().argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        if eos_id is not None:
            done |= nxt[:, 0] == eos_id
            if bool(done.all()):
                break
    return idx


@torch.no_grad()
def _greedy_tensor(model, idx: torch.Tensor, max_new_tokens: int, eos_id: int | None,
                   sampling: dict | None = None) -> torch.Tensor:
    gen = getattr(model, "generate", None)
    if sampling:
        if not callable(gen):
            raise ValueError("sampling needs a model with a generate() method")
        return gen(idx, max_new_tokens, eos_id=eos_id, **sampling)
    if callable(gen):
        return gen(idx, max_new_tokens, temperature=0.0, eos_id=eos_id)
    return _full_forward_greedy(model, idx, max_new_tokens, eos_id)


def _cut(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in ids:
        return ids[:ids.index(eos_id)]
    return ids


def greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt: up to `max_new_tokens` new ids, cut before the first EOS."""
    return greedy_batch(model, [prompt_ids], max_new_tokens, eos_id)[0]


def greedy_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None = None,
                 batch_size: int = 8, sampling: dict | None = None,
                 on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of many prompts (same order as `prompts`); equal-length prompts share a batch.
    `sampling` ({"temperature", "top_k", "top_p"}) samples instead, through `model.generate`. `on_batch(n)` is
    called after each batch with its number of prompts (progress)."""
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device = next(model.parameters()).device
    groups: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("greedy decoding needs a non-empty prompt")
        groups[len(p)].append(i)
    out: list[list[int] | None] = [None] * len(prompts)
    for length in sorted(groups):
        members = groups[length]
        for s in range(0, len(members), max(1, batch_size)):
            chunk = members[s:s + max(1, batch_size)]
            idx = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long, device=device)
            res = _greedy_tensor(model, idx, max_new_tokens, eos_id, sampling)
            for row, i in enumerate(chunk):
                out[i] = _cut(res[row, length:length + max_new_tokens].tolist(), eos_id)
            if on_batch is not None:
                on_batch(len(chunk))
    return out  # type: ignore[return-value]
