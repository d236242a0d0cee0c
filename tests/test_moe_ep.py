"""Expert parallelism on CPU (gloo): the parity script (logits and gradients equal the single-process MoE), the
trainer's --ep runs against the single-process MoE run, composed with DDP and FSDP2, and checkpoints saved at --ep 2
resumed in one process (--ep 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from archscale.cli import main
from tests.test_distributed import ROOT, TIMEOUT, assert_same, base_args, driver, env, losses, torchrun

MOE = ["--moe", "4:2", "--moe_shared", "1", "--moe_z_coef", "1e-3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.conftest import make_dataset

    return make_dataset(tmp_path_factory.mktemp("ep") / "data")


@pytest.fixture(scope="module")
def moe_reference(data, tmp_path_factory):
    """The single-process MoE run (6 steps) every --ep run is compared with."""
    ref = tmp_path_factory.mktemp("epref") / "single"
    assert main(["pretrain", *base_args(data, ref, "transformer", "--resume", "none", *MOE)]) == 0
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("nproc,arch", [(2, "transformer"), (4, "sambay")])
def test_ep_logits_and_gradients_equal_the_single_process_moe(tmp_path, nproc, arch):
    """tests/ep_parity.py: --ep 2 on 2 ranks, and on 4 ranks (2 replicas x 2 expert ranks), fp32, atol 1e-5."""
    out = tmp_path / "parity.json"
    torchrun(str(ROOT / "tests" / "ep_parity.py"), str(out), "2", arch, nproc=nproc)
    assert json.loads(out.read_text())["max_diff"] < 1e-5


@pytest.mark.slow
def test_ep_training_matches_the_single_process(data, moe_reference, tmp_path):
    """6 steps of --ep 2 with DDP and with FSDP2 on 2 processes: train and validation losses equal the single
    process's (rel 2e-4, as the other strategy comparisons; only the order of floating-point sums differs)."""
    runs = {"ep2_ddp": ["--strategy", "ddp", "--ep", "2"], "ep2_fsdp": ["--strategy", "fsdp", "--ep", "2"]}
    plan = [base_args(data, tmp_path / n, "transformer", "--resume", "none", *MOE, *x) for n, x in runs.items()]
    torchrun(*driver(tmp_path, plan))
    for name in runs:
        assert_same(tmp_path / name, moe_reference)
        assert_same(tmp_path / name, moe_reference, col="val_loss")


@pytest.mark.slow
def test_ep_composes_with_fsdp_over_replicas_and_reshards_to_one_process(data, moe_reference, tmp_path):
    """4 processes = 2 replicas (FSDP2 over all 4 for the dense weights) x --ep 2, 3 steps, checkpoint at step 2;
    then one process at --ep 1 resumes from step 2 (the DTensor experts reshard into plain tensors) to the end:
    the whole trajectory equals the uninterrupted single process."""
    run = tmp_path / "run"
    torchrun(*driver(tmp_path, [base_args(data, run, "transformer", "--resume", "none", *MOE, "--max_steps", "3",
                                          "--save_interval", "2", "--strategy", "fsdp", "--ep", "2")]), nproc=4)
    (run / "checkpoints" / "step-00000003" / "COMPLETE").unlink()
    out = subprocess.run([sys.executable, "pretrain.py", *base_args(data, run, "transformer", *MOE)], cwd=ROOT,
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-4000:]
    assert "world size 4 -> 1" in text and "at step 2" in text
    assert [s for s, _ in losses(run)] == list(range(1, 7))
    assert_same(run, moe_reference)
    assert_same(run, moe_reference, col="val_loss")
