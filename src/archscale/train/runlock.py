"""One process per run dir: an exclusive `flock` on `<run>/.lock`, which holds the owner's PID.

The kernel drops the lock when its process dies (kill -9 included), so a lock file left behind by a dead run is
simply taken over by the next one; a live holder makes the second process fail with a one-line error naming it.
Under torchrun only rank 0 locks (the trainer shares the outcome with the other ranks). On network file systems
`flock` is as good as the file system's lock support (NFSv4 and Lustre with `flock` mounts honour it).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

from archscale.errors import UserError

LOCK_NAME = ".lock"


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: another process holds it
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"--out_dir {self.path.parent} is in use by process {holder} (it holds {self.path}); "
                            "wait for that run to end or stop it, or pick another --out_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a process that opened it lock a deleted inode)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None
