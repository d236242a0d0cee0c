"""Tests of the stateful packed loader (`archscale.data.loader`).

Every shard holds `arange(base, base + length)`, so a block is identified by its first token and its content is
known exactly: block k of the file with base B is `arange(B + k*bs, B + (k+1)*bs)`.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest
import torch

from archscale.data import format as shard_format
from archscale.data.loader import PackedLoader, load_mixture, read_manifest, validation_batches
from archscale.errors import UserError

FILE_STRIDE = 1000  # file i of a prefix starts at base + i * FILE_STRIDE


def make_shards(d, lengths, prefix="train", base=0, dtype=np.uint16):
    """Write `{prefix}_{i:010d}.bin` holding arange(base + i*FILE_STRIDE, ... + length); return block starts."""
    d.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(lengths):
        start = base + i * FILE_STRIDE
        shard_format.write_shard(d / f"{prefix}_{i:010d}.bin", np.arange(start, start + n), dtype)


def block_starts(lengths, bs, base=0):
    """Block first-tokens in file order, block order (what an unshuffled single stream yields)."""
    return [base + i * FILE_STRIDE + k * bs for i, n in enumerate(lengths) for k in range(n // bs)]


def rows(batch):
    """First tokens of a batch, after checking each row is a contiguous, block-aligned slice."""
    arr = batch.numpy()
    bs = arr.shape[1]
    for r in arr:
        np.testing.assert_array_equal(r, np.arange(r[0], r[0] + bs))
        assert (r[0] % FILE_STRIDE) % bs == 0, f"block not aligned: {r[0]}"
    return arr[:, 0].tolist()


def take(loader, n):
    return [next(loader) for _ in range(n)]


def epoch_of(loader, src=0, worker=0):
    return loader.state_dict()["streams"][src][worker]["epoch"]


# ----------------------------------------------------------------------------------------------- cutting

def test_blocks_cut_exactly_and_one_unshuffled_epoch_visits_each_block_once(tmp_path):
    lengths = [50, 50, 50, 23]  # bs 8: 6, 6, 6, 2 blocks; leftovers 2, 2, 2, 7 tokens are never used
    make_shards(tmp_path, lengths)
    loader = PackedLoader(tmp_path, "train", block_size=8, micro_bsz=2, shuffle=False)
    expected = block_starts(lengths, 8)
    assert len(expected) == 20
    first = next(loader)
    assert first.dtype == torch.int64 and first.shape == (2, 8)
    np.testing.assert_array_equal(first.numpy(), [np.arange(0, 8), np.arange(8, 16)])
    got = rows(first) + [s for b in take(loader, 9) for s in rows(b)]
    assert got == expected  # sequential, each block exactly once
    # The stream is infinite: the next epoch repeats the same (unshuffled) order.
    again = [s for b in take(loader, 10) for s in rows(b)]
    assert again == expected
    # The tensor is a private copy: writing to it changes nothing the loader will return later.
    first[:] = -5
    assert rows(take(loader, 1)[0]) == expected[:2]


def test_mixed_dtypes_in_one_dataset(tmp_path):
    shard_format.write_shard(tmp_path / "train_a.bin", np.arange(100, 112), np.uint16)
    shard_format.write_shard(tmp_path / "train_b.bin", np.arange(70000, 70012), np.int32)
    loader = PackedLoader(tmp_path, block_size=6, micro_bsz=4, shuffle=False)
    batch = next(loader).numpy()
    np.testing.assert_array_equal(batch[:, 0], [100, 106, 70000, 70006])
    np.testing.assert_array_equal(batch[3], np.arange(70006, 70012))


# ----------------------------------------------------------------------------------------------- shuffle

def test_shuffle_is_deterministic_seed_dependent_and_buffered(tmp_path):
    lengths = [24] * 10  # bs 4 -> 6 blocks per file, 60 blocks
    make_shards(tmp_path, lengths)
    mk = lambda seed: PackedLoader(tmp_path, block_size=4, micro_bsz=3, seed=seed, buffer_chunks=3)
    a = [s for b in take(mk(1), 20) for s in rows(b)]
    b = [s for b in take(mk(1), 20) for s in rows(b)]
    c = [s for b in take(mk(2), 20) for s in rows(b)]
    assert a == b
    assert a != c
    everything = block_starts(lengths, 4)
    assert sorted(a) == everything and sorted(c) == everything  # one epoch = every block once
    assert a != everything  # actually shuffled
    # Buffers: the first 18 blocks are all blocks of exactly 3 files (buffer_chunks=3), in a permuted order.
    files = {s // FILE_STRIDE for s in a[:18]}
    assert len(files) == 3
    assert sorted(a[:18]) == sorted(f * FILE_STRIDE + 4 * k for f in files for k in range(6))
    assert a[:18] != sorted(a[:18])
    # Each buffer gets its own permutation: with one file per buffer, the in-file block orders differ.
    single = [s for b in take(PackedLoader(tmp_path, block_size=4, micro_bsz=6, seed=1, buffer_chunks=1), 4)
              for s in rows(b)]
    patterns = [tuple((s % FILE_STRIDE) // 4 for s in single[i:i + 6]) for i in range(0, 24, 6)]
    assert all(sorted(p) == list(range(6)) for p in patterns)
    assert len(set(patterns)) == 4
    # The next epoch uses a different file order / permutation.
    loader = mk(1)
    take(loader, 20)
    assert [s for b in take(loader, 20) for s in rows(b)] != a


# ----------------------------------------------------------------------------------------------- sharding

def collect_epoch0(loader, workers):
    """Blocks each logical worker yields in its epoch 0 (micro_bsz=1)."""
    seen = {w: [] for w in range(workers)}
    done = set()
    while len(done) < workers:
        w = loader.state_dict()["next_worker"]
        (start,) = rows(next(loader))
        if epoch_of(loader, 0, w) == 0:
            seen[w].append(start)
        else:
            done.add(w)
    return seen


@pytest.mark.parametrize("lengths,world,workers", [
    ([40, 24, 33, 16, 40, 8, 40, 24, 17, 40], 3, 1),  # file striding, uneven files per rank
    ([40, 24, 33, 16, 40, 8, 40, 24, 17, 40], 2, 2),  # file striding over 4 data shards
    ([40, 24, 33, 16, 40], 1, 2),                     # workers only
    ([44, 37], 4, 1),                                 # fewer files than ranks: block striding
    ([44, 37, 12], 2, 2),                             # fewer files than ranks x workers: block striding
])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_and_workers_cover_each_block_exactly_once_per_epoch(tmp_path, lengths, world, workers, shuffle):
    make_shards(tmp_path, lengths)
    everything = block_starts(lengths, 4)
    per_shard = []
    for rank in range(world):
        loader = PackedLoader(tmp_path, block_size=4, micro_bsz=1, rank=rank, world_size=world,
                              num_workers=workers, shuffle=shuffle, buffer_chunks=2, seed=11)
        seen = collect_epoch0(loader, workers)
        per_shard += [seen[w] for w in range(workers)]
    union = [s for part in per_shard for s in part]
    assert sorted(union) == everything  # covers every block, no overlap (a duplicate would show up here)
    assert all(per_shard)
    n_shards = world * workers
    if len(lengths) >= n_shards:  # file striding: every file belongs to exactly one data shard
        owners = {}
        for i, part in enumerate(per_shard):
            for s in part:
                assert owners.setdefault(s // FILE_STRIDE, i) == i
    else:  # block striding over the global block numbering: an even split, at most one block apart
        sizes = [len(p) for p in per_shard]
        assert max(sizes) - min(sizes) <= 1


# ----------------------------------------------------------------------------------------------- resume

def resume_matches(make, n, m):
    reference = take(make(), n + m)
    first = make()
    take(first, n)
    sd = json.loads(json.dumps(first.state_dict()))  # must survive JSON
    resumed = make()
    resumed.load_state_dict(sd)
    for i, (x, y) in enumerate(zip(take(resumed, m), reference[n:])):
        assert torch.equal(x, y), f"batch {n + i} differs after resuming at {n}"
    return sd


@pytest.mark.parametrize("n", [0, 1, 5, 13, 31])
def test_exact_resume_single_source(tmp_path, n):
    make_shards(tmp_path, [40, 28, 36, 12, 40])  # bs 4: 10+7+9+3+10 = 39 blocks; buffers of 2 files
    make = lambda: PackedLoader(tmp_path, block_size=4, micro_bsz=3, seed=5, buffer_chunks=2)
    sd = resume_matches(make, n, 12)
    if n == 31:  # 93 blocks taken: well into the third epoch, across buffer boundaries
        assert sd["streams"][0][0]["epoch"] == 2


@pytest.mark.parametrize("n", [0, 3, 17, 40])
def test_exact_resume_mixture_workers_ranks(tmp_path, n):
    make_shards(tmp_path, [40, 28, 36, 12, 40, 20], prefix="train_web")
    make_shards(tmp_path, [30, 17], prefix="train_code", base=30000)  # 2 files < 4 shards: block striding
    make = lambda: PackedLoader(tmp_path, {"train_web": 0.7, "train_code": 0.3}, block_size=4, micro_bsz=3,
                                seed=9, rank=1, world_size=2, num_workers=2, buffer_chunks=2)
    sd = resume_matches(make, n, 10)
    if n == 40:
        assert min(st["epoch"] for per in sd["streams"] for st in per) >= 1  # every stream wrapped
    assert sd["next_worker"] == n % 2


def test_state_dict_is_plain_json(tmp_path):
    make_shards(tmp_path, [40, 40], prefix="train_a")
    make_shards(tmp_path, [40], prefix="train_b", base=20000)
    loader = PackedLoader(tmp_path, {"train_a": 1, "train_b": 3}, block_size=4, micro_bsz=2, num_workers=2)
    take(loader, 7)
    sd = loader.state_dict()
    assert json.loads(json.dumps(sd)) == sd
    assert sd["batches"] == 7 and sd["fingerprint"]["num_workers"] == 2
    assert [s["prefix"] for s in sd["fingerprint"]["sources"]] == ["train_a", "train_b"]


def test_load_state_dict_reads_no_data(tmp_path, monkeypatch):
    make_shards(tmp_path, [12, 12])  # bs 4: 6 blocks; 10_000 batches of 2 = thousands of epochs
    make = lambda: PackedLoader(tmp_path, block_size=4, micro_bsz=2, seed=1)
    far = make()
    take(far, 10_000)
    sd_far = far.state_dict()
    near = make()
    take(near, 1)
    sd_near = near.state_dict()
    assert sd_far["streams"][0][0]["epoch"] > 3000

    calls = Counter()
    real_open, real_header = shard_format.open_shard, shard_format.read_header
    monkeypatch.setattr(shard_format, "open_shard", lambda p: (calls.update(["open"]), real_open(p))[1])
    monkeypatch.setattr(shard_format, "read_header", lambda *a: (calls.update(["header"]), real_header(*a))[1])
    opens = {}
    for name, sd, ref in (("far", sd_far, far), ("near", sd_near, near)):
        resumed = make()
        calls.clear()
        resumed.load_state_dict(sd)
        assert calls == Counter(), f"load_state_dict read data ({name})"
        batch = next(resumed)
        opens[name] = calls["open"]
        assert torch.equal(batch, next(ref))
    assert 1 <= opens["far"] <= 2 and 1 <= opens["near"] <= 2  # only the files of the one batch read

    # A position a skip-ahead loader could never reach in a test: epoch 10**9 resumes instantly.
    sd_huge = json.loads(json.dumps(sd_far))
    sd_huge["streams"][0][0]["epoch"] = 10 ** 9
    t0 = time.perf_counter()
    x, y = make(), make()
    x.load_state_dict(sd_huge)
    y.load_state_dict(sd_huge)
    assert torch.equal(next(x), next(y))
    assert time.perf_counter() - t0 < 2.0
    assert x.state_dict()["streams"][0][0]["epoch"] >= 10 ** 9


def test_mismatched_fingerprint_is_a_user_error(tmp_path):
    make_shards(tmp_path, [40, 40, 40])
    base = dict(block_size=4, micro_bsz=2, seed=3, world_size=2, rank=0)
    sd = PackedLoader(tmp_path, **base).state_dict()
    for change, word in [(dict(block_size=8), "block_size"), (dict(micro_bsz=4), "micro_bsz"),
                         (dict(seed=4), "seed"), (dict(world_size=3), "world_size"),
                         (dict(num_workers=2), "num_workers"), (dict(rank=1), "rank")]:
        with pytest.raises(UserError, match=f"{word}.* changed from"):
            PackedLoader(tmp_path, **{**base, **change}).load_state_dict(sd)
    make_shards(tmp_path, [40, 40, 40, 40])  # a file was added
    with pytest.raises(UserError, match=r"files of 'train' changed \(3 files .* now 4 files"):
        PackedLoader(tmp_path, **base).load_state_dict(sd)
    with pytest.raises(UserError, match="data prefixes changed"):
        PackedLoader(tmp_path, {"train": 1.0, "train_0000000000": 1.0}, **base).load_state_dict(sd)
    with pytest.raises(UserError, match="version"):
        PackedLoader(tmp_path, **base).load_state_dict({"version": 99})


# ----------------------------------------------------------------------------------------------- mixture

def test_mixture_frequencies_follow_weights(tmp_path):
    make_shards(tmp_path, [40, 40, 40], prefix="web")
    make_shards(tmp_path, [40, 40], prefix="code", base=30000)
    mix_file = tmp_path / "mix.json"
    mix_file.write_text(json.dumps({"web": 4, "code": 1}))
    mixture = load_mixture(mix_file, data_dir=tmp_path)
    assert mixture == {"web": 4.0, "code": 1.0}
    loader = PackedLoader(tmp_path, mixture, block_size=4, micro_bsz=10, seed=0)
    starts = [s for b in take(loader, 200) for s in rows(b)]
    frac_web = sum(s < 30000 for s in starts) / len(starts)
    assert abs(frac_web - 0.8) <= 0.05
    other = PackedLoader(tmp_path, mixture, block_size=4, micro_bsz=10, seed=1)
    assert [s for b in take(other, 200) for s in rows(b)] != starts  # the pick sequence depends on the seed
    # Each source, seen alone, is its own exactly-once stream: the first 30 web blocks are all 30 web blocks.
    web = [s for s in starts if s < 30000][:30]
    assert sorted(web) == block_starts([40, 40, 40], 4)


def test_load_mixture_errors_name_the_file_and_prefix(tmp_path):
    make_shards(tmp_path, [40], prefix="web")
    for content, pattern in [({"web": -1}, "'web' must be a positive"), ({"web": 0}, "'web' must be a positive"),
                             ({"web": "1"}, "'web' must be a positive"), ({}, "non-empty"),
                             ({"web": 1, "books": 2}, r"'books' matches no .*books\*\.bin")]:
        f = tmp_path / "mix.json"
        f.write_text(json.dumps(content))
        with pytest.raises(UserError, match=pattern) as e:
            load_mixture(f, data_dir=tmp_path)
        assert str(f) in str(e.value) and "\n" not in str(e.value)
    f.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON") as e:
        load_mixture(f)
    assert str(f) in str(e.value)
    with pytest.raises(UserError, match="mixture file not found"):
        load_mixture(tmp_path / "missing.json")
    assert load_mixture('{"web": 2.5}') == {"web": 2.5}
    with pytest.raises(UserError, match="'web' must be a positive"):
        PackedLoader(tmp_path, {"web": 0.0}, block_size=4, micro_bsz=1)


# ----------------------------------------------------------------------------------------------- errors

def test_errors_are_one_line_user_errors_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match="does not exist") as e:
        PackedLoader(missing, block_size=4, micro_bsz=1)
    assert str(missing) in str(e.value)

    make_shards(tmp_path, [40], prefix="validation")
    with pytest.raises(UserError) as e:
        PackedLoader(tmp_path, block_size=4, micro_bsz=1)
    assert str(e.value) == (f"no train*.bin in {tmp_path}; run `archscale prepare` first or check --train_data_dir")

    short = tmp_path / "short"
    make_shards(short, [10, 20, 5])
    with pytest.raises(UserError, match=r"fewer than block_size=64 tokens \(longest 20\); use a smaller --ctx_len") \
            as e:
        PackedLoader(short, block_size=64, micro_bsz=1)
    assert str(short) in str(e.value)

    tiny = tmp_path / "tiny"
    make_shards(tiny, [8])  # 2 blocks of 4 cannot feed 4 ranks
    with pytest.raises(UserError, match="only 2 blocks .* fewer than the 4 data shards"):
        PackedLoader(tiny, block_size=4, micro_bsz=1, rank=0, world_size=4)

    bad = tmp_path / "bad"
    make_shards(bad, [40])
    (bad / "train_zzz.bin").write_bytes(b"garbage, not a shard at all.....")
    with pytest.raises(UserError, match="not a LITPKDS shard") as e:
        PackedLoader(bad, block_size=4, micro_bsz=1)
    assert str(bad / "train_zzz.bin") in str(e.value)

    with pytest.raises(UserError, match="rank must be in"):
        PackedLoader(tmp_path, "validation", block_size=4, micro_bsz=1, rank=2, world_size=2)
    with pytest.raises(UserError, match="micro_bsz"):
        PackedLoader(tmp_path, "validation", block_size=4, micro_bsz=0)


def test_read_manifest(tmp_path):
    assert read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 32000, "eos_id": 2, "dtype": "uint16"}))
    assert read_manifest(tmp_path) == {"vocab_size": 32000, "eos_id": 2, "dtype": "uint16"}
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(UserError, match="cannot parse the dataset manifest") as e:
        read_manifest(tmp_path)
    assert str(tmp_path / "manifest.json") in str(e.value)


# ----------------------------------------------------------------------------------------------- validation

def test_validation_batches_sequential_finite_sharded(tmp_path):
    lengths = [40, 43, 17]  # bs 8: 5 + 5 + 2 = 12 blocks
    make_shards(tmp_path, lengths, prefix="validation")
    make_shards(tmp_path, [80], prefix="train", base=50000)  # must not be read
    everything = block_starts(lengths, 8)

    batches = list(validation_batches(tmp_path, block_size=8, micro_bsz=5))
    assert [tuple(b.shape) for b in batches] == [(5, 8), (5, 8), (2, 8)]  # last partial batch kept
    assert all(b.dtype == torch.int64 for b in batches)
    assert [s for b in batches for s in rows(b)] == everything  # sequential, unshuffled

    r0 = list(validation_batches(tmp_path, block_size=8, micro_bsz=5, rank=0, world_size=2))
    r1 = list(validation_batches(tmp_path, block_size=8, micro_bsz=5, rank=1, world_size=2))
    assert [len(b) for b in r0] == [len(b) for b in r1] == [5, 1]
    assert [s for b in r0 for s in rows(b)] == everything[0::2]
    assert [s for b in r1 for s in rows(b)] == everything[1::2]

    # 12 blocks over 5 ranks: 2 each (same batch count everywhere), the last 2 blocks are skipped.
    parts = [[s for b in validation_batches(tmp_path, block_size=8, micro_bsz=4, rank=r, world_size=5)
              for s in rows(b)] for r in range(5)]
    assert parts == [[everything[r], everything[r + 5]] for r in range(5)]

    assert len(list(validation_batches(tmp_path, block_size=8, micro_bsz=5, max_batches=1))) == 1
    with pytest.raises(UserError, match=r"no validation_x\*\.bin in .*; run `archscale prepare` first or check "
                                        r"--val_data_dir"):
        validation_batches(tmp_path, prefix="validation_x", block_size=8, micro_bsz=1)
    with pytest.raises(UserError, match="does not exist"):
        validation_batches(tmp_path / "nope", block_size=8, micro_bsz=1)  # raised at the call, not at next()
