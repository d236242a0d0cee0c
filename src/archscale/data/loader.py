"""A stateful, exactly resumable loader of packed token blocks (`ctx_len + 1` tokens each).

Terminology used below:

* **source** - one prefix of a dataset dir (`{data_dir}/{prefix}*.bin`, sorted); a mixture has several.
* **block** - `block_size` consecutive tokens of one shard file: block `k` of a file is `tokens[k*bs:(k+1)*bs]`.
  A file holds `len // block_size` blocks; its leftover tokens are never used. Files too short to hold a block
  are skipped.
* **data shard** - one of `S = world_size * num_workers` disjoint sub-streams; rank `r`, worker `w` owns data shard
  `s = r * num_workers + w`. Workers are *logical*: their streams are interleaved round-robin (one batch each) in
  the calling process, so the state is exact without worker processes (the data are already tokenized; reading a
  block is a memmap slice).

Sharding. Each epoch the file list of a source is put in an order (a permutation seeded from `(seed, source,
epoch)` when shuffling, the sorted order otherwise); the order is the same on every rank.

* *file striding* (the normal case, at least `S` usable files): data shard `s` owns the files at positions
  `s, s+S, s+2S, ...` of that order. Unlike lit-gpt no files are dropped, so data shards may own one file more than
  others (and files differ in length): each data shard simply wraps to its next epoch when it runs out.
* *block striding* (fallback, fewer usable files than `S`): the blocks of the epoch are numbered globally in file
  order and data shard `s` owns the blocks with `number % S == s`. This keeps tiny datasets usable on many ranks;
  it needs at least `S` blocks in all.

Either way the `S` data shards together cover every block of a source exactly once per epoch, without overlap.

Shuffling. A data shard's files are taken `buffer_chunks` at a time (a *buffer*; in block striding a buffer is
`buffer_chunks` consecutive files of the epoch order, of which the shard owns some blocks). The buffer's blocks are
permuted with a generator seeded from `(seed, source, rank, worker, epoch, buffer)`. So the position of the stream
is just `(epoch, buffer, pos)`: resuming regenerates the one permutation and reads nothing it skips.

Mixture. Each sample of a batch picks its source with one numpy generator seeded from `(seed, rank)` (weights
normalised); the generator's state is part of `state_dict()`. A source that runs out wraps to its next epoch, so
the stream is infinite.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from archscale.data import format as shard_format
from archscale.errors import UserError

STATE_VERSION = 1

# Domain tags so that ArchScale sequences of different uses never coincide.
_TAG_FILE_ORDER = 0
_TAG_BUFFER = 1
_TAG_MIXTURE = 2


# ----------------------------------------------------------------------------------------------- helpers

def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    """Return `data_dir/manifest.json` as a dict, None if there is none; UserError if it cannot be parsed."""
    path = Path(data_dir) / shard_format.MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot parse the dataset manifest ({_one_line(e)}); "
                        f"re-create it with `archscale prepare` or delete it") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the dataset manifest must be a JSON object, got {type(data).__name__}; "
                        f"re-create it with `archscale prepare` or delete it")
    return data


def load_mixture(path_or_json: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> dict[str, float]:
    """Read a mixture `{"prefix": weight, ...}` from a JSON file (or an inline JSON object string).

    Weights must be positive finite numbers; they are returned as given (the loader normalises them). When
    `data_dir` is given, each prefix must match at least one `{data_dir}/{prefix}*.bin`.
    """
    text = str(path_or_json)
    if text.lstrip().startswith("{"):
        where, raw = "the --data_mixture JSON", text
    else:
        where = str(path_or_json)
        try:
            raw = Path(path_or_json).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{where}: mixture file not found; check --data_mixture") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: cannot read the mixture file ({_one_line(e)})") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({_one_line(e)}); "
                        f'write it as {{"prefix": weight, ...}}') from None
    if not isinstance(data, dict) or not data:
        raise UserError(f'{where}: a mixture must be a non-empty JSON object {{"prefix": weight, ...}}')
    mixture: dict[str, float] = {}
    for prefix, weight in data.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise UserError(f"{where}: weight of prefix {prefix!r} must be a positive number, got {weight!r}")
        if not prefix:
            raise UserError(f"{where}: empty prefix; name the shard prefix, e.g. \"train_slimpajama\"")
        if data_dir is not None and not _glob_shards(Path(data_dir), prefix):
            raise UserError(f"{where}: prefix {prefix!r} matches no {Path(data_dir) / prefix}*.bin; "
                            f"fix the prefix or --train_data_dir")
        mixture[prefix] = float(weight)
    return mixture


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _flag_for(prefix: str) -> str:
    return "--val_data_dir" if prefix.startswith("val") else "--train_data_dir"


def _check_dir(data_dir: str | os.PathLike, prefix: str) -> Path:
    path = Path(data_dir)
    if not path.exists():
        raise UserError(f"data dir {path} does not exist; run `archscale prepare` first or check {_flag_for(prefix)}")
    if not path.is_dir():
        raise UserError(f"data dir {path} is not a directory; check {_flag_for(prefix)}")
    return path


def _glob_shards(data_dir: Path, prefix: str) -> list[Path]:
    pattern = os.path.join(glob.escape(str(data_dir)), glob.escape(prefix) + "*.bin")
    return sorted(Path(p) for p in glob.glob(pattern) if os.path.isfile(p))


def _find_shards(data_dir: Path, prefix: str) -> list[Path]:
    files = _glob_shards(data_dir, prefix)
    if not files:
        raise UserError(f"no {prefix}*.bin in {data_dir}; run `archscale prepare` first or check {_flag_for(prefix)}")
    return files


def _manifest_dtype(data_dir: Path) -> str | None:
    """The token dtype the folder's manifest.json records (None without one: foreign lit-gpt shards)."""
    dtype = (read_manifest(data_dir) or {}).get("dtype")
    if dtype is None:
        return None
    try:
        return str(np.dtype(dtype))
    except TypeError:
        raise UserError(f"{data_dir / shard_format.MANIFEST}: unknown dtype {dtype!r}; re-create it with "
                        "`archscale prepare`") from None


def _block_counts(files: list[Path], block_size: int) -> np.ndarray:
    """Blocks per file, from the headers only (a file that is not a shard, or whose header dtype differs from
    its manifest's, raises format's UserError)."""
    expect = {d: _manifest_dtype(d) for d in {f.parent for f in files}}
    return np.array([shard_format.read_header(f, expect[f.parent])[1] // block_size for f in files],
                    dtype=np.int64)


def _no_block_error(data_dir: Path, prefix: str, block_size: int, files: list[Path]) -> UserError:
    longest = max(shard_format.read_header(f)[1] for f in files)
    return UserError(f"{data_dir / prefix}*.bin: all {len(files)} shards hold fewer than block_size={block_size} "
                     f"tokens (longest {longest}); use a smaller --ctx_len")


def _seed_int(seed: int) -> int:
    return int(seed) % (1 << 63)


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------- sources

class _Source:
    """One prefix: its usable files (those with at least one block) and their block counts."""

    def __init__(self, index: int, data_dir: Path, prefix: str, weight: float, block_size: int, n_shards: int):
        self.index = index
        self.prefix = prefix
        self.weight = weight
        all_files = _find_shards(data_dir, prefix)
        counts = _block_counts(all_files, block_size)
        keep = counts > 0
        if not keep.any():
            raise _no_block_error(data_dir, prefix, block_size, all_files)
        self.paths = [f for f, k in zip(all_files, keep) if k]
        self.names = [os.path.relpath(p, data_dir) for p in self.paths]
        self.nblocks = counts[keep]
        self.total_blocks = int(self.nblocks.sum())
        self.block_striding = len(self.paths) < n_shards
        if self.block_striding and self.total_blocks < n_shards:
            raise UserError(
                f"{data_dir / prefix}*.bin holds only {self.total_blocks} blocks of block_size={block_size}, fewer "
                f"than the {n_shards} data shards (world_size x num_workers); use a smaller --ctx_len, fewer "
                f"ranks/workers, or more data")
        h = hashlib.sha256()
        for name, n in zip(self.names, self.nblocks.tolist()):
            h.update(f"{name}\0{n}\n".encode())
        self.digest = h.hexdigest()[:16]
        self._order_cache: tuple[int, np.ndarray] | None = None

    def fingerprint(self) -> dict:
        return {"prefix": self.prefix, "weight": self.weight, "n_files": len(self.names),
                "first_file": self.names[0], "last_file": self.names[-1], "blocks": self.total_blocks,
                "digest": self.digest}

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """File indices of this epoch, in reading order; identical on all ranks."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self.paths)
        order = _rng(seed, _TAG_FILE_ORDER, self.index, epoch).permutation(n) if shuffle else np.arange(n)
        self._order_cache = (epoch, order)
        return order


class _Stream:
    """The block stream of one (source, data shard); its position is (epoch, buffer, pos)."""

    def __init__(self, loader: PackedLoader, source: _Source, worker: int):
        self.loader = loader
        self.source = source
        self.worker = worker
        self.shard = loader.rank * loader.num_workers + worker
        self.epoch = 0
        self.buffer = 0
        self.pos = 0
        self._plan: tuple[int, list[np.ndarray], np.ndarray | None] | None = None  # epoch, buffers, starts
        self._buf_key: tuple[int, int] | None = None
        self._buf_files = np.zeros(0, dtype=np.int64)
        self._buf_blocks = np.zeros(0, dtype=np.int64)
        self._open: dict[int, np.ndarray] = {}

    # -- plan of an epoch: which files form each buffer of this data shard
    def _epoch_plan(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray | None]:
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1], self._plan[2]
        ld, src = self.loader, self.source
        order = src.epoch_order(epoch, ld._seed, ld.shuffle)
        bc = ld.buffer_chunks
        if src.block_striding:
            files = order
            counts = src.nblocks[order]
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # global block number
        else:
            files = order[self.shard::ld.n_shards]
            starts = None
        buffers = [files[i:i + bc] for i in range(0, len(files), bc)]
        self._plan = (epoch, buffers, starts)
        return buffers, starts

    def _load_buffer(self) -> None:
        key = (self.epoch, self.buffer)
        if self._buf_key == key:
            return
        ld, src = self.loader, self.source
        buffers, starts = self._epoch_plan(self.epoch)
        fids = buffers[self.buffer]
        if starts is None:
            counts = src.nblocks[fids]
            files = np.repeat(fids, counts)
            blocks = np.concatenate([np.arange(n, dtype=np.int64) for n in counts.tolist()])
        else:
            S = ld.n_shards
            f_parts, b_parts = [], []
            first = self.buffer * ld.buffer_chunks
            for j, f in enumerate(fids.tolist()):
                k0 = (self.shard - int(starts[first + j])) % S
                ks = np.arange(k0, int(src.nblocks[f]), S, dtype=np.int64)
                f_parts.append(np.full(len(ks), f, dtype=np.int64))
                b_parts.append(ks)
            files = np.concatenate(f_parts) if f_parts else np.zeros(0, dtype=np.int64)
            blocks = np.concatenate(b_parts) if b_parts else np.zeros(0, dtype=np.int64)
        if ld.shuffle and len(files) > 1:
            perm = _rng(ld._seed, _TAG_BUFFER, src.index, ld.rank, self.worker, self.epoch,
                        self.buffer).permutation(len(files))
            files, blocks = files[perm], blocks[perm]
        self._buf_key = key
        self._buf_files, self._buf_blocks = files, blocks
        self._open = {}  # memmaps of the previous buffer are released

    def next_block(self, out: np.ndarray | None) -> None:
        """Copy the next block into `out` (int64, length block_size) and advance; `out=None` only advances
        (nothing is read: skipping another rank's samples costs index arithmetic only)."""
        while True:
            self._load_buffer()
            if self.pos < len(self._buf_files):
                break
            # This buffer is used up (or, in block striding, holds none of our blocks): move on.
            self.buffer += 1
            self.pos = 0
            if self.buffer >= len(self._epoch_plan(self.epoch)[0]):
                self.epoch += 1
                self.buffer = 0
        fid = int(self._buf_files[self.pos])
        k = int(self._buf_blocks[self.pos])
        self.pos += 1
        if out is None:
            return
        mm = self._open.get(fid)
        if mm is None:
            mm = self._open[fid] = shard_format.open_shard(self.source.paths[fid])
        bs = self.loader.block_size
        out[:] = mm[k * bs:(k + 1) * bs]

    def state(self) -> dict:
        return {"epoch": self.epoch, "buffer": self.buffer, "pos": self.pos}

    def set_state(self, st: Mapping) -> None:
        self.epoch, self.buffer, self.pos = int(st["epoch"]), int(st["buffer"]), int(st["pos"])
        # nothing is read here: the buffer's permutation is regenerated on the next block


# ----------------------------------------------------------------------------------------------- loader

class PackedLoader:
    """Infinite iterator of `(micro_bsz, block_size)` int64 batches with an exact `state_dict()`.

    Batch `j` is drawn from logical worker `j % num_workers`; each of its samples picks a source (mixture) and
    takes the next block of that source's stream for this (rank, worker). See the module docstring.
    """

    def __init__(self, data_dir: str | os.PathLike, prefixes: str | Mapping[str, float] = "train", *,
                 block_size: int, micro_bsz: int, seed: int = 3407, rank: int = 0, world_size: int = 1,
                 num_workers: int = 1, shuffle: bool = True, buffer_chunks: int = 8):
        self.block_size = _positive_int("block_size", block_size)
        self.micro_bsz = _positive_int("micro_bsz", micro_bsz)
        self.world_size = _positive_int("world_size", world_size)
        self.num_workers = max(1, _positive_int("num_workers", num_workers, minimum=0))  # 0 means 1 (in-process)
        self.buffer_chunks = _positive_int("buffer_chunks", buffer_chunks)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise UserError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        self.rank = int(rank)
        self.seed = int(seed)
        self._seed = _seed_int(seed)
        self.shuffle = bool(shuffle)
        self.n_shards = self.world_size * self.num_workers

        if isinstance(prefixes, str):
            mixture = {prefixes: 1.0}
        elif isinstance(prefixes, Mapping) and prefixes:
            mixture = {}
            for p, w in prefixes.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                    raise UserError(f"mixture weight of prefix {p!r} must be a positive number, got {w!r}")
                mixture[str(p)] = float(w)
        else:
            raise UserError(f"prefixes must be a prefix string or a non-empty {{prefix: weight}} mapping, "
                            f"got {prefixes!r}")
        first = next(iter(mixture))
        self.data_dir = _check_dir(data_dir, first)
        self.sources = [_Source(i, self.data_dir, p, w, self.block_size, self.n_shards)
                        for i, (p, w) in enumerate(mixture.items())]
        weights = np.array([s.weight for s in self.sources], dtype=np.float64)
        self._cdf = np.cumsum(weights / weights.sum())
        self._streams = [[_Stream(self, src, w) for w in range(self.num_workers)] for src in self.sources]
        self._mix_rng = _rng(self._seed, _TAG_MIXTURE, self.rank)
        self.next_worker = 0
        self.batches = 0

    # -- iteration
    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return torch.from_numpy(self._step(read=True))

    def skip(self, n: int = 1) -> None:
        """Advance past `n` batches exactly as `n` calls of `next()` would, without reading any data."""
        for _ in range(n):
            self._step(read=False)

    def _step(self, read: bool) -> np.ndarray | None:
        w = self.next_worker
        if len(self.sources) > 1:
            u = self._mix_rng.random(self.micro_bsz)
            picks = np.minimum(np.searchsorted(self._cdf, u, side="right"), len(self.sources) - 1).tolist()
        else:
            picks = [0] * self.micro_bsz
        batch = np.empty((self.micro_bsz, self.block_size), dtype=np.int64) if read else None
        for i, src in enumerate(picks):
            self._streams[src][w].next_block(batch[i] if read else None)
        self.next_worker = (w + 1) % self.num_workers
        self.batches += 1
        return batch

    # -- state
    def fingerprint(self) -> dict:
        return {"block_size": self.block_size, "micro_bsz": self.micro_bsz, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "num_workers": self.num_workers, "shuffle": self.shuffle,
                "buffer_chunks": self.buffer_chunks, "sources": [s.fingerprint() for s in self.sources]}

    def state_dict(self) -> dict:
        bg = self._mix_rng.bit_generator.state
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "streams": [[st.state() for st in per_src] for per_src in self._streams],
            "next_worker": self.next_worker,
            "batches": self.batches,
            # big integers as strings so that any JSON reader keeps them exact
            "mixture_rng": {"state": str(bg["state"]["state"]), "inc": str(bg["state"]["inc"]),
                            "has_uint32": int(bg["has_uint32"]), "uinteger": int(bg["uinteger"])},
        }

    def load_state_dict(self, sd: Mapping) -> None:
        """Restore the position; the next batch is the one an uninterrupted loader would give. Reads no data."""
        version = sd.get("version") if isinstance(sd, Mapping) else None
        if version != STATE_VERSION:
            raise UserError(f"data loader state has version {version!r}, expected {STATE_VERSION}; "
                            f"the checkpoint was written by another archscale version")
        diffs = _fingerprint_diff(sd.get("fingerprint", {}), self.fingerprint())
        if diffs:
            raise UserError(
                f"cannot resume the data loader of rank {self.rank} from this checkpoint: {'; '.join(diffs)}; "
                f"the saved data position only fits the same data and batch settings, so resume with the original "
                f"settings or start the run fresh (--resume none)")
        try:
            streams = sd["streams"]
            if len(streams) != len(self._streams) or any(len(a) != len(b) for a, b in zip(streams, self._streams)):
                raise ValueError("stream count")
            for saved, per_src in zip(streams, self._streams):
                for st, stream in zip(saved, per_src):
                    if min(int(st["epoch"]), int(st["buffer"]), int(st["pos"])) < 0:
                        raise ValueError("negative position")
            rng = sd["mixture_rng"]
            bg_state = {"bit_generator": "PCG64",
                        "state": {"state": int(rng["state"]), "inc": int(rng["inc"])},
                        "has_uint32": int(rng["has_uint32"]), "uinteger": int(rng["uinteger"])}
            next_worker = int(sd["next_worker"])
            if not 0 <= next_worker < self.num_workers:
                raise ValueError("next_worker")
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"data loader state in the checkpoint is malformed ({_one_line(e)}); "
                            f"start the run fresh (--resume none)") from None
        for saved, per_src in zip(streams, self._streams):
            for st, stream in zip(saved, per_src):
                stream.set_state(st)
        self._mix_rng.bit_generator.state = bg_state
        self.next_worker = next_worker
        self.batches = int(sd.get("batches", 0))


class GlobalOrderLoader:
    """Rank `rank`'s share of ONE sample order that does not depend on the number of ranks.

    The global order is that of a single-process `PackedLoader` (world_size=1; logical workers, shuffling and
    mixture as described above): global micro-batch 0, 1, 2, ... Rank r of W takes the micro-batches j with
    j % W == r. Each `next()` consumes a group of W global micro-batches: it skips the r before its own and the
    W-1-r after it without reading them (`PackedLoader.skip`). Hence:

    * an optimizer step of `accum` micro-batches per rank covers global micro-batches [s*A, (s+1)*A) with
      A = accum * W, the same samples whatever W is (the trainer keeps A = micro-batches per global batch fixed);
    * after n calls every rank sits at global position n*W, so `state_dict()` is identical on all ranks and is
      exactly the single-process state; it can be loaded with any world size that divides the position (at an
      optimizer-step boundary: any W that divides A). That is the cross-world-size resume mapping (2 -> 1 -> 2).

    Prefer this for training; `PackedLoader(rank=, world_size=)` (disjoint files per rank) stays available for
    readers that want each rank to open only its own files, at the price of an order tied to the world size.
    """

    def __init__(self, data_dir: str | os.PathLike, prefixes: str | Mapping[str, float] = "train", *,
                 block_size: int, micro_bsz: int, seed: int = 3407, rank: int = 0, world_size: int = 1,
                 num_workers: int = 1, shuffle: bool = True, buffer_chunks: int = 8):
        self.world_size = _positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise UserError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        self.rank = int(rank)
        self.inner = PackedLoader(data_dir, prefixes, block_size=block_size, micro_bsz=micro_bsz, seed=seed,
                                  num_workers=num_workers, shuffle=shuffle, buffer_chunks=buffer_chunks)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        self.inner.skip(self.rank)
        batch = next(self.inner)
        self.inner.skip(self.world_size - 1 - self.rank)
        return batch

    def state_dict(self) -> dict:
        return self.inner.state_dict()  # the global position: the same on every rank, for any world size

    def load_state_dict(self, sd: Mapping) -> None:
        batches = int(sd.get("batches", 0)) if isinstance(sd, Mapping) else 0
        if batches % self.world_size:
            raise UserError(f"the saved data position ({batches} global micro-batches) is not a multiple of the "
                            f"new world size {self.world_size}; resume with a world size that divides the number "
                            f"of micro-batches per optimizer step")
        self.inner.load_state_dict(sd)


_HINTS = {"block_size": " (--ctx_len)", "micro_bsz": " (--micro_bsz)", "world_size": " (number of ranks)",
          "num_workers": " (--num_workers)", "seed": " (--seed)"}


def _fingerprint_diff(old: Mapping, new: Mapping) -> list[str]:
    diffs = []
    for key in ("block_size", "micro_bsz", "seed", "rank", "world_size", "num_workers", "shuffle", "buffer_chunks"):
        if old.get(key) != new[key]:
            diffs.append(f"{key}{_HINTS.get(key, '')} changed from {old.get(key)!r} to {new[key]!r}")
    old_src, new_src = list(old.get("sources", [])), new["sources"]
    old_names = [s.get("prefix") for s in old_src]
    new_names = [s["prefix"] for s in new_src]
    if old_names != new_names:
        diffs.append(f"the data prefixes changed from {old_names} to {new_names}")
        return diffs
    for o, n in zip(old_src, new_src):
        p = n["prefix"]
        if o.get("weight") != n["weight"]:
            diffs.append(f"the mixture weight of {p!r} changed from {o.get('weight')!r} to {n['weight']!r}")
        if o.get("digest") != n["digest"]:
            diffs.append(f"the files of {p!r} changed ({o.get('n_files')} files {o.get('first_file')}.."
                         f"{o.get('last_file')} with {o.get('blocks')} blocks, now {n['n_files']} files "
                         f"{n['first_file']}..{n['last_file']} with {n['blocks']} blocks)")
    return diffs


# ----------------------------------------------------------------------------------------------- validation

def validation_batches(data_dir: str | os.PathLike, prefix: str = "validation", *, block_size: int, micro_bsz: int,
                       max_batches: int | None = None, rank: int = 0,
                       world_size: int = 1) -> Iterator[torch.Tensor]:
    """One sequential, unshuffled pass over `{data_dir}/{prefix}*.bin` as `(<=micro_bsz, block_size)` batches.

    The blocks (files sorted, blocks in file order) are numbered globally; rank `r` takes numbers `r, r+W, ...`.
    Every rank gets the same number of blocks, `total // world_size` (the few left over are skipped), so all ranks
    yield the same number of batches (no collective can hang). The last partial batch is KEPT (it is shorter,
    identical in size on all ranks), so a small validation set is still evaluated in full. Errors are raised
    when this function is called, not at the first batch.
    """
    block_size = _positive_int("block_size", block_size)
    micro_bsz = _positive_int("micro_bsz", micro_bsz)
    world_size = _positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise UserError(f"rank must be in [0, {world_size}), got {rank!r}")
    if max_batches is not None:
        max_batches = _positive_int("max_batches", max_batches, minimum=0)
    path = _check_dir(data_dir, prefix)
    files = _find_shards(path, prefix)
    counts = _block_counts(files, block_size)
    total = int(counts.sum())
    if total == 0:
        raise _no_block_error(path, prefix, block_size, files)
    per_rank = total // world_size
    if per_rank == 0:
        raise UserError(f"{path / prefix}*.bin holds only {total} blocks of block_size={block_size}, fewer than "
                        f"world_size={world_size}; use a smaller --ctx_len or more validation data")
    n_batches = math.ceil(per_rank / micro_bsz)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    return _validation_iter(files, counts, block_size, micro_bsz, n_batches, per_rank, rank, world_size)


def _validation_iter(files: list[Path], counts: np.ndarray, block_size: int, micro_bsz: int, n_batches: int,
                     per_rank: int, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # global number of each file's block 0
    fid, mm = -1, None
    taken = 0
    for _ in range(n_batches):
        n = min(micro_bsz, per_rank - taken)
        batch = np.empty((n, block_size), dtype=np.int64)
        for i in range(n):
            g = rank + (taken + i) * world_size
            f = int(np.searchsorted(starts, g, side="right")) - 1
            if f != fid:
                fid, mm = f, shard_format.open_shard(files[f])
            k = g - int(starts[f])
            batch[i] = mm[k * block_size:(k + 1) * block_size]
        taken += n
        yield torch.from_numpy(batch)

class Prefetcher:
    """Batches of `loader` read ahead on a background thread, `prepare`d there (on CUDA: copied into pinned
    memory, so that the trainer's `.to(device, non_blocking=True)` is a real asynchronous copy), handed out in
    the loader's own order. `state_dict()` is the loader's state after the last batch handed out (not after the
    ones read ahead), so a checkpoint resumes with exactly the next batch; an error of the loader is raised by
    the `next()` that would have returned its batch."""

    def __init__(self, loader, prepare: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch,
                 depth: int = 2):
        self.loader, self.prepare = loader, prepare
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._state = loader.state_dict()  # after the last batch handed out
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self.prepare(next(self.loader)), self.loader.state_dict(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="archscale-prefetch", daemon=True)
            self._thread.start()
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, sd) -> None:
        if self._thread is not None:
            raise RuntimeError("Prefetcher.load_state_dict after batches were read ahead")
        self.loader.load_state_dict(sd)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        """Stop the reader thread (it exits after its current batch)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def prefetching(loader, device: torch.device, pin: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """The trainer's batch source: on CUDA a `Prefetcher` into pinned memory (`pin`, default
    `Tensor.pin_memory`; a test injects its own), elsewhere `loader` itself (a CPU batch needs no copy)."""
    if device.type != "cuda":
        return loader
    return Prefetcher(loader, prepare=pin or (lambda batch: batch.pin_memory()))
