"""Continuous batching over our inference caches: rows at different positions decoded in one forward.

`GPT.forward(idx, cache=...)` decodes a batch whose rows share one position. A server wants rows that joined at
different times (different prompt lengths, different numbers of generated tokens) in one step. So:

- each request is prefilled through `GPT.forward` with its own `InferenceCache` (exactly the model's path); prompts
  of one length that arrive together are prefilled as one batch (`prefill_batch`: rows are independent in the
  model's arithmetic, so each row's cache is what it would be alone), and row i of that cache becomes a slot;
- its per-layer state is then copied into one row ("slot") of `BatchState`, which keeps every layer's state for
  all active rows stacked on dim 0: K/V buffers padded to the longest row (full attention, sliding windows and the
  YOCO KV layer alike; zeros where a row has no key yet), and recurrent states (Mamba's conv + SSM state, or any
  dataclass of batch-first tensors) stacked as they are;
- `decode_step` runs one token per row through every block's own `forward`, with per-row RoPE positions and
  `ForwardContext.row_pos`: a layer with a K/V cache asks `ctx.cache.row_kv(layer)` for its stacked keys, which
  appends this step's K/V per row and returns a per-row key mask; a recurrent layer gets its stacked state from
  `ctx.cache.layer(...)` as in ordinary decoding;
- a row leaves by moving the last row into its slot (one copy), so active rows stay contiguous (views, no gathers).

`tests/test_serve.py` checks `decode_step` against `GPT.forward` with a cache for every architecture, alone and
in a batch of rows at different positions: the same logits to 1e-5 and the same greedy tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from archscale.models.cache import InferenceCache, KVCache, WindowKVCache
from archscale.models.mixers import ForwardContext


class _SlotKV:
    """K/V of every active row, (S, G, cap, hd); row b's key j is position j (earlier ones zero when a window
    dropped them: the window mask never lets a query see them)."""

    def __init__(self, k: torch.Tensor, slots: int, window: int):
        self.window = window
        self.k = k.new_zeros(slots, k.shape[1], max(64, k.shape[2]), k.shape[3])
        self.v = torch.zeros_like(self.k)

    def ensure(self, length: int) -> None:
        cap = self.k.shape[2]
        if length > cap:  # grow by doubling (rare): keeps the buffers' time axis contiguous
            grow = max(length, 2 * cap) - cap
            pad = self.k.new_zeros(self.k.shape[0], self.k.shape[1], grow, self.k.shape[3])
            self.k, self.v = torch.cat([self.k, pad], 2), torch.cat([self.v, pad.clone()], 2)

    def insert(self, row: int, k: torch.Tensor, v: torch.Tensor, end: int) -> None:
        """k, v (G, n, hd): the row's keys for positions end-n .. end-1."""
        n = k.shape[1]
        self.ensure(end)
        self.k[row].zero_()
        self.v[row].zero_()
        self.k[row, :, end - n:end] = k
        self.v[row, :, end - n:end] = v

    def move(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst] = self.k[src], self.v[src]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n_keys: int):
        """k, v (B, G, 1, hd): row b's key at position pos[b]. Returns the keys 0..n_keys-1 of the B rows and the
        mask (B, 1, 1, n_keys) of those each row's query may see."""
        B = k.shape[0]
        self.ensure(n_keys)
        rows = torch.arange(B, device=k.device)
        self.k[rows, :, pos] = k[:, :, 0]
        self.v[rows, :, pos] = v[:, :, 0]
        return self.k[:B, :, :n_keys], self.v[:B, :, :n_keys], _key_mask(pos, n_keys, self.window)


class _RowKV:
    """One layer's `_SlotKV` bound to this step's key count (what `Attention` sees as `ctx.cache.row_kv(i)`)."""

    def __init__(self, slot: _SlotKV, n_keys: int):
        self.slot, self.n_keys = slot, n_keys

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        return self.slot.append(k, v, pos, self.n_keys)


class _SlotRecurrent:
    """A recurrent state type (a dataclass of batch-first tensors, e.g. `MambaState`), stacked over rows."""

    def __init__(self, state: Any, slots: int):
        self.cls = type(state)
        self.names = [f.name for f in dataclasses.fields(state)]
        self.bufs = {n: getattr(state, n).new_zeros(slots, *getattr(state, n).shape[1:]) for n in self.names}

    def insert(self, row: int, state: Any, index: int) -> None:
        for n in self.names:
            self.bufs[n][row] = getattr(state, n)[index]

    def move(self, src: int, dst: int) -> None:
        for n in self.names:
            self.bufs[n][dst] = self.bufs[n][src]

    def view(self, rows: int) -> Any:
        return self.cls(**{n: self.bufs[n][:rows] for n in self.names})

    def write_back(self, state: Any, rows: int) -> None:
        """The layer may update a field in place (a view: nothing to do) or replace it (copy it back)."""
        for n in self.names:
            t = getattr(state, n)
            if t.data_ptr() != self.bufs[n].data_ptr():
                self.bufs[n][:rows] = t


class _StackedCache:
    """What a layer sees as `ctx.cache` during `decode_step`: K/V layers get `row_kv`, recurrent layers their
    stacked state through `layer`, as from an `InferenceCache`."""

    def __init__(self, batch: "BatchState", n_keys: int):
        self.batch = batch
        self.n_keys = n_keys  # from the host-side lengths: no device sync per layer
        self.views: dict[int, Any] = {}

    def row_kv(self, idx: int) -> _RowKV:
        return _RowKV(self.batch.kv[idx], self.n_keys)

    def layer(self, idx: int, make):
        if idx not in self.views:
            self.views[idx] = self.batch.recurrent[idx].view(self.batch.rows)
        return self.views[idx]


class BatchState:
    """Decode state of up to `slots` sequences; row i holds `lengths[i]` positions (its cache.pos)."""

    def __init__(self, model, slots: int):
        self.model = model
        self.slots = slots
        self.rows = 0
        self.lengths: list[int] = []
        self.kv: dict[int, _SlotKV] = {}
        self.recurrent: dict[int, _SlotRecurrent] = {}

    def insert(self, cache: InferenceCache, index: int = 0) -> int:
        """Add a prefilled sequence: row `index` of `cache` (a prefill's own cache, or one row of
        `prefill_batch`'s); returns its slot."""
        if self.rows >= self.slots:
            raise RuntimeError("no free slot")
        row, end = self.rows, cache.pos
        for idx, state in cache.layers.items():
            if isinstance(state, (KVCache, WindowKVCache)):
                k, v = (state.k[:, :, :state.length], state.v[:, :, :state.length]) if isinstance(state, KVCache) \
                    else state.ordered()
                if idx not in self.kv:
                    window = state.keep + 1 if isinstance(state, WindowKVCache) else 0
                    self.kv[idx] = _SlotKV(k, self.slots, window)
                self.kv[idx].insert(row, k[index], v[index], end)
            elif dataclasses.is_dataclass(state):
                if idx not in self.recurrent:
                    self.recurrent[idx] = _SlotRecurrent(state, self.slots)
                self.recurrent[idx].insert(row, state, index)
            else:
                raise NotImplementedError(f"layer {idx}: cannot batch a decode state of type {type(state).__name__}")
        self.rows += 1
        self.lengths.append(end)
        return row

    def remove(self, row: int) -> int | None:
        """Free `row`; the last row moves into it. Returns the row that moved (None if `row` was last)."""
        last = self.rows - 1
        moved = None
        if row != last:
            for s in (*self.kv.values(), *self.recurrent.values()):
                s.move(last, row)
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths.pop()
        self.rows -= 1
        return moved


def _key_mask(lengths: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """(B, 1, 1, n_keys) bool: row b's query sits at position lengths[b] and sees keys 0..lengths[b] (the last
    W of them with a window)."""
    j = torch.arange(n_keys, device=lengths.device)[None, :]
    mask = j <= lengths[:, None]
    if window:
        mask &= j > lengths[:, None] - window
    return mask[:, None, None, :]


@torch.no_grad()
def decode_step(batch: BatchState, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (rows,): each row's next input token, at position lengths[row]. Returns logits (rows, vocab) and
    advances every row by one position (mirrors `GPT.forward` for T = 1)."""
    model, B = batch.model, batch.rows
    cfg = model.config
    pos = torch.tensor(batch.lengths, device=tokens.device)
    n_keys = max(batch.lengths) + 1
    cos = sin = None
    if cfg.uses_rope:
        cos, sin = model.rope(n_keys, tokens.device)
        cos, sin = cos[pos][:, None, None, :], sin[pos][:, None, None, :]  # (B, 1, 1, hd/2)
    cache = _StackedCache(batch, n_keys)
    ctx = ForwardContext(pos=0, cos=cos, sin=sin, cache=cache, row_pos=pos)
    x = model.wte(tokens[:, None]).float()
    for block in model.blocks:
        x = block(x, ctx)
    for idx, state in cache.views.items():
        batch.recurrent[idx].write_back(state, B)
    batch.lengths = [n + 1 for n in batch.lengths]
    x = model.ln_f(x)
    if cfg.logit_scale != 1.0:
        x = x * cfg.logit_scale
    logits = model.lm_head(x)[:, 0]
    return logits[:, :cfg.vocab_size] if cfg.padded_vocab_size != cfg.vocab_size else logits


@torch.no_grad()
def prefill(model, ids: list[int], capacity: int, all_logits: bool = False) -> tuple[torch.Tensor, InferenceCache]:
    """The prompt alone through the model's own cached path: (logits (T or 1, vocab), its cache)."""
    device = next(model.parameters()).device
    cache = InferenceCache(capacity=capacity)
    logits = model(torch.tensor([ids], device=device), cache=cache, last_only=not all_logits)
    return logits[0], cache


@torch.no_grad()
def prefill_batch(model, prompts: list[list[int]], capacity: int) -> tuple[torch.Tensor, InferenceCache]:
    """Prompts of one length through the model's own cached path as one batch: (each row's last logits
    (rows, vocab), the batch's cache, whose row i `BatchState.insert(cache, i)` takes). One forward reads every
    weight once for all rows, where prefilling them alone reads the weights once per prompt."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prefill_batch: the prompts must have one length")
    device = next(model.parameters()).device
    cache = InferenceCache(capacity=capacity)
    logits = model(torch.tensor(prompts, device=device), cache=cache, last_only=True)
    return logits[:, -1], cache
