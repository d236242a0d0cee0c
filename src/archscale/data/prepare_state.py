"""What `archscale prepare` keeps in its output folder to resume: work units, settings, done records, cleanup.

Layout of `output_dir`:
  * `{split}_{unit}_{counter:010d}.bin`  - the shards of one unit (`.tmp` while being written);
  * `manifest.json`                      - written last, so its presence means "complete";
  * `.prepare/settings.json`             - everything that decides the output; a re-run must match it;
  * `.prepare/{unit}.done.json`          - written when all shards of a unit are, with its files and counts.
Every JSON file is written atomically, so a crash never leaves a half-written record that looks valid.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from archscale.data.format import MANIFEST, read_header
from archscale.data.sources import InputFile, file_extension
from archscale.errors import UserError

PREPARE_VERSION = 2  # 2: --max_length splits long documents instead of truncating them
SPLITS = ("train", "validation")
STATE_DIR = ".prepare"
SETTINGS = "settings.json"

_FIX = "pick a new --output_dir or delete it"


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temp file in the same folder, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _blake2b8(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def hash_u64(text: str) -> int:
    """A stable 64-bit hash (unlike hash(), the same in every process and Python version)."""
    return int.from_bytes(_blake2b8(text), "little")


def _short_hash(text: str, n: int = 6) -> str:
    return _blake2b8(text).hex()[:n]


def remove_manifest(out: Path) -> None:
    (out / MANIFEST).unlink(missing_ok=True)
    (out / (MANIFEST + ".tmp")).unlink(missing_ok=True)


def is_shard_name(name: str) -> bool:
    """Whether the trainer's loader would read `name` as a shard (whoever wrote it)."""
    return name.endswith(".bin") and name.startswith(SPLITS)


# ---------------------------------------------------------------------------------------------- units

@dataclass
class Unit:
    """Input files tokenized together by one worker into their own shards (the unit of resuming)."""
    name: str
    files: list[InputFile] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def payload(self) -> dict:
        """The unit as plain data, to send to a worker process."""
        return {"name": self.name, "files": [f.as_dict() for f in self.files]}


def _base_name(key: str) -> str:
    """A file-name-safe unit name derived from the first input's key."""
    ext = file_extension(key) or ""
    stem = key[: len(key) - len(ext)] if ext else key
    s = re.sub(r"[^A-Za-z0-9-]+", "_", stem.replace("/", "-")).strip("_-") or "input"
    if len(s) > 80:
        s = s[:80].rstrip("_-") + "-" + _short_hash(key)
    return s


def make_units(files: list[InputFile], unit_bytes: int) -> list[Unit]:
    """Group consecutive files of one `--input` argument while the unit stays under `unit_bytes`.

    Grouping keeps a folder of thousands of small files from giving thousands of tiny shards; files of different
    arguments are never grouped, so each argument's data stays in files of its own.
    """
    units: list[Unit] = []
    cur: Unit | None = None
    for f in files:
        if cur is None or cur.files[0].arg != f.arg or cur.size + f.size > unit_bytes:
            cur = Unit(_base_name(f.key), [f])
            units.append(cur)
        else:
            cur.files.append(f)
    # Unit names must be unique, also on case-insensitive file systems.
    counts: dict[str, int] = {}
    for u in units:
        counts[u.name.lower()] = counts.get(u.name.lower(), 0) + 1
    for u in units:
        if counts[u.name.lower()] > 1:
            u.name = f"{u.name}-{_short_hash(u.files[0].key)}"
    seen: set[str] = set()
    for i, u in enumerate(units):
        if u.name.lower() in seen:  # practically impossible after the hash, but never overwrite another unit
            u.name = f"{u.name}-{i}"
        seen.add(u.name.lower())
    return units


def unit_file_re(name: str) -> re.Pattern:
    """Matches the shards (finished or `.tmp`) of the unit `name`."""
    return re.compile(rf"^(train|validation)_{re.escape(name)}_\d{{10}}\.bin(\.tmp)?$")


def done_record_path(out: Path, unit_name: str) -> Path:
    return out / STATE_DIR / f"{unit_name}.done.json"


# ---------------------------------------------------------------------------------------------- settings

def _describe(value) -> str:
    s = json.dumps(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _settings_diffs(old: dict, new: dict) -> list[str]:
    """What changed between two settings, in words for the error message."""
    diffs = []
    for k in new:
        if old.get(k) != new[k]:
            if k == "inputs":
                a, b = old.get(k) or [], new[k]
                first = next((x for x, y in itertools.zip_longest(a, b) if x != y), None)
                first = first or next((y for x, y in itertools.zip_longest(a, b) if x != y), None)
                diffs.append(f"inputs: {len(a)} -> {len(b)} files, first difference {first!r}")
            elif k == "units":
                diffs.append("grouping of the input files (their sizes changed)")
            else:
                diffs.append(f"{k}: {_describe(old.get(k))} -> {_describe(new[k])}")
    return diffs


def _start_over(out: Path, old: dict) -> None:
    """Remove everything an earlier run with the `old` settings wrote, except settings.json itself."""
    old_units = [u[0] for u in old.get("units", []) if isinstance(u, list) and u and isinstance(u[0], str)]
    pats = [unit_file_re(n) for n in old_units]
    for n in os.listdir(out):
        if any(p.match(n) for p in pats):
            os.remove(out / n)
    remove_manifest(out)
    state = out / STATE_DIR
    for n in os.listdir(state):
        if n != SETTINGS:
            os.remove(state / n)


def check_settings(out: Path, settings: dict) -> None:
    """Record `settings` in a new output folder, or refuse one prepared with other settings (UserError)."""
    state = out / STATE_DIR
    sfile = state / SETTINGS
    if sfile.exists():
        try:
            old = json.loads(sfile.read_text(encoding="utf-8"))
            assert isinstance(old, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AssertionError):
            raise UserError(f"--output_dir {out}: {sfile} is unreadable; {_FIX}") from None
        if old == settings:
            return
        if not any(n.endswith(".done.json") for n in os.listdir(state)):
            # Nothing was finished (an earlier attempt failed early, e.g. on a bad input the user has since
            # fixed): there is nothing to resume, so start over with the new settings.
            _start_over(out, old)
            write_json(sfile, settings)
            return
        diffs = _settings_diffs(old, settings)
        if diffs:
            raise UserError(f"--output_dir {out} holds data prepared with other settings ({'; '.join(diffs)}); "
                            f"{_FIX}")
        return
    # No settings: refuse to mix our shards with ones we did not write and so cannot resume or clean up.
    ours = [n for n in sorted(os.listdir(out)) if n == MANIFEST or is_shard_name(n)]
    if ours:
        raise UserError(f"--output_dir {out} already holds {ours[0]} from another tool or an older prepare; {_FIX}")
    state.mkdir(exist_ok=True)
    write_json(sfile, settings)


# ---------------------------------------------------------------------------------------------- done records

def load_done_record(out: Path, unit: Unit) -> tuple[dict | None, str]:
    """Return (record, "") if the unit's done record is intact, else (None, why); why is "" if there is none."""
    path = done_record_path(out, unit.name)
    if not path.is_file():
        return None, ""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("version") != PREPARE_VERSION or rec.get("unit") != unit.name:
            return None, "its record is from another version"
        recorded = [(i["key"], i["size"], i["mtime_ns"]) for i in rec["inputs"]]
        if recorded != [(f.key, f.size, f.mtime_ns) for f in unit.files]:
            return None, "an input file changed since it was prepared"
        pat = unit_file_re(unit.name)
        for s in SPLITS:
            total = 0
            for name in rec["splits"][s]["files"]:
                if not pat.match(name) or name.endswith(".tmp"):
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


def clean_unit(out: Path, unit: Unit) -> None:
    """Remove a unit's shards and state files (leftovers of an unfinished or invalid run) before redoing it."""
    pat = unit_file_re(unit.name)
    for n in os.listdir(out):
        if pat.match(n):
            os.remove(out / n)
    state = out / STATE_DIR
    for n in os.listdir(state):
        if n.startswith(unit.name + "."):
            os.remove(state / n)
