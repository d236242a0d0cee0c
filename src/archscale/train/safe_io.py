"""Checkpoint I/O that never executes code from the files it reads, and hashes what it writes.

Checkpoints may come from someone else, so nothing read here may run code:
* train state (step, counters, loader position, RNG states, grad scaler) is one safetensors file per rank: the
  tensors (torch/CUDA RNG states) as tensors, everything else as JSON in its metadata. Python floats go through
  `repr`, so the numpy and `random` states round-trip exactly (bitwise resume);
* DCP's `.metadata` is a pickle: `SafeDCPReader` unpickles it with `find_class` restricted to the classes DCP
  itself writes (its metadata dataclasses, `torch.Size`, dtypes, layouts, paths); anything else is refused;
* DCP's non-tensor values (BYTE_IO items such as an optimizer's param-group hyperparameters) are read with
  `torch.load(weights_only=True)` (`SafeLoadPlanner`), where DCP's default planner uses `weights_only=False`;
* DeepSpeed loads its files with `torch.load(weights_only=False)` everywhere; `deepspeed_weights_only()`
  forces `weights_only=True` around those calls, admitting only the few DeepSpeed/stdlib classes its checkpoints
  hold (`torch.serialization.safe_globals`).

Hashing while writing: `HashingFileSystem` is DCP's file system with every stream wrapped so that each byte
written also feeds a sha256 (DCP writes each file front to back; a seek marks the file for a re-read instead).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import pathlib
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo

from archscale.errors import UserError

CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- train state
def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able tree; tensors move to `tensors` and leave a reference."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"train state dict keys must be strings, got {list(obj)[:5]}")
        return {k: _encode(v, tensors) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in the train state")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__ndarray__", "dtype"}:
            return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


TRAIN_STATE_KEY = "archscale_train_state"


def encode_train_state(state: dict[str, Any]) -> bytes:
    """The bytes of a train-state file (safetensors; non-tensor values as JSON metadata)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors)
    return save(tensors, metadata={TRAIN_STATE_KEY: json.dumps(tree)})


def decode_train_state(data: bytes, name: str = "train state") -> dict[str, Any]:
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
        tree = json.loads(header["__metadata__"][TRAIN_STATE_KEY])
        return _decode(tree, tensors)
    except Exception as e:  # any malformed byte: not a train state (nothing here can run code)
        raise UserError(f"{name}: not a readable archscale train state ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


# ---------------------------------------------------------------------------------------------- DCP metadata
def _dcp_classes() -> dict[tuple[str, str], Any]:
    allowed = {("torch", "Size"): torch.Size,
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
               ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("collections", "OrderedDict"): collections.OrderedDict}
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"):
        if hasattr(dcp_metadata, name):
            allowed[(dcp_metadata.__name__, name)] = getattr(dcp_metadata, name)
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
        allowed[("pathlib._local", name)] = getattr(pathlib, name)
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the classes DCP writes into `.metadata` (Python docs, "Restricting Globals")."""

    allowed = _dcp_classes()

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a class DCP metadata holds")


def load_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """Unpickle a DCP `.metadata` file with the restricted unpickler."""
    with open(path, "rb") as f:
        md = _RestrictedUnpickler(f).load()
    if not isinstance(md, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeDCPReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        md = load_dcp_metadata(Path(self._get_metadata_path(rank)))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are read with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------------------------------- hashing writer
class _HashingStream(io.RawIOBase):
    """Wraps a binary file: every write also updates a sha256 while the writes run front to back."""

    def __init__(self, raw, on_close):
        self.raw, self.sha, self.pos, self.sequential, self._on_close = raw, hashlib.sha256(), 0, True, on_close

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.raw.write(b)  # a buffered file writes everything (returns len(b))
        mv = memoryview(b).cast("B")
        n = len(mv) if n is None else n
        if self.sequential:
            self.sha.update(mv[:n])
        self.pos += n
        return n

    def seek(self, offset, whence=0):
        pos = self.raw.seek(offset, whence)
        if pos != self.pos:
            self.sequential = False  # DCP does not seek; if a future one does, the file is re-read once
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._on_close(self)
        super().close()


class HashingFileSystem(FileSystem):
    """DCP's local file system; `digests` maps each written path (after DCP's renames) to its sha256, or to
    None when the file must be hashed from disk."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, str | None] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        key = str(Path(path))
        with super().create_stream(path, mode) as raw:
            def done(s: _HashingStream) -> None:
                self.digests[key] = s.sha.hexdigest() if s.sequential else None
            stream = _HashingStream(raw, done)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if str(Path(path)) in self.digests:
            self.digests[str(Path(new_path))] = self.digests.pop(str(Path(path)))


# ---------------------------------------------------------------------------------------------- DeepSpeed
def _deepspeed_globals() -> list:
    """The non-tensor classes DeepSpeed (0.1x) stores in its model/optimizer state files."""
    out: list = [collections.OrderedDict, collections.defaultdict, set, frozenset]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        out += [LossScaler, DynamicLossScaler]
    except Exception:
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
        out.append(ZeroStageEnum)
    except Exception:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address
        out.append(fragment_address)
    except Exception:
        pass
    return out


@contextmanager
def deepspeed_weights_only():
    """Within this block every `torch.load` (DeepSpeed calls it with weights_only=False) runs with
    weights_only=True, admitting DeepSpeed's own state classes only."""
    original = torch.load

    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = safe_load
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            yield
    finally:
        torch.load = original
