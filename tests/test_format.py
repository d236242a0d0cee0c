"""LITPKDS shard format: byte-exact against the spec, round trips, and errors."""

import struct

import numpy as np
import pytest

from archscale.data.format import (HEADER_SIZE, ShardWriter, auto_dtype, encode_header, open_shard, read_header,
                                   write_shard)
from archscale.errors import UserError

SPEC_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float32, 7: np.float64,
              8: np.uint16}


def spec_bytes(code, tokens):
    """A shard built byte by byte from spec §6, independent of format.py."""
    out = bytearray(b"LITPKDS")
    out += (1).to_bytes(8, "little")
    out += bytes([code])
    out += len(tokens).to_bytes(8, "little")
    out += np.asarray(tokens, dtype=SPEC_CODES[code]).astype(np.dtype(SPEC_CODES[code]).newbyteorder("<")).tobytes()
    return bytes(out)


@pytest.mark.parametrize("code", [1, 3, 4, 5, 8])
def test_written_file_equals_spec_bytes(tmp_path, code):
    tokens = [0, 1, 2, 100, 127, 5]
    write_shard(tmp_path / "a.bin", np.array(tokens), SPEC_CODES[code])
    assert (tmp_path / "a.bin").read_bytes() == spec_bytes(code, tokens)


def test_reading_a_spec_built_file(tmp_path):
    tokens = np.arange(1000, 1050)
    (tmp_path / "train_x_0000000000.bin").write_bytes(spec_bytes(8, tokens))
    dtype, n = read_header(tmp_path / "train_x_0000000000.bin")
    assert dtype == np.uint16 and n == 50
    assert np.array_equal(open_shard(tmp_path / "train_x_0000000000.bin"), tokens)


def test_header_layout():
    h = encode_header(np.uint16, 2049 * 1024)
    assert len(h) == HEADER_SIZE == 24
    assert struct.unpack("<7sQBQ", h) == (b"LITPKDS", 1, 8, 2049 * 1024)


def test_auto_dtype():
    assert auto_dtype(32000) == np.uint16 and auto_dtype(65499) == np.uint16
    assert auto_dtype(65500) == np.int32 and auto_dtype(200064) == np.int32


def test_writer_keeps_final_partial_chunk(tmp_path):
    w = ShardWriter(tmp_path, "train_demo", chunk_size=10, dtype=np.uint16)
    docs = [np.arange(7), np.arange(100, 113), np.arange(200, 203)]  # 23 tokens -> 10 + 10 + 3
    for d in docs:
        w.add(d)
    files = w.close()
    assert files == ["train_demo_0000000000.bin", "train_demo_0000000001.bin", "train_demo_0000000002.bin"]
    sizes = [read_header(tmp_path / f)[1] for f in files]
    assert sizes == [10, 10, 3]
    joined = np.concatenate([open_shard(tmp_path / f) for f in files])
    assert np.array_equal(joined, np.concatenate(docs))
    assert not list(tmp_path.glob("*.tmp"))


def test_out_of_range_tokens_refused(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        write_shard(tmp_path / "x.bin", np.array([70000]), np.uint16)


@pytest.mark.parametrize("content,expect", [
    (b"", "not a LITPKDS shard"),
    (b"GARBAGE" + bytes(17), "not a LITPKDS shard"),
    (b"LITPKDS" + (2).to_bytes(8, "little") + bytes([8]) + (0).to_bytes(8, "little"), "version 2"),
    (b"LITPKDS" + (1).to_bytes(8, "little") + bytes([9]) + (0).to_bytes(8, "little"), "unknown dtype code 9"),
    (b"LITPKDS" + (1).to_bytes(8, "little") + bytes([8]) + (10).to_bytes(8, "little") + bytes(4), "truncated"),
])
def test_bad_files_are_user_errors(tmp_path, content, expect):
    p = tmp_path / "bad.bin"
    p.write_bytes(content)
    with pytest.raises(UserError, match=expect) as e:
        read_header(p)
    assert str(p) in str(e.value)
