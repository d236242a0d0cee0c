"""Input documents for `archscale prepare` and `train_bpe`: finding the files, reading their texts.

Supported files (see `archscale.data.prepare` for how they become shards):
  * `.txt`            - one document per file;
  * `.jsonl(.gz)`     - one JSON object per line, the document in field `text_key` (blank lines are skipped);
  * `.parquet`        - the document in column `text_key`, read one record batch at a time.
Bad arguments and bad content raise UserError naming the file (and the line where there is one), so the user
can fix the input instead of reading a traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from archscale.errors import UserError

__all__ = ["SUPPORTED_EXTENSIONS", "InputFile", "file_extension", "list_input_files", "iter_texts"]

# Longest first: ".jsonl.gz" must win over a plain suffix match.
SUPPORTED_EXTENSIONS = (".jsonl.gz", ".jsonl", ".txt", ".parquet")

_REPORT_BYTES = 1 << 20  # JSONL progress is reported at this granularity (per line would be too chatty)
_PARQUET_BATCH_ROWS = 1024


@dataclass
class InputFile:
    path: str  # absolute path
    key: str  # path relative to the common parent of all inputs, "/"-separated
    size: int
    mtime_ns: int
    arg: int  # index of the --input argument it came from

    def as_dict(self) -> dict:
        return {"key": self.key, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def file_extension(name: str) -> str | None:
    """The supported extension `name` ends with (case-insensitive), or None."""
    low = name.lower()
    for ext in SUPPORTED_EXTENSIONS:
        if low.endswith(ext):
            return ext
    return None


# ---------------------------------------------------------------------------------------------- finding files

def _walk(folder: Path) -> list[Path]:
    """Supported files under `folder`, recursively, hidden entries skipped, sorted by relative path."""
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
            if not name.startswith(".") and file_extension(name):
                found.append(Path(root) / name)
    found.sort(key=lambda q: q.relative_to(folder).as_posix())
    return found


def _files_of_argument(raw: str | os.PathLike) -> list[Path]:
    p = Path(raw).expanduser()
    if not p.exists():
        raise UserError(f"--input {raw}: no such file or folder")
    if p.is_dir():
        files = _walk(p)
        if not files:
            raise UserError(f"--input {raw}: the folder holds no .txt, .jsonl, .jsonl.gz or .parquet files")
        return files
    if p.is_file():
        if not file_extension(p.name):
            raise UserError(f"--input {raw}: unsupported file type; use .txt (one document per file), "
                            f".jsonl, .jsonl.gz or .parquet, or a folder of them")
        return [p]
    raise UserError(f"--input {raw}: not a regular file or folder")


def list_input_files(inputs: Sequence[str | os.PathLike]) -> list[InputFile]:
    """Expand `--input` arguments into the ordered list of files to read (UserError for bad arguments).

    Keys are relative to the common parent of all arguments, so they do not depend on where the corpus lives
    (moving it does not change the prepared output).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise UserError("--input: give at least one file or folder")
    per_arg = [(i, str(raw), _files_of_argument(raw)) for i, raw in enumerate(inputs)]

    parents = [os.path.dirname(os.path.abspath(Path(raw).expanduser())) for _, raw, _ in per_arg]
    common = os.path.commonpath(parents)
    out: list[InputFile] = []
    origin: dict[str, str] = {}
    for i, raw, files in per_arg:
        for f in files:
            absf = os.path.abspath(f)
            real = os.path.realpath(absf)
            if real in origin:  # reading a file twice would silently duplicate its documents
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


# ---------------------------------------------------------------------------------------------- reading texts

def iter_texts(path: str | os.PathLike, text_key: str = "text",
               on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, str]]:
    """Yield `(index, text)` for every document of one input file; blank documents are yielded too.

    index: the 1-based line number (JSONL), the 0-based row (Parquet), 0 (.txt). `on_bytes(n)` is called with
    progress in bytes of the file; the calls add up to the file size. Bad content raises UserError naming the file
    (and the line for .txt / JSONL).
    """
    path = str(path)
    ext = file_extension(path)
    report = on_bytes or (lambda n: None)
    if ext == ".txt":
        yield from _iter_txt(path, report)
    elif ext in (".jsonl", ".jsonl.gz"):
        yield from _iter_jsonl(path, text_key, ext == ".jsonl.gz", report)
    elif ext == ".parquet":
        yield from _iter_parquet(path, text_key, report)
    else:
        raise UserError(f"{path}: unsupported file type; use .txt, .jsonl, .jsonl.gz or .parquet")


def _cannot_read(path: str, e: OSError) -> UserError:
    return UserError(f"{path}: cannot read it ({e.strerror})")


def _not_utf8(where: str, byte: str) -> UserError:
    return UserError(f"{where}: not valid UTF-8 ({byte}); convert the file to UTF-8")


def _iter_txt(path: str, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _cannot_read(path, e) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise _not_utf8(f"{path}:{line}", f"byte {e.start}") from None
    if text.startswith("\ufeff"):  # a BOM is an encoding marker, not document text
        text = text[1:]
    report(len(data))
    yield 0, text


def _jsonl_text(path: str, lineno: int, line: bytes, text_key: str) -> str:
    """The document of one non-blank JSONL line."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(f"{path}:{lineno}", f"byte {e.start} of the line") from None
    if lineno == 1 and s.startswith("\ufeff"):
        s = s[1:]
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} field, "
                        f"got a JSON {type(obj).__name__}")
    if text_key not in obj:
        keys = ", ".join(list(obj)[:8]) or "none"
        raise UserError(f"{path}:{lineno}: no {text_key!r} field (fields: {keys}); "
                        f"pass --text_key to read another field")
    text = obj[text_key]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: field {text_key!r} is a {type(text).__name__}, not a string")
    return text


def _iter_jsonl(path: str, text_key: str, gz: bool, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise _cannot_read(path, e) from None
    size = os.fstat(raw.fileno()).st_size
    done = pending = 0  # bytes reported so far / read but not yet reported
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
                # Progress is in bytes of the file, so count compressed bytes consumed, not line lengths.
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
            if line.strip():
                yield lineno, _jsonl_text(path, lineno, line, text_key)
    if size > done:
        report(size - done)


def _iter_parquet(path: str, text_key: str, report: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    import pyarrow as pa  # imported here: only Parquet inputs need it
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
    if hasattr(pa.types, "is_string_view"):  # newer pyarrow only
        string_types.append(pa.types.is_string_view)
    if not any(check(typ) for check in string_types):
        raise UserError(f"{path}: column {text_key!r} has type {typ}, not string")
    # Progress: the file's bytes spread evenly over its rows (the decoded size of a batch is not file bytes).
    size = os.path.getsize(path)
    rows_total = max(1, pf.metadata.num_rows)
    row = 0
    done = 0
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key]):
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
