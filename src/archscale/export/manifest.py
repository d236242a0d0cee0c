"""`archscale_manifest.json`: every file of an exported or quantised folder with its size and sha256, written last
by `archscale export --format hf` and `archscale quantize`, checked before anything in the folder is read (as a
checkpoint's COMPLETE file is). A folder with a changed, missing, extra or truncated file is refused in one line
naming the file. transformers ignores the file: its own loading of the folder is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from archscale.errors import UserError
from archscale.export.common import _read_json
from archscale.train.safe_io import sha256_file

MANIFEST_FILE = "archscale_manifest.json"
FORMAT = 1


def _listed(folder: Path) -> list[Path]:
    """The files a manifest covers: every regular, non-hidden file at the top of the folder but itself."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name != MANIFEST_FILE)


def write_manifest(folder: str | Path) -> Path:
    folder = Path(folder)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in _listed(folder)}
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n")
    return path


def verify_manifest(folder: str | Path) -> None:
    """Raise a one-line UserError unless every file of `folder` is exactly the one its manifest lists."""
    folder = Path(folder)
    where = f"--checkpoint {folder}"
    if not (folder / MANIFEST_FILE).is_file():
        raise UserError(f"{where}: {MANIFEST_FILE} is missing (archscale writes it into every export and quantised "
                        "folder); re-export the folder")
    files = _read_json(folder / MANIFEST_FILE, where).get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        raise UserError(f"{where}: {MANIFEST_FILE} lists no files")
    present = {p.name for p in _listed(folder)}
    for name in sorted(present - set(files)):
        raise UserError(f"{where}: {name} is not listed in {MANIFEST_FILE} (added after the export?)")
    for name, entry in sorted(files.items()):
        path = folder / name
        if "/" in name or "\\" in name or name in ("", ".", "..") or not path.is_file():
            raise UserError(f"{where}: {name}, listed in {MANIFEST_FILE}, is missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise UserError(f"{where}: {name} is {size} bytes, {MANIFEST_FILE} says {entry.get('bytes')} "
                            "(truncated or replaced); re-export the folder")
        if sha256_file(path) != entry.get("sha256"):
            raise UserError(f"{where}: {name} does not match its sha256 in {MANIFEST_FILE} (modified or damaged); "
                            "re-export the folder")
