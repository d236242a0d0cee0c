"""Counting host reads of tensors: each `.item()`, `float(t)`, `int(t)`, `bool(t)` or `.tolist()` of a tensor on a
GPU waits for the device to finish everything queued before it (a host sync). The step path is meant to need one
per optimizer step (train/strategy.py: the loss and gradient norm read together); tests and
benchmarks/gpu_check.py count them with `count_host_reads`.

On CUDA, `torch.cuda.set_sync_debug_mode` reports syncs too, but not on CPU; counting the reads themselves works
on any device, so a CPU test can hold the GPU path to its budget.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class HostReads:
    def __init__(self, device_type: Optional[str]):
        self.device_type = device_type  # count reads of tensors on this device type only (None: every tensor)
        self.count = 0
        self.where: list[str] = []  # the method of each counted read, in order
        self.paused = False  # a caller may stop counting around a call it does not measure


@contextmanager
def count_host_reads(device_type: Optional[str] = None) -> Iterator[HostReads]:
    """Within the block, count host reads of tensors (of `device_type`, e.g. "cuda"; None: all)."""
    reads = HostReads(device_type)
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def spy(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if not reads.paused and (reads.device_type is None or self.device.type == reads.device_type):
                reads.count += 1
                reads.where.append(name)
            return original(self, *args, **kwargs)
        return read

    for name in _READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
