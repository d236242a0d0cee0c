"""`archscale prepare`: text / JSONL / Parquet -> tokenized LITPKDS shards + manifest.json, resumable.

Inputs (`archscale.data.sources`). Each `--input` is a file or a folder (searched recursively, hidden entries
skipped, sorted) of:
  * `.txt`            - one document per file;
  * `.jsonl(.gz)`     - one JSON object per line, the document in field `text_key` (blank lines are skipped);
  * `.parquet`        - the document in column `text_key`, read one record batch at a time.
Every file gets a *key*: its path relative to the common parent of all inputs (so `--input wiki/train.jsonl
books/train.jsonl` gives the keys "wiki/train.jsonl" and "books/train.jsonl"). Keys do not depend on where the
data lives, so moving the corpus does not change the output.

Documents. `tokenizer.encode(text)`: EOS appended, no BOS (ArchScale's convention). With `max_length` (ProLong-style
long-context preparation) a document of up to `max_length` tokens including its EOS is kept whole and a longer one
is split into pieces of `max_length` tokens, each closed by its own EOS (so variable-length training sees each
piece as a document). Blank documents (only whitespace) are skipped and counted.

Split. A document goes to validation iff blake2b(seed, file key, document index) / 2**64 < val_fraction, where the
index is the line number (JSONL), the row number (Parquet) or 0 (.txt). The split therefore does not depend on the
number of workers, the order of inputs, or on other documents. With 0 < val_fraction < 1 neither split is left
empty: if no document's hash falls under val_fraction (a small corpus), the non-empty document of lowest hash goes
to validation; if every one does, the one of highest hash goes to train (its unit is tokenized again; prepare says
which document moved). A corpus of a single document is refused before any work (it cannot be split).

Work units and outputs (`archscale.data.prepare_worker`). Files are grouped into *units*: consecutive files of one
`--input` argument are packed together while the unit stays under `UNIT_BYTES` (bigger files are a unit on their
own), so a folder of thousands of small .txt files does not give thousands of tiny shards. Each unit is tokenized
by one worker (a process pool of `num_workers`, spawned) into its own chunk files
`{split}_{unit}_{counter:010d}.bin`, split in ("train", "validation"), with `ShardWriter` (documents run across
chunk boundaries; the final partial chunk is written, never dropped). With `shuffle`, a unit's documents are
written in a permuted order (seeded by `seed` and the unit name); the document-to-split assignment is unchanged.
The trainer's loader additionally shuffles files.

Resume (`archscale.data.prepare_state`). `output_dir/.prepare/settings.json` records everything that decides the
output (tokenizer hash, inputs and their grouping, split and chunking settings); a re-run with different settings
is refused. When a unit is finished - all of its shards written (each atomically) - the worker writes
`.prepare/{unit}.done.json` (atomically) with its files and counts. A re-run skips units whose record is intact
(the files exist with valid headers holding the recorded number of tokens, the inputs have the recorded size and
mtime) and redoes the others after deleting their leftovers (shards not in a record, `*.tmp`). `manifest.json` is
written last, atomically, and removed while any unit is being (re)done, so nothing half-written looks complete.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from archscale.data.format import auto_dtype
from archscale.data.prepare_state import (MANIFEST, PREPARE_VERSION, SPLITS, Unit, check_settings, clean_unit,
                                          is_shard_name, load_done_record, make_units, remove_manifest,
                                          unit_file_re, write_json)
from archscale.data.prepare_worker import ProgressUI, run_units
from archscale.data.sources import SUPPORTED_EXTENSIONS, InputFile, iter_texts, list_input_files
from archscale.data.tokenizer import Tokenizer
from archscale.errors import UserError
from archscale.outputs import writable_dir

__all__ = ["prepare", "list_input_files", "iter_texts", "InputFile", "SUPPORTED_EXTENSIONS", "UNIT_BYTES"]

# Target input bytes per work unit (small files are grouped up to this). Read at call time, so tests can lower it.
UNIT_BYTES = 64 << 20


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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _make_output_dir(output_dir: str | os.PathLike) -> Path:
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {output_dir}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--output_dir {output_dir}: cannot create it ({e.strerror})") from None
    writable_dir(out, "--output_dir")  # a read-only folder fails now, not after tokenizing
    return out.resolve()


def _sort_out_done(out: Path, units: list[Unit], log: Callable[[str], None]) -> tuple[dict[str, dict], list[Unit]]:
    """Split `units` into the finished ones (their done records, by unit name) and the ones still to do."""
    records: dict[str, dict] = {}
    pending: list[Unit] = []
    for u in units:
        rec, why = load_done_record(out, u)
        if rec is not None:
            records[u.name] = rec
        else:
            if why:
                log(f"prepare: redoing {u.files[0].key}: {why}")
            pending.append(u)
    return records, pending


def _clear_for_redo(out: Path, units: list[Unit], pending: list[Unit], log: Callable[[str], None]) -> None:
    """Remove the manifest and the pending units' leftovers; warn about shards that are not ours."""
    remove_manifest(out)
    for u in pending:
        clean_unit(out, u)
    known = [unit_file_re(u.name) for u in units]
    for n in sorted(os.listdir(out)):
        if is_shard_name(n) and not any(p.match(n) for p in known):
            log(f"prepare: warning: {out / n} was not written by this prepare run; the loader will read it "
                f"too unless you delete it")


def _sum_records(units: list[Unit], records: dict[str, dict], files: list[InputFile]) -> tuple[dict, list, int]:
    """The manifest's splits and inputs, and the number of skipped empty documents, from the done records."""
    splits = {s: {"documents": 0, "tokens": 0, "files": []} for s in SPLITS}
    inputs = []
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
            inputs.append({"path": paths.get(i["key"], i["path"]), "key": i["key"], "bytes": i["size"],
                           "documents": i["documents"], "tokens": i["tokens"], "skipped_empty": i["skipped_empty"]})
    return splits, inputs, skipped


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
    if 0 < val_fraction < 1 and _count_documents(files, text_key, stop=2) == 1:
        raise UserError(f"--input {', '.join(str(x) for x in inputs)}: a single document cannot be split into train "
                        f"and validation; add documents, or pass --val_fraction 0 (and train with --eval_iters 0)")
    dtype = auto_dtype(tok.vocab_size)
    units = make_units(files, UNIT_BYTES)
    out = _make_output_dir(output_dir)
    job = {
        "output_dir": str(out), "tokenizer": tok.path, "dtype": dtype.name, "chunk_size": chunk_size,
        "val_fraction": val_fraction, "max_length": max_length, "shuffle": shuffle, "seed": seed,
        "text_key": text_key,
    }
    check_settings(out, _settings(job, tok, files, units))
    records = _tokenize_pending(out, units, job, num_workers, tok, progress, log)
    records = _fill_empty_split(out, units, records, job, tok, log)

    splits, manifest_inputs, skipped = _sum_records(units, records, files)
    n_docs = sum(splits[s]["documents"] for s in SPLITS)
    if n_docs == 0:
        names = ", ".join(str(x) for x in inputs)
        raise UserError(f"--input {names}: no text found (all {skipped} documents are empty)")
    manifest = _manifest(job, tok, splits, manifest_inputs)
    write_json(out / MANIFEST, manifest)  # last: its presence means every unit is done
    tr, va = splits["train"], splits["validation"]
    log(f"prepare: {out}: train {tr['documents']:,} documents, {tr['tokens']:,} tokens in {len(tr['files'])} "
        f"files; validation {va['documents']:,} documents, {va['tokens']:,} tokens in {len(va['files'])} files"
        + (f"; skipped {skipped:,} empty documents" if skipped else ""))
    return manifest


def _count_documents(files: list[InputFile], text_key: str, stop: int) -> int:
    """Non-empty documents in `files`, counting no further than `stop` (so a big corpus costs a few reads)."""
    n = 0
    for f in files:
        for _, text in iter_texts(f.path, text_key):
            n += bool(text.strip())
            if n >= stop:
                return n
    return n


# split left empty by the hash rule -> (which end of the hash order moves into it, what the rule is called)
_FILL = {"validation": ("lowest", "the document of lowest hash"),
         "train": ("highest", "the document of highest hash")}


def _fill_empty_split(out: Path, units: list[Unit], records: dict[str, dict], job: dict, tok: Tokenizer,
                      log: Callable[[str], None]) -> dict[str, dict]:
    """With 0 < val_fraction < 1 both splits get a document: when the hash rule (module docstring) leaves one
    empty - a small corpus, a small fraction - the document nearest to that side of the threshold moves there
    (lowest hash to validation, highest to train) and its unit is tokenized again. A function of the inputs and
    settings only, so a re-run (or a resume) writes the same shards."""
    if not 0 < job["val_fraction"] < 1:
        return records
    force: list[dict] = []
    for split, (end, rule) in _FILL.items():
        counts = {s: sum(r["splits"][s]["documents"] for r in records.values()) for s in SPLITS}
        if counts[split] or sum(counts.values()) < 2:
            continue
        best = None  # (hash, unit, key, index)
        for u in units:
            for i in records[u.name]["inputs"]:
                h = i.get(end)
                if h is not None and (best is None or (h[0] < best[0]) == (end == "lowest")):
                    best = (h[0], u, i["key"], h[1])
        if best is None:
            continue
        _, unit, key, index = best
        force.append({"key": key, "index": index, "split": split})
        where = key if key.lower().endswith(".txt") else f"{key} item {index}"
        log(f"prepare: no document's hash fell into {split} (--val_fraction {job['val_fraction']} of "
            f"{sum(counts.values())} documents), so {rule} ({where}) goes there")
        remove_manifest(out)
        clean_unit(out, unit)

        def done(u: Unit, rec: dict) -> None:
            records[u.name] = rec

        run_units([unit], {**job, "force": list(force)}, 1, tok, ProgressUI(False, 0, 0), done)
    return records


def _settings(job: dict, tok: Tokenizer, files: list[InputFile], units: list[Unit]) -> dict:
    """Everything that decides the output's bytes: a re-run with other settings must not mix with this one."""
    return {
        "prepare_version": PREPARE_VERSION,
        "tokenizer_sha256": file_sha256(tok.path),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "dtype": job["dtype"],
        "chunk_size": job["chunk_size"],
        "val_fraction": job["val_fraction"],
        "max_length": job["max_length"],
        "shuffle": job["shuffle"],
        "text_key": job["text_key"],
        "seed": job["seed"],
        "inputs": [f.key for f in files],
        "units": [[u.name, [f.key for f in u.files]] for u in units],
    }


def _tokenize_pending(out: Path, units: list[Unit], job: dict, num_workers: int, tok: Tokenizer, progress: bool,
                      log: Callable[[str], None]) -> dict[str, dict]:
    """Tokenize the units not finished by an earlier run; return every unit's record."""
    records, pending = _sort_out_done(out, units, log)
    if not pending:
        log(f"prepare: nothing to do: all {len(units)} units of {out} are already prepared")
        return records
    _clear_for_redo(out, units, pending, log)
    if records:
        log(f"prepare: resuming: {len(records)} of {len(units)} units already done")
    show = bool(progress) and sys.stderr.isatty()
    with ProgressUI(show, sum(u.size for u in pending), len(pending)) as ui:
        def done_cb(unit: Unit, rec: dict) -> None:
            records[unit.name] = rec
            ui.units += 1

        run_units(pending, job, min(num_workers, len(pending)), tok, ui, done_cb)
    return records


def _manifest(job: dict, tok: Tokenizer, splits: dict, manifest_inputs: list) -> dict:
    return {
        "format": "LITPKDS",
        "version": 1,
        "tokenizer": tok.path,
        "tokenizer_kind": tok.kind,
        "tokenizer_sha256": file_sha256(tok.path),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "dtype": job["dtype"],
        "chunk_size": job["chunk_size"],
        "splits": splits,
        "inputs": manifest_inputs,
        "settings": {"val_fraction": job["val_fraction"], "max_length": job["max_length"], "shuffle": job["shuffle"],
                     "text_key": job["text_key"], "seed": job["seed"], "unit_bytes": UNIT_BYTES},
    }
