"""Tokenizing `archscale prepare`'s work units into shards: in this process or in a pool of spawned workers.

Each unit is tokenized by one worker into its own chunk files (`ShardWriter`: documents run across chunk
boundaries; the final partial chunk is written, never dropped) and finished by writing its done record. Workers
report progress through shared counters that the parent shows as a progress bar.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from archscale.data.format import ShardWriter
from archscale.data.prepare_state import (PREPARE_VERSION, SPLITS, STATE_DIR, Unit, done_record_path, hash_u64,
                                          write_json)
from archscale.data.sources import iter_texts
from archscale.data.tokenizer import Tokenizer
from archscale.errors import UserError

# encode_batch amortizes the per-call overhead; the character cap bounds the memory of a batch of huge documents.
_BATCH_DOCS = 1024  # documents per encode_batch call
_BATCH_CHARS = 8 << 20  # ... or this many characters, whichever comes first


# ---------------------------------------------------------------------------------------------- progress

class ProgressUI:
    """A rich progress bar on stderr (bytes read, tokens, units done); does nothing unless `show`."""

    def __init__(self, show: bool, total_bytes: int, total_units: int):
        self.show = show
        self.total_bytes = total_bytes
        self.total_units = total_units
        self.units = 0
        self._progress = None
        self._task = None
        self._last = 0.0

    def __enter__(self):
        if self.show:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._progress = Progress(
                TextColumn("[bold]prepare[/bold]"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TextColumn("{task.fields[tokens]:,} tokens"), TextColumn("{task.fields[units]}"),
                TimeRemainingColumn(), console=Console(file=sys.stderr),
            )
            self._progress.start()
            self._task = self._progress.add_task("prepare", total=max(1, self.total_bytes), tokens=0,
                                                 units=f"0/{self.total_units} units")
        return self

    def update(self, nbytes: int, ntokens: int, force: bool = False) -> None:
        if self._progress is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:  # redrawing on every batch would cost more than the work
            return
        self._last = now
        self._progress.update(self._task, completed=nbytes, tokens=ntokens,
                              units=f"{self.units}/{self.total_units} units")

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False


class _LocalCounters:
    """Progress counters for in-process work (calls the UI directly)."""

    def __init__(self, ui: ProgressUI):
        self.ui = ui
        self.bytes = 0
        self.tokens = 0

    def add(self, nbytes: int, ntokens: int) -> None:
        self.bytes += nbytes
        self.tokens += ntokens
        self.ui.update(self.bytes, self.tokens)


class _SharedCounters:
    """Progress counters shared with spawned workers (inherited at spawn time)."""

    def __init__(self, ctx):
        self._bytes = ctx.Value("q", 0)
        self._tokens = ctx.Value("q", 0)

    def add(self, nbytes: int, ntokens: int) -> None:
        with self._bytes.get_lock():
            self._bytes.value += nbytes
        with self._tokens.get_lock():
            self._tokens.value += ntokens

    @property
    def bytes(self) -> int:
        return self._bytes.value

    @property
    def tokens(self) -> int:
        return self._tokens.value


# Per-process state: a worker gets its counters from the pool initializer; in-process runs set them around the
# loop. Tokenizers are cached so a worker loads one once, not once per unit.
_COUNTERS = None
_TOKENIZERS: dict[str, Tokenizer] = {}


def _init_worker(counters, parent_pid: int | None = None) -> None:
    global _COUNTERS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; don't oversubscribe
    _COUNTERS = counters
    if parent_pid is not None:
        die_with_parent(parent_pid)


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """End this worker when `prepare`'s main process dies, even by kill -9 (which runs no cleanup there):
    Linux's parent-death signal (prctl PR_SET_PDEATHSIG), and, on every OS, a watchdog thread that exits once
    the parent pid changes (the worker was re-parented). A killed worker leaves at most `*.tmp` files, which a
    re-run deletes before redoing its unit."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="archscale-parent-watchdog", daemon=True).start()


def _report(nbytes: int, ntokens: int) -> None:
    if _COUNTERS is not None and (nbytes or ntokens):
        _COUNTERS.add(nbytes, ntokens)


def _get_tokenizer(path: str) -> Tokenizer:
    tok = _TOKENIZERS.get(path)
    if tok is None:
        tok = _TOKENIZERS[path] = Tokenizer(path)
    return tok


# ---------------------------------------------------------------------------------------------- one unit

def _batches(docs: Iterator[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
    batch: list[tuple[int, str]] = []
    chars = 0
    for item in docs:
        batch.append(item)
        chars += len(item[1])
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _Spool:
    """Collects a unit's documents of one split on disk so they can be written out in a shuffled order."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.f = open(path, "wb")
        self.lengths: list[int] = []

    def add_docs(self, flat: np.ndarray, lengths: list[int]) -> None:
        self.f.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self.lengths.extend(lengths)

    def drain(self, writer: ShardWriter, seed_u64: int) -> None:
        self.f.close()
        n = int(sum(self.lengths))
        if n:
            data = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(n,))
            offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=offsets[1:])
            for i in np.random.default_rng(seed_u64).permutation(len(self.lengths)):
                writer.add(data[offsets[i]:offsets[i + 1]])
            del data
        os.remove(self.path)


def document_hash(seed: int, key: str, index: int) -> int:
    """The 64-bit hash that decides the split of document `index` of file `key`."""
    return hash_u64(f"{seed}\x00{key}\x00{index}")


def _split_chooser(val_fraction: float, seed: int, force: list | None = None) -> Callable[[str, int], str]:
    """The split of document `index` of file `key`: a hash of (seed, key, index), so it depends on nothing else;
    `force` ([{"key", "index", "split"}]) overrides it for the documents prepare() moved to keep a split non-empty."""
    threshold = math.floor(val_fraction * 2.0 ** 64)
    forced = {(f["key"], f["index"]): f["split"] for f in force or ()}

    def split_of(key: str, index: int) -> str:
        if (key, index) in forced:
            return forced[(key, index)]
        if val_fraction <= 0:
            return "train"
        if val_fraction >= 1:
            return "validation"
        return "validation" if document_hash(seed, key, index) < threshold else "train"

    return split_of


def _note_extremes(stats: dict, seed: int, key: str, idxs: list[int]) -> None:
    """Keep the file's non-empty documents of lowest and highest hash: prepare() moves one of them when a split
    would otherwise stay empty."""
    for idx in idxs:
        h = document_hash(seed, key, idx)
        if stats["lowest"] is None or h < stats["lowest"][0]:
            stats["lowest"] = [h, idx]
        if stats["highest"] is None or h > stats["highest"][0]:
            stats["highest"] = [h, idx]


def _tokenize_file(f: dict, tok: Tokenizer, job: dict, dtype: np.dtype, split_of: Callable[[str, int], str],
                   writers: dict[str, ShardWriter], spools: dict[str, _Spool] | None) -> dict:
    """Tokenize one input file into the unit's writers (or spools); return its counts."""
    max_length = job["max_length"]
    stats = {"documents": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS}, "skipped_empty": 0,
             "lowest": None, "highest": None}
    pending_bytes = 0

    def on_bytes(n: int) -> None:
        nonlocal pending_bytes
        pending_bytes += n

    for batch in _batches(iter_texts(f["path"], job["text_key"], on_bytes)):
        idxs, texts = [], []
        for idx, text in batch:
            if text.strip():
                idxs.append(idx)
                texts.append(text)
            else:
                stats["skipped_empty"] += 1
        encoded = tok.encode_batch(texts, eos=False) if texts else []
        _note_extremes(stats, job["seed"], f["key"], idxs)
        parts: dict[str, list[list[int]]] = {s: [] for s in SPLITS}
        for idx, ids in zip(idxs, encoded):
            split = split_of(f["key"], idx)
            if max_length is not None and len(ids) >= max_length:
                # ProLong-style: a long document becomes pieces of max_length tokens, each closed by an EOS
                step = max_length - 1
                for a in range(0, len(ids), step):
                    parts[split].append(ids[a:a + step] + [tok.eos_id])
                continue
            ids.append(tok.eos_id)
            parts[split].append(ids)
        ntok = 0
        for s, docs in parts.items():
            if not docs:
                continue
            lengths = [len(d) for d in docs]
            total = sum(lengths)
            flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=total)
            if spools is not None:
                spools[s].add_docs(flat, lengths)
            else:
                writers[s].add(flat)
            stats["documents"][s] += len(docs)
            stats["tokens"][s] += total
            ntok += total
        _report(pending_bytes, ntok)
        pending_bytes = 0
    _report(pending_bytes, 0)
    return stats


def process_unit(unit: dict, job: dict) -> dict:
    """Tokenize one unit (`Unit.payload()`) into its shards and write its done record; return the record."""
    tok = _get_tokenizer(job["tokenizer"])
    out = Path(job["output_dir"])
    dtype = np.dtype(job["dtype"])
    name = unit["name"]
    seed = job["seed"]
    split_of = _split_chooser(job["val_fraction"], seed, job.get("force"))

    writers = {s: ShardWriter(out, f"{s}_{name}", job["chunk_size"], dtype) for s in SPLITS}
    # With shuffle, documents go through disk: a unit may be too big to permute in memory.
    spools = ({s: _Spool(out / STATE_DIR / f"{name}.{s}.spool.tmp", dtype) for s in SPLITS}
              if job["shuffle"] else None)
    inputs = [{**f, **_tokenize_file(f, tok, job, dtype, split_of, writers, spools)} for f in unit["files"]]

    splits = {}
    for s in SPLITS:
        if spools is not None:
            spools[s].drain(writers[s], hash_u64(f"shuffle\x00{seed}\x00{name}\x00{s}"))
        splits[s] = {"documents": sum(i["documents"][s] for i in inputs),
                     "tokens": sum(i["tokens"][s] for i in inputs),
                     "files": writers[s].close()}
    record = {"version": PREPARE_VERSION, "unit": name, "inputs": inputs, "splits": splits}
    write_json(done_record_path(out, name), record)
    return record


# ---------------------------------------------------------------------------------------------- many units

def run_units(pending: list[Unit], job: dict, workers: int, tok: Tokenizer, ui: ProgressUI,
              done_cb: Callable[[Unit, dict], None]) -> None:
    """Process `pending`, calling `done_cb(unit, record)` as each finishes; in this process if `workers` <= 1."""
    if workers > 1:
        _run_pool(pending, job, workers, ui, done_cb)
        return
    global _COUNTERS
    _TOKENIZERS[tok.path] = tok  # reuse the caller's tokenizer instead of loading it again
    counters = _LocalCounters(ui)
    saved, _COUNTERS = _COUNTERS, counters
    try:
        for u in pending:
            done_cb(u, process_unit(u.payload(), job))
            ui.update(counters.bytes, counters.tokens, force=True)
    finally:
        _COUNTERS = saved


def _terminate(executor) -> None:
    """Kill the pool's workers now: shutdown() alone would wait for the running units to finish."""
    fn = getattr(executor, "terminate_workers", None)  # Python >= 3.14
    if fn is not None:
        try:
            fn()
        except Exception:
            pass
        return
    for p in list((getattr(executor, "_processes", None) or {}).values()):
        try:
            p.terminate()
        except Exception:
            pass


def _run_pool(pending: list[Unit], job: dict, workers: int, ui: ProgressUI,
              done_cb: Callable[[Unit, dict], None]) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("spawn")
    counters = _SharedCounters(ctx)
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(counters, os.getpid()))
    try:
        order = sorted(pending, key=lambda u: -u.size)  # biggest first: better balance; output is order-free
        futures = {ex.submit(process_unit, u.payload(), job): u for u in order}
        left = set(futures)
        while left:
            done, left = wait(left, timeout=0.2, return_when=FIRST_COMPLETED)
            for fut in done:
                try:
                    rec = fut.result()
                except BrokenProcessPool:
                    raise UserError(f"a prepare worker process died (out of memory?); re-run with a smaller "
                                    f"--num_workers (now {workers}); finished inputs are kept") from None
                done_cb(futures[fut], rec)
            ui.update(counters.bytes, counters.tokens, force=bool(done))
    except BaseException:
        _terminate(ex)
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
