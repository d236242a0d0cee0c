"""Output paths checked before long work starts, and OS errors (full disk, read-only paths) as one line.

A command that writes its result at the end (eval's JSON, a tokenizer, shards, a run dir) probes its output
location first, so a typo or a read-only mount costs a second, not the whole evaluation.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from archscale.errors import UserError

# OS errors that are the environment's fault (not a bug): printed as one line by the CLI, exit 2.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                      errno.EISDIR, errno.EMFILE, errno.ENFILE}


def _probe(folder: Path, flag: str, value: str | os.PathLike) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".archscale-write-probe-"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {value}: cannot write there ({e.strerror or e})") from None


def writable_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create `path` (and its parents) if needed and check that files can be created in it."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create it ({e.strerror or e})") from None
    _probe(p, flag, path)
    return p


def writable_file(path: str | os.PathLike, flag: str) -> Path:
    """Check that the file `path` can be written (its folder is created if needed); writes nothing to it."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {path}: the file exists and is not writable")
    writable_dir(p.parent if str(p.parent) else Path("."), flag)
    return p


def os_error_line(e: OSError) -> str:
    """One line for an environment OS error: what failed, on which file, and what to do."""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    text = f"{e.strerror or e}{where}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        text += "; free some space (a run resumes from its last checkpoint with --resume auto, prepare skips " \
                "finished inputs)"
    return text


def environment_error(e: BaseException) -> OSError | None:
    """The environment OS error in `e` or its causes (DCP wraps a rank's exception in CheckpointException)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                found = environment_error(inner)
                if found is not None:
                    return found
        e = e.__cause__ or e.__context__
    return None
