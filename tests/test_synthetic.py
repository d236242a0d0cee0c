"""`--train_data_dir synthetic[:markov|:uniform]`: token streams from the seed, no files; exact resume; ranks
draw disjoint micro-batches of one world-size-independent order; a Markov chain a short run visibly learns."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from archscale.cli import main
from archscale.data.synthetic import (MARKOV_PROBS, SUCCESSORS, SyntheticLoader, markov_entropy, markov_successors,
                                      synthetic_kind, synthetic_validation_batches)
from archscale.errors import UserError
from tests.test_train import det, rows


def syn_args(out, kind="synthetic", *extra):
    return ["pretrain", "--train_data_dir", kind, "--vocab_size", "64", "--train_model", "transformer", "--depth",
            "1", "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "5120",
            "--base_hps.eta0", "3e-3", "--base_hps.warmup_tokens0", "256", "--eval_interval", "10",
            "--eval_iters", "2", "--log_interval", "1", "--out_dir", str(out), "--progress", "false",
            "--precision", "fp32", *extra]


def test_kinds_are_parsed_and_bad_ones_refused():
    assert synthetic_kind("synthetic") == "markov" and synthetic_kind("synthetic:uniform") == "uniform"
    assert synthetic_kind("data/train") is None and synthetic_kind("./synthetic") is None  # a real folder
    with pytest.raises(UserError, match="unknown synthetic data kind 'zipf'"):
        synthetic_kind("synthetic:zipf")


@pytest.mark.parametrize("kind", ["markov", "uniform"])
def test_order_is_world_size_independent_disjoint_and_resumes(kind):
    kw = dict(vocab_size=50, block_size=17, micro_bsz=3, seed=5)
    single = SyntheticLoader(kind, **kw)
    order = [next(single) for _ in range(8)]
    assert all(b.shape == (3, 17) and b.dtype == torch.int64 and 0 <= int(b.min()) and int(b.max()) < 50
               for b in order)
    assert len({tuple(b.flatten().tolist()) for b in order}) == 8  # no two micro-batches alike
    two = [SyntheticLoader(kind, rank=r, world_size=2, **kw) for r in range(2)]
    for j in range(2):  # rank r gets global micro-batches r, r+2, ...: disjoint, and the single order
        for r in range(2):
            assert torch.equal(next(two[r]), order[2 * j + r])
    state = json.loads(json.dumps(two[0].state_dict()))
    assert state == two[1].state_dict() and state["batches"] == 4
    one = SyntheticLoader(kind, **kw)
    one.load_state_dict(state)  # 2 ranks -> 1: continues with global micro-batch 4
    assert all(torch.equal(next(one), order[j]) for j in range(4, 8))
    other_seed = SyntheticLoader(kind, **{**kw, "seed": 6})
    assert not torch.equal(next(other_seed), order[0])
    with pytest.raises(UserError, match="seed 5 -> 6"):
        other_seed.load_state_dict(state)
    with pytest.raises(UserError, match="not a multiple of the new world size 3"):
        SyntheticLoader(kind, rank=0, world_size=3, **kw).load_state_dict(state)


def test_markov_tokens_follow_the_chain_and_validation_is_held_out():
    V, seed = 40, 11
    table = markov_successors(V, seed)
    assert table.shape == (V, SUCCESSORS) and all(len(set(r)) == SUCCESSORS for r in table.tolist())
    assert np.array_equal(table, markov_successors(V, seed))  # a function of (vocab, seed) only
    batch = next(SyntheticLoader("markov", vocab_size=V, block_size=2001, micro_bsz=2, seed=seed)).numpy()
    prev, nxt = batch[:, :-1].ravel(), batch[:, 1:].ravel()
    slot = (table[prev] == nxt[:, None])  # which successor each transition took
    assert slot.any(axis=1).all()  # every transition is one of the chain's
    freq = np.bincount(slot.argmax(axis=1), minlength=SUCCESSORS) / len(slot)
    assert np.allclose(freq, MARKOV_PROBS, atol=0.03), freq  # 4000 draws: a few sigma of binomial noise
    assert markov_entropy() == pytest.approx(1.1097, abs=1e-4)
    val = synthetic_validation_batches("markov", vocab_size=V, block_size=2001, micro_bsz=2, seed=seed, max_batches=1)
    assert not torch.equal(val[0], torch.from_numpy(batch))


def test_markov_run_learns_and_uniform_run_cannot(tmp_path):
    assert main(syn_args(tmp_path / "m", "synthetic", "--resume", "none")) == 0
    vals = [float(r["val_loss"]) for r in rows(tmp_path / "m") if r["val_loss"]]
    assert vals[0] == pytest.approx(math.log(64), abs=0.3) and vals[-1] < vals[0] - 1.5, vals  # ln 64 = 4.16
    assert vals[-1] > markov_entropy() - 0.05  # nothing beats the chain's entropy rate
    assert main(syn_args(tmp_path / "u", "synthetic:uniform", "--resume", "none")) == 0
    vals = [float(r["val_loss"]) for r in rows(tmp_path / "u") if r["val_loss"]]
    assert min(vals) > math.log(64) - 0.1, vals  # random tokens: nothing to learn


def test_synthetic_run_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(syn_args(full, "synthetic", "--resume", "none", "--max_tokens", "2560")) == 0
    assert main(syn_args(part, "synthetic", "--resume", "none", "--max_tokens", "2560", "--max_steps", "10",
                         "--save_interval", "5")) == 0
    assert main(syn_args(part, "synthetic", "--resume", "auto", "--max_tokens", "2560")) == 0
    assert det(part) == det(full) and len(det(full)) == 21


def test_synthetic_needs_a_vocab_size(tmp_path, capsys):
    argv = syn_args(tmp_path / "r")
    i = argv.index("--vocab_size")
    assert main(argv[:i] + argv[i + 2:]) == 2
    assert "synthetic data needs --vocab_size" in capsys.readouterr().err
    assert main(syn_args(tmp_path / "r", "synthetic:zipf")) == 2
    assert main(syn_args(tmp_path / "r", "synthetic", "--data_mixture", '{"train": 1}')) == 2


@pytest.mark.slow
def test_synthetic_data_under_torchrun_matches_one_process(tmp_path):
    """DDP, FSDP2 and ZeRO-2 on 2 gloo ranks: the same global batches as one process (the ranks' micro-batches
    are disjoint and together the single order), hence the same losses."""
    from tests.test_distributed import assert_same, driver, torchrun

    def run_args(out, *extra):
        return syn_args(out, "synthetic", "--resume", "none", "--max_tokens", "768", "--eval_interval", "3",
                        *extra)[1:]
    ref = tmp_path / "single"
    assert main(["pretrain", *run_args(ref)]) == 0
    runs = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"],
            "zero2": ["--strategy", "deepspeed", "--zero_stage", "2"]}
    torchrun(*driver(tmp_path, [run_args(tmp_path / name, *extra) for name, extra in runs.items()]))
    for name in runs:
        assert_same(tmp_path / name, ref)
        assert_same(tmp_path / name, ref, col="val_loss")
