"""The lit-gpt / TinyLlama / Samba packed shard format (`*.bin`), read and written exactly.

Layout (little endian): b"LITPKDS" (7 bytes) + uint64 version (=1) + uint8 dtype code + uint64 chunk_size,
then `chunk_size` tokens of that dtype. Unlike the original builder we never drop data: the final partial chunk
is written as a shorter file whose header holds its real size, which the original reader also accepts.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from archscale.errors import UserError

MAGIC = b"LITPKDS"
VERSION = 1
HEADER_SIZE = 24  # 7 + 8 + 1 + 8
MANIFEST = "manifest.json"  # beside the shards: vocab size, EOS id, dtype, tokenizer (`archscale prepare`)
_HEADER = struct.Struct("<7sQBQ")
assert _HEADER.size == HEADER_SIZE

DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float32,
    7: np.float64,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def auto_dtype(vocab_size: int) -> np.dtype:
    """ArchScale's "auto" rule: uint16 below 65,500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def encode_header(dtype: np.dtype | type, chunk_size: int) -> bytes:
    dtype = np.dtype(dtype)
    if dtype not in CODES:
        raise ValueError(f"dtype {dtype} has no code in the LITPKDS format")
    return _HEADER.pack(MAGIC, VERSION, CODES[dtype], int(chunk_size))


def read_header(path: str | os.PathLike, expect_dtype: str | None = None) -> tuple[np.dtype, int]:
    """Return (dtype, chunk_size) of a shard, or raise UserError saying what is wrong with the file.
    `expect_dtype` (the manifest's "dtype") must match the header's dtype."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise UserError(f"{path}: cannot read shard ({e.strerror})") from None
    if len(raw) < HEADER_SIZE or raw[:7] != MAGIC:
        raise UserError(f"{path}: not a LITPKDS shard (bad magic); re-create it with `archscale prepare`")
    _, version, code, chunk_size = _HEADER.unpack(raw)
    if version != VERSION:
        raise UserError(f"{path}: LITPKDS version {version} is not supported (only version {VERSION})")
    if code not in DTYPES:
        raise UserError(f"{path}: unknown dtype code {code} in the shard header")
    dtype = np.dtype(DTYPES[code])
    if expect_dtype is not None and np.dtype(expect_dtype) != dtype:
        raise UserError(f"{path}: the shard header says dtype {dtype}, but the manifest.json beside it says "
                        f"{np.dtype(expect_dtype)}; re-create the shards with `archscale prepare`")
    if dtype.kind not in "iu":
        raise UserError(f"{path}: the shard header says dtype {dtype}; token shards hold integer ids "
                        "(uint16/int32...), so this file is not a token shard")
    expected = HEADER_SIZE + chunk_size * dtype.itemsize
    actual = path.stat().st_size
    if actual < expected:
        raise UserError(
            f"{path}: truncated shard ({actual} bytes, header promises {expected}); delete it and re-run prepare"
        )
    return dtype, chunk_size


def open_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map the tokens of a shard (read only, no copy)."""
    dtype, chunk_size = read_header(path)
    if chunk_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(chunk_size,))


def write_shard(path: str | os.PathLike, tokens: np.ndarray, dtype: np.dtype | type) -> None:
    """Write one shard atomically: a temp file in the same folder, then a rename."""
    path = Path(path)
    dtype = np.dtype(dtype)
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids out of range for {dtype}")
    arr = arr.astype(dtype, copy=False)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(encode_header(dtype, arr.size))
        f.write(np.ascontiguousarray(arr).tobytes(order="C"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Concatenate documents into fixed-size chunks named `{prefix}_{counter:010d}.bin`.

    Documents run across chunk boundaries (as in lit-gpt); `close()` writes the final partial chunk too.
    """

    def __init__(self, out_dir: str | os.PathLike, prefix: str, chunk_size: int, dtype: np.dtype | type,
                 start_counter: int = 0):
        if chunk_size <= 0:
            raise UserError(f"--chunk_size must be positive, got {chunk_size}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.chunk_size = int(chunk_size)
        self.dtype = np.dtype(dtype)
        self.counter = start_counter
        self.files: list[str] = []
        self._buf = np.empty(self.chunk_size, dtype=self.dtype)
        self._fill = 0

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        pos = 0
        while pos < tokens.size:
            take = min(self.chunk_size - self._fill, tokens.size - pos)
            self._buf[self._fill:self._fill + take] = tokens[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == self.chunk_size:
                self._flush()

    def _flush(self) -> None:
        if self._fill == 0:
            return
        name = f"{self.prefix}_{self.counter:010d}.bin"
        write_shard(self.out_dir / name, self._buf[:self._fill], self.dtype)
        self.files.append(name)
        self.counter += 1
        self._fill = 0

    def close(self) -> list[str]:
        self._flush()
        return self.files
