"""Measured memory of a training step on any device: the peak of the bytes held by live tensors.

`LivePeak` is the CPU analogue of `torch.cuda.max_memory_allocated`: a `TorchDispatchMode` that sees every tensor
every op creates (forward, backward, optimizer, collectives' buffers), plus every tensor alive when it starts
(found by the garbage collector, as `benchmarks/zero_stages.py`'s census does), and after each op adds up the
storages still alive. Each storage counts once whatever views it has, with its current size (FSDP2 frees an
all-gathered parameter by resizing its storage to 0). What it cannot see: memory a C++ library allocates outside
torch's tensors (gloo's and NCCL's own buffers, oneDNN scratch, the allocator's rounding and caching); the memory
model's allocator factor covers that on a GPU.

`measure_training_peak(cfg)` builds the trainer's own setup (plan, model, parallelize, strategy, loss) for a
`PretrainConfig` on synthetic data and returns the peak over its optimizer steps after the first (the first one
creates the optimizer states, so the second is the steady state every later step repeats).
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
import tempfile
import warnings
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t):
    """A DTensor's local shard (FSDP2 parameters), else the tensor itself."""
    return getattr(t, "_local_tensor", t)


class LivePeak(TorchDispatchMode):
    """Tracks the bytes of live tensor storages; `peak` is the largest total seen after any op (bytes).

    By default a storage's size is read when a tensor on it is seen and the total follows the tensors' deaths
    (weak-reference callbacks): fast. `rescan=True` re-reads every storage's size after every op (slow), for code
    that resizes storages outside any op (FSDP2 frees an all-gathered parameter with `storage.resize_(0)`)."""

    def __init__(self, device_type: str = "cpu", rescan: bool = False, ignore: frozenset = frozenset()):
        super().__init__()
        self.device_type, self.rescan, self.ignore = device_type, rescan, ignore  # ignore: storages not counted
        self._size: dict[int, int] = {}  # storage data_ptr -> bytes
        self._holders: dict[int, set] = {}  # storage data_ptr -> ids of the live tensors on it
        self._refs: dict[int, tuple] = {}  # tensor id -> (weak reference, storage data_ptr)
        self.peak = 0
        self.current = 0

    def __enter__(self):
        with warnings.catch_warnings():  # isinstance() on some modules' deprecated attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._track(obj)
        self.peak = self.current
        return super().__enter__()

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track(self, t) -> None:
        t = _local(t)
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse / subclass without a storage; a FakeTensor left
            return  # behind by an earlier torch.compile (its storage has no data pointer)
        if ptr in self.ignore:
            return
        if id(t) in self._refs and self._refs[id(t)][1] != ptr:  # re-allocated in place: move it
            self._drop(id(t))
        if ptr and nbytes != self._size.get(ptr, nbytes):
            self.current += nbytes - self._size[ptr]
            self._size[ptr] = nbytes
        if not ptr or id(t) in self._refs:
            return
        if ptr not in self._size:
            self._size[ptr], self._holders[ptr] = nbytes, set()
            self.current += nbytes
        self._holders[ptr].add(id(t))
        self._refs[id(t)] = (weakref.ref(t, lambda _, key=id(t): self._drop(key)), ptr)

    def _drop(self, key: int) -> None:
        entry = self._refs.pop(key, None)
        if entry is None:
            return
        holders = self._holders.get(entry[1])
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[entry[1]]
                self.current -= self._size.pop(entry[1])

    def _resize_all(self) -> None:
        for key, (ref, ptr) in list(self._refs.items()):
            t = ref()
            if t is not None:
                self._track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):  # inputs too: an in-place resize_ changes their storage
            if isinstance(t, torch.Tensor):
                self._track(t)
        if self.rescan:
            self._resize_all()
        self.peak = max(self.peak, self.current)
        return out


def live_storages(device_type: str = "cpu") -> frozenset:
    """The data pointers of every live tensor storage now (what a measurement leaves out as not its own)."""
    gc.collect()
    out = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and _local(obj).device.type == device_type:
                try:
                    out.add(_local(obj).untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    pass
    return frozenset(out)


def measure_training_peak(cfg, steps: int = 2, explicit: frozenset = frozenset(), env=None) -> dict:
    """Run `steps` optimizer steps of the trainer's setup for `cfg` (a PretrainConfig with synthetic data) and
    return {"peak_bytes": the live-tensor peak over the steps after the first, "states_bytes": what is alive
    between steps (parameters, optimizer states)}. `env`: a DistEnv (torchrun workers pass theirs)."""
    from archscale.train.distributed import setup as setup_distributed
    from archscale.train.trainer import Trainer

    own_env = env is None
    with tempfile.TemporaryDirectory() as tmp:
        cfg.out_dir, cfg.eval_iters, cfg.progress, cfg.resume = f"{tmp}/run", 0, False, "none"
        env = env or setup_distributed(cfg.strategy)
        before = live_storages(env.device.type)  # whatever the process held already is not this run's
        trainer = Trainer(cfg, set(explicit), env, lambda msg: None)
        try:
            trainer.train_step(trainer.state, trainer.loader)  # creates the optimizer states
            gc.collect()
            with LivePeak(env.device.type, rescan=env.strategy == "fsdp", ignore=before) as probe:
                states = probe.current
                for _ in range(max(1, steps - 1)):
                    trainer.train_step(trainer.state, trainer.loader)
        finally:
            trainer.close()
            if own_env:
                env.close()
    return {"peak_bytes": probe.peak, "states_bytes": states}


def saved_bytes(fn, *args, exclude=()) -> dict[str, int]:
    """Bytes autograd saves for backward while `fn(*args)` runs, by dtype (each storage once, tensors on the
    storages of `exclude`, e.g. the parameters, left out): what a mixer's `saved` declaration must predict."""
    skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[int, torch.dtype]] = {}
    keep = []  # referenced until the end: no address reuse

    def pack(t):
        keep.append(t)
        t = _local(t)
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen.setdefault(st.data_ptr(), (st.nbytes(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    by: dict[str, int] = {}
    for nbytes, dtype in seen.values():
        name = str(dtype).replace("torch.", "")
        by[name] = by.get(name, 0) + nbytes
    del out
    return by


def peak_of(fn, *args, device_type: str = "cpu") -> tuple[int, Optional[object]]:
    """(live-tensor peak in bytes while `fn(*args)` runs, its result)."""
    with LivePeak(device_type) as probe:
        out = fn(*args)
    return probe.peak, out


def saved_by_block(model, idx: torch.Tensor, autocast_dtype: Optional[torch.dtype] = None) -> dict:
    """Bytes autograd saves in one forward of a GPT on `idx`, by where it is saved: {"blocks": [per block
    {"mixer": .., "ffn": .., "norms": ..}], "outside": embedding, final norm and head} (parameters left out;
    each storage counted once, at its first save)."""
    skip = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    where = ["outside"]
    seen: dict[int, str] = {}
    sizes: dict[str, int] = {}
    keep = []  # every saved tensor stays referenced, so no freed storage's address is reused and mistaken for it

    def pack(t):
        keep.append(t)
        st = _local(t).untyped_storage()
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            seen[st.data_ptr()] = where[-1]
            sizes[where[-1]] = sizes.get(where[-1], 0) + st.nbytes()
        return t

    handles = []
    for i, block in enumerate(model.blocks):
        for part, module in (("mixer", block.mixer), ("ffn", block.mlp), ("norms", block.norm_1),
                             ("norms", block.norm_2)):
            tag = f"{i}.{part}"
            handles.append(module.register_forward_pre_hook(lambda m, a, tag=tag: where.append(tag) and None))
            handles.append(module.register_forward_hook(lambda m, a, o: where.pop() and None))
    ctx = torch.autocast(idx.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            out = model(idx)
            out.float().sum()
    finally:
        for h in handles:
            h.remove()
    blocks = [{part: sizes.get(f"{i}.{part}", 0) for part in ("mixer", "ffn", "norms")}
              for i in range(len(model.blocks))]
    return {"blocks": blocks, "outside": sizes.get("outside", 0)}


def measure_distributed(fields: dict, nproc: int, timeout: float = 600) -> list[dict]:
    """`measure_training_peak` on `nproc` processes (torchrun on this machine, gloo): one result per rank.
    `fields`: PretrainConfig fields (JSON-able, `base_hps` as a dict)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "-m", "archscale.train.memory_measure", json.dumps(fields),
               tmp]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"measure_distributed failed:\n{proc.stdout.decode(errors='replace')[-3000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]


def _worker(fields_json: str, out_dir: str) -> None:
    """One torchrun rank of `measure_distributed`."""
    import json
    from pathlib import Path

    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig
    from archscale.train.distributed import setup as setup_distributed

    fields = json.loads(fields_json)
    cfg = PretrainConfig(**{**fields, "base_hps": BaseHyperparameters(**fields.get("base_hps", {}))})
    env = setup_distributed(cfg.strategy)
    try:
        result = measure_training_peak(cfg, env=env)
        Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(result))
        env.barrier()
    finally:
        env.close()


if __name__ == "__main__":
    import sys

    _worker(sys.argv[1], sys.argv[2])
