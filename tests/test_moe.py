"""Mixture of experts (models/mixers/moe.py): routing equals a naive per-token loop in values and gradients, the
auxiliary losses equal their formulas, active-parameter accounting, and a tiny MoE model trains."""

import math

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.errors import UserError
from archscale.models import accounting
from archscale.models.mixers import ForwardContext
from archscale.models.mixers.moe import MoE


def moe_config(arch="transformer", depth=4, ar=16, n_experts=4, top_k=2, n_shared=0, **kw):
    opts = dict(n_experts=n_experts, top_k=top_k, n_shared=n_shared, **kw.pop("moe", {}))
    base = dict(vocab_size=97, block_size=64, ffn_kind="moe", mixer_options={"moe": opts})
    if arch != "transformer":
        base["sliding_window"] = 64
    base.update(kw)
    return ModelConfig.from_arch(arch, depth, ar=ar, **base)


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the k largest router logits (or, with routing "softmax_then_topk", the k largest
    of the softmax over all logits), the weighted sum of those experts' SwiGLUs."""
    out = []
    for xt in x.reshape(-1, x.shape[-1]):
        logits = (xt @ layer.router.weight.t()) * layer.logit_scale
        chosen = sorted(range(layer.n_experts), key=lambda e: -float(logits[e].detach()))[: layer.top_k]
        if layer.routing == "softmax_then_topk":
            gates = torch.softmax(logits, dim=0)[chosen]
        else:
            gates = torch.softmax(logits[chosen], dim=0)
        y = torch.zeros_like(xt)
        for g, e in zip(gates, chosen):
            gate, inp = (layer.w1.weight[e] @ xt).chunk(2)
            y = y + g * (layer.w3.weight[e] @ (F.silu(gate) * inp))
        if layer.shared is not None:
            y = y + layer.shared(xt)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("n_experts,top_k,n_shared,routing", [(4, 2, 0, "topk_then_softmax"),
                                                              (8, 1, 0, "topk_then_softmax"),
                                                              (6, 3, 1, "topk_then_softmax"),
                                                              (4, 2, 0, "softmax_then_topk"),
                                                              (8, 1, 0, "softmax_then_topk")])
def test_routing_equals_a_per_token_loop(n_experts, top_k, n_shared, routing):
    """Values and gradients (input and every parameter) of the sorted, dropless dispatch equal the per-token loop,
    fp32, atol 1e-6, for both gate rules."""
    torch.manual_seed(0)
    cfg = moe_config(n_experts=n_experts, top_k=top_k, n_shared=n_shared, moe=dict(routing=routing))
    layer = MoE(cfg, 0, "moe")
    layer.reset_parameters()
    x = torch.randn(3, 7, cfg.n_embd, requires_grad=True)
    grads = []
    for fn in (lambda: layer(x), lambda: naive_moe(layer, x)):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        grads.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y1, gx1, gp1), (y2, gx2, gp2) = grads
    torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx1, gx2, atol=1e-6, rtol=1e-5)
    for name in gp1:
        torch.testing.assert_close(gp1[name], gp2[name], atol=1e-6, rtol=1e-5, msg=name)
    # every expert got tokens, so the comparison covers them all; with k = 1 the gate is softmax of one logit = 1
    # and the router learns only from the auxiliary loss (softmax after top-k, as ArchScale); the softmax over all
    # E logits (Jamba's rule) gives it a gradient whatever k
    assert all(bool((gp1[n].flatten(1).abs().amax(1) > 0).all()) for n in ("w1.weight", "w3.weight"))
    assert bool(gp1["router.weight"].abs().max() > 0) == (top_k > 1 or routing == "softmax_then_topk")


def test_softmax_then_topk_gates_are_not_renormalised_and_differ_from_the_default():
    """Jamba's gates are the chosen probabilities of the softmax over all E (they sum to < 1); the default rule's
    sum to 1. Same experts chosen by both (softmax is monotonic), so only the gates differ."""
    torch.manual_seed(0)
    layers = {}
    for routing in ("topk_then_softmax", "softmax_then_topk"):
        torch.manual_seed(0)
        layers[routing] = MoE(moe_config(n_experts=8, top_k=2, moe=dict(routing=routing)), 0, "moe")
    flat = torch.randn(50, layers["softmax_then_topk"].router.in_features)
    _, idx_a, gates_a = layers["topk_then_softmax"].route(flat)
    logits, idx_b, gates_b = layers["softmax_then_topk"].route(flat)
    assert torch.equal(idx_a, idx_b)
    torch.testing.assert_close(gates_a.sum(-1), torch.ones(50))
    assert bool((gates_b.sum(-1) < 1 - 1e-3).all())
    torch.testing.assert_close(gates_b, torch.softmax(logits, -1).gather(1, idx_b))


def test_fine_grained_off_gives_experts_the_dense_width():
    cfg = moe_config(n_experts=4, top_k=2, moe=dict(fine_grained=False))
    layer = MoE(cfg, 0, "moe")
    assert layer.w1.weight.shape == (4, 2 * cfg.intermediate_size, cfg.n_embd)
    assert MoE(moe_config(n_experts=4, top_k=2), 0, "moe").w1.weight.shape[1] == cfg.intermediate_size
    explicit = MoE(moe_config(n_experts=4, top_k=2, moe=dict(fine_grained=False, expert_hidden=24)), 0, "moe")
    assert explicit.w3.weight.shape == (4, cfg.n_embd, 24)  # an explicit width wins


def test_aux_loss_equals_its_formula():
    """Switch loss aux_coef * E * sum_i f_i P_i plus z_coef * mean logsumexp^2, recomputed here from the router
    with explicit loops; a perfectly balanced uniform router gives exactly aux_coef (f_i = P_i = 1/E)."""
    torch.manual_seed(1)
    cfg = moe_config(n_experts=4, top_k=2, moe=dict(aux_coef=0.01, z_coef=0.001))
    layer = MoE(cfg, 0, "moe")
    layer.reset_parameters()
    x = torch.randn(2, 9, cfg.n_embd)
    ctx = ForwardContext(pos=0, cos=None, sin=None)
    layer(x, ctx)
    (got,) = ctx.aux_losses
    flat = x.reshape(-1, cfg.n_embd)
    logits = flat @ layer.router.weight.t()
    N, E, k = flat.shape[0], 4, 2
    f = [0.0] * E
    for t in range(N):
        for e in logits[t].topk(k).indices.tolist():
            f[e] += 1.0 / (N * k)
    P = [sum(float(torch.softmax(logits[t], 0)[e]) for t in range(N)) / N for e in range(E)]
    z = sum(float(torch.logsumexp(logits[t], 0)) ** 2 for t in range(N)) / N
    want = 0.01 * E * sum(fi * pi for fi, pi in zip(f, P)) + 0.001 * z
    assert float(got) == pytest.approx(want, rel=1e-5)
    with torch.no_grad():  # uniform router: every logit ties (topk picks k of E; P = 1/E)
        layer.router.weight.zero_()
    ctx = ForwardContext(pos=0, cos=None, sin=None)
    layer(x, ctx)
    assert float(ctx.aux_losses[0]) == pytest.approx(0.01 * E * (1 / E) + 0.001 * math.log(E) ** 2, rel=1e-6)


def test_model_sums_aux_losses_and_counts_active_params():
    torch.manual_seed(0)
    cfg = moe_config(depth=4, n_experts=8, top_k=2)
    model = GPT(cfg)
    dense = GPT(cfg.replace(ffn_kind="", mixer_options={}))
    model(torch.randint(0, 97, (2, 16)))
    assert model.aux_loss is not None and model.aux_loss.requires_grad
    dense(torch.randint(0, 97, (2, 16)))
    assert dense.aux_loss is None
    # k of E experts of hidden 4d/k: the active parameters are the dense twin's plus the routers
    router = cfg.n_layer * cfg.n_embd * 8
    assert model.num_params(active=True) == dense.num_params() + router
    dense_mlp = cfg.n_layer * 3 * cfg.intermediate_size * cfg.n_embd
    assert model.num_params() == dense.num_params() + 3 * dense_mlp + router  # E/k = 4 dense MLPs per layer
    assert model.flops_per_token(32) == pytest.approx(dense.flops_per_token(32) + 3 * 2 * router)


def test_bad_moe_options_are_one_line_errors():
    with pytest.raises(UserError, match="top_k"):
        GPT(moe_config(n_experts=2, top_k=3))
    with pytest.raises(UserError, match="no ffn registered"):
        GPT(moe_config().replace(ffn_kind="moee"))
    with pytest.raises(UserError, match="routing must be one of"):
        GPT(moe_config(moe=dict(routing="sigmoid")))


# ------------------------------------------------- the registry's per-architecture checks, on MoE models
MOE_ARCHS = ["transformer", "sambay"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_models_pass_the_per_architecture_checks(arch):
    """Causality and information flow, a gradient for every parameter (routers and every expert included), cached
    greedy decoding equal to the full forward, FLOPs equal to FlopCounterMode (5%)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from model_checks import check_every_parameter_learns, check_information_flows

    torch.manual_seed(0)
    cfg = moe_config(arch, depth=4, n_experts=4, top_k=2, n_shared=1)
    model = GPT(cfg)
    check_information_flows(model.eval())
    check_every_parameter_learns(model.train())
    prompt = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        out = model.eval().generate(prompt, 6)
        ref = prompt
        for _ in range(6):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    T = 32
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randint(0, 97, (1, T)))
    terms = accounting.flops_breakdown(model, T)
    ours = sum(v for k, v in terms.items() if not k.endswith("_elementwise"))
    assert ours == pytest.approx(counter.get_total_flops() / T, rel=0.05), terms


@pytest.mark.parametrize("scheme,w", [("sp", 1.0), ("sp", 2.0), ("mup", 1.0), ("mup", 0.5)])
def test_moe_roles_give_groups_and_init(scheme, w):
    """Experts and routers are matrix-like for the optimizer (ArchScale's name rule); each expert slice is drawn
    like the dense SwiGLU's Linear (SP N(0, 0.02) x w, w3 / sqrt(2L); mu-P U(+-1/sqrt(fan_in)) x w), the router
    N(0, 0.02) (ArchScale's Router), and init_stds() reports the expert numbers (rel 12%: sampling noise)."""
    from archscale.scaling_rules import BaseHyperparameters, resolve_parametrization
    from archscale.train.optim import param_groups

    torch.manual_seed(0)
    cfg = moe_config(depth=4, ar=32, n_experts=4, top_k=2, n_shared=1, init_scheme=scheme, w_init_mult=w)
    model = GPT(cfg)
    r = resolve_parametrization("mup++", BaseHyperparameters(), 4, 4, 32)
    groups = {id(p): g["name"] for g in param_groups(model, r.matrix, r.vector) for p in g["params"]}
    layer = model.blocks[1].mlp
    for name, p in layer.named_parameters():
        assert groups[id(p)] == "matrix", name
    reported = model.init_stds()
    residual = 1 / math.sqrt(2 * cfg.n_layer)
    for rel, fan_in, out in (("w1.weight", cfg.n_embd, False), ("w3.weight", layer.w1.weight.shape[1] // 2, True)):
        want = (0.02 if scheme == "sp" else 1 / math.sqrt(3 * fan_in)) * w * (residual if out and scheme == "sp"
                                                                              else 1.0)
        for e in range(4):
            assert layer.get_parameter(rel)[e].std().item() == pytest.approx(want, rel=0.12), (rel, e)
        assert reported[f"moe.{rel}"] == pytest.approx(want, rel=1e-9)
    assert layer.router.weight.std().item() == pytest.approx(0.02, rel=0.12)


# ------------------------------------------------------------------------------------------- training
def pretrain_args(data, out, *extra):
    return ["pretrain", "--train_data_dir", str(data), "--train_model", "transformer", "--depth", "2",
            "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "768",
            "--base_hps.eta0", "3e-3", "--base_hps.warmup_tokens0", "128", "--eval_interval", "100",
            "--eval_iters", "1", "--log_interval", "1", "--out_dir", str(out), "--progress", "false",
            "--precision", "fp32", "--moe", "4:2", *extra]


def metrics(run):
    import csv

    with open(run / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["train_loss"]]


@pytest.mark.slow
def test_pretrain_with_moe_trains_and_backpropagates_the_aux_loss(dataset, tmp_path, capsys):
    """`--moe 4:2` trains through the CLI (loss falls over 6 steps); the logged train_loss is the LM loss (equal at
    step 1 whatever the aux coefficient) while the aux loss reaches the gradient (step 1's grad norm moves)."""
    import yaml

    from archscale.cli import main

    runs = {}
    for coef in ("0", "1.0"):
        run = tmp_path / f"aux{coef}"
        assert main(pretrain_args(dataset, run, "--moe_aux_coef", coef)) == 0
        runs[coef] = metrics(run)
    first = [runs[c][0] for c in runs]
    assert first[0]["train_loss"] == first[1]["train_loss"]
    assert float(first[0]["grad_norm"]) != pytest.approx(float(first[1]["grad_norm"]), rel=1e-4)
    losses = [float(r["train_loss"]) for r in runs["1.0"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
    saved = yaml.safe_load((tmp_path / "aux1.0" / "config.yaml").read_text())["model"]
    assert saved["ffn_kind"] == "moe" and saved["mixer_options"]["moe"]["n_experts"] == 4


def test_dry_run_shows_total_and_active_parameters(capsys):
    import json

    from archscale.cli import main

    out = {}
    for extra in ([], ["--moe", "8:2"]):
        assert main(["pretrain", "--dry_run", "--json", "--depth", "4", "--vocab_size", "1000", *extra]) == 0
        out[bool(extra)] = json.loads(capsys.readouterr().out)
    dense, moe = out[False], out[True]
    assert dense["n_params_active"] == dense["n_params"]
    router = 4 * dense["n_embd"] * 8
    assert moe["n_params_active"] == dense["n_params"] + router  # experts of width 4d/k: k of them = the dense MLP
    mlp = 4 * 3 * dense["intermediate_size"] * dense["n_embd"]
    assert moe["n_params"] == dense["n_params"] + router + (8 // 2 - 1) * mlp  # E/k dense MLPs' worth of experts
    assert moe["flops_per_token"] == pytest.approx(dense["flops_per_token"] + 3 * 2 * router)
    assert moe["ffn_kinds"] == ["moe"] and moe["run_name"].endswith("_moe8k2")


@pytest.mark.slow
def test_moe_beats_its_dense_twin_on_a_memorisation_task():
    """c = table[a, b] over 32 x 32 random pairs (32 classes): a capacity-bound task, where 4x the FFN parameters
    at equal active parameters should help. One run each, same seed, 400 AdamW steps at lr 1e-2: measured mean
    loss over the last 20 steps 0.525 (dense) vs 0.061 (MoE 8:2); asserted with a 2x margin."""
    torch.set_num_threads(1)
    K = 32
    table = torch.randint(0, K, (K, K), generator=torch.Generator().manual_seed(123))

    def run(moe):
        kw = dict(ffn_kind="moe", mixer_options={"moe": dict(n_experts=8, top_k=2)}) if moe else {}
        torch.manual_seed(0)
        model = GPT(ModelConfig.from_arch("transformer", 1, ar=16, vocab_size=3 * K, block_size=32, **kw))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        g = torch.Generator().manual_seed(7)
        tail = []
        for step in range(400):
            a, b = torch.randint(0, K, (32, 10), generator=g), torch.randint(0, K, (32, 10), generator=g)
            seq = torch.stack([a, b + K, table[a, b] + 2 * K], -1).flatten(1)
            logits = model(seq[:, :-1])[:, 1::3]  # at every b: predict c
            loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 2::3].flatten())
            (loss if model.aux_loss is None else loss + model.aux_loss).backward()
            opt.step()
            opt.zero_grad()
            tail = (tail + [loss.item()])[-20:]
        return sum(tail) / len(tail), model.num_params(active=True)

    (dense, dense_active), (moe, moe_active) = run(False), run(True)
    assert moe_active == dense_active + 16 * 8  # the router is the only extra active weight
    print(f"dense {dense:.4f} moe {moe:.4f}")
    assert moe < 0.5 * dense


def test_experts_without_tokens_stay_in_the_autograd_graph():
    """A rank may receive no token for its experts (expert parallelism); its backward must still reach the
    all-to-all that sent them, so an empty dispatch keeps a graph to the input and the weights."""
    from archscale.models.mixers.moe import run_experts

    x = torch.randn(0, 8, requires_grad=True)
    w1, w3 = torch.randn(2, 12, 8, requires_grad=True), torch.randn(2, 8, 6, requires_grad=True)
    y = run_experts(x, [0, 0], w1, w3, [0, 1])
    assert y.shape == (0, 8) and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and w1.grad is not None and not w1.grad.any()


def test_an_moe_transformer_is_not_exported_as_llama():
    from archscale.export.hf import llama_incompatibility

    assert llama_incompatibility(moe_config().replace(name="t")) == "Llama has no equivalent of ffn_kind=moe"
    assert llama_incompatibility(moe_config().replace(ffn_kind="", mixer_options={})) is None


def test_activation_checkpointing_keeps_the_aux_loss_gradient():
    """--act_ckpt recomputes each block in backward; the auxiliary losses (a side output of the block) still get
    their gradient: every gradient equals the plain model's (exact, fp32)."""
    import copy

    from archscale.train.parallelize import apply_act_ckpt

    torch.manual_seed(0)
    plain = GPT(moe_config(depth=2, moe=dict(aux_coef=1.0, z_coef=0.1)))
    ckpt = copy.deepcopy(plain)
    apply_act_ckpt(ckpt)
    x = torch.randint(0, 97, (2, 17))
    for m in (plain, ckpt):
        logits = m(x[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()) + m.aux_loss).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=name)
