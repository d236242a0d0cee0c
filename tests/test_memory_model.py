"""The memory model (train/memory_model.py) against measurement (train/memory_measure.py) at tiny sizes.

Tolerances: a mixer's declaration within 15% of what autograd saves in its layer; a whole training step's
predicted peak within 12% of the live-tensor peak (single process, DDP, FSDP2, a --pp 2 pipeline stage, a --ep 2
expert shard) and 15% (DeepSpeed stage 0 and ZeRO-1/2/3).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from archscale.config import ModelConfig
from archscale.models.mixers.base import REGISTRY, SaveEnv, _BY_KIND
from archscale.models.model import GPT
from archscale.scaling_rules import BaseHyperparameters
from archscale.train.config import PretrainConfig, validate
from archscale.train.memory_measure import measure_distributed, measure_training_peak, saved_by_block
from archscale.train.memory_model import GIB, memory_section, parse_bytes, predict_memory, shape_of, suggest
from archscale.train.trainer import make_plan

# architectures whose layers cover every registered kind (the test below fails when a new kind is not covered)
COVERING = [("transformer", {}), ("sambay", {}), ("sambayda", {}), ("sambayattn", {}), ("sambaymlp", {}),
            ("mambay2", {"mamba2": {"headdim": 16, "d_state": 16}}), ("gdny", {"gdn": {"head_dim": 32}}),
            ("transformer", {"moe": {"n_experts": 4, "top_k": 2}})]


def _tiny(arch: str, opts: dict, T: int) -> ModelConfig:
    cfg = ModelConfig.from_arch(arch, 8, ar=16, vocab_size=256, block_size=T, mixer_options=opts)
    return cfg.replace(ffn_kind="moe") if "moe" in opts else cfg


def test_every_kind_declares_what_it_saves_within_15_percent():
    T, covered = 128, set()
    for arch, opts in COVERING:
        cfg = _tiny(arch, opts, T)
        torch.manual_seed(0)
        model = GPT(cfg)
        measured = saved_by_block(model, torch.randint(0, 256, (1, T)), torch.bfloat16)["blocks"]
        env = SaveEnv(seq_len=T, act_bytes=2, device="cpu")
        for i, block in enumerate(model.blocks):
            for slot, kind, module, part in (("mixer", block.kind, block.mixer, "mixer"),
                                             ("ffn", block.ffn_kind, block.mlp, "ffn")):
                terms = _BY_KIND[slot, kind].saved(cfg, kind, env)
                copies = 2 * sum(p.numel() for p in module.parameters() if p.ndim >= 2)
                predicted = T * sum(v for k, v in terms.items() if k != "per_layer") + terms.get("per_layer", 0)
                got = measured[i][part] - copies
                assert abs(predicted - got) <= 0.15 * got, (arch, i, kind, predicted, got)
                covered.add((slot, kind))
    assert covered == set(_BY_KIND), f"kinds without a test architecture: {set(_BY_KIND) - covered}"
    assert {spec.name for spec in REGISTRY.values()} == {_BY_KIND[k].name for k in covered}


def _cfg(**fields) -> PretrainConfig:
    ctx = fields.get("ctx_len", 256)
    base = dict(train_data_dir="synthetic", vocab_size=2048, train_model="transformer", depth=4, ar=32,
                ctx_len=ctx, micro_bsz=1, max_tokens=1e7, strategy="single")
    base.update(fields)
    return PretrainConfig(**{**base, "base_hps": BaseHyperparameters(b0=ctx)})


def _predicted(cfg: PretrainConfig, world: int = 1) -> float:
    plan, m = make_plan(dataclasses.replace(cfg), set(), world_size=world, warn=lambda s: None)
    return predict_memory(m, shape_of(cfg, world, device="cpu"))["peak_bytes"]


@pytest.mark.parametrize("fields", [dict(), dict(act_ckpt=True), dict(train_model="mamba"),
                                    dict(precision="fp32", ctx_len=128), dict(loss="chunked")],
                         ids=["single", "single-act_ckpt", "single-mamba", "single-fp32", "single-chunked"])
def test_single_process_prediction_within_12_percent_of_measured(fields):
    cfg = _cfg(**fields)
    predicted = _predicted(cfg)
    measured = measure_training_peak(cfg)["peak_bytes"]
    assert abs(predicted / measured - 1) <= 0.12, (predicted / 2**20, measured / 2**20)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,tol", [(dict(strategy="ddp"), 0.12), (dict(strategy="fsdp"), 0.12),
                                          (dict(strategy="ddp", pp=2), 0.12),
                                          (dict(strategy="ddp", ep=2, moe="4:2"), 0.12),
                                          (dict(strategy="deepspeed", zero_stage=0), 0.15),
                                          (dict(strategy="deepspeed", zero_stage=1), 0.15),
                                          (dict(strategy="deepspeed", zero_stage=2), 0.15),
                                          (dict(strategy="deepspeed", zero_stage=3), 0.15)],
                         ids=["ddp", "fsdp2", "pp2", "ep2", "zero0", "zero1", "zero2", "zero3"])
def test_two_rank_prediction_matches_measured_peak(strategy, tol):
    """Every strategy at 2 ranks: a pipeline stage (--pp 2: each rank holds 4 of the 8 blocks), an expert-parallel
    shard (--ep 2: 2 of the 4 experts per rank), DeepSpeed without ZeRO (stage 0) and ZeRO-1/2/3."""
    pytest.importorskip("deepspeed") if strategy["strategy"] == "deepspeed" else None
    fields = dict(train_data_dir="synthetic", vocab_size=2048, train_model="transformer", depth=8, ar=32,
                  ctx_len=256, micro_bsz=1, max_tokens=1e7, base_hps={"b0": 512}, **strategy)
    measured = max(r["peak_bytes"] for r in measure_distributed(fields, 2))
    predicted = _predicted(PretrainConfig(**{**fields, "base_hps": BaseHyperparameters(b0=512)}), world=2)
    assert abs(predicted / measured - 1) <= tol, (predicted / 2**20, measured / 2**20)


def _model(arch="sambay", depth=8, ctx=32768, vocab=32000):
    return ModelConfig.from_arch(arch, depth, vocab_size=vocab, block_size=ctx)


def test_suggestion_when_applied_makes_the_prediction_fit():
    m = _model()
    shape = shape_of(PretrainConfig(train_model="sambay", depth=8, ctx_len=32768, micro_bsz=4, vocab_size=32000,
                                    strategy="fsdp"), world_size=8)
    device = 40 * GIB
    assert predict_memory(m, shape)["peak_bytes"] > device  # the plan does not fit as given
    s = suggest(m, shape, device)
    assert s is not None
    applied = dataclasses.replace(shape, **s["change"])
    assert predict_memory(m, applied)["peak_bytes"] <= device
    section = memory_section(m, shape, device)
    assert section["fits"] is False and s["flags"] in section["suggestion"]
    # and nothing to suggest when even the smallest plan cannot fit
    assert suggest(m, shape, 0.01 * GIB) is None
    assert "nothing" in memory_section(m, shape, 0.01 * GIB)["suggestion"]


def test_memory_grows_with_context_and_shrinks_with_checkpointing_and_sharding():
    m = _model(ctx=8192)
    base = shape_of(PretrainConfig(train_model="sambay", depth=8, ctx_len=8192, micro_bsz=1, vocab_size=32000),
                    world_size=1)
    peak = predict_memory(m, base)["peak_bytes"]
    assert predict_memory(m, dataclasses.replace(base, ctx_len=16384))["peak_bytes"] > 1.5 * peak
    assert predict_memory(m, dataclasses.replace(base, act_ckpt=True))["peak_bytes"] < 0.7 * peak
    fsdp = dataclasses.replace(base, strategy="fsdp", world_size=8)
    states = predict_memory(m, fsdp)["breakdown_bytes"]["optimizer"]
    assert states == pytest.approx(predict_memory(m, base)["breakdown_bytes"]["optimizer"] / 8)


def test_parse_bytes_units_and_one_line_error():
    assert parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("512MiB") == 512 * 2 ** 20
    from archscale.errors import UserError
    with pytest.raises(UserError, match="--device_memory"):
        parse_bytes("lots")


def _dry_run(*flags) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "archscale.cli", "pretrain", "--dry_run", "--json", "--vocab_size",
                           "32000", *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout[proc.stdout.index("{"):]), proc.stderr


def test_dry_run_prints_memory_fit_suggestion_and_step_time():
    out, _ = _dry_run("--train_model", "sambay", "--depth", "8", "--ctx_len", "32768", "--micro_bsz", "4",
                      "--target", "a100")
    mem, step = out["memory"], out["step_time"]
    assert mem["fits"] is False and mem["device_memory_gib"] == 80
    assert mem["per_rank_peak_gib"] == pytest.approx(sum(mem["breakdown_gib"].values()), rel=1e-6)
    assert "--act_ckpt" in mem["suggestion"]
    assert step["target"] == "a100" and step["tokens_per_s"] > 0 and step["assumptions"]
    # the suggestion, applied on the command line, fits
    fixed, _ = _dry_run("--train_model", "sambay", "--depth", "8", "--ctx_len", "32768", "--micro_bsz", "4",
                        "--target", "a100", "--act_ckpt")
    assert fixed["memory"]["fits"] is True


def test_seed_spellings_are_aliases_with_a_note():
    out, err = _dry_run("--gradient_checkpointing", "--precision", "bf16", "--depth", "2", "--ctx_len", "256")
    assert "--act_ckpt" in err and "bf16-mixed" in err
    assert "act_ckpt True" in out["memory"]["assumptions"][0]
    cfg = PretrainConfig(precision="bf16", gradient_checkpointing=True)
    validate(cfg)
    assert cfg.precision == "bf16-mixed" and cfg.act_ckpt


def test_step_time_is_flops_over_peak_at_mfu_plus_comm_over_bandwidth():
    from archscale.train.memory_model import TARGETS, RunShape, step_time

    single = RunShape(micro_bsz=1, ctx_len=4096)
    t = step_time(1e9, 1_000_000, 10_000_000, 1, 1e8, single, target="a100", mfu=0.5)
    assert t["compute_s"] == pytest.approx(1e9 * 1e6 / (312e12 * 0.5)) and t["comm_s"] == 0
    assert t["tokens_per_s"] == pytest.approx(1e6 / t["seconds_per_step"])
    assert t["wall_time_h"] == pytest.approx(10 * t["seconds_per_step"] / 3600)
    ddp = dataclasses.replace(single, strategy="ddp", world_size=8)
    t8 = step_time(1e9, 1_000_000, 10_000_000, 8, 1e8, ddp, target="a100", mfu=0.5)
    assert t8["compute_s"] == pytest.approx(t["compute_s"] / 8)
    # a ring all-reduce of fp32 gradients: 2 (N-1)/N x 4 B x P over the bandwidth
    assert t8["comm_s"] == pytest.approx(2 * 7 / 8 * 4 * 1e8 / TARGETS["a100"]["bandwidth"])
    assert any("MFU 0.50" in line for line in t8["assumptions"])


def test_pipeline_stage_and_expert_shards_hold_their_share():
    m = ModelConfig.from_arch("transformer", 8, vocab_size=32000, block_size=4096)
    base = shape_of(PretrainConfig(depth=8, ctx_len=4096, vocab_size=32000), world_size=1)
    one = predict_memory(m, base)["breakdown_bytes"]
    two = predict_memory(m, dataclasses.replace(base, pp=2, world_size=2, strategy="ddp"))["breakdown_bytes"]
    assert two["activations"] < 0.6 * one["activations"] and two["optimizer"] < 0.7 * one["optimizer"]
    moe = m.replace(ffn_kind="moe", mixer_options={"moe": {"n_experts": 8, "top_k": 2}})
    full = predict_memory(moe, base)["breakdown_bytes"]["optimizer"]
    sharded = predict_memory(moe, dataclasses.replace(base, ep=4, world_size=4, strategy="ddp"))
    assert sharded["breakdown_bytes"]["optimizer"] < 0.5 * full
