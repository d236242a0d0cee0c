"""Meta-device init (train/meta_init.py) gives exactly the eager init: every parameter and buffer bitwise equal
(torch.equal), the CPU generator left in the same state, the same logits; in one process and FSDP2-sharded over
2 gloo processes (each rank holding only its shards), for every kind of mixer and init special case.

Run as a script (`torchrun ... tests/test_meta_init.py OUT.json`) it is the 2-process worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from archscale import GPT, ModelConfig
from archscale.train.meta_init import ReplayInit, build_on_meta, materialize

SEED = 1234
SMALL_MAMBA2 = {"mamba2": {"expand": 2, "headdim": 16, "d_state": 16, "chunk_size": 32}}
# name -> (architecture, depth, overrides). Together: attention (full, SWA, differential, YOCO KV / cross), Mamba,
# Mamba-2, Gated DeltaNet (one head: the second rank's shard of its (1,) A_log / dt_bias is empty), GMU / nGMU,
# a mixture of experts with a shared expert, tied embeddings with LayerNorm and biases (Phi4-mini-Flash), the
# mu-P init (module inits x w_init_mult, tied: 1/sqrt(2L) on outputs), odd first dims (uneven shards).
CONFIGS = {
    "transformer": ("transformer", 2, {}),
    "mamba": ("mamba", 2, {}),
    "samba": ("samba", 4, {"sliding_window": 5}),
    "sambay": ("sambay", 8, {"sliding_window": 5}),
    "sambay2": ("sambay2", 8, {"sliding_window": 5, "mixer_options": SMALL_MAMBA2}),
    "sgdny": ("sgdny", 8, {"sliding_window": 5, "mixer_options": {"gdn": {"head_dim": 16, "num_heads": 1}}}),
    "phi4miniflash_tied": ("phi4miniflash", 4, {"n_head": 8, "n_query_groups": 4, "head_size": 8}),
    "moe": ("transformer", 2, {"ffn_kind": "moe", "mixer_options": {"moe": {"n_experts": 4, "top_k": 2,
                                                                           "n_shared": 1}}}),
    "samba_mup_tied": ("samba", 4, {"sliding_window": 5, "init_scheme": "mup", "w_init_mult": 2.0,
                                    "tie_embeddings": True}),
}


def config(name: str) -> ModelConfig:
    arch, depth, overrides = CONFIGS[name]
    return ModelConfig.from_arch(arch, depth, ar=16, vocab_size=97, block_size=64, **overrides)


def eager(cfg: ModelConfig) -> tuple[GPT, torch.Tensor]:
    """Today's init (what the trainer does without meta init) and the CPU generator's state after it."""
    torch.manual_seed(SEED)
    model = GPT(cfg)
    return model, torch.get_rng_state()


def meta_then(cfg: ModelConfig, shard=lambda model: None) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(SEED)
    model = build_on_meta(cfg)
    assert all(p.is_meta for p in model.parameters())
    shard(model)
    materialize(model, "cpu")
    return model, torch.get_rng_state()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def mismatches(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    """Names of the parameters / buffers of `model` (gathered when sharded) not bitwise equal to `ref`'s."""
    bad = [n for n, p in model.named_parameters() if not torch.equal(full(p), ref.get_parameter(n))]
    bad += [n for n, b in model.named_buffers() if not torch.equal(full(b), ref.get_buffer(n))]
    names = lambda m: sorted(n for n, _ in (*m.named_parameters(), *m.named_buffers()))  # noqa: E731
    return bad + ([f"names differ: {names(model)} vs {names(ref)}"] if names(model) != names(ref) else [])


def tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", CONFIGS)
def test_meta_init_equals_eager_init_in_one_process(name):
    cfg = config(name)
    ref, ref_rng = eager(cfg)
    model, rng = meta_then(cfg)
    assert mismatches(model, ref) == []
    assert torch.equal(rng, ref_rng)  # every draw replayed: later randomness is unchanged too
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        assert torch.equal(model(tokens(cfg)), ref(tokens(cfg)))  # RoPE cache and all


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["sambay", "sgdny", "moe"])
def test_meta_init_on_cuda_equals_the_eager_cpu_init(name):
    """Materialised on a GPU, the values are still the CPU init's (the trainer's eager build is on the CPU, then
    moved): RNG draws and the mixers' init arithmetic (exp, log of Mamba's dt / A) run on the CPU."""
    cfg = config(name)
    ref, ref_rng = eager(cfg)
    torch.manual_seed(SEED)
    model = materialize(build_on_meta(cfg), "cuda")
    assert all(p.is_cuda for p in model.parameters())
    assert mismatches(model.cpu(), ref) == [] and torch.equal(torch.get_rng_state(), ref_rng)


def test_a_replay_that_skips_the_constructor_draws_is_caught(monkeypatch):
    """Negative control of the comparison: a meta build that does not replay the constructor's draws (the
    generator then starts `reset_parameters` elsewhere) gives other values, and the test above sees it."""
    monkeypatch.setattr(ReplayInit, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    cfg = config("mamba")
    ref, ref_rng = eager(cfg)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = GPT(cfg)
    monkeypatch.undo()
    materialize(model, "cpu")
    assert "wte.weight" in mismatches(model, ref) and not torch.equal(torch.get_rng_state(), ref_rng)


def test_a_parameter_no_init_sets_is_an_error(monkeypatch):
    """A mixer whose reset_parameters forgets one parameter (here Mamba's D = 1) leaves it NaN: refused, named."""
    from torch import nn

    from archscale.models.mixers.mamba import Mamba

    original = Mamba.reset_parameters

    def forgets_d(self):
        ones = nn.init.ones_
        nn.init.ones_ = lambda t: t if t is self.D else ones(t)
        try:
            original(self)
        finally:
            nn.init.ones_ = ones

    monkeypatch.setattr(Mamba, "reset_parameters", forgets_d)
    with pytest.raises(RuntimeError, match=r"nothing initialises 'blocks.0.mixer.D'"):
        meta_then(config("mamba"))


@pytest.mark.slow
def test_fsdp2_meta_init_equals_eager_init_on_two_processes(tmp_path):
    """Every parameter of the FSDP2-sharded (per block, then the root, as parallelize.apply_fsdp does) meta-built
    model, gathered, equals the eager model bitwise on both ranks; each rank held only its shards."""
    from tests.test_distributed import torchrun

    out = tmp_path / "results"
    torchrun(str(Path(__file__)), str(out))
    for rank in (0, 1):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert set(results) == set(CONFIGS)
        for name, r in results.items():
            assert r["mismatches"] == [] and r["rng_equal"] and r["logits_equal"], (rank, name, r)
            assert r["local_numel"] < 0.6 * r["total_numel"], (rank, name, r)  # sharded: about half each


@pytest.mark.slow
def test_fsdp2_training_builds_on_meta_and_matches_one_process(tmp_path):
    """The trainer's FSDP2 path builds on meta (it says so) and trains like one process (eager init there): same
    train and validation losses, the tolerance of tests/test_distributed.py (only the order of sums differs)."""
    from archscale.cli import main
    from tests.conftest import make_dataset
    from tests.test_distributed import assert_same, base_args, torchrun

    data = make_dataset(tmp_path / "data")
    short = ("--resume", "none", "--max_tokens", "768")  # 3 optimizer steps
    assert main(["pretrain", *base_args(data, tmp_path / "single", "transformer", *short)]) == 0
    out = torchrun("pretrain.py", *base_args(data, tmp_path / "fsdp", "transformer", *short, "--strategy", "fsdp"))
    assert "meta-device init: built on meta" in out
    assert_same(tmp_path / "fsdp", tmp_path / "single")
    assert_same(tmp_path / "fsdp", tmp_path / "single", col="val_loss")


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    dist.init_process_group("gloo")
    results = {}
    for name in CONFIGS:
        cfg = config(name)
        ref, ref_rng = eager(cfg)
        model, rng = meta_then(cfg, shard)
        local = sum(p._local_tensor.numel() for p in model.parameters())
        with torch.no_grad():
            same_logits = torch.equal(model(tokens(cfg)), ref(tokens(cfg)))
        results[name] = dict(mismatches=mismatches(model, ref), rng_equal=torch.equal(rng, ref_rng),
                             logits_equal=same_logits, local_numel=local,
                             total_numel=sum(p.numel() for p in ref.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
