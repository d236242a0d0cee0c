"""SP / mu-P / mu-P++ (spec §4.2): every formula against hand-computed numbers, the `--dry_run` plan, and a
coordinate check (mu-P++ keeps activations O(1) as depth and width grow together; SP does not)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from archscale.cli import main
from archscale.config import ModelConfig
from archscale.models.model import GPT
from archscale.scaling_rules import (BaseHyperparameters, default_tokens, resolve_batch_and_lr,
                                     resolve_parametrization)
from archscale.train.config import PretrainConfig
from archscale.models.accounting import named_roles
from archscale.train.optim import build_adamw, param_groups, set_lr
from archscale.train.trainer import make_plan

HPS = BaseHyperparameters()  # d0=16, eta0=4e-4, b0=2**21, t0=1e11, hd0=128, wd 0.1

# Hand-computed with the defaults, b = b0 (ctx 4096 x micro 2 x 1 process divides 2**21: 256 micro-steps):
# depth: (mu-P++ matrix LR = 4e-4 (16/d)^1.5, vector LR = 4e-4 (16/d)^0.5, tokens = 1e11 (d/16)^3,
#         1/sqrt(2L), logit scale 16/L)
EXPECTED = {
    2: (9.050966799187808e-3, 1.1313708498984761e-3, 1.953125e8, 0.5, 8.0),
    8: (1.1313708498984761e-3, 5.656854249492381e-4, 1.25e10, 0.25, 2.0),
    16: (4e-4, 4e-4, 1e11, 0.17677669529663687, 1.0),
    24: (2.1773242158072694e-4, 3.265986323710904e-4, 3.375e11, 0.14433756729740646, 0.6666666666666666),
}


@pytest.mark.parametrize("depth", sorted(EXPECTED))
def test_mup_plus_plus_formulas(depth):
    lr_m, lr_v, tokens, res, logit = EXPECTED[depth]
    batch, accum, lr = resolve_batch_and_lr(HPS, micro_bsz=2, ctx_len=4096, world_size=1)
    assert (batch, accum, lr) == (2**21, 256, 4e-4)
    r = resolve_parametrization("mup++", HPS, depth, n_layer=depth, head_size=128)
    assert lr * r.global_lr_mult * r.matrix.lr_mult == pytest.approx(lr_m, rel=1e-12)
    assert lr * r.global_lr_mult * r.vector.lr_mult == pytest.approx(lr_v, rel=1e-12)
    assert (r.matrix.weight_decay, r.vector.weight_decay) == (0.1, 0.0)
    assert r.residual_scale == pytest.approx(res, rel=1e-12)
    assert r.logit_scale == pytest.approx(logit, rel=1e-12)
    assert r.attn_scale_mult == 1.0  # head_size 128 = hd0
    assert (r.init_scheme, r.w_init_mult) == ("mup", 1.0)
    assert default_tokens(HPS, "transformer", depth) == pytest.approx(tokens, rel=1e-12)


@pytest.mark.parametrize("depth", sorted(EXPECTED))
def test_original_mup_and_sp_formulas(depth):
    width_ratio = 16 / depth
    r = resolve_parametrization("mup", HPS, depth, n_layer=depth, head_size=128)
    assert r.global_lr_mult == 1.0  # no Depth-mu-P
    assert (r.matrix.lr_mult, r.matrix.weight_decay) == (pytest.approx(width_ratio), 0.1)
    assert (r.vector.lr_mult, r.vector.weight_decay) == (1.0, 0.1)  # vectors keep weight decay
    assert r.residual_scale == 1.0 and r.logit_scale == pytest.approx(width_ratio)
    assert r.init_scheme == "mup"
    s = resolve_parametrization("sp", HPS, depth, n_layer=depth, head_size=128)
    assert s.global_lr_mult == 1.0
    assert (s.matrix.lr_mult, s.matrix.weight_decay) == (s.vector.lr_mult, s.vector.weight_decay) == (1.0, 0.1)
    assert (s.residual_scale, s.logit_scale, s.attn_scale_mult, s.init_scheme) == (1.0, 1.0, 1.0, "sp")


def test_rounded_batch_attention_scale_and_w_init():
    # ctx 4096 x micro 3 = 12288 tokens per micro-step: 2**21 // 12288 = 170 -> b = 2,088,960
    batch, accum, lr = resolve_batch_and_lr(HPS, micro_bsz=3, ctx_len=4096, world_size=1)
    assert (batch, accum) == (2_088_960, 170)
    assert lr == pytest.approx(4e-4 * math.sqrt(2_088_960 / 2**21), rel=1e-12)
    hps = BaseHyperparameters(w_init0=0.5)
    r = resolve_parametrization("mup++", hps, 4, n_layer=4, head_size=32)
    assert r.attn_scale_mult == pytest.approx(2.0)  # sqrt(128 / 32)
    assert r.w_init_mult == 0.5
    with pytest.raises(Exception, match="unknown"):
        resolve_parametrization("ntk", HPS, 4, 4, 128)


def test_roles_and_init_follow_the_rules():
    cfg = ModelConfig.from_arch("transformer", 4, ar=32, vocab_size=512, tie_embeddings=False)
    r = resolve_parametrization("mup++", BaseHyperparameters(w_init0=2.0), 4, cfg.n_layer, cfg.head_size)
    cfg = cfg.replace(**r.model_overrides())
    torch.manual_seed(0)
    model = GPT(cfg)
    roles = {n: role.group == "vector" for n, _, role in named_roles(model)}
    assert roles["wte.weight"] and roles["lm_head.weight"] and roles["blocks.0.norm_1.weight"]
    assert not roles["blocks.0.mixer.attn.weight"] and not roles["blocks.3.mlp.w3.weight"]
    groups = {g["name"]: g for g in param_groups(model, r.matrix, r.vector)}
    assert groups["matrix"]["lr_mult"] == 4.0 and groups["vector"]["weight_decay"] == 0.0  # d0=16 / d=4
    stds = model.init_stds()
    measured = {"wte": model.wte.weight, "lm_head": model.lm_head.weight,
                "attention.attn.weight": model.blocks[0].mixer.attn.weight, "attention.proj.weight": model.blocks[0].mixer.proj.weight,
                "swiglu.w1.weight": model.blocks[0].mlp.w1.weight, "swiglu.w3.weight": model.blocks[0].mlp.w3.weight}
    assert stds["lm_head"] == 0.0 and model.lm_head.weight.abs().max() == 0  # zero readout (untied mu-P)
    assert stds["wte"] == 1e-4
    assert stds["swiglu.w3.weight"] == pytest.approx(2.0 / math.sqrt(3 * 512))  # w_init0 x kaiming-uniform std
    for role, w in measured.items():
        if stds[role] > 0:
            assert w.std().item() == pytest.approx(stds[role], rel=0.1), role
    # SP keeps its seed init: GPT-2 1/sqrt(2L) on the output projections
    sp = GPT(ModelConfig.from_arch("transformer", 4, ar=32, vocab_size=512)).init_stds()
    assert sp["attention.attn.weight"] == 0.02 and sp["swiglu.w3.weight"] == pytest.approx(0.02 / math.sqrt(8)) and sp["wte"] == 1e-4


def test_plan_wires_rules_into_model_and_groups(tmp_path):
    cfg = PretrainConfig(train_data_dir=str(tmp_path / "none"), depth=4, ar=32, ctx_len=64, micro_bsz=2,
                         vocab_size=256, train_name="x_mup", max_tokens=1e6,
                         base_hps=BaseHyperparameters(d0=2, b0=1024, hd0=32))
    plan, m = make_plan(cfg, set())
    assert plan.parametrization == "mup++" and (m.n_embd, m.n_head, m.head_size) == (128, 4, 32)
    assert plan.lr == pytest.approx(4e-4 * math.sqrt(2 / 4))
    assert (plan.lr_mult_matrix, plan.wd_matrix, plan.lr_mult_vector, plan.wd_vector) == (0.5, 0.1, 1.0, 0.0)
    assert m.residual_scale == pytest.approx(1 / math.sqrt(8)) and m.logit_scale == 0.5
    assert m.attn_scale_mult == 1.0 and m.init_scheme == "mup"
    sp_plan, sp_model = make_plan(PretrainConfig(train_data_dir=str(tmp_path / "none"), depth=4, vocab_size=256,
                                                 ctx_len=64, max_tokens=1e6, base_hps=BaseHyperparameters(b0=1024)),
                                  set())
    assert sp_plan.lr == 4e-4 and sp_plan.group_rules()[0] == sp_plan.group_rules()[1]
    assert (sp_model.residual_scale, sp_model.logit_scale, sp_model.init_scheme) == (1.0, 1.0, "sp")


# --------------------------------------------------------------------------------------------------- dry run
def test_dry_run_d24_mup_tie_matches_the_formulas(tmp_path, capsys):
    out = tmp_path / "never"
    argv = ["pretrain", "--train_model", "transformer", "--depth", "24", "--train_name", "scaling_mup_tie",
            "--train_data_dir", str(tmp_path / "no_data"), "--out_dir", str(out), "--dry_run", "--json"]  # bare flags
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not out.exists()
    lr_m, lr_v, tokens, res, logit = EXPECTED[24]
    assert (plan["n_layer"], plan["n_embd"], plan["n_head"], plan["n_kv_head"]) == (24, 3072, 24, 6)
    assert plan["vocab_size"] == 32000 and plan["tie_embeddings"] is True and plan["parametrization"] == "mup++"
    # 14.5 ar^2 d^3 matmul weights + 2 RMSNorms per layer + the final one; embedding counted once (tied)
    assert plan["n_params_non_embedding"] == 14.5 * 128**2 * 24**3 + (2 * 24 + 1) * 3072
    assert plan["n_params"] == plan["n_params_non_embedding"] + 32000 * 3072
    assert plan["batch_tokens"] == 2**21 and plan["max_tokens"] == tokens
    assert plan["optimizer_steps"] == int(tokens) // 2**21 == 160_932
    assert plan["warmup_tokens"] == math.ceil(1e9 / 2**21) * 2**21
    assert plan["lr_matrix"] == pytest.approx(lr_m, rel=1e-12) and plan["lr_vector"] == pytest.approx(lr_v, rel=1e-12)
    assert (plan["wd_matrix"], plan["wd_vector"]) == (0.1, 0.0)
    assert plan["residual_scale"] == pytest.approx(res) and plan["logit_scale"] == pytest.approx(logit)
    assert plan["attn_scale"] == pytest.approx(1 / math.sqrt(128))
    stds = plan["init_std"]
    assert stds["wte"] == stds["lm_head"] == 0.02  # tied under mu-P: N(0, 0.02)
    assert stds["attention.attn.weight"] == pytest.approx(1 / math.sqrt(3 * 3072))
    # tied under mu-P, ArchScale's `_init_weights` also divides output projections by sqrt(2L)
    assert stds["swiglu.w3.weight"] == pytest.approx(1 / math.sqrt(3 * 4 * 3072) / math.sqrt(2 * 24))


def test_dry_run_ar_override_and_vocab_flag(tmp_path, capsys):
    argv = ["pretrain", "--depth", "4", "--ar", "32", "--vocab_size", "1000", "--parametrization", "mup",
            "--train_data_dir", str(tmp_path), "--json", "--dry_run", "true"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["n_embd"], plan["n_head"], plan["head_size"], plan["n_kv_head"]) == (128, 4, 32, 1)
    assert plan["vocab_size"] == 1000 and plan["padded_vocab_size"] == 1024
    assert plan["attn_scale"] == pytest.approx(math.sqrt(128 / 32) / math.sqrt(32))
    assert plan["lr_matrix"] == pytest.approx(4e-4 * 4) and plan["wd_vector"] == 0.1  # mu-P: d0/d = 4, no sqrt
    assert plan["residual_scale"] == 1.0 and plan["logit_scale"] == 4.0
    assert plan["max_tokens"] == int(1e11 * 14.5 * 32**2 * 4**3 / (237_568 * 16**3))  # N(d) at ar 32
    assert main(argv[:-2] + ["--ar", "7", "--dry_run", "true"]) == 2
    assert "--ar must be an even number" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- coordinate check
DEPTHS = (2, 4, 8)  # width = 32 * depth: 64, 128, 256; heads = depth, head_size 32
COORD_LR = 1e-2  # ~25x a normal LR at this base size, so that a wrong rule shows within a few steps
STEPS = 4


def coordinates(parametrization: str, depth: int, seed: int = 0, arch: str = "transformer", d0: int = DEPTHS[0],
                ar: int = 32) -> list[dict]:
    """mean |x| of every block output and of the logits, before and after each of STEPS AdamW steps."""
    hps = BaseHyperparameters(d0=d0, hd0=ar)
    cfg = ModelConfig.from_arch(arch, depth, ar=ar, vocab_size=256, block_size=64)
    rules = resolve_parametrization(parametrization, hps, depth, cfg.n_layer, cfg.head_size)
    cfg = cfg.replace(**rules.model_overrides())
    torch.manual_seed(seed)
    model = GPT(cfg)
    lr = COORD_LR * rules.global_lr_mult
    opt = build_adamw(param_groups(model, rules.matrix, rules.vector), lr, (0.9, 0.95), 1e-8)
    set_lr(opt, lr)
    record: dict = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda mod, inp, out, i=i: record.__setitem__(f"block{i}", out.abs().mean().item()))
    data = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    history = []
    for _ in range(STEPS + 1):
        logits = model(data[:, :-1])
        history.append({**record, "logits": logits.abs().mean().item()})
        F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return history


def spread(values):
    return max(values) / min(values)


@pytest.fixture(scope="module")
def coords():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and robust on a busy shared machine
    try:
        return {p: {d: coordinates(p, d) for d in DEPTHS} for p in ("mup++", "sp")}
    finally:
        torch.set_num_threads(threads)


def test_coordinate_check_mup_plus_plus_is_flat_and_sp_is_not(coords):
    """Residual stream at relative depth 1/2 and 1 (block L/2-1, L-1) after t = 2..4 steps (at t = 1 only the
    zero-initialised lm_head has moved), and the logits averaged over t = 1..4.

    Measured (seed 0; seeds 0-3 in brackets): residual-stream spread (max/min over widths) mu-P++ 1.05-1.34
    [<= 1.45], SP 22-85 [>= 22]; logits, widest / narrowest: mu-P++ 0.57 [0.43-0.57] (the sqrt(d0/d) Depth-mu-P
    factor on lm_head's LR shrinks them as 1/sqrt(d): 0.5 expected), SP 2.26 [2.26-3.05] (grows with width).
    """
    for key_at in (lambda d: f"block{d // 2 - 1}", lambda d: f"block{d - 1}"):
        for t in range(2, STEPS + 1):
            mupp = spread([coords["mup++"][d][t][key_at(d)] for d in DEPTHS])
            sp = spread([coords["sp"][d][t][key_at(d)] for d in DEPTHS])
            assert mupp < 1.75, (t, mupp)
            assert sp > 10.0, (t, sp)  # negative control: the same check catches SP
    logits = {p: [sum(h["logits"] for h in coords[p][d][1:]) / STEPS for d in DEPTHS] for p in coords}
    growth = {p: v[-1] / v[0] for p, v in logits.items()}
    assert 0.3 < growth["mup++"] < 1.25, growth
    assert growth["sp"] > 1.6, growth
    assert all(math.isfinite(x) for v in logits.values() for x in v)


@pytest.mark.slow
@pytest.mark.parametrize("arch,depths,ar", [("mamba", (2, 4, 8), 32), ("sambay", (4, 8, 16), 16)])
def test_coordinate_check_hybrid_families(arch, depths, ar):
    """The same check for the Mamba family and the SambaY family (Mamba + SWA + GMU + YOCO cross-attention).

    Measured (seeds 0, 1): residual-stream spread mu-P++ 1.13-2.46, SP 11-169; logits widest / narrowest mu-P++
    0.34-0.53, SP 2.23-4.37. Bounds below leave room for noise; the SP side is the negative control.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c = {p: {d: coordinates(p, d, arch=arch, d0=depths[0], ar=ar) for d in depths} for p in ("mup++", "sp")}
    finally:
        torch.set_num_threads(threads)
    for key_at in (lambda d: f"block{d // 2 - 1}", lambda d: f"block{d - 1}"):
        for t in range(2, STEPS + 1):
            assert spread([c["mup++"][d][t][key_at(d)] for d in depths]) < 3.0, t
            assert spread([c["sp"][d][t][key_at(d)] for d in depths]) > 8.0, t
    logits = {p: [sum(h["logits"] for h in c[p][d][1:]) / STEPS for d in depths] for p in c}
    growth = {p: v[-1] / v[0] for p, v in logits.items()}
    assert 0.25 < growth["mup++"] < 1.25 and growth["sp"] > 1.6, growth


# ------------------------------------------------------------------------------------------------- training
def test_mup_plus_plus_run_trains_and_logs_its_rules(dataset, tmp_path):
    from tests.test_train import args, rows

    run = tmp_path / "run"
    argv = args(dataset, run, "--resume", "none", "--train_name", "scaling_mup", "--depth", "2", "--ar", "32",
                "--base_hps.d0", "2", "--base_hps.hd0", "32", "--base_hps.eta0", "1e-2", "--max_tokens", "3840")
    assert main(argv) == 0
    vals = [float(x["val_loss"]) for x in rows(run) if x["val_loss"]]
    assert vals[0] == pytest.approx(math.log(256), abs=1e-3)  # zero readout: uniform logits at init
    assert vals[-1] < vals[0] - 0.5, vals
    cfg = (run / "config.yaml").read_text()
    assert "parametrization: mup++" in cfg and "init_scheme: mup" in cfg and "wd_vector: 0.0" in cfg


# ------------------------------------------------------------------------------- the seed's hybrid commands
def dry(capsys, *argv):
    assert main(["pretrain", "--train_data_dir", "/nonexistent/data", *argv, "--dry_run", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dry_run_phi4_mini_flash_readme_recipe(capsys):
    plan = dry(capsys, "--base_hps.eta0=5e-4", "--base_hps.b0=8388608", "--base_hps.warmup_tokens0=25_165_824_000",
               "--ctx_len", "8192", "--max_tokens", "5e12", "--resume=auto", "--train_model", "phi4miniflash",
               "--depth", "32", "--train_name", "scaling")
    assert (plan["n_layer"], plan["n_embd"], plan["n_head"], plan["n_kv_head"], plan["head_size"]) == (
        32, 2560, 40, 20, 64)
    assert plan["vocab_size"] == 200064 and plan["tie_embeddings"] is True  # the preset, not the 32000 default
    assert 3.80e9 < plan["n_params"] < 3.90e9 and plan["parametrization"] == "sp"
    assert plan["batch_tokens"] == 8388608 and plan["lr_matrix"] == plan["lr_vector"] == 5e-4  # b = b0: x1
    assert plan["optimizer_steps"] == int(5e12) // 8388608 == 596046
    assert plan["warmup_tokens"] == 25_165_824_000 and plan["warmup_steps"] == 3000
    assert plan["wd_vector"] == 0.1 and plan["residual_scale"] == 1.0 and plan["attn_scale"] == 0.125
    # an explicit vocabulary still wins over the preset
    assert dry(capsys, "--train_model", "phi4miniflash", "--depth", "32", "--vocab_size", "32000")["vocab_size"] == 32000


@pytest.mark.parametrize("arch", ["sambay", "sambayda"])
def test_dry_run_sambay_d24_scaling_mup_tie(capsys, arch):
    plan = dry(capsys, "--train_model", arch, "--depth", "24", "--train_name", "scaling_mup_tie",
               "--vocab_size", "200064", "--ctx_len", "8192")
    lr_m, lr_v, _, res, logit = EXPECTED[24]
    assert (plan["n_layer"], plan["n_embd"], plan["n_head"], plan["n_kv_head"]) == (24, 124 * 24, 24, 6)
    assert abs(plan["n_params_non_embedding"] - 3.37e9) / 3.37e9 < 0.01  # spec §2.2
    assert plan["tie_embeddings"] is True and plan["parametrization"] == "mup++"
    assert plan["lr_matrix"] == pytest.approx(lr_m) and plan["lr_vector"] == pytest.approx(lr_v)
    assert plan["residual_scale"] == pytest.approx(res) and plan["logit_scale"] == pytest.approx(logit)
    assert (plan["wd_matrix"], plan["wd_vector"]) == (0.1, 0.0)
    # tokens: the architecture's own law for N(d), the Transformer's for N(d0) (era 1)
    assert plan["max_tokens"] == int(1e11 * (14.5 * 124**2 + 144 * 124) * 24**3 / (237_568 * 16**3))


@pytest.mark.parametrize("lr,bs", [("4e-4", 4194304), ("1e-3", 16777216)])
def test_dry_run_hp_sweep_names(capsys, lr, bs):
    plan = dry(capsys, "--train_model", "sambay", "--depth", "8", "--base_hps.eta0", lr, "--base_hps.b0", str(bs),
               "--max_tokens", "1e10", "--train_name", f"hp_sweep_lr{lr}_bs{bs}")
    assert plan["run_name"] == f"hp_sweep_lr{lr}_bs{bs}_sambay_d8_ctx{plan['ctx_len']}"
    assert plan["parametrization"] == "sp" and plan["batch_tokens"] == bs
    assert plan["lr_matrix"] == plan["lr_vector"] == pytest.approx(float(lr))  # b = b0 exactly
    assert plan["optimizer_steps"] == int(1e10) // bs


def test_dry_run_prints_the_parameter_law_and_its_deviation(tmp_path, capsys):
    argv = ["pretrain", "--train_model", "sambay", "--depth", "16", "--train_data_dir", str(tmp_path),
            "--dry_run", "--json", "--varlen", "true", "--ctx_len", "4096"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["n_params_law"] == (14.5 * 124**2 + 144 * 124) * 16**3
    assert plan["n_params_law_deviation"] == pytest.approx(plan["n_params_law"] / plan["n_params_non_embedding"] - 1)
    assert abs(plan["n_params_law_deviation"]) < 0.03
    assert any("ctx 8192" in n for n in plan["notes"])  # ArchScale's silent varlen switch, stated
