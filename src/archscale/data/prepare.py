"""`archscale prepare`: text / JSONL / Parquet -> tokenized LITPKDS shards + manifest.json, resumable.

Inputs. Each `--input` is a file or a folder (searched recursively, hidden entries skipped, sorted) of:
  * `.txt`            - one document per file;
  * `.jsonl(.gz)`     - one JSON object per line, the document in field `text_key` (blank lines are skipped);
  * `.parquet`        - the document in column `text_key`, read one record batch at a time.
Every file gets a *key*: its path relative to the common parent of all inputs (so `--input wiki/train.jsonl
books/train.jsonl` gives the keys "wiki/train.jsonl" and "books/train.jsonl"). Keys do not depend on where the
data lives, so moving the corpus does not change the output.

Documents. `tokenizer.encode(text)`: EOS appended, no BOS (the seed's convention), optionally truncated to
`max_length` tokens including the EOS. Blank documents (only whitespace) are skipped and counted.

Split. A document goes to validation iff blake2b(seed, file key, document index) / 2**64 < val_fraction, where the
index is the line number (JSONL), the row number (Parquet) or 0 (.txt). The split therefore does not depend on the
number of workers, the order of inputs, or on other documents.

Work units and outputs. Files are grouped into *units*: consecutive files of one `--input` argument are packed
together while the unit stays under `UNIT_BYTES` (bigger files are a unit on their own), so a folder of thousands
of small .txt files does not give thousands of tiny shards. Each unit is tokenized by one worker (a process pool
of `num_workers`, spawned) into its own chunk files `{split}_{unit}_{counter:010d}.bin`, split in
("train", "validation"), with `ShardWriter` (documents run across chunk boundaries; the final partial chunk is
written, never dropped). With `shuffle`, a unit's documents are written in a permuted order (seeded by `seed` and
the unit name); the document-to-split assignment is unchanged. The trainer's loader additionally shuffles files.

Resume. `output_dir/.prepare/settings.json` records everything that decides the output (tokenizer hash, inputs and
their grouping, split and chunking settings); a re-run with different settings is refused. When a unit is
finished - all of its shards written (each atomically) - the worker writes `.prepare/{unit}.done.json` (atomically)
with its files and counts. A re-run skips units whose record is intact (the files exist with valid headers holding
the recorded number of tokens, the inputs have the recorded size and mtime) and redoes the others after deleting
their leftovers (shards not in a record, `*.tmp`). `manifest.json` is written last, atomically, and removed while
any unit is being (re)done, so nothing half-written looks complete.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from archscale.data.format import ShardWriter, auto_dtype, read_header
from archscale.data.tokenizer import Tokenizer
from archscale.errors import UserError

__all__ = ["prepare", "list_input_files", "iter_texts", "InputFile", "SUPPORTED_EXTENSIONS", "UNIT_BYTES"]

SUPPORTED_EXTENSIONS = (".jsonl.gz", ".jsonl", ".txt", ".parquet")
UNIT_BYTES = 64 << 20  # target input bytes per work unit (small files are grouped up to this)
PREPARE_VERSION = 1
SPLITS = ("train", "validation")
STATE_DIR = ".prepare"
MANIFEST = "manifest.json"
SETTINGS = "settings.json"

_BATCH_DOCS = 1024  # documents per encode_batch call
_BATCH_CHARS = 8 << 20  # ... or this many characters, whichever comes first
_REPORT_BYTES = 1 << 20  # progress is reported at this granularity


# ---------------------------------------------------------------------------------------------- inputs

@dataclass
class InputFile:
    path: str  # absolute path
    key: str  # path relative to the common parent of all inputs, "/"-separated
    size: int
    mtime_ns: int
    arg: int  # index of the --input argument it came from

    def as_dict(self) -> dict:
        return {"key": self.key, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def _extension(name: str) -> str | None:
    low = name.lower()
    for ext in SUPPORTED_EXTENSIONS:
        if low.endswith(ext):
            return ext
    return None


def _walk(folder: Path) -> list[Path]:
    found: list[Path] = []
    seen: set[str] = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a symlink cycle
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and _extension(name):
                found.append(Path(root) / name)
    found.sort(key=lambda q: q.relative_to(folder).as_posix())
    return found


def list_input_files(inputs: Sequence[str | os.PathLike]) -> list[InputFile]:
    """Expand `--input` arguments into the ordered list of files to read (UserError for bad arguments)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise UserError("--input: give at least one file or folder")
    per_arg: list[tuple[int, str, list[Path]]] = []
    for i, raw in enumerate(inputs):
        p = Path(raw).expanduser()
        if not p.exists():
            raise UserError(f"--input {raw}: no such file or folder")
        if p.is_dir():
            files = _walk(p)
            if not files:
                raise UserError(f"--input {raw}: the folder holds no .txt, .jsonl, .jsonl.gz or .parquet files")
        elif p.is_file():
            if not _extension(p.name):
                raise UserError(f"--input {raw}: unsupported file type; use .txt (one document per file), "
                                f".jsonl, .jsonl.gz or .parquet, or a folder of them")
            files = [p]
        else:
            raise UserError(f"--input {raw}: not a regular file or folder")
        per_arg.append((i, str(raw), files))

    parents = [os.path.dirname(os.path.abspath(Path(raw).expanduser())) for _, raw, _ in per_arg]
    common = os.path.commonpath(parents) if parents else os.getcwd()
    out: list[InputFile] = []
    origin: dict[str, str] = {}
    for i, raw, files in per_arg:
        for f in files:
            absf = os.path.abspath(f)
            real = os.path.realpath(absf)
            if real in origin:
                raise UserError(f"--input {raw}: {absf} is included twice (also via --input {origin[real]}); "
                                f"give each file once")
            origin[real] = raw
            try:
                st = os.stat(absf)
            except OSError as e:
                raise UserError(f"--input {raw}: cannot read {absf} ({e.strerror})") from None
            key = os.path.relpath(absf, common).replace(os.sep, "/")
            out.append(InputFile(absf, key, int(st.st_size), int(st.st_mtime_ns), i))
    return out


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def iter_texts(path: str | os.PathLike, text_key: str = "text",
               on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, str]]:
    """Yield `(index, text)` for every document of one input file; blank documents are yielded too.

    index: the 1-based line number (JSONL), the 0-based row (Parquet), 0 (.txt). `on_bytes(n)` is called with
    progress in bytes of the file; the calls add up to the file size. Bad content raises UserError naming the file
    (and the line for .txt / JSONL).
    """
    path = str(path)
    ext = _extension(path)
    report = on_bytes or (lambda n: None)
    if ext == ".txt":
        yield from _iter_txt(path, report)
    elif ext in (".jsonl", ".jsonl.gz"):
        yield from _iter_jsonl(path, text_key, ext == ".jsonl.gz", report)
    elif ext == ".parquet":
        yield from _iter_parquet(path, text_key, report)
    else:
        raise UserError(f"{path}: unsupported file type; use .txt, .jsonl, .jsonl.gz or .parquet")


def _iter_txt(path: str, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}:{_line_of(data, e.start)}: not valid UTF-8 (byte {e.start}); "
                        f"convert the file to UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    report(len(data))
    yield 0, text


def _iter_jsonl(path: str, text_key: str, gz: bool, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    size = os.fstat(raw.fileno()).st_size
    done = pending = 0
    with raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        lineno = 0
        lines = iter(stream)
        while True:
            try:
                line = next(lines)
            except StopIteration:
                break
            except (OSError, EOFError, zlib.error) as e:
                what = "corrupt or truncated gzip file" if gz else "read error"
                raise UserError(f"{path}:{lineno + 1}: {what} ({e}); re-create or re-download it") from None
            lineno += 1
            if gz:
                pos = raw.tell()
                if pos - done >= _REPORT_BYTES:
                    report(pos - done)
                    done = pos
            else:
                pending += len(line)
                if pending >= _REPORT_BYTES:
                    report(pending)
                    done += pending
                    pending = 0
            if not line.strip():
                continue
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line); "
                                f"convert the file to UTF-8") from None
            if lineno == 1 and s.startswith("\ufeff"):
                s = s[1:]
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} field, "
                                f"got a JSON {type(obj).__name__}")
            if text_key not in obj:
                keys = ", ".join(list(obj)[:8]) or "none"
                raise UserError(f"{path}:{lineno}: no {text_key!r} field (fields: {keys}); "
                                f"pass --text_key to read another field")
            text = obj[text_key]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: field {text_key!r} is a {type(text).__name__}, not a string")
            yield lineno, text
    if size > done:
        report(size - done)


def _iter_parquet(path: str, text_key: str, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def fail(e: Exception) -> UserError:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return UserError(f"{path}: cannot read it as Parquet ({msg})")

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as e:
        raise fail(e) from None
    if text_key not in schema.names:
        cols = ", ".join(schema.names[:8]) or "none"
        raise UserError(f"{path}: no column {text_key!r} (columns: {cols}); pass --text_key to read another column")
    typ = schema.field(text_key).type
    string_types = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        string_types.append(pa.types.is_string_view)
    if not any(check(typ) for check in string_types):
        raise UserError(f"{path}: column {text_key!r} has type {typ}, not string")
    size = os.path.getsize(path)
    rows_total = max(1, pf.metadata.num_rows)
    row = 0
    done = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=[text_key]):
            for text in batch.column(0).to_pylist():
                yield row, (text or "")
                row += 1
            now = size * row // rows_total
            if now > done:
                report(now - done)
                done = now
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise fail(e) from None
    if size > done:
        report(size - done)


# ---------------------------------------------------------------------------------------------- units

@dataclass
class _Unit:
    name: str
    files: list[InputFile] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def payload(self) -> dict:
        return {"name": self.name, "files": [f.as_dict() for f in self.files]}


def _hash_hex(text: str, n: int = 6) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()[:n]


def _hash_u64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _base_name(key: str) -> str:
    ext = _extension(key) or ""
    stem = key[: len(key) - len(ext)] if ext else key
    s = re.sub(r"[^A-Za-z0-9-]+", "_", stem.replace("/", "-")).strip("_-") or "input"
    if len(s) > 80:
        s = s[:80].rstrip("_-") + "-" + _hash_hex(key)
    return s


def _make_units(files: list[InputFile], unit_bytes: int) -> list[_Unit]:
    units: list[_Unit] = []
    cur: _Unit | None = None
    for f in files:
        if cur is None or cur.files[0].arg != f.arg or cur.size + f.size > unit_bytes:
            cur = _Unit(_base_name(f.key), [f])
            units.append(cur)
        else:
            cur.files.append(f)
    # Unit names must be unique, also on case-insensitive file systems.
    counts: dict[str, int] = {}
    for u in units:
        counts[u.name.lower()] = counts.get(u.name.lower(), 0) + 1
    for u in units:
        if counts[u.name.lower()] > 1:
            u.name = f"{u.name}-{_hash_hex(u.files[0].key)}"
    seen: set[str] = set()
    for i, u in enumerate(units):
        if u.name.lower() in seen:  # practically impossible after the hash, but never overwrite another unit
            u.name = f"{u.name}-{i}"
        seen.add(u.name.lower())
    return units


def _unit_file_re(name: str) -> re.Pattern:
    return re.compile(rf"^(train|validation)_{re.escape(name)}_\d{{10}}\.bin(\.tmp)?$")


# ---------------------------------------------------------------------------------------------- workers

class _LocalCounters:
    """Progress counters for in-process work (calls the UI directly)."""

    def __init__(self, ui: "_ProgressUI"):
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


_COUNTERS = None  # set per process: _LocalCounters in-process, _SharedCounters in a worker
_TOKENIZERS: dict[str, Tokenizer] = {}


def _init_worker(counters) -> None:
    global _COUNTERS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; don't oversubscribe
    _COUNTERS = counters


def _report(nbytes: int, ntokens: int) -> None:
    if _COUNTERS is not None and (nbytes or ntokens):
        _COUNTERS.add(nbytes, ntokens)


def _get_tokenizer(path: str) -> Tokenizer:
    tok = _TOKENIZERS.get(path)
    if tok is None:
        tok = _TOKENIZERS[path] = Tokenizer(path)
    return tok


def _write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temp file in the same folder, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def _process_unit(unit: dict, job: dict) -> dict:
    """Tokenize one unit into its shards and write its done record; return the record."""
    tok = _get_tokenizer(job["tokenizer"])
    out = Path(job["output_dir"])
    state = out / STATE_DIR
    dtype = np.dtype(job["dtype"])
    name = unit["name"]
    eos = tok.eos_id
    max_length = job["max_length"]
    vf = job["val_fraction"]
    seed = job["seed"]
    threshold = math.floor(vf * 2.0 ** 64)

    writers = {s: ShardWriter(out, f"{s}_{name}", job["chunk_size"], dtype) for s in SPLITS}
    spools = ({s: _Spool(state / f"{name}.{s}.spool.tmp", dtype) for s in SPLITS} if job["shuffle"] else None)
    totals = {s: {"documents": 0, "tokens": 0} for s in SPLITS}
    inputs = []
    for f in unit["files"]:
        fstats = {"documents": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS}, "skipped_empty": 0}
        pending_bytes = [0]

        def on_bytes(n: int, _p=pending_bytes) -> None:
            _p[0] += n

        for batch in _batches(iter_texts(f["path"], job["text_key"], on_bytes)):
            idxs, texts = [], []
            for idx, text in batch:
                if text.strip():
                    idxs.append(idx)
                    texts.append(text)
                else:
                    fstats["skipped_empty"] += 1
            encoded = tok.encode_batch(texts, eos=False) if texts else []
            parts: dict[str, list[list[int]]] = {s: [] for s in SPLITS}
            for idx, ids in zip(idxs, encoded):
                if max_length is not None and len(ids) >= max_length:
                    del ids[max_length - 1:]
                ids.append(eos)
                if vf <= 0:
                    split = "train"
                elif vf >= 1:
                    split = "validation"
                else:
                    h = _hash_u64(f"{seed}\x00{f['key']}\x00{idx}")
                    split = "validation" if h < threshold else "train"
                parts[split].append(ids)
            ntok = 0
            for s in SPLITS:
                docs = parts[s]
                if not docs:
                    continue
                lengths = [len(d) for d in docs]
                total = sum(lengths)
                flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=total)
                if spools is not None:
                    spools[s].add_docs(flat, lengths)
                else:
                    writers[s].add(flat)
                fstats["documents"][s] += len(docs)
                fstats["tokens"][s] += total
                ntok += total
            _report(pending_bytes[0], ntok)
            pending_bytes[0] = 0
        _report(pending_bytes[0], 0)
        for s in SPLITS:
            totals[s]["documents"] += fstats["documents"][s]
            totals[s]["tokens"] += fstats["tokens"][s]
        inputs.append({**f, **fstats})

    splits = {}
    for s in SPLITS:
        if spools is not None:
            spools[s].drain(writers[s], _hash_u64(f"shuffle\x00{seed}\x00{name}\x00{s}"))
        splits[s] = {**totals[s], "files": writers[s].close()}
    record = {"version": PREPARE_VERSION, "unit": name, "inputs": inputs, "splits": splits}
    _write_json(state / f"{name}.done.json", record)
    return record


# ---------------------------------------------------------------------------------------------- progress

class _ProgressUI:
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
        if not force and now - self._last < 0.1:
            return
        self._last = now
        self._progress.update(self._task, completed=nbytes, tokens=ntokens,
                              units=f"{self.units}/{self.total_units} units")

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False


# ---------------------------------------------------------------------------------------------- prepare

def _check_args(val_fraction, chunk_size, max_length, num_workers, text_key, seed) -> None:
    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not isinstance(val_fraction, (int, float)) or isinstance(val_fraction, bool) \
            or not (0.0 <= float(val_fraction) <= 1.0):
        raise UserError(f"--val_fraction must be a number in [0, 1], got {val_fraction}")
    if not is_int(chunk_size) or chunk_size <= 0:
        raise UserError(f"--chunk_size must be a positive integer, got {chunk_size}")
    if max_length is not None and (not is_int(max_length) or max_length < 2):
        raise UserError(f"--max_length must be an integer >= 2 (tokens per document, EOS included) or omitted, "
                        f"got {max_length}")
    if not is_int(num_workers) or num_workers < 0:
        raise UserError(f"--num_workers must be an integer >= 0, got {num_workers}")
    if not isinstance(text_key, str) or not text_key:
        raise UserError(f"--text_key must be a non-empty field name, got {text_key!r}")
    if not is_int(seed):
        raise UserError(f"--seed must be an integer, got {seed!r}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _describe(value) -> str:
    s = json.dumps(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _check_settings(out: Path, settings: dict) -> None:
    state = out / STATE_DIR
    sfile = state / SETTINGS
    fix = "pick a new --output_dir or delete it"
    if sfile.exists():
        try:
            old = json.loads(sfile.read_text(encoding="utf-8"))
            assert isinstance(old, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AssertionError):
            raise UserError(f"--output_dir {out}: {sfile} is unreadable; {fix}") from None
        if old == settings:
            return
        if not any(n.endswith(".done.json") for n in os.listdir(state)):
            # Nothing was finished (an earlier attempt failed early, e.g. on a bad input the user has since
            # fixed): there is nothing to resume, so start over with the new settings.
            old_units = [u[0] for u in old.get("units", []) if isinstance(u, list) and u and isinstance(u[0], str)]
            pats = [_unit_file_re(n) for n in old_units]
            for n in os.listdir(out):
                if any(p.match(n) for p in pats) or n in (MANIFEST, MANIFEST + ".tmp"):
                    os.remove(out / n)
            for n in os.listdir(state):
                if n != SETTINGS:
                    os.remove(state / n)
            _write_json(sfile, settings)
            return
        diffs = []
        for k in settings:
            if old.get(k) != settings[k]:
                if k == "inputs":
                    a, b = old.get(k) or [], settings[k]
                    first = next((x for x, y in itertools.zip_longest(a, b) if x != y), None)
                    first = first or next((y for x, y in itertools.zip_longest(a, b) if x != y), None)
                    diffs.append(f"inputs: {len(a)} -> {len(b)} files, first difference {first!r}")
                elif k == "units":
                    diffs.append("grouping of the input files (their sizes changed)")
                else:
                    diffs.append(f"{k}: {_describe(old.get(k))} -> {_describe(settings[k])}")
        if diffs:
            raise UserError(f"--output_dir {out} holds data prepared with other settings ({'; '.join(diffs)}); {fix}")
        return
    ours = [n for n in sorted(os.listdir(out))
            if n == MANIFEST or (n.endswith(".bin") and (n.startswith("train") or n.startswith("validation")))]
    if ours:
        raise UserError(f"--output_dir {out} already holds {ours[0]} from another tool or an older prepare; {fix}")
    state.mkdir(exist_ok=True)
    _write_json(sfile, settings)


def _valid_record(out: Path, unit: _Unit) -> tuple[dict | None, str]:
    """Return (record, "") if the unit's done record is intact, else (None, why)."""
    path = out / STATE_DIR / f"{unit.name}.done.json"
    if not path.is_file():
        return None, ""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("version") != PREPARE_VERSION or rec.get("unit") != unit.name:
            return None, "its record is from another version"
        recorded = [(i["key"], i["size"], i["mtime_ns"]) for i in rec["inputs"]]
        if recorded != [(f.key, f.size, f.mtime_ns) for f in unit.files]:
            return None, "an input file changed since it was prepared"
        for s in SPLITS:
            total = 0
            for name in rec["splits"][s]["files"]:
                if not _unit_file_re(unit.name).match(name) or name.endswith(".tmp"):
                    return None, f"its record lists a foreign file {name}"
                try:
                    _, n = read_header(out / name)
                except UserError:
                    return None, f"{name} is missing or damaged"
                total += n
            if total != rec["splits"][s]["tokens"]:
                return None, f"its {s} shards do not hold the recorded number of tokens"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None, "its record is unreadable"
    return rec, ""


def _clean_unit(out: Path, unit: _Unit) -> None:
    pat = _unit_file_re(unit.name)
    for n in os.listdir(out):
        if pat.match(n):
            os.remove(out / n)
    state = out / STATE_DIR
    for n in os.listdir(state):
        if n.startswith(unit.name + "."):
            os.remove(state / n)


def _terminate(executor) -> None:
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


def _run_pool(pending: list[_Unit], job: dict, workers: int, ui: _ProgressUI, done_cb) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("spawn")
    counters = _SharedCounters(ctx)
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(counters,))
    try:
        order = sorted(pending, key=lambda u: -u.size)  # biggest first: better balance; output is order-free
        futures = {ex.submit(_process_unit, u.payload(), job): u for u in order}
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


def prepare(
    inputs: Sequence[str | os.PathLike] | str,
    output_dir: str | os.PathLike,
    tokenizer: str | os.PathLike,
    val_fraction: float = 0.01,
    chunk_size: int = 2049 * 1024,
    max_length: int | None = None,
    shuffle: bool = False,
    num_workers: int | None = None,
    text_key: str = "text",
    seed: int = 42,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into LITPKDS shards under `output_dir` and return the manifest (also `manifest.json`).

    Re-running the same command resumes (finished inputs are kept). `num_workers`: processes that tokenize in
    parallel (None = min(4, CPUs); 0 or 1 = in this process). `progress`: show a progress bar on a terminal and
    print a summary to stderr; False is silent. See the module docstring for the details.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if num_workers is None:
        num_workers = min(4, os.cpu_count() or 1)
    _check_args(val_fraction, chunk_size, max_length, num_workers, text_key, seed)
    val_fraction = float(val_fraction)
    chunk_size, seed = int(chunk_size), int(seed)
    max_length = None if max_length is None else int(max_length)
    shuffle = bool(shuffle)

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    files = list_input_files(list(inputs))
    tok = Tokenizer(tokenizer)
    dtype = auto_dtype(tok.vocab_size)
    units = _make_units(files, UNIT_BYTES)

    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {output_dir}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--output_dir {output_dir}: cannot create it ({e.strerror})") from None
    out = out.resolve()

    settings = {
        "prepare_version": PREPARE_VERSION,
        "tokenizer_sha256": _sha256(tok.path),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "dtype": dtype.name,
        "chunk_size": chunk_size,
        "val_fraction": val_fraction,
        "max_length": max_length,
        "shuffle": shuffle,
        "text_key": text_key,
        "seed": seed,
        "inputs": [f.key for f in files],
        "units": [[u.name, [f.key for f in u.files]] for u in units],
    }
    _check_settings(out, settings)

    records: dict[str, dict] = {}
    pending: list[_Unit] = []
    for u in units:
        rec, why = _valid_record(out, u)
        if rec is not None:
            records[u.name] = rec
        else:
            if why:
                log(f"prepare: redoing {u.files[0].key}: {why}")
            pending.append(u)

    if pending:
        (out / MANIFEST).unlink(missing_ok=True)
        (out / (MANIFEST + ".tmp")).unlink(missing_ok=True)
        for u in pending:
            _clean_unit(out, u)
        known = [_unit_file_re(u.name) for u in units]
        for n in sorted(os.listdir(out)):
            if n.endswith(".bin") and n.startswith(SPLITS) and not any(p.match(n) for p in known):
                log(f"prepare: warning: {out / n} was not written by this prepare run; the loader will read it "
                    f"too unless you delete it")

        job = {
            "output_dir": str(out), "tokenizer": tok.path, "dtype": dtype.name, "chunk_size": chunk_size,
            "val_fraction": val_fraction, "max_length": max_length, "shuffle": shuffle, "seed": seed,
            "text_key": text_key,
        }
        if len(records):
            log(f"prepare: resuming: {len(records)} of {len(units)} units already done")
        show = bool(progress) and sys.stderr.isatty()
        with _ProgressUI(show, sum(u.size for u in pending), len(pending)) as ui:
            def done_cb(unit: _Unit, rec: dict) -> None:
                records[unit.name] = rec
                ui.units += 1

            workers = min(num_workers, len(pending))
            if workers <= 1:
                global _COUNTERS
                _TOKENIZERS[tok.path] = tok
                counters = _LocalCounters(ui)
                saved, _COUNTERS = _COUNTERS, counters
                try:
                    for u in pending:
                        done_cb(u, _process_unit(u.payload(), job))
                        ui.update(counters.bytes, counters.tokens, force=True)
                finally:
                    _COUNTERS = saved
            else:
                _run_pool(pending, job, workers, ui, done_cb)
    else:
        log(f"prepare: nothing to do: all {len(units)} units of {out} are already prepared")

    # ----- manifest
    splits = {s: {"documents": 0, "tokens": 0, "files": []} for s in SPLITS}
    manifest_inputs = []
    skipped = 0
    paths = {f.key: f.path for f in files}  # where the inputs are now (the corpus may have moved)
    for u in units:
        rec = records[u.name]
        for s in SPLITS:
            splits[s]["documents"] += rec["splits"][s]["documents"]
            splits[s]["tokens"] += rec["splits"][s]["tokens"]
            splits[s]["files"].extend(rec["splits"][s]["files"])
        for i in rec["inputs"]:
            skipped += i["skipped_empty"]
            manifest_inputs.append({"path": paths.get(i["key"], i["path"]), "key": i["key"], "bytes": i["size"],
                                    "documents": i["documents"], "tokens": i["tokens"],
                                    "skipped_empty": i["skipped_empty"]})
    n_docs = sum(splits[s]["documents"] for s in SPLITS)
    if n_docs == 0:
        names = ", ".join(str(x) for x in inputs)
        raise UserError(f"--input {names}: no text found (all {skipped} documents are empty)")

    manifest = {
        "format": "LITPKDS",
        "version": 1,
        "tokenizer": tok.path,
        "tokenizer_kind": tok.kind,
        "tokenizer_sha256": settings["tokenizer_sha256"],
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "dtype": dtype.name,
        "chunk_size": chunk_size,
        "splits": splits,
        "inputs": manifest_inputs,
        "settings": {"val_fraction": val_fraction, "max_length": max_length, "shuffle": shuffle,
                     "text_key": text_key, "seed": seed, "unit_bytes": UNIT_BYTES},
    }
    _write_json(out / MANIFEST, manifest)
    tr, va = splits["train"], splits["validation"]
    log(f"prepare: {out}: train {tr['documents']:,} documents, {tr['tokens']:,} tokens in {len(tr['files'])} "
        f"files; validation {va['documents']:,} documents, {va['tokens']:,} tokens in {len(va['files'])} files"
        + (f"; skipped {skipped:,} empty documents" if skipped else ""))
    if val_fraction > 0 and va["documents"] == 0:
        log(f"prepare: warning: no document fell into validation (--val_fraction {val_fraction} of {n_docs} "
            f"documents); raise --val_fraction for a validation set")
    return manifest
