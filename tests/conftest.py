import json
import os

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


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """Tiny real training runs (3 steps, ctx 32) of a Transformer++ (d1) and a SambaY (d4) on Milton's
    Areopagitica, with their own 320-token BPE tokenizer recorded in the data manifest."""
    from pathlib import Path

    from archscale.cli import main
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe

    essay = Path(__file__).resolve().parents[1] / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"
    d = tmp_path_factory.mktemp("tiny_runs")
    paras = [p for p in essay.read_text().split("\n\n") if p.strip()]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    train_bpe([str(d / "c.jsonl")], 320, str(d / "tok.json"))
    prepare([str(d / "c.jsonl")], str(d / "data"), str(d / "tok.json"), val_fraction=0.2, chunk_size=8192,
            progress=False, num_workers=1)
    out = {}
    for arch, depth in (("transformer", "1"), ("sambay", "4")):
        assert main(["pretrain", "--train_data_dir", str(d / "data"), "--train_model", arch, "--depth", depth,
                     "--ar", "16", "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens",
                     "384", "--base_hps.warmup_tokens0", "128", "--eval_iters", "1", "--eval_interval", "2",
                     "--vocab_size", "320", "--out_dir", str(d / arch), "--progress", "false",
                     "--precision", "fp32", "--resume", "none"]) == 0
        out[arch] = d / arch
    return out


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """An in-process DeepSpeed run gets RANK / WORLD_SIZE / LOCAL_RANK in os.environ (train.distributed.setup);
    left behind, they make later libraries (accelerate, under lm-eval's HF model) believe they run under torchrun."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def deepspeed_one_rank_group():
    """A one-process gloo group shared by a module's in-process DeepSpeed runs (pretrain() reuses a group it did
    not create and leaves it alone). DeepSpeed caches groups derived from the default one (a clone of the world group, ...):
    they are dropped at teardown, or the next test's DeepSpeed would use groups of a destroyed default group."""
    import torch.distributed as dist

    pytest.importorskip("deepspeed")
    from deepspeed.utils import groups

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for name, value in list(vars(groups).items()):
        if "GROUP" in name and isinstance(value, (dict, dist.ProcessGroup)):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mesh_device = None
