"""Variable-length training: packed documents with document masking equal the documents run separately.

Tolerance 2e-5 absolute on fp32 logits (RoPE is shift-invariant, so a document at positions 9.. without
position reset gives the same logits as alone at 0.., up to rounding); gradients within 5e-5 of each tensor's
largest entry, plus 1e-6 (sums over many positions, e.g. the differential-attention lambdas).
"""

import pytest
import torch

from archscale import GPT
from archscale.config import ARCHITECTURES
from archscale.models.varlen import document_ids, document_positions
from tests.test_architectures import tiny

EOS = 0
ARCHS = sorted(ARCHITECTURES)


def test_document_ids_and_positions():
    idx = torch.tensor([[5, 0, 7, 8, 0, 0, 3], [1, 2, 3, 4, 5, 6, 0]])
    docs = document_ids(idx, EOS)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]]  # EOS closes its own document
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]


def docs_pair(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 97, (9,), generator=g)
    a[-1] = EOS
    b = torch.randint(1, 97, (12,), generator=g)
    return a, b


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_separate_logits_and_grads(arch):
    torch.manual_seed(0)
    model = GPT(tiny(arch, window=5)).eval()
    a, b = docs_pair(1)
    packed = torch.cat([a, b])[None]
    docs = document_ids(packed, EOS)
    w = torch.randn(1, len(a) + len(b), 97, generator=torch.Generator().manual_seed(2))

    out = model(packed, doc_ids=docs)
    (out * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone_a, alone_b = model(a[None]), model(b[None])
    ((alone_a * w[:, :len(a)]).sum() + (alone_b * w[:, len(a):]).sum()).backward()

    torch.testing.assert_close(out[:, :len(a)], alone_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, len(a):], alone_b, atol=2e-5, rtol=1e-4)
    # relative to the tensor's largest entry (wte grads reach ~1e4), with a floor of 2e-6: a gradient that is a
    # near-cancelling sum of O(1) terms (sambayda's deepest differential-attention lambdas: max ~1.5e-4) keeps
    # their fp32 rounding, ~1e-6 absolute, and where it lands moves with any change of summation order
    for n, p in model.named_parameters():
        err = (packed_grads[n] - p.grad).abs().max().item()
        assert err <= 5e-5 * p.grad.abs().max().item() + 2e-6, (n, err)

    # the control: without document masking the second document sees the first, far beyond the masked error
    # (a small random Mamba forgets fast, so its leak is only ~1e-4 here; attention leaks ~1e-2)
    with torch.no_grad():
        leaky = model(packed)
        masked_err = (out[:, len(a):] - alone_b).abs().max().item()
    assert (leaky[:, len(a):] - alone_b).abs().max().item() > 20 * max(masked_err, 1e-6)


@pytest.mark.parametrize("arch", ["transformer", "samba"])
def test_rows_with_different_boundaries(arch):
    """Each row of a batch has its own documents; position reset gives positions 0.. inside every document."""
    torch.manual_seed(3)
    model = GPT(tiny(arch, window=5)).eval()
    a, b = docs_pair(4)
    rows = torch.stack([torch.cat([a, b]), torch.cat([b[:9], a, b[9:]])])
    rows[1, 8] = EOS
    docs = document_ids(rows, EOS)
    with torch.no_grad():
        out = model(rows, doc_ids=docs, position_ids=document_positions(docs))
        torch.testing.assert_close(out[1, :9], model(rows[1:, :9])[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[0, 9:], model(b[None])[0], atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- through training
def docs_dataset(path, vocab=128, doc_len=(20, 300), n_tokens=30000, seed=0):
    """Shards of EOS-separated documents of random lengths cut from a repeated random pattern (learnable)."""
    import json

    import numpy as np

    from archscale.data.format import write_shard
    rng = np.random.default_rng(seed)
    stream = np.resize(rng.integers(1, vocab, size=500), n_tokens)
    ends = np.cumsum(rng.integers(*doc_len, size=n_tokens // doc_len[0]))
    stream[ends[ends < n_tokens]] = EOS
    stream = stream.astype(np.uint16)
    path.mkdir(parents=True)
    write_shard(path / "train_0000000000.bin", stream, np.uint16)
    write_shard(path / "validation_0000000000.bin", stream[:6000], np.uint16)
    (path / "manifest.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": EOS, "dtype": "uint16"}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["transformer", "sambay"])
def test_varlen_training_at_long_context(tmp_path, arch):
    """A few steps of --varlen training at ctx 1024 (4x the demo's), batch 2, with per-document positions."""
    from archscale.cli import main
    from tests.test_train import rows
    data = docs_dataset(tmp_path / "data")
    run = tmp_path / "run"
    argv = ["pretrain", "--train_data_dir", str(data), "--train_model", arch, "--depth", "4", "--ar", "16",
            "--ctx_len", "1024", "--micro_bsz", "2", "--base_hps.b0", "2048", "--max_tokens", "32768",
            "--base_hps.eta0", "3e-3", "--base_hps.warmup_tokens0", "4096", "--eval_interval", "8",
            "--eval_iters", "2", "--log_interval", "1", "--out_dir", str(run), "--progress", "false",
            "--precision", "fp32", "--resume", "none", "--train_name", "scaling_varlen", "--reset_position_ids",
            "--logger", "csv,tensorboard"]
    assert main(argv) == 0
    vals = [float(r["val_loss"]) for r in rows(run) if r["val_loss"]]
    assert vals[-1] < vals[0] - 0.2, vals  # 16 steps from the SP init: measured drops 0.29 (T++) and > 0.5
    cfg = (run / "config.yaml").read_text()
    assert "varlen: true" in cfg and "reset_position_ids: true" in cfg
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_varlen_needs_an_eos_id(tmp_path, capsys):
    import json

    from archscale.cli import main
    from tests.conftest import make_dataset
    data = make_dataset(tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["eos_id"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    argv = ["pretrain", "--train_data_dir", str(data), "--depth", "1", "--ctx_len", "32", "--micro_bsz", "1",
            "--base_hps.b0", "32", "--max_tokens", "64", "--out_dir", str(tmp_path / "r"), "--varlen",
            "--progress", "false", "--resume", "none"]
    assert main(argv) == 2
    assert "--varlen" in capsys.readouterr().err
    assert main(argv[:-5] + ["--rope_scaling", "cubic:2"]) == 2
    assert "--rope_scaling" in capsys.readouterr().err


def test_train_name_varlen_rbase_dry_run(capsys):
    import json

    from archscale.cli import main
    assert main(["pretrain", "--train_data_dir", "/nonexistent", "--train_model", "sambay", "--depth", "8",
                 "--train_name", "scaling_mup_rbase_varlen", "--ctx_len", "32768", "--dry_run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["train_name_settings"] == {"parametrization": "mup++", "rope_base": 640000.0, "varlen": True}
