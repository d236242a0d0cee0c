"""Perplexity: validation loss at 1x..kx the training length, and sliding-window perplexity over a text file.

Extrapolation (as ArchScale validates): each validation sample holds `k_max * T + 1` tokens (T = training length);
one forward pass over the first `k_max * T` tokens gives the loss on every prefix `k * T`, so `loss@kx` is the
mean next-token loss over positions `0 .. k*T-1` of the same samples (a causal model's prefix logits do not
depend on later tokens).

Sliding window (HF-style): windows of `window` tokens start every `stride` tokens; each window scores only the
tokens no earlier window scored, so every token is predicted exactly once, with `window - stride` tokens or more
of context (all earlier tokens in the first window). The text is preceded by the EOS token (documents are
separated by EOS in training), which is context only, never scored.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from archscale.errors import UserError
from archscale.eval.loading import read_user_text


def _token_losses(model, x: torch.Tensor, y: torch.Tensor, autocast) -> torch.Tensor:
    """Per-position next-token loss (B, T) in fp32."""
    with torch.no_grad(), autocast():
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def validation_extrapolation(em, data_dir, factors: list[int], batch_size: int = 4,
                             max_batches: int | None = None) -> dict:
    """{"1x": {"context": T, "loss": .., "ppl": .., "tokens": n}, "2x": ...} on the run's validation shards."""
    from archscale.data.loader import validation_batches

    if not factors or any(k < 1 for k in factors):
        raise UserError(f"--extrapolation needs positive integers, got {factors}")
    factors = sorted(set(factors))
    T = em.train_len
    k_max = factors[-1]
    try:
        batches = validation_batches(data_dir, "validation", block_size=k_max * T + 1, micro_bsz=batch_size,
                                     max_batches=max_batches)
    except UserError as e:
        raise UserError(f"ppl extrapolation to {k_max}x ({k_max * T + 1} tokens per sample): {e}") from None
    sums = {k: 0.0 for k in factors}
    count_samples = 0
    for batch in batches:
        batch = batch.to(em.device)
        vocab = em.model.config.vocab_size
        if int(batch.max()) >= vocab:
            raise UserError(f"{data_dir}: token id {int(batch.max())} >= the model's vocab size {vocab}; "
                            "these shards were made with another tokenizer")
        losses = _token_losses(em.model, batch[:, :-1], batch[:, 1:], em.autocast)
        for k in factors:
            sums[k] += float(losses[:, :k * T].sum())
        count_samples += batch.shape[0]
    out = {}
    for k in factors:
        n = count_samples * k * T
        loss = sums[k] / n
        out[f"{k}x"] = {"context": k * T, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": n}
    out["samples"] = count_samples
    return out


def sliding_window_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows (begin, end, n_scored) over tokens 0..n_tokens-1 (token 0 is context only): the model reads
    tokens[begin:end] (at most `window` tokens) and predicts tokens[begin+1:end+1]; the last `n_scored` of those
    targets are scored. Windows start every `stride` tokens, and every token 1..n_tokens-1 is scored once."""
    if window < 1:
        raise UserError(f"--window must be at least 1, got {window}")
    if not 1 <= stride <= window:
        raise UserError(f"--stride must be in [1, --window={window}], got {stride}")
    out = []
    last = n_tokens - 1  # index of the last target
    done = 0  # targets 1..done are scored
    begin = 0
    while done < last:
        end = min(begin + window, last)
        out.append((begin, end, end - done))
        done = end
        begin += stride
    return out


def sliding_window_ppl(em, text_file: str, window: int, stride: int, batch_size: int = 4) -> dict:
    text = read_user_text(text_file, "--ppl_file")
    ids = [em.tokenizer.eos_id] + em.tokenizer.encode(text, eos=False)
    if len(ids) < 2:
        raise UserError(f"--ppl_file {text_file}: no text to score")
    windows = sliding_window_windows(len(ids), window, stride)
    data = torch.tensor(ids, dtype=torch.long)
    total, scored = 0.0, 0
    # windows of equal length batch together (all but the last ones have length `window`)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        groups.setdefault(w[1] - w[0], []).append(w)
    for length, ws in groups.items():
        for s in range(0, len(ws), batch_size):
            chunk = ws[s:s + batch_size]
            seq = torch.stack([data[b:e + 1] for b, e, _ in chunk]).to(em.device)
            losses = _token_losses(em.model, seq[:, :-1], seq[:, 1:], em.autocast)
            for row, (_, _, n) in enumerate(chunk):
                total += float(losses[row, -n:].sum())
                scored += n
    assert scored == len(ids) - 1
    loss = total / scored
    n_bytes = len(text.encode("utf-8"))
    return {"file": str(text_file), "window": window, "stride": stride, "tokens": scored, "bytes": n_bytes,
            "loss": loss, "ppl": math.exp(min(loss, 700.0)), "bits_per_byte": total / math.log(2) / max(1, n_bytes)}
