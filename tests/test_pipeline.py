"""Pipeline parallelism (`--pp N`): the stage cut, what crosses a stage boundary (a hybrid's YOCO KV and GMU memory,
a mixture of experts' auxiliary losses), and, under torchrun on CPU (gloo), the loss trajectory of 2- and 4-process
pipelines (GPipe, 1F1B, interleaved 1F1B; pp x dp on a 2-D mesh) against the single process, plus a pipeline
checkpoint resumed by one process.

Tolerance: 1e-5 relative on every logged train and validation loss over 5 steps. The pipeline computes the same
micro-batches with the same weights; only the order of floating-point sums differs (gradient scaling by 1/count
after backward instead of the loss before it, the clipping norm summed over stages, the data-parallel all-reduce).
"""

from __future__ import annotations


import pytest
import torch

from archscale.cli import main
from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.model import GPT
from archscale.train.pipeline import carried_layout, make_stages, stage_layers
from tests.test_distributed import assert_same, driver, losses, torchrun

RTOL = 1e-5


def tiny_args(data, out, arch="transformer", *extra):
    depth = "8" if arch == "sambay" else "4"
    return ["--train_data_dir", str(data), "--train_model", arch, "--depth", depth, "--ar", "8", "--ctx_len", "32",
            "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens", "1280", "--base_hps.eta0", "2e-3",
            "--base_hps.warmup_tokens0", "256", "--parametrization", "mup++", "--eval_interval", "5",
            "--eval_iters", "2", "--log_interval", "1", "--save_interval", "5", "--out_dir", str(out),
            "--progress", "false", "--precision", "fp32", "--resume", "none", *extra]


# ------------------------------------------------------------------------------------------ in one process
def test_stage_cut():
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(8, 2, "6,2") == [range(0, 6), range(6, 8)]
    for bad in ("6,3", "8,0", "4", "a,b"):
        with pytest.raises(UserError, match="--pp_layers"):
            stage_layers(8, 2, bad)


def _sambay():
    return ModelConfig.from_arch("sambay", 8, ar=8, vocab_size=64, block_size=16)


def test_probe_finds_what_crosses_each_boundary():
    """SambaY d8: mamba swa mamba swa mamba_mem kv | gmu cross. After the KV layer, the YOCO key/values and the
    GMU memory must travel; before the memory layer nothing does. A mixture of experts' aux losses travel too."""
    torch.manual_seed(0)
    layout = carried_layout(GPT(_sambay()), [2, 4, 5, 6, 7])
    assert layout[2] == () and layout[4] == ()
    assert layout[5] == (("memory", "tensor", 1),)
    assert layout[6] == layout[7] == (("memory", "tensor", 1), ("shared_kv", "tuple", 2))
    moe = ModelConfig.from_arch("transformer", 4, ar=8, vocab_size=64, block_size=16)
    moe = moe.replace(ffn_kind="moe", mixer_options={**moe.mixer_options, "moe": dict(n_experts=4, top_k=2)})
    assert carried_layout(GPT(moe), [1, 3]) == {1: (("aux_losses", "list", 1),), 3: (("aux_losses", "list", 3),)}


@pytest.mark.parametrize("cut", ["6,2", "2,2,2,2", "5,3", "1,7"])
def test_chained_stages_equal_the_model(cut):
    """The stages run one after the other in one process give the model's logits and every gradient (fp32, the
    same ops: exact up to 1e-6), wherever the cut falls; dropping what crosses the boundary changes them."""
    torch.manual_seed(0)
    model = GPT(_sambay())
    idx = torch.randint(0, 64, (2, 16))
    ref = model(idx)
    ref.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ranges = stage_layers(8, len(cut.split(",")), cut)
    stages, _ = make_stages(model, ranges, list(range(len(ranges))))
    out = (idx,)
    for stage in stages:
        out = stage(*out)
    assert len(out) == 1
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-6)
    out[0].square().mean().backward()
    names = {id(p): n for n, p in model.named_parameters()}
    for stage in stages:  # every stage keeps the model's names (so checkpoints reshard)
        for n, p in stage.named_parameters():
            assert names[id(p)] == n
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-6, msg=n)
    if cut == "6,2":  # negative control: the second stage without the KV and memory of the first
        stages[1].carry_in = ()
        with pytest.raises(RuntimeError, match="context tensors"):
            stages[1](*stages[0](idx))


def test_chained_stages_take_the_documents():
    """--varlen under --pp: every stage gets doc_ids / position_ids as keyword inputs and runs GPT's own context
    set-up, so the chained stages give the model's document-masked logits; without them they differ."""
    from archscale.models.varlen import document_ids, document_positions

    torch.manual_seed(0)
    model = GPT(ModelConfig.from_arch("transformer", 4, ar=8, vocab_size=64, block_size=16))
    idx = torch.randint(1, 64, (2, 16))
    idx[:, 5] = 0
    docs = document_ids(idx, 0)
    kw = {"doc_ids": docs, "position_ids": document_positions(docs)}
    ref = model(idx, **kw)
    stages, _ = make_stages(model, stage_layers(4, 2), [0, 1])
    out = stages[1](*stages[0](idx, **kw), **kw)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert (stages[1](*stages[0](idx))[0] - ref).abs().max() > 1e-3  # the documents matter


def _dry(args, world=1):
    from archscale.cli import parse_pretrain
    from archscale.train.trainer import dry_run_summary

    cfg, explicit = parse_pretrain(["--vocab_size", "64", *args])
    return dry_run_summary(cfg, explicit, world_size=world, warn=lambda m: None)


def test_dry_run_shows_the_cut_and_refuses_bad_combinations():
    base = ["--train_model", "sambay", "--depth", "8", "--ar", "8", "--ctx_len", "32", "--micro_bsz", "2",
            "--base_hps.b0", "256"]
    got = _dry([*base, "--pp", "2", "--pp_layers", "6,2", "--pp_schedule", "gpipe"], world=4)["pipeline"]
    assert got["schedule"] == "gpipe" and got["microbatches"] == 2
    assert [s["blocks"] for s in got["stages"]] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert got["stages"][0]["also"] == ["wte"] and got["stages"][1]["also"] == ["ln_f", "lm_head"]
    inter = _dry([*base, "--pp", "2", "--pp_schedule", "interleaved1f1b"], world=2)["pipeline"]
    assert [(s["pp_rank"], s["blocks"]) for s in inter["stages"]] == [(0, [0, 1]), (1, [2, 3]), (0, [4, 5]),
                                                                      (1, [6, 7])]
    bad = {"needs at least 16 blocks": (["--pp", "8", "--pp_schedule", "interleaved1f1b"], 8),
           "must divide the number of processes": (["--pp", "2"], 3),
           "does not combine with --strategy deepspeed": (["--pp", "2", "--strategy", "deepspeed"], 2),
           "does not combine with --ep": (["--pp", "2", "--moe", "4:2", "--ep", "2"], 2),
           "does not combine with --precision fp16-mixed": (["--pp", "2", "--precision", "fp16-mixed"], 2),
           "does not combine with --grad_compression": (["--pp", "2", "--strategy", "ddp", "--grad_compression",
                                                         "fp16"], 2),
           "1f1b needs at least --pp 4 micro-batches": (["--pp", "4", "--micro_bsz", "4"], 4),
           "--pp_layers cuts a pipeline": (["--pp_layers", "4,4"], 1),
           "--pp_schedule 'zb' is unknown": (["--pp", "2", "--pp_schedule", "zb"], 2)}
    for message, (extra, world) in bad.items():
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            _dry([*base, *extra], world=world)
    # the lifted refusals: the stages run the model's own forward (documents, tied weights, any length), and
    # FSDP2 shards each stage over the dp_shard ranks
    for extra, world in ((["--strategy", "fsdp"], 4), (["--tie_embeddings"], 2), (["--varlen"], 2),
                         (["--curriculum", "seqlen:start=8,steps=2"], 2)):
        assert _dry([*base, "--pp", "2", *extra], world=world)["pipeline"]["stages"]


def test_pipeline_checkpoints_key_optimizer_state_by_name(tmp_path):
    """`flat_optim` (what a pipeline saves) keys every optimizer group setting by parameter name; the default keys
    them by group index. Loading tells the two apart and reads either."""
    from archscale.train import checkpoint as ckpt
    from archscale.train.optim import build_adamw

    for flat in (False, True):
        torch.manual_seed(0)
        model = GPT(ModelConfig.from_arch("transformer", 2, ar=8, vocab_size=64, block_size=16))
        opt = build_adamw([{"name": "all", "params": list(model.parameters())}], 1e-2, (0.9, 0.95), 1e-8)
        model(torch.randint(0, 64, (1, 8))).sum().backward()
        opt.step()
        path = ckpt.save_checkpoint(tmp_path / str(flat), 1, model, opt, {"step": 1}, "x: 1\n", flat_optim=flat)
        assert ckpt.optim_keyed_by_name(path) is flat
        want = {k: v.clone() for k, v in opt.state[model.wte.weight].items()}
        fresh = GPT(model.config)
        opt2 = build_adamw([{"name": "all", "params": list(fresh.parameters())}], 1e-2, (0.9, 0.95), 1e-8)
        ckpt.load_checkpoint(path, fresh, opt2, warn=lambda m: None)
        for k, v in want.items():
            torch.testing.assert_close(opt2.state[fresh.wte.weight][k], v, rtol=0, atol=0)
        # a pipeline (whose stages need name-keyed state) refuses the index-keyed form in one line
        from types import SimpleNamespace

        from archscale.train.distributed import DistEnv
        from archscale.train.trainer import RunCheckpoints

        pipeline = SimpleNamespace(flat_optimizer_state=True, state_dict_target=lambda: (fresh, opt2, None),
                                   after_load=lambda env: None)
        loads = RunCheckpoints(tmp_path, DistEnv(), lambda m: None)
        if flat:
            assert loads.load(path, pipeline)["step"] == 1
        else:
            with pytest.raises(UserError, match="saved without --pp"):
                loads.load(path, pipeline)


# ------------------------------------------------------------------------------------------- under torchrun
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.conftest import make_dataset

    return make_dataset(tmp_path_factory.mktemp("pp") / "data")


@pytest.fixture(scope="module")
def singles(data, tmp_path_factory):
    """The single-process runs every pipeline is compared with (5 steps each)."""
    root = tmp_path_factory.mktemp("pp_single")
    runs = {"transformer": [], "sambay": [], "moe": ["--moe", "4:2"]}
    for name, extra in runs.items():
        arch = "sambay" if name == "sambay" else "transformer"
        assert main(["pretrain", *tiny_args(data, root / name, arch, *extra)]) == 0
    return root


def _check(run, ref):
    """Every train loss (steps 1-5) and the reference's validations (steps 0 and 5) within RTOL; a run that was
    stopped after step 3 and resumed also validated at step 3."""
    assert_same(run, ref, rtol=RTOL)
    got = dict(losses(run, "val_loss"))
    for step, want in losses(ref, "val_loss"):
        assert got[step] == pytest.approx(want, rel=RTOL), f"{run.name} step {step}: val_loss"
    assert len(losses(run)) == 5


@pytest.mark.slow
def test_two_process_pipelines_match_single_process(data, singles, tmp_path, capsys):
    """pp 2 on 2 gloo processes: Transformer++ under GPipe, 1F1B and interleaved 1F1B (4 stages), SambaY cut after
    its KV layer (6,2: the YOCO KV and the GMU memory cross), an MoE (its aux losses cross); then the 1F1B
    checkpoint saved at step 3 by the 2 stages is resumed by ONE process and continues as the single run."""
    runs = {"gpipe": ("transformer", ["--pp_schedule", "gpipe"]),
            "1f1b": ("transformer", ["--pp_schedule", "1f1b", "--max_steps", "3", "--save_interval", "2"]),
            "interleaved": ("transformer", ["--pp_schedule", "interleaved1f1b"]),
            "sambay": ("sambay", ["--pp_layers", "6,2"]),
            "moe": ("transformer", ["--pp_schedule", "gpipe", "--moe", "4:2"])}
    plan = [tiny_args(data, tmp_path / name, arch, "--pp", "2", *extra) for name, (arch, extra) in runs.items()]
    out = torchrun(*driver(tmp_path, plan))
    assert "pipeline 2 ranks x 2 stage(s), interleaved1f1b" in out
    for name, (arch, _) in runs.items():
        if name != "1f1b":
            _check(tmp_path / name, singles / (name if name in ("sambay", "moe") else "transformer"))
    # reshard to one process: --resume auto from the pipeline's step-3 checkpoint (optimizer state included)
    run = tmp_path / "1f1b"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000003"]
    args = tiny_args(data, run, "transformer")
    args[args.index("--resume") + 1] = "auto"
    capsys.readouterr()
    assert main(["pretrain", *args]) == 0
    assert "at step 3 (768 tokens); world size 2 -> 1" in capsys.readouterr().out
    _check(run, singles / "transformer")  # steps 1-3 by the pipeline, 4-5 by one process


@pytest.mark.slow
def test_four_process_pipelines_and_2d_mesh_match_single_process(data, singles, tmp_path):
    """4 gloo processes: Transformer++ and SambaY in 4 stages (SambaY's boundary after its KV layer carries the KV
    and the memory), and pp 2 x dp 2 (two pipelines on a 2-D mesh averaging their gradients), stopped after step 3
    and resumed by the same mesh from its checkpoint."""
    runs = {"t_pp4": ("transformer", ["--pp", "4", "--pp_schedule", "gpipe"]),
            "s_pp4": ("sambay", ["--pp", "4", "--pp_schedule", "1f1b"]),
            "t_pp2_dp2": ("transformer", ["--pp", "2", "--pp_schedule", "1f1b", "--max_steps", "3"])}
    plan = [tiny_args(data, tmp_path / name, arch, *extra) for name, (arch, extra) in runs.items()]
    resume = tiny_args(data, tmp_path / "t_pp2_dp2", "transformer", "--pp", "2", "--pp_schedule", "1f1b")
    resume[resume.index("--resume") + 1] = "auto"  # the same 2-D mesh resumes its own step-3 checkpoint
    out = torchrun(*driver(tmp_path, plan + [resume]), nproc=4)
    assert "resumed from" in out and "at step 3" in out
    assert "pipeline 2 ranks x 1 stage(s), 1f1b, data parallel 2" in out
    for name, (arch, _) in runs.items():
        _check(tmp_path / name, singles / arch)


# ------------------------------------------------------------- the lifted refusals, under torchrun
def eos_dataset(path):
    """make_dataset's pattern with an EOS (0) every 11 tokens: documents of 10 tokens for --varlen."""
    import json

    import numpy as np

    from archscale.data.format import write_shard

    path.mkdir(parents=True, exist_ok=True)
    stream = np.tile(np.random.default_rng(0).integers(1, 256, size=500), 40)
    stream[::11] = 0
    for i in range(3):
        write_shard(path / f"train_{i:010d}.bin", stream[i * 6000:(i + 1) * 6000], np.uint16)
    write_shard(path / "validation_0000000000.bin", stream[:3000], np.uint16)
    (path / "manifest.json").write_text(json.dumps({"vocab_size": 256, "eos_id": 0, "dtype": "uint16"}))
    return path


LIFTED = {"tied": ["--tie_embeddings"], "varlen": ["--varlen", "--reset_position_ids"],
          "curriculum": ["--curriculum", "seqlen:start=8,steps=3"]}


@pytest.fixture(scope="module")
def lifted_singles(data, tmp_path_factory):
    """One process of each lifted combination; the --varlen runs read documents (EOS every 11 tokens)."""
    root = tmp_path_factory.mktemp("pp_lifted")
    docs = eos_dataset(root / "docs")
    for name, extra in {**LIFTED, "plain_docs": []}.items():
        source = docs if name in ("varlen", "plain_docs") else data
        assert main(["pretrain", *tiny_args(source, root / name, "transformer", *extra)]) == 0
    return root


@pytest.mark.slow
def test_pipeline_with_tied_embeddings_varlen_and_curriculum_matches_single_process(data, lifted_singles, tmp_path):
    """pp 2 on 2 gloo processes, each against its own single-process run (1e-5 relative): tied embeddings (the
    embedding's and the head's gradients summed between the two ends, so both copies stay equal), --varlen with
    per-document positions (every stage gets the documents), a sequence-length curriculum (8 -> 32 tokens: a
    schedule per length). The varlen reference itself differs from the same data without documents."""
    docs = lifted_singles / "docs"
    runs = {name: tiny_args(docs if name == "varlen" else data, tmp_path / name, "transformer", "--pp", "2", *extra)
            for name, extra in LIFTED.items()}
    out = torchrun(*driver(tmp_path, list(runs.values())))
    assert "tied embeddings" in out
    for name in LIFTED:
        _check(tmp_path / name, lifted_singles / name)
    masked, plain = losses(lifted_singles / "varlen"), losses(lifted_singles / "plain_docs")
    assert any(abs(a - b) > 1e-3 for (_, a), (_, b) in zip(masked, plain))  # the documents did change training


@pytest.mark.slow
def test_pipeline_by_fsdp2_on_a_2d_mesh_matches_single_process(data, singles, tmp_path):
    """4 gloo processes: pp 2 x dp_shard 2 (FSDP2 shards every stage over the two data ranks; torch's
    PipelineStage drives its gradient reduce-scatter), 1F1B, against the single process (1e-5 relative)."""
    args = tiny_args(data, tmp_path / "pp2_fsdp2", "transformer", "--pp", "2", "--strategy", "fsdp")
    out = torchrun(*driver(tmp_path, [args]), nproc=4)
    assert "FSDP2 over 2" in out
    _check(tmp_path / "pp2_fsdp2", singles / "transformer")
