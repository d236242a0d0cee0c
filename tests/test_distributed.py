"""Scale-out on CPU: 2 gloo processes under torchrun give the single-process loss trajectory (DDP, FSDP2,
DeepSpeed ZeRO 0-3), resume across world sizes, multi-node rendezvous, activation checkpointing.

To keep the suite fast, the strategy comparisons run several trainings inside ONE torchrun launch (the process
group is created once; `pretrain` reuses it), while the resume and multi-node tests go through the real
`pretrain.py` command line.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from archscale.cli import main
from archscale.config import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["transformer"] + (["samba"] if "samba" in ARCHITECTURES else [])
# Losses of 2-process runs vs the single process: same samples, same init, same groups; only the order of
# floating-point sums differs (gradient all-reduce, sharded clipping norm). Measured differences are ~1e-6.
RTOL = 2e-4
TIMEOUT = int(os.environ.get("ARCHSCALE_TEST_TIMEOUT", "240"))  # seconds per torchrun launch (raise on a loaded machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_args(data, out, arch="transformer", *extra):
    return ["--train_data_dir", str(data), "--train_model", arch, "--depth", "1" if arch == "transformer" else "2",
            "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens", "1536",
            "--base_hps.eta0", "2e-4", "--base_hps.warmup_tokens0", "256", "--parametrization", "mup++",
            "--eval_interval", "2", "--eval_iters", "2", "--log_interval", "1", "--save_interval", "2",
            "--out_dir", str(out), "--progress", "false", "--precision", "fp32", *extra]


def losses(run, col="train_loss"):
    with open(Path(run) / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r[col])) for r in csv.DictReader(f) if r[col]]


def assert_same(run, ref, col="train_loss", rtol=RTOL):
    got, want = losses(run, col), losses(ref, col)
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    for (s, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=rtol), f"{run.name} step {s}: {col} {a} vs single {b}"


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("DS_ACCELERATOR", "cpu")
    return e


def driver(tmp_path, plan) -> list[str]:
    """torchrun arguments that run the trainings of `plan` (argument lists) in one launch."""
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    return [str(script), json.dumps(plan)]


def torchrun(*argv, nproc=2, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", *extra, *argv]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=TIMEOUT)
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0, out[-4000:]
    return out


# Runs several trainings in one torchrun launch: argv[1] is a JSON list of argument lists.
_DRIVER = """
import json, sys
import torch.distributed as dist
from archscale.cli import parse_pretrain
from archscale.train.trainer import pretrain
dist.init_process_group("gloo")  # created once here, so every pretrain() below reuses (and keeps) it
for argv in json.loads(sys.argv[1]):
    cfg, explicit = parse_pretrain(argv)
    pretrain(cfg, explicit)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.conftest import make_dataset

    return make_dataset(tmp_path_factory.mktemp("dist") / "data")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The single-process Transformer++ run every 2-process run is compared with (6 steps)."""
    ref = tmp_path_factory.mktemp("ref") / "single"
    assert main(["pretrain", *base_args(data, ref, "transformer", "--resume", "none")]) == 0
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_strategies_match_single_process(data, reference, tmp_path, arch):
    short = [] if arch == "transformer" else ["--max_tokens", "768"]  # the hybrid is slower: 3 steps
    ref = reference
    if arch != "transformer":
        ref = tmp_path / "single"
        assert main(["pretrain", *base_args(data, ref, arch, "--resume", "none", *short)]) == 0
    runs = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"],
            "fsdp_save_mem": ["--strategy", "fsdp", "--fsdp_save_mem"]}
    runs.update({f"zero{z}": ["--strategy", "deepspeed", "--zero_stage", str(z)] for z in (0, 1, 2, 3)})
    plan = [base_args(data, tmp_path / name, arch, "--resume", "none", *short, *extra) for name, extra in runs.items()]
    torchrun(*driver(tmp_path, plan))
    for name in runs:
        assert_same(tmp_path / name, ref)
        assert_same(tmp_path / name, ref, col="val_loss")
        # global batch unchanged: 2 ranks x accum 2 x micro 2 x ctx 32 == 1 x accum 4 x ...
        assert "grad_accum: 2" in (tmp_path / name / "config.yaml").read_text()
    ds_cfg = json.loads((tmp_path / "zero3" / "deepspeed_config.json").read_text())
    assert ds_cfg["train_batch_size"] == 8 and ds_cfg["gradient_accumulation_steps"] == 2
    assert ds_cfg["zero_optimization"]["stage"] == 3 and "scheduler" not in ds_cfg and "optimizer" not in ds_cfg

    # `archscale export` consolidates the 2-rank FSDP2 (DCP) and ZeRO-3 checkpoints into one safetensors file
    # each; loaded into a plain model, the weights reproduce the run's final validation loss.
    from contextlib import nullcontext

    from safetensors.torch import load_file

    from archscale.data.loader import validation_batches
    from archscale.eval.generate import load_model
    from archscale.train.trainer import evaluate

    val = list(validation_batches(data, block_size=33, micro_bsz=2, max_batches=2))
    for name in ("fsdp", "zero3"):
        out = tmp_path / f"{name}.safetensors"
        assert main(["export", "--checkpoint", str(tmp_path / name), "--out", str(out)]) == 0
        model, _ = load_model(tmp_path / name)  # the architecture, from the run's config.yaml
        model.load_state_dict(load_file(out), strict=True)
        final_val = losses(tmp_path / name, "val_loss")[-1][1]
        assert evaluate(model, val, torch.device("cpu"), nullcontext) == pytest.approx(final_val, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategies", [("fsdp", "single", "ddp"), ("deepspeed", "deepspeed", "deepspeed")])
def test_resume_with_another_world_size(data, reference, tmp_path, strategies):
    """2 processes, "killed" while saving step 3 -> 1 process from step 2 to step 4 -> 2 processes to the end ==
    uninterrupted. The kill is simulated deterministically by what it leaves on disk: metrics rows up to step 3,
    a complete step-2 checkpoint and a step-3 checkpoint without its COMPLETE marker."""
    ref = reference
    run = tmp_path / "run"
    a, b, c = ([ "--strategy", s] + (["--zero_stage", "2"] if s == "deepspeed" else []) for s in strategies)
    torchrun("pretrain.py", *base_args(data, run, "transformer", "--resume", "none", "--max_steps", "3",
                                       "--save_interval", "2", *a))
    (run / "checkpoints" / "step-00000003" / "COMPLETE").unlink()
    out = subprocess.run([sys.executable, "pretrain.py", *base_args(data, run, "transformer", "--max_steps", "4",
                                                                    *b)],
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-4000:]
    assert "world size 2 -> 1" in text and "at step 2" in text
    torchrun("pretrain.py", *base_args(data, run, "transformer", *c))
    assert [s for s, _ in losses(run)] == list(range(1, 7))
    assert_same(run, ref)
    assert_same(run, ref, col="val_loss")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000006"


@pytest.mark.slow
def test_multi_node_rendezvous(data, reference, tmp_path):
    """Two torchrun agents (--nnodes=2, one process each) meet on 127.0.0.1 and train like one process."""
    ref = reference
    port = free_port()
    run = tmp_path / "mn"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=mn",
               "pretrain.py", *base_args(data, run, "transformer", "--resume", "none", "--strategy", "ddp")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT)
        outs.append(out.decode(errors="replace"))
        assert p.returncode == 0, out[-4000:]
    assert "2 processes, ddp" in outs[0] + outs[1]
    assert_same(run, ref)


def test_activation_checkpointing_gives_the_same_gradients():
    from archscale.config import ModelConfig
    from archscale.models.model import GPT
    from archscale.train.parallelize import apply_act_ckpt

    # + the YOCO families: their GMU / cross layers read tensors that earlier checkpointed blocks produced
    for arch, depth in [(a, 2) for a in ARCHS] + [("sambay", 4), ("sambayoco", 4)]:
        cfg = ModelConfig.from_arch(arch, depth, ar=32, vocab_size=128, block_size=32)
        torch.manual_seed(0)
        plain = GPT(cfg)
        ckpt = GPT(cfg)
        ckpt.load_state_dict(plain.state_dict())
        apply_act_ckpt(ckpt)
        x = torch.randint(0, 128, (2, 33))
        grads = []
        for m in (plain, ckpt):
            loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=f"{arch} {n}")
        assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]  # FQNs kept


def test_deepspeed_config_keeps_our_groups_and_schedule():
    from archscale.train.deepspeed_engine import ds_config
    from archscale.errors import UserError

    c = ds_config(micro_bsz=2, grad_accum=4, world_size=8, zero_stage=3, precision="fp16-mixed", offload="params")
    assert c["train_batch_size"] == 64 and c["gradient_clipping"] == 1.0
    assert c["fp16"]["enabled"] and c["fp16"]["loss_scale"] == 0 and not c["bf16"]["enabled"]  # dynamic scaling
    assert c["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "optimizer" not in c and "scheduler" not in c  # our AdamW groups, our LR schedule
    with pytest.raises(UserError, match="needs --zero_stage 3"):
        ds_config(micro_bsz=1, grad_accum=1, world_size=1, zero_stage=2, precision="fp32", offload="params")


def test_global_order_loader_is_world_size_independent_and_resumes_across_world_sizes(tmp_path):
    """Rank r of W gets global micro-batches r, r+W, ...; the state after a step is the same on every rank and
    loads at another world size (2 -> 1 -> 2) with the continuation of the single-process order."""
    from archscale.data.loader import GlobalOrderLoader, PackedLoader
    from archscale.errors import UserError
    from tests.conftest import make_dataset

    data = make_dataset(tmp_path / "d", n_train_files=3, tokens_per_file=700)
    kw = dict(block_size=17, micro_bsz=2, seed=7, num_workers=2, buffer_chunks=1)
    single = PackedLoader(data, **kw)
    order = [next(single) for _ in range(24)]  # 24 global micro-batches = 6 steps of 4
    two = [GlobalOrderLoader(data, rank=r, world_size=2, **kw) for r in range(2)]
    for j in range(4):  # 2 steps at W=2: accum 2 per rank
        for r in range(2):
            assert torch.equal(next(two[r]), order[2 * j + r])
    sd = two[0].state_dict()
    assert sd == two[1].state_dict() and sd["batches"] == 8
    one = GlobalOrderLoader(data, rank=0, world_size=1, **kw)
    one.load_state_dict(json.loads(json.dumps(sd)))
    for j in range(8, 16):  # 2 steps at W=1: accum 4
        assert torch.equal(next(one), order[j])
    back = [GlobalOrderLoader(data, rank=r, world_size=2, **kw) for r in range(2)]
    for r in range(2):
        back[r].load_state_dict(one.state_dict())
    for j in range(16, 24, 2):
        assert [torch.equal(next(back[r]), order[j + r]) for r in range(2)] == [True, True]
    three = GlobalOrderLoader(data, rank=0, world_size=3, **kw)
    with pytest.raises(UserError, match="not a multiple of the new world size 3"):
        three.load_state_dict(sd)
