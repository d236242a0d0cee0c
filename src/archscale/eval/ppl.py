"""Perplexity: validation loss at 1x..kx the training length, and sliding-window perplexity over a text file.

Extrapolation (as ArchScale validates): each validation sample holds `k_max * T + 1` tokens (T = training length);
one forward pass over the first `k_max * T` tokens gives the loss on every prefix `k * T`, so `loss@kx` is the
mean next-token loss over positions `0 .. k*T-1` of the same samples (a causal model's prefix logits do not
depend on later tokens). The forward is the run's own (`EvalModel.forward`: document masking for --varlen runs,
as the trainer validates). Samples: every block in file order, or ArchScale's 200 (`archscale_block_order`).

Sliding window (HF-style): windows of `window` tokens start every `stride` tokens; each window scores only the
tokens no earlier window scored, so every token is predicted exactly once, with `window - stride` tokens or more
of context (all earlier tokens in the first window). The text is preceded by the EOS token (documents are
separated by EOS in training), which is context only, never scored.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import torch
import torch.nn.functional as F

from archscale.errors import UserError
from archscale.eval.loading import read_user_text


def _plain_forward(model, x):
    return model(x)


def _token_losses(model, x: torch.Tensor, y: torch.Tensor, autocast, forward=_plain_forward) -> torch.Tensor:
    """Per-position next-token loss (B, T) in fp32; `forward(model, x)` is the run's (document masking)."""
    with torch.no_grad(), autocast():
        logits = forward(model, x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


ARCHSCALE_VAL_SAMPLES = 200  # pretrain.py: eval_iters validation batches of ceil(micro_batch_size / 2) samples
ARCHSCALE_VAL_SEED = 12345  # create_dataloader's seed, which shuffles the file list
ARCHSCALE_VAL_CHUNKS = 8  # PackedDataset n_chunks for validation on one node


def archscale_factors(train_len: int, varlen: bool) -> list[int]:
    """ArchScale's `num_extrapol`: 4 for its 4096-token runs (which `_varlen` trains at 8192), else 2."""
    return [1, 2, 3, 4] if train_len == 4096 or (varlen and train_len == 8192) else [1, 2]


def archscale_block_order(data_dir, block_size: int, n_samples: int = ARCHSCALE_VAL_SAMPLES,
                          seed: int = ARCHSCALE_VAL_SEED, n_chunks: int = ARCHSCALE_VAL_CHUNKS):
    """(file, block) of the first `n_samples` validation samples ArchScale's unshuffled PackedDataset yields on
    one GPU: the sorted validation*.bin list shuffled by random.seed(seed), read in groups of `n_chunks` files
    (only whole groups: drop_last), each file's blocks in order, starting over when the groups are used up."""
    import random

    from archscale.data.loader import _block_counts, _find_shards

    files = _find_shards(Path(data_dir), "validation")
    random.Random(seed).shuffle(files)
    counts = _block_counts(files, block_size)
    k = min(n_chunks, len(files))
    used = len(files) // k * k
    cycle = [(files[f], b) for f in range(used) for b in range(int(counts[f]))]
    if not cycle:
        raise UserError(f"{data_dir}: no validation shard holds a block of {block_size} tokens")
    return [cycle[i % len(cycle)] for i in range(n_samples)]


def archscale_batches(data_dir, block_size: int, batch_size: int, n_samples: int = ARCHSCALE_VAL_SAMPLES):
    from archscale.data import format as shard_format

    order = archscale_block_order(data_dir, block_size, n_samples)
    for s in range(0, len(order), batch_size):
        rows = [shard_format.open_shard(f)[b * block_size:(b + 1) * block_size] for f, b in order[s:s + batch_size]]
        yield torch.from_numpy(np.stack(rows).astype(np.int64))


def validation_extrapolation(em, data_dir, factors: list[int], batch_size: int = 4,
                             max_batches: int | None = None, selection: str = "all", on_batch=None) -> dict:
    """{"1x": {"context": T, "loss": .., "ppl": .., "tokens": n}, "2x": ...} on the run's validation shards,
    through the run's own forward (`em.forward`: document masking for --varlen runs, as the trainer validates).
    `selection`: "all" blocks in file order (at most `max_batches` batches), or "archscale" (its 200 samples)."""
    from archscale.data.loader import validation_batches

    if not factors or any(k < 1 for k in factors):
        raise UserError(f"--extrapolation needs positive integers, got {factors}")
    factors = sorted(set(factors))
    T = em.train_len
    k_max = factors[-1]
    try:
        if selection == "archscale":
            batches = archscale_batches(data_dir, k_max * T + 1, batch_size)
        else:
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
        forward = getattr(em, "forward", _plain_forward)
        losses = _token_losses(em.model, batch[:, :-1], batch[:, 1:], em.autocast, forward)
        for k in factors:
            sums[k] += float(losses[:, :k * T].sum())
        count_samples += batch.shape[0]
        if on_batch is not None:  # progress: samples done
            on_batch(batch.shape[0])
    out = {}
    for k in factors:
        n = count_samples * k * T
        loss = sums[k] / n
        out[f"{k}x"] = {"context": k * T, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": n}
    out["samples"] = count_samples
    out["selection"] = selection
    out["masking"] = getattr(em, "masking", "none")
    return out


def count_validation_samples(data_dir, block_size: int, batch_size: int, max_batches: int | None,
                             selection: str) -> int:
    """How many samples `validation_extrapolation` will read (0 when the shards hold no block): for the plan."""
    from archscale.data.loader import _block_counts, _glob_shards

    if selection == "archscale":
        return ARCHSCALE_VAL_SAMPLES
    files = _glob_shards(Path(data_dir), "validation")
    total = int(_block_counts(files, block_size).sum()) if files else 0
    return total if max_batches is None else min(total, max_batches * batch_size)


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
