"""--grad_compression: DDP communication hooks (fp16 / bf16 / PowerSGD), the byte counter, PowerSGD's state through
checkpoints, and the flag's checks. In-process tests use a one-rank gloo group (DDP and its hooks run the same
code for one rank); the multi-rank ones run under torchrun with 2 gloo processes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from archscale.errors import UserError
from archscale.train import safe_io
from archscale.train.grad_compression import CountingHook, install, parse_grad_compression

from tests.test_distributed import base_args, driver, losses, torchrun


@pytest.fixture(scope="module")
def one_rank_group():
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


def toy(seed=0):
    """Known shapes: a 16 x 32 matrix (PowerSGD compresses it at rank 2: (16 + 32) * 2 = 96 < 512 / 2) and a
    16-vector (never compressed)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1, bias=False))


def train(model, hook: CountingHook, steps, seed=0):
    """`steps` plain SGD steps on fixed random data; returns the per-step gradient of the first layer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + hook.steps)  # the global step's batch
        x = torch.randn(8, 32, generator=g)
        model(x).square().mean().backward()
        hook.end_step()
        grads.append(model.module[0].weight.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def test_the_counter_counts_the_tensors_each_method_all_reduces(one_rank_group):
    # bytes per step, from the shapes: 16x32 + 16 + 1x16 = 544 fp32 gradient elements
    dense = 544
    expect = {"none": [dense * 4] * 4, "fp16": [dense * 2] * 4, "bf16": [dense * 2] * 4,
              # 2 plain steps, then P (16x2) and Q (32x2) of the 16x32 matrix + the 16-vector + the 1x16 matrix
              # (rank min(1, 16, 2) = 1: (1 + 16) * 1 * 2 > 16, so uncompressed) in fp32
              "powersgd:rank=2": [dense * 4] * 2 + [(16 * 2 + 32 * 2 + 16 + 16) * 4] * 2}
    for method, want in expect.items():
        ddp = DDP(toy(), gradient_as_bucket_view=True)
        hook = install(ddp, parse_grad_compression(method))
        got = []
        for _ in range(4):
            train(ddp, hook, 1)
            got.append(hook.last_step_bytes)
        assert got == want, method
        assert hook.total_bytes == sum(want) and hook.steps == 4


def test_powersgd_error_feedback_changes_and_round_trips_through_the_train_state(one_rank_group):
    """6 steps straight == 3 steps, state -> safetensors bytes -> a fresh DDP + hook, 3 steps (bitwise). The
    resumed DDP starts with its first-iteration buckets (all parameters in one) and regroups after it, so the
    per-parameter state is rebuilt twice on the way."""
    spec = parse_grad_compression("powersgd:rank=2,start=2")
    ddp = DDP(toy(), gradient_as_bucket_view=True)
    hook = install(ddp, spec)
    straight = train(ddp, hook, 6)
    straight_rng = hook.powersgd.rng.get_state()

    ddp = DDP(toy(), gradient_as_bucket_view=True)
    hook = install(ddp, spec)
    first = train(ddp, hook, 3)
    errors = [e.clone() for e in hook.powersgd.error_dict.values()]
    assert errors and all(e.abs().sum() > 0 for e in errors)  # rank 2 of a 16x32 gradient loses something
    saved_model = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    data = safe_io.encode_train_state({"grad_compression": hook.state_dict()})

    model = toy()
    model.load_state_dict(saved_model)
    ddp = DDP(model, gradient_as_bucket_view=True)
    hook = install(ddp, spec)
    assert hook.load_state_dict(safe_io.decode_train_state(data)["grad_compression"]) is None
    assert hook.powersgd.iter == 3 and hook.steps == 3
    second = train(ddp, hook, 3)
    assert all(torch.equal(a, b) for a, b in zip(straight, first + second))
    rng = hook.powersgd.rng.get_state()  # no extra draw on the way (PowerSGD seeds new Q's from it)
    assert (rng[1] == straight_rng[1]).all() and rng[2:] == straight_rng[2:] and hook.powersgd.iter == 6
    changed = [e for e in hook.powersgd.error_dict.values()]
    assert not any(torch.equal(a, b) for a, b in zip(errors, changed))  # the error moved on

    # the negative control: the same resume without the state differs
    model = toy()
    model.load_state_dict(saved_model)
    ddp = DDP(model, gradient_as_bucket_view=True)
    hook = install(ddp, spec)
    hook.steps = 3
    fresh = train(ddp, hook, 3)
    assert not torch.equal(fresh[-1], straight[-1])


def test_a_nonfinite_step_resets_what_it_poisoned_and_other_methods_start_afresh(one_rank_group):
    spec = parse_grad_compression("powersgd:rank=2")
    ddp = DDP(toy(), gradient_as_bucket_view=True)
    hook = install(ddp, spec)
    train(ddp, hook, 3)
    ps = hook.powersgd
    (index,) = ps.error_dict
    ps.error_dict[index][0] = float("nan")
    ps.q_memory_dict[index][0] = float("inf")
    hook.drop_nonfinite()
    assert torch.equal(ps.error_dict[index], torch.zeros_like(ps.error_dict[index]))
    assert index not in ps.q_memory_dict and index not in ps.p_memory_dict  # PowerSGD draws a new Q
    grads = train(ddp, hook, 1)
    assert torch.isfinite(grads[0]).all()
    other = install(DDP(toy(), gradient_as_bucket_view=True), parse_grad_compression("fp16"))
    note = other.load_state_dict(hook.state_dict())
    assert "starts afresh" in note and other.steps == 4  # the byte counts carry over


def test_no_hook_and_the_counting_allreduce_give_the_same_gradients(one_rank_group):
    """`none` (torch's allreduce_hook, counted) is DDP's own all-reduce: bitwise the same gradients."""
    plain = DDP(toy(), gradient_as_bucket_view=True)
    counted = DDP(toy(), gradient_as_bucket_view=True)
    hook = install(counted, parse_grad_compression("none"))
    a = train(plain, CountingHook(parse_grad_compression("none"), {}), 3)
    b = train(counted, hook, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown method 'zip'"), ("powersgd", "rank=R with R >= 1"), ("powersgd:rank=0", "R >= 1"),
    ("powersgd:rank=2,start=1", "start must be >= 2"), ("powersgd:rank=x", "cannot read"),
    ("fp16:rank=2", "takes no options")])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        parse_grad_compression(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("strategy", ["auto", "single", "fsdp", "deepspeed"])
def test_compression_without_ddp_is_refused_at_argument_time(strategy, capsys):
    from archscale.cli import main

    code = main(["pretrain", "--dry_run", "--json", "--vocab_size", "256", "--depth", "2", "--strategy", strategy,
                 "--grad_compression", "fp16"])
    err = capsys.readouterr().err
    assert code == 2 and "needs --strategy ddp" in err and len(err.strip().splitlines()) == 1


def test_dry_run_shows_the_compression(capsys):
    from archscale.cli import main

    assert main(["pretrain", "--dry_run", "--json", "--vocab_size", "256", "--depth", "2", "--strategy", "ddp",
                 "--grad_compression", "powersgd:rank=4,start=10"]) == 0
    assert json.loads(capsys.readouterr().out)["grad_compression"] == "powersgd rank 4 after 10 plain steps"
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "powersgd:rank=R" in capsys.readouterr().out  # the flag's help


# ----------------------------------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.conftest import make_dataset

    return make_dataset(tmp_path_factory.mktemp("gc") / "data")


def comm_bytes(run):
    return [int(b) for _, b in losses(run, "comm_bytes")]


@pytest.mark.slow
def test_two_ranks_compressed_losses_bytes_and_exact_powersgd_resume(data, tmp_path):
    """One torchrun launch (2 gloo ranks, 6 steps each): none, fp16, bf16, powersgd rank 2 straight, and powersgd
    3 steps + resume + 3 steps."""
    psgd = ["--grad_compression", "powersgd:rank=2"]
    runs = {m: ["--grad_compression", m] for m in ("none", "fp16", "bf16")}
    runs["powersgd"] = psgd
    plan = [base_args(data, tmp_path / name, "transformer", "--resume", "none", "--strategy", "ddp", *extra)
            for name, extra in runs.items()]
    half = base_args(data, tmp_path / "resumed", "transformer", "--strategy", "ddp", "--save_interval", "3", *psgd)
    plan += [half + ["--resume", "none", "--max_steps", "3"], half + ["--resume", "auto"]]
    out = torchrun(*driver(tmp_path, plan))
    ref = losses(tmp_path / "none")
    assert len(ref) == 6
    # Step 1 (same weights everywhere): the gradient is rounded once before the sum and once after it (gloo adds
    # in 16 bits), so its norm is within 2 * 2**-11 (fp16) / 2 * 2**-8 (bf16) of the fp32 one.
    # The losses after that: the run is short and its LR high (the loss swings by 0.7 between steps), so the
    # rounding grows; measured at most 1.4e-5 (fp16) and 7.8e-3 (bf16) relative; asserted 1e-4 and 2e-2.
    norm = losses(tmp_path / "none", "grad_norm")[0][1]
    for name, rtol, bound in (("fp16", 1e-4, 2 * 2**-11), ("bf16", 2e-2, 2 * 2**-8)):
        got = losses(tmp_path / name)
        assert [s for s, _ in got] == [s for s, _ in ref]
        assert all(a == pytest.approx(b, rel=rtol) for (_, a), (_, b) in zip(got, ref)), (name, got, ref)
        assert got[1:] != ref[1:], f"{name} compression changed nothing"  # step 1's loss precedes any update
        assert losses(tmp_path / name, "grad_norm")[0][1] == pytest.approx(norm, rel=bound)
    # bytes per step: the gradients of every parameter (fp32), half of that in 16 bits; PowerSGD from step 3
    dense = comm_bytes(tmp_path / "none")
    assert len(set(dense)) == 1 and comm_bytes(tmp_path / "fp16") == [d // 2 for d in dense]
    assert comm_bytes(tmp_path / "bf16") == [d // 2 for d in dense]
    psgd_bytes = comm_bytes(tmp_path / "powersgd")
    assert psgd_bytes[:2] == dense[:2] and all(b < d / 2 for b, d in zip(psgd_bytes[2:], dense[2:]))
    # exact resume: the same losses, bitwise (same samples, same arithmetic, same error feedback)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "powersgd")
    resumed_val = dict(losses(tmp_path / "resumed", "val_loss"))  # + one at step 3, where the first half ended
    assert all(resumed_val[s] == v for s, v in losses(tmp_path / "powersgd", "val_loss"))
    assert comm_bytes(tmp_path / "resumed") == psgd_bytes
    from archscale.eval.generate import load_model  # metrics.csv keeps 6 digits; the weights are bitwise equal

    straight, resumed = (load_model(tmp_path / name)[0].state_dict() for name in ("powersgd", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert "gradient all-reduce (powersgd rank 2 after 2 plain steps)" in out
