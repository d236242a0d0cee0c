"""Synthetic token data: `--train_data_dir synthetic[:markov|:uniform]`, generated from the seed, no files.

Two kinds:

* `uniform` - every token uniform over the vocabulary: a throughput test (the loss stays at ln V; nothing is
  learnable);
* `markov` (the default) - a fixed sparse Markov chain: each token has `SUCCESSORS` possible next tokens, chosen
  from the seed, with fixed probabilities `MARKOV_PROBS`; the first token of a block is uniform. A short run's loss
  falls from ln V towards the chain's entropy rate (`markov_entropy()`, 1.11 nats), so it is a quick check that
  training learns without a dataset.

Order and sharding follow `GlobalOrderLoader`: there is one global sequence of micro-batches, micro-batch `j`
generated from a generator seeded with `(seed, kind, j)` alone, and rank `r` of `W` takes `j = r, r+W, ...`.
Ranks therefore draw disjoint micro-batches, the global batches do not depend on the world size, and the
state is one counter (`batches`): resuming at any world size that divides it regenerates exactly the next batch.
Validation uses the same generator under another tag, so it never repeats a training block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from archscale.errors import UserError

PREFIX = "synthetic"
KINDS = ("markov", "uniform")
SUCCESSORS = 4
MARKOV_PROBS = (0.55, 0.25, 0.15, 0.05)  # of a token's successors; entropy 1.11 nats
STATE_VERSION = 1
_TAG_CHAIN, _TAG_TRAIN, _TAG_VALIDATION = 0, 1, 2


def synthetic_kind(data_dir) -> str | None:
    """'markov' / 'uniform' for `synthetic`, `synthetic:markov`, `synthetic:uniform`; None for a real folder (a
    folder that is literally named `synthetic` is reached as `./synthetic`)."""
    text = str(data_dir) if data_dir is not None else ""
    if text != PREFIX and not text.startswith(PREFIX + ":"):
        return None
    kind = text.partition(":")[2] or "markov"
    if kind not in KINDS:
        raise UserError(f"--train_data_dir {text}: unknown synthetic data kind {kind!r}; use synthetic (= "
                        "synthetic:markov, learnable) or synthetic:uniform (random tokens)")
    return kind


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) % (1 << 63) for w in words])))


def markov_successors(vocab_size: int, seed: int) -> np.ndarray:
    """(vocab, SUCCESSORS) next-token table of the chain: a function of (vocab, seed) only, the same everywhere."""
    rng = _rng(seed, _TAG_CHAIN, vocab_size)
    return np.stack([rng.choice(vocab_size, size=SUCCESSORS, replace=False) for _ in range(vocab_size)])


def markov_entropy() -> float:
    """The chain's entropy rate in nats: the loss a perfect model reaches (after each block's first token)."""
    return -sum(p * math.log(p) for p in MARKOV_PROBS)


def generate_block_batch(kind: str, vocab_size: int, seed: int, tag: int, index: int, rows: int, length: int,
                         successors: np.ndarray | None = None) -> np.ndarray:
    """Micro-batch `index` of stream `tag`: (rows, length) int64 tokens, a pure function of its arguments."""
    rng = _rng(seed, tag, index, KINDS.index(kind))
    if kind == "uniform":
        return rng.integers(0, vocab_size, size=(rows, length), dtype=np.int64)
    table = successors if successors is not None else markov_successors(vocab_size, seed)
    picks = rng.choice(SUCCESSORS, size=(rows, length), p=np.asarray(MARKOV_PROBS))
    out = np.empty((rows, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab_size, size=rows)
    for t in range(1, length):  # vectorised over rows; ~1 us per position
        out[:, t] = table[out[:, t - 1], picks[:, t]]
    return out


class SyntheticLoader:
    """Rank `rank`'s share of the global synthetic micro-batch order; the same interface and state semantics as
    `GlobalOrderLoader` (`state_dict()` is the global position, identical on every rank)."""

    def __init__(self, kind: str, *, vocab_size: int, block_size: int, micro_bsz: int, seed: int = 3407,
                 rank: int = 0, world_size: int = 1):
        if kind not in KINDS:
            raise UserError(f"unknown synthetic data kind {kind!r}; use one of {', '.join(KINDS)}")
        if vocab_size < 2 or (kind == "markov" and vocab_size < SUCCESSORS):
            raise UserError(f"synthetic data needs --vocab_size >= {SUCCESSORS} (got {vocab_size})")
        self.kind, self.vocab_size, self.block_size, self.micro_bsz = kind, int(vocab_size), block_size, micro_bsz
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.successors = markov_successors(self.vocab_size, self.seed) if kind == "markov" else None
        self.batches = 0  # global micro-batches consumed (all ranks together)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        index = self.batches + self.rank
        self.batches += self.world_size
        return torch.from_numpy(generate_block_batch(self.kind, self.vocab_size, self.seed, _TAG_TRAIN, index,
                                                     self.micro_bsz, self.block_size, self.successors))

    def fingerprint(self) -> dict:
        return {"synthetic": self.kind, "vocab_size": self.vocab_size, "block_size": self.block_size,
                "micro_bsz": self.micro_bsz, "seed": self.seed}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "batches": self.batches}

    def load_state_dict(self, sd: Mapping) -> None:
        if not isinstance(sd, Mapping) or sd.get("version") != STATE_VERSION or "batches" not in sd:
            raise UserError("the checkpoint's data state is not a synthetic-data state; resume with the data it was "
                            "trained on (or start fresh with --resume none)")
        old, new = sd.get("fingerprint", {}), self.fingerprint()
        diffs = [f"{k} {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
        if diffs:
            raise UserError(f"cannot resume the synthetic data stream: {', '.join(diffs)}; resume with the original "
                            "settings or start fresh (--resume none)")
        batches = int(sd["batches"])
        if batches % self.world_size:
            raise UserError(f"the saved data position ({batches} global micro-batches) is not a multiple of the "
                            f"new world size {self.world_size}; resume with a world size that divides the number "
                            "of micro-batches per optimizer step")
        self.batches = batches


def synthetic_validation_batches(kind: str, *, vocab_size: int, block_size: int, micro_bsz: int, seed: int,
                                 max_batches: int) -> list[torch.Tensor]:
    """`max_batches` held-out micro-batches (another tag than training: never a training block)."""
    table = markov_successors(vocab_size, seed) if kind == "markov" else None
    return [torch.from_numpy(generate_block_batch(kind, vocab_size, seed, _TAG_VALIDATION, i, micro_bsz, block_size,
                                                  table)) for i in range(max_batches)]
