"""Inference state for incremental decoding: one object per generation, one entry per layer.

- full attention: `KVCache`, K/V buffers preallocated to the generation's length and filled in place;
- sliding-window attention: `WindowKVCache`, only the last W-1 keys (all a new query can see), a ring in decoding;
- Mamba: `MambaState` (conv window + SSM state), kept by the Mamba mixer itself;
- YOCO: the one `kv` layer's `KVCache`, which every cross-attention layer reads (no per-layer KV);
- GMU layers keep nothing: their memory is the current tokens' Mamba output, recomputed every step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class KVCache:
    """K/V of every position so far; `append` returns views over all of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, G, T, d). Returns all cached K/V (B, G, length, d); key 0 is position 0."""
        T = k.shape[2]
        if self.k is None:
            cap = max(self.capacity, T)
            self.k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            self.v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
        if self.length + T > self.k.shape[2]:  # generation ran past the planned length: grow (rare)
            grow = max(self.length + T, 2 * self.k.shape[2]) - self.k.shape[2]
            self.k = torch.cat([self.k, self.k.new_empty(*self.k.shape[:2], grow, self.k.shape[3])], dim=2)
            self.v = torch.cat([self.v, self.v.new_empty(*self.v.shape[:2], grow, self.v.shape[3])], dim=2)
        self.k[:, :, self.length:self.length + T] = k
        self.v[:, :, self.length:self.length + T] = v
        self.length += T
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


class WindowKVCache:
    """Rolling K/V of the last `window - 1` positions (a query sees itself and W-1 earlier keys).

    A prompt (T > 1) keeps them in position order. Once W-1 keys are kept, single-token decoding switches to a ring
    of W slots written in place (the new key over the one that just left the window), so a step copies one key,
    not the window: a lone query sees every key of its window, and attention does not depend on the keys' order
    (RoPE is already applied). `ordered()` gives the kept keys in position order in either mode."""

    def __init__(self, window: int):
        self.keep = window - 1
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.next: int | None = None  # ring mode: the slot the next key goes to (it holds the oldest key)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Returns (K, V, n_old): the keys this step's queries attend to, n_old of them from before."""
        if k.shape[2] == 1 and self.k is not None and self.keep > 0 and (self.next is not None or
                                                                         self.k.shape[2] == self.keep):
            if self.next is None:  # the window just filled: one copy into a ring of W slots, the new key last
                self.k, self.v, self.next = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), 0
            else:
                self.k[:, :, self.next], self.v[:, :, self.next] = k[:, :, 0], v[:, :, 0]
                self.next = (self.next + 1) % (self.keep + 1)
            return self.k, self.v, self.keep
        old_k, old_v = self.ordered() if self.k is not None else (None, None)
        if old_k is None:
            n_old, kk, vv = 0, k, v
        else:
            n_old = old_k.shape[2]
            kk, vv = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        start = max(0, kk.shape[2] - self.keep)
        self.k, self.v, self.next = kk[:, :, start:].clone(), vv[:, :, start:].clone(), None
        return kk, vv, n_old

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept K/V (B, G, <= W-1, d) in position order."""
        if self.next is None:
            return self.k, self.v
        shift = -((self.next + 1) % (self.keep + 1))  # the oldest kept key's slot first; drop the leaving one
        return (torch.roll(self.k, shift, dims=2)[:, :, :self.keep],
                torch.roll(self.v, shift, dims=2)[:, :, :self.keep])


class InferenceCache:
    """Per-layer decoding state plus the number of positions already consumed (`pos`)."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # planned total length (prompt + new tokens); buffers grow past it if needed
        self.pos = 0
        self.layers: dict[int, Any] = {}

    def layer(self, idx: int, make: Callable[[], Any]) -> Any:
        if idx not in self.layers:
            self.layers[idx] = make()
        return self.layers[idx]
