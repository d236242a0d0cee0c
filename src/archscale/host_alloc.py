"""Host (CPU) memory allocator settings: keep freed tensor memory in the process instead of handing it back.

PyTorch's CPU tensors come from glibc's malloc. By default glibc serves each allocation above a (dynamic,
32 MiB at most) threshold by a fresh `mmap` and unmaps it when the tensor is freed, and it returns the heap's
free top to the kernel once it exceeds 128 KiB. A training step frees and re-allocates the same large buffers
(activations, logits, gradients) every step, so every one of them is page-faulted and zero-filled by the kernel
again: on a 2-core VM that cost 8% (Transformer++) to 30% (GDNY) of a d4 training step's wall time
(`docs/BENCHMARKS.md`, "The host allocator"). Raising both thresholds to 1 GiB makes a step reuse the pages of the
previous one, as jemalloc / tcmalloc (which Intel and vLLM's CPU build preload) do.

The cost: freed memory stays mapped (the resident size does not shrink after a peak). The live-tensor peak,
which the memory model predicts, does not change. `ARCHSCALE_HOST_ALLOC=system` keeps glibc's defaults; other
allocators (an `LD_PRELOAD`ed jemalloc or tcmalloc) are left alone, since `mallopt` is glibc's.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "ARCHSCALE_HOST_ALLOC"
THRESHOLD = 1 << 30  # bytes: allocations below it come from the heap; a free top below it stays mapped

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def _glibc():
    """glibc's handle when it is this process's C library and no other allocator was preloaded, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def tune_host_allocator() -> bool:
    """Apply the settings once per process (later calls return the first answer). True when applied; False
    with ARCHSCALE_HOST_ALLOC=system, off glibc, or under a preloaded allocator. Never raises."""
    global _applied
    if _applied is not None:
        return _applied
    mode = os.environ.get(ENV, "tuned").strip().lower()
    libc = _glibc() if mode != "system" else None
    _applied = False
    if libc is not None and hasattr(libc, "mallopt"):
        # mallopt returns 1 on success; setting the mmap threshold also stops glibc's dynamic adjustment of it
        _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD)) & bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                        THRESHOLD))
    return _applied


def describe() -> str:
    """One line for a benchmark's header: which allocator settings this process runs under."""
    if tune_host_allocator():
        return f"host allocator: glibc, mmap/trim thresholds {THRESHOLD >> 20} MiB ({ENV}=system for its defaults)"
    return f"host allocator: as the process started ({ENV}={os.environ.get(ENV, 'tuned')}, glibc defaults or a preload)"
