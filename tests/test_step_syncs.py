"""The step path's host syncs and its batch source: one host read of a tensor per optimizer step (the loss and the
gradient norm read together, the non-finite guard decided from them), and on CUDA batches read ahead on a
background thread into pinned memory, in the loader's order, with a checkpointable position that counts only
the batches handed out. The CUDA path's logic runs here on CPU with the pinning injected."""

from __future__ import annotations

import threading

import pytest
import torch

from archscale.data.loader import GlobalOrderLoader, Prefetcher, prefetching
from archscale.train.host_sync import count_host_reads


def _trainer(dataset, tmp_path, *extra):
    from archscale.cli import parse_pretrain
    from archscale.train.distributed import DistEnv
    from archscale.train.trainer import Trainer

    cfg, explicit = parse_pretrain(["--train_data_dir", str(dataset), "--train_model", "transformer", "--depth", "1",
                                    "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens",
                                    "2048", "--eval_iters", "0", "--progress", "false", "--precision", "fp32",
                                    "--out_dir", str(tmp_path / "run"), "--resume", "none", *extra])
    return Trainer(cfg, explicit, DistEnv(), log=lambda m: None)


def test_one_host_read_per_optimizer_step(dataset, tmp_path, monkeypatch):
    """Counted over a whole `train_step` (4 micro-batches), apart from the CPU-side token-range check of each
    batch (a CPU tensor, no device sync) and AdamW's own step counters (CPU tensors too): exactly one read, the
    (grad norm, loss) pair. Before the fused read there were two (the loss mean, then the norm)."""
    import archscale.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "check_token_range", lambda *a, **k: None)
    trainer = _trainer(dataset, tmp_path)
    try:
        trainer.train_step(trainer.state, trainer.loader)
        opt = trainer.strategy.optimizer
        with count_host_reads() as reads:
            step = opt.step

            def unwatched_step(*args, **kwargs):  # the optimizer's step counters are CPU scalars
                reads.paused = True
                try:
                    return step(*args, **kwargs)
                finally:
                    reads.paused = False
            opt.step = unwatched_step
            result = trainer.train_step(trainer.state, trainer.loader)
        assert result.applied and result.train_loss > 0
        assert reads.where == ["tolist"], reads.where
    finally:
        trainer.close()


def test_the_read_decides_the_guard(dataset, tmp_path):
    """A non-finite loss given to clip_and_step is not applied even with finite gradients (the guard reads the
    loss with the norm, so dropping either read would apply a bad update)."""
    trainer = _trainer(dataset, tmp_path)
    try:
        trainer.train_step(trainer.state, trainer.loader)
        model = trainer.strategy.model
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        before = [p.detach().clone() for p in model.parameters()]
        out = trainer.strategy.clip_and_step(loss=torch.tensor(float("nan"), dtype=torch.float64))
        assert not out.applied and out.grad_norm > 0 and out.train_loss != out.train_loss
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        trainer.close()


def _loader(dataset, **kw):
    return GlobalOrderLoader(dataset, "train", block_size=33, micro_bsz=2, seed=1, **kw)


def test_prefetcher_hands_out_the_loaders_batches_and_position(dataset):
    pinned_on = []

    def fake_pin(batch):
        pinned_on.append(threading.current_thread().name)
        return batch.clone()

    plain, ahead = _loader(dataset), prefetching(_loader(dataset), torch.device("cuda"), pin=fake_pin)
    assert isinstance(ahead, Prefetcher) and prefetching(plain, torch.device("cpu")) is plain  # CPU: unchanged
    try:
        for _ in range(5):
            torch.testing.assert_close(next(ahead), next(plain), rtol=0, atol=0)
        assert ahead.state_dict() == plain.state_dict()  # the position of what was handed out, not read ahead
        assert set(pinned_on) == {"archscale-prefetch"} and len(pinned_on) >= 5
        resumed = _loader(dataset)
        resumed.load_state_dict(ahead.state_dict())
        torch.testing.assert_close(next(resumed), next(ahead), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="read ahead"):
            ahead.load_state_dict(plain.state_dict())
    finally:
        ahead.close()


def test_prefetcher_raises_the_loaders_error_in_order():
    class Three:
        def __init__(self):
            self.n = 0

        def __next__(self):
            if self.n == 3:
                raise ValueError("shard 7 is truncated")
            self.n += 1
            return torch.tensor([self.n])

        def state_dict(self):
            return {"n": self.n}

    ahead = Prefetcher(Three())
    try:
        assert [int(next(ahead)) for _ in range(3)] == [1, 2, 3] and ahead.state_dict() == {"n": 3}
        with pytest.raises(ValueError, match="truncated"):
            next(ahead)
    finally:
        ahead.close()
