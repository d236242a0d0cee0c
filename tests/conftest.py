import json

import numpy as np
import pytest

from archscale.data.format import write_shard


def make_dataset(path, vocab=256, n_train_files=3, tokens_per_file=6000, seed=0):
    """A learnable synthetic dataset: a repeated random pattern, split into LITPKDS shards + manifest."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pattern = rng.integers(1, vocab, size=500)
    stream = np.tile(pattern, (n_train_files * tokens_per_file) // 500 + 2)
    for i in range(n_train_files):
        write_shard(path / f"train_{i:010d}.bin", stream[i * tokens_per_file:(i + 1) * tokens_per_file], np.uint16)
    write_shard(path / "validation_0000000000.bin", stream[:3000], np.uint16)
    (path / "manifest.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": 0, "dtype": "uint16"}))
    return path


@pytest.fixture
def dataset(tmp_path):
    return make_dataset(tmp_path / "data")


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests need an NVIDIA GPU: skipped, with that reason, where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
