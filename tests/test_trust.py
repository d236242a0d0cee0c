"""Trust: nothing in a checkpoint runs, every file is verified, no good checkpoint is lost, bad input gets one line.

The attacks are the ones a hostile colleague could mail: a checkpoint whose `.metadata` or train state is a pickle
that runs code when unpickled (here: creates a marker file), with COMPLETE re-sealed so that sizes and checksums
match. Every entry point that reads a checkpoint (eval, generate, export, pretrain --resume) must refuse it in
one line without running the payload.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from archscale.cli import main
from archscale.errors import UserError
from archscale.train import checkpoint as ckpt
try:
    from archscale.train import safe_io
except ImportError:  # lets this file run against older code, to watch each test fail there
    safe_io = None

from tests.test_train import args, det, rows


class Payload:
    """Unpickling this runs `exec`, which creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def reseal(step_dir: Path) -> None:
    """Rewrite COMPLETE so sizes and sha256 match the (tampered) files: what an attacker would do."""
    info = json.loads((step_dir / "COMPLETE").read_text())
    files = {}
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name != "COMPLETE":
            files[str(p.relative_to(step_dir))] = {"bytes": p.stat().st_size,
                                                   "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    info["files"] = files
    (step_dir / "COMPLETE").write_text(json.dumps(info))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4 and 6 (and a tokenizer file for generate/eval)."""
    from tests.conftest import make_dataset

    base = tmp_path_factory.mktemp("trust")
    data = make_dataset(base / "data")
    run = base / "run"
    assert main(args(data, run, "--resume", "none", "--max_steps", "6", "--save_interval", "2",
                     "--keep_last", "0", "--eval_interval", "2")) == 0
    return data, run


@pytest.fixture
def run_copy(trained, tmp_path):
    data, run = trained
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return data, dst


def step(run: Path, n: int) -> Path:
    return run / "checkpoints" / ckpt.step_dir_name(n)


def test_payload_runs_under_plain_pickle(tmp_path):
    """Positive control: the payload used below does run when unpickled the ordinary way."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.read_text() == "ran"


def _poison_metadata(d: Path, marker: Path) -> None:
    (d / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(d)


def _poison_train_state(d: Path, marker: Path) -> None:
    torch.save({"step": Payload(marker)}, d / ckpt.train_state_name(0))
    reseal(d)


def tiny_tokenizer(folder: Path) -> Path:
    from archscale.data.tokenizer import train_bpe

    path = folder / "tok.json"
    if not path.exists():
        corpus = folder / "tok_corpus.txt"
        corpus.write_text("some words and more words\n" * 100)
        train_bpe([str(corpus)], 300, str(path))
    return path


def _entry_points(run: Path, d: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "eval": ["eval", "--checkpoint", str(d), "--tasks", "ppl", "--output", str(tmp_path / "res.json")],
        "generate": ["generate", "--checkpoint", str(d), "--tokenizer", str(tiny_tokenizer(tmp_path))],
        "export": ["export", "--checkpoint", str(d), "--out", str(tmp_path / "w.safetensors")],
    }


@pytest.mark.parametrize("poison", [_poison_metadata, _poison_train_state], ids=["dcp_metadata", "train_state"])
def test_no_entry_point_executes_a_checkpoint(run_copy, tmp_path, capsys, poison):
    data, run = run_copy
    marker = tmp_path / "marker"
    for n in (2, 4, 6):
        poison(step(run, n), marker)
    for name, argv in _entry_points(run, step(run, 6), tmp_path).items():
        assert main(argv) == 2, name
        line = one_line_error(capsys)
        assert not marker.exists(), f"{name} executed the payload"
        assert "not a usable checkpoint" in line or "none of the" in line, (name, line)
    # resume: an explicit path, and auto with every checkpoint poisoned (exit 2, metrics.csv untouched)
    metrics = (run / "metrics.csv").read_bytes()
    assert main(args(data, run, "--resume", str(step(run, 6)))) == 2
    assert "not a usable checkpoint" in one_line_error(capsys)
    assert main(args(data, run, "--resume", "auto")) == 2
    assert "none of the 3 checkpoints is usable" in capsys.readouterr().err
    assert not marker.exists()
    assert (run / "metrics.csv").read_bytes() == metrics


def test_dcp_byte_item_payload_is_refused_on_resume(run_copy, tmp_path, capsys):
    """DCP stores non-tensor values (an optimizer's param-group settings) as pickled byte items, which its default
    planner reads with weights_only=False: point one at a payload appended to the shard."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    data, run = run_copy
    d = step(run, 6)
    marker = tmp_path / "marker"
    md = safe_io.load_dcp_metadata(d / ".metadata")
    key = next(k for k in md.storage_data if k.fqn == "optim.param_groups.0.lr_mult")
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    shard = d / md.storage_data[key].relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[key] = _StorageInfo(md.storage_data[key].relative_path, offset, len(buf.getvalue()))
    (d / ".metadata").write_bytes(pickle.dumps(md))
    reseal(d)
    assert ckpt.verify_checkpoint(d) is None  # consistent, readable metadata: only the value is hostile
    assert main(args(data, tmp_path / "other", "--resume", str(d))) == 2
    assert "refused to unpickle" in one_line_error(capsys)
    assert not marker.exists()


def test_restricted_unpickler_reads_what_dcp_writes_and_nothing_else(trained, tmp_path):
    _, run = trained
    md = safe_io.load_dcp_metadata(step(run, 6) / ".metadata")
    assert len(md.state_dict_metadata) > 10 and any(k.startswith("model.") for k in md.state_dict_metadata)
    marker = tmp_path / "marker"
    bad = tmp_path / "bad.metadata"
    bad.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="builtins.exec"):
        safe_io.load_dcp_metadata(bad)
    assert not marker.exists()


def test_dcp_byte_values_are_read_weights_only(tmp_path):
    """DCP's default planner reads non-tensor values with torch.load(weights_only=False); ours refuses code."""
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    buf.seek(0)
    planner = safe_io.SafeLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}

    class Item:
        class dest_index:
            fqn = "x"

    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(Item, buf)
    assert not marker.exists()
    ok = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.95)}, ok)
    ok.seek(0)
    planner.load_bytes(Item, ok)
    assert planner.state_dict["x"] == {"lr": 0.1, "betas": (0.9, 0.95)}


def test_deepspeed_files_are_read_weights_only(trained, tmp_path, capsys):
    """A DeepSpeed-format step dir whose model states file runs code: export and eval refuse it."""
    _, run = trained
    d = tmp_path / "ds" / "checkpoints" / "step-00000002"
    (d / "deepspeed").mkdir(parents=True)
    shutil.copy(step(run, 2) / "config.yaml", d / "config.yaml")
    shutil.copy(step(run, 2) / ckpt.train_state_name(0), d / ckpt.train_state_name(0))
    marker = tmp_path / "marker"
    torch.save({"module": Payload(marker)}, d / "deepspeed" / "mp_rank_00_model_states.pt")
    (d / "COMPLETE").write_text(json.dumps({"step": 2, "files": {}}))
    reseal(d)
    assert ckpt.verify_checkpoint(d) is None  # integrity holds: only the content is hostile
    for name, argv in _entry_points(d.parent.parent, d, tmp_path).items():
        if name == "generate":
            continue  # the same loader as export
        assert main(argv) == 2, name
        one_line_error(capsys)
        assert not marker.exists(), f"{name} executed the DeepSpeed payload"
    with pytest.raises(pickle.UnpicklingError):
        with safe_io.deepspeed_weights_only():
            torch.load(d / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=False)
    assert not marker.exists() and torch.load is not None


def test_train_state_round_trips_rng_exactly():
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.standard_normal()  # leaves a cached gaussian (a float) in numpy's state
    random.gauss(0, 1)  # and one in python's
    state = {"step": 7, "tokens": 1 << 40, "rng": ckpt.rng_state(), "loader": {"a": [1, "2", None]},
             "grad_scaler": {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 3}, "loss": float("nan")}
    back = safe_io.decode_train_state(safe_io.encode_train_state(state))
    want = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random(), random.gauss(0, 1))
    ckpt.set_rng_state(back["rng"])
    got = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random(), random.gauss(0, 1))
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and np.array_equal(want[2], got[2])
    assert want[3:] == got[3:]
    assert back["grad_scaler"] == state["grad_scaler"] and back["loader"] == state["loader"]
    assert back["step"] == 7 and back["tokens"] == 1 << 40 and np.isnan(back["loss"])
    with pytest.raises(UserError, match="not a readable archscale train state"):
        safe_io.decode_train_state(pickle.dumps({"step": 1}), "x")


# ------------------------------------------------------------------------------------------------ integrity
def test_complete_records_sha256_computed_while_writing(tmp_path, monkeypatch):
    reads = []
    real = safe_io.sha256_file
    monkeypatch.setattr(safe_io, "sha256_file", lambda p: reads.append(Path(p).name) or real(p))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    d = ckpt.save_checkpoint(tmp_path, 1, model, opt, {"step": 1, "loss": 2.5}, "a: 1\n")
    assert reads == []  # no file was read back to hash it
    info = json.loads((d / "COMPLETE").read_text())
    assert info["finite"] is True and set(info["files"]) == {".metadata", "__0_0.distcp", "config.yaml",
                                                             ckpt.train_state_name(0)}
    for name, v in info["files"].items():
        assert v["sha256"] == hashlib.sha256((d / name).read_bytes()).hexdigest(), name
        assert v["bytes"] == (d / name).stat().st_size


def test_hashing_stream_falls_back_to_a_reread_after_a_seek(tmp_path):
    fs = safe_io.HashingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as f:
        f.write(b"hello ")
        f.write(memoryview(b"world"))
    with fs.create_stream(tmp_path / "b.tmp", "wb") as f:
        f.write(b"xxxx")
        f.seek(0)
        f.write(b"y")
    fs.rename(tmp_path / "b.tmp", tmp_path / "b")
    assert fs.digests[str(tmp_path / "a")] == hashlib.sha256(b"hello world").hexdigest()
    assert fs.digests[str(tmp_path / "b")] is None  # not front to back: the sealer hashes it from disk
    assert (tmp_path / "b").read_bytes() == b"yxxx"


def _flip(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    for i in range(start, min(len(data), start + n)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_detected(run_copy, tmp_path, capsys):
    data, run = run_copy
    full = tmp_path / "full"
    assert main(args(data, full, "--resume", "none", "--max_steps", "10", "--save_interval", "2",
                     "--eval_interval", "2")) == 0
    capsys.readouterr()
    _flip(step(run, 6) / "__0_0.distcp")
    # an explicit path: one line
    for argv in (["export", "--checkpoint", str(step(run, 6)), "--out", str(tmp_path / "w.safetensors")],
                 args(data, tmp_path / "other", "--resume", str(step(run, 6)))):
        assert main(argv) == 2
        assert "does not match its sha256" in one_line_error(capsys)
    # auto: skip it with one warning, resume from step 4, end exactly like an uninterrupted run
    assert main(args(data, run, "--resume", "auto", "--max_steps", "10", "--save_interval", "2",
                     "--eval_interval", "2")) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and "sha256" in warnings[0]
    assert "at step 4" in out
    assert det(run) == det(full)


@pytest.mark.parametrize("damage", ["metadata", "train_state", "both_newest"])
def test_unreadable_newest_falls_back(run_copy, capsys, damage):
    data, run = run_copy
    d = step(run, 6)
    if damage in ("metadata", "both_newest"):
        (d / ".metadata").write_bytes(b"\x80\x04not a pickle")
        reseal(d)  # checksums match: only the parse fails
    if damage in ("train_state", "both_newest"):
        (d / ckpt.train_state_name(0)).write_bytes(b"{}" * 10)
        reseal(d)
    root = run / "checkpoints"
    warned = []
    assert ckpt.find_latest(root, warn=warned.append) == step(run, 4)
    assert len(warned) == 1 and "unreadable" in warned[0]
    capsys.readouterr()
    assert main(args(data, run, "--resume", "auto", "--max_steps", "6", "--save_interval", "2")) == 0
    out = capsys.readouterr().out
    assert "at step 4" in out and "skipping checkpoint" in out


def test_no_usable_checkpoint_is_exit_2_not_a_restart(run_copy, capsys):
    data, run = run_copy
    for n in (2, 4, 6):
        (step(run, n) / ".metadata").write_bytes(b"garbage")  # sizes differ too
    before = (run / "metrics.csv").read_bytes(), (run / "config.yaml").read_bytes()
    assert main(args(data, run, "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "none of the 3 checkpoints is usable" in err
    assert ((run / "metrics.csv").read_bytes(), (run / "config.yaml").read_bytes()) == before
    with pytest.raises(UserError, match="none of the 3"):
        ckpt.find_latest(run / "checkpoints", warn=lambda m: None)
    assert ckpt.find_latest(run / "nothing_here") is None


# ------------------------------------------------------------------------------------------------ keep_last
def _save(root, n, loss, keep_last):
    model = torch.nn.Linear(2, 2)
    return ckpt.save_checkpoint(root, n, model, None, {"step": n, "loss": loss}, "x: 1\n", keep_last=keep_last)


def test_keep_last_never_deletes_the_newest_finite_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1, 3.0, keep_last=2)
    _save(root, 2, 2.5, keep_last=2)
    for n in (3, 4, 5):
        _save(root, n, float("nan"), keep_last=2)
    names = [p.name for p in ckpt.complete_checkpoints(root)]
    assert names == ["step-00000002", "step-00000004", "step-00000005"]  # 2: the newest finite one
    assert json.loads((root / "step-00000002" / "COMPLETE").read_text())["finite"] is True
    assert json.loads((root / "step-00000005" / "COMPLETE").read_text())["finite"] is False
    _save(root, 6, 1.0, keep_last=1)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000006"]


def test_prune_keeps_what_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2, 3):
        _save(root, n, 1.0, keep_last=0)
    (root / "latest").write_text("step-00000001\n")  # e.g. a user pointed it back by hand
    deleted = ckpt.prune(root, 1)
    assert [p.name for p in deleted] == ["step-00000002"]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000001", "step-00000003"]


# ------------------------------------------------------------------------------------------------ input checks
def _set_header_code(path: Path, code: int) -> None:
    data = bytearray(path.read_bytes())
    data[15] = code  # b"LITPKDS" + uint64 version, then the dtype code
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("code,name", [(1, "uint8"), (2, "int8"), (6, "float32")])
def test_shard_header_dtype_must_match_the_manifest(tmp_path, capsys, code, name):
    from tests.conftest import make_dataset

    data = make_dataset(tmp_path / "data")
    shard = data / "train_0000000001.bin"
    _set_header_code(shard, code)
    assert main(args(data, tmp_path / "run", "--resume", "none")) == 2
    line = one_line_error(capsys)
    assert str(shard) in line and name in line and "uint16" in line and "truncated" not in line, line
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_float_header_is_not_called_truncated(tmp_path):
    from archscale.data.format import read_header, write_shard

    p = tmp_path / "x.bin"
    write_shard(p, np.arange(10), np.uint16)
    _set_header_code(p, 6)
    with pytest.raises(UserError, match="float32; token shards hold integer ids") as e:
        read_header(p)
    assert "truncated" not in str(e.value)


# ------------------------------------------------------------------------------------------------ one line, not a traceback
def test_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(dataset, tmp_path, capsys, monkeypatch):
    import errno

    run = tmp_path / "run"
    assert main(args(dataset, run, "--resume", "none", "--max_steps", "4", "--save_interval", "2")) == 0
    real = safe_io._HashingStream.write

    def full(self, b):
        raise OSError(errno.ENOSPC, "No space left on device", str(getattr(self.raw, "name", "?")))

    monkeypatch.setattr(safe_io._HashingStream, "write", full)
    assert main(args(dataset, run, "--resume", "auto", "--max_steps", "6", "--save_interval", "2")) == 2
    line = one_line_error(capsys)
    assert "No space left on device" in line and "--resume auto" in line
    monkeypatch.setattr(safe_io._HashingStream, "write", real)
    assert ckpt.find_latest(run / "checkpoints") == step(run, 4)  # the last good state is intact


def test_full_disk_in_prepare_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    from archscale.data import format as shard_format
    from archscale.data.tokenizer import train_bpe

    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, a small corpus of words\n" * 200)
    train_bpe([str(corpus)], 300, str(tmp_path / "tok.json"))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "x.bin.tmp"))

    monkeypatch.setattr(shard_format, "write_shard", full)
    monkeypatch.setattr("archscale.data.format.ShardWriter._flush",
                        lambda self: full() if self._fill else None)
    assert main(["prepare", "--input", str(corpus), "--output_dir", str(tmp_path / "out"), "--tokenizer",
                 str(tmp_path / "tok.json"), "--num_workers", "1", "--val_fraction", "0"]) == 2  # one document
    assert "No space left on device" in one_line_error(capsys)


def _unwritable(tmp_path) -> Path:
    """A path that cannot be created, even by root: its parent is a regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    return blocker / "sub"


def test_unwritable_outputs_fail_before_the_work(trained, tmp_path, capsys, monkeypatch):
    data, run = trained
    from archscale.data.tokenizer import train_bpe

    bad = _unwritable(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("some words and more words\n" * 100)
    train_bpe([str(corpus)], 300, str(tmp_path / "tok.json"))
    called = []
    monkeypatch.setattr("archscale.data.tokenizer.train_bpe", lambda *a, **k: called.append("bpe"))
    monkeypatch.setattr("archscale.eval.loading.load_eval_model", lambda *a, **k: called.append("eval"))
    cases = [
        ["tokenizer", "train", "--input", str(corpus), "--vocab_size", "300", "--out", str(bad / "tok.json")],
        ["eval", "--checkpoint", str(run), "--tasks", "ppl", "--output", str(bad / "r.json")],
        ["prepare", "--input", str(corpus), "--output_dir", str(bad), "--tokenizer", str(tmp_path / "tok.json"),
         "--val_fraction", "0"],  # one document: nothing to split
        args(data, bad, "--resume", "none"),
    ]
    for argv in cases:
        assert main(argv) == 2, argv[0]
        line = one_line_error(capsys)
        assert str(bad) in line or "blocker" in line, line
    assert called == []


def test_negative_learning_rate_and_other_hps(dataset, tmp_path, capsys):
    for flag, value in (("--base_hps.eta0", "-1e-3"), ("--base_hps.b0", "0"), ("beta2_0", "1.5")):
        assert main(args(dataset, tmp_path / "r", flag if flag.startswith("--") else f"--base_hps.{flag}",
                         value)) == 2
        assert flag in one_line_error(capsys)


def test_generate_checks_its_options_and_the_tokenizer_vocab(trained, tmp_path, capsys):
    from archscale.data.tokenizer import train_bpe

    _, run = trained
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(3000)))
    train_bpe([str(corpus)], 400, str(tmp_path / "big.json"))  # the model embeds 256 ids
    base = ["generate", "--checkpoint", str(run), "--tokenizer", str(tmp_path / "big.json")]
    for extra, expect in ((["--max_new_tokens", "-3"], "--max_new_tokens must be >= 0"),
                          (["--temperature", "-1"], "--temperature must be >= 0"),
                          (["--top_p", "1.5"], "--top_p"),
                          ([], "tokens but the model embeds only 256")):
        assert main(base + extra) == 2
        assert expect in one_line_error(capsys)


def test_pretrain_flag_errors_are_one_line(dataset, tmp_path, capsys):
    assert main(args(dataset, tmp_path / "r", "--bogus_flag", "1")) == 2
    line = one_line_error(capsys)
    assert "bogus_flag" in line and "see archscale pretrain --help" in line
    cfg = tmp_path / "c.yaml"
    cfg.write_text("depht: 2\n")
    assert main(args(dataset, tmp_path / "r", "--config", str(cfg))) == 2
    assert "depht" in one_line_error(capsys)
    assert main(args(dataset, tmp_path / "r", "--depth", "two")) == 2
    assert "depth" in one_line_error(capsys)


def test_every_pretrain_flag_has_help():
    from archscale.cli import pretrain_parser

    p = pretrain_parser()
    missing = [a.option_strings[0] for a in p._actions if a.option_strings and not (a.help or "").strip()]
    assert missing == []
    helps = {a.dest: a.help for a in p._actions}
    assert "base learning rate" in helps["base_hps.eta0"] and "sequence length" in helps["ctx_len"]


def test_sweep_dry_run_reports_the_failing_runs_error(dataset, tmp_path, capsys):
    import yaml

    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"name": "t", "out_dir": str(tmp_path / "out"),
                                     "base": {"train_data_dir": str(dataset), "train_model": "transformer",
                                              "dpeth": 1, "vocab_size": 256},
                                     "grid": {"base_hps.eta0": [1e-3]}}))
    assert main(["sweep", str(study), "--dry_run"]) == 2
    line = one_line_error(capsys)
    assert "dpeth" in line and "run " in line, line


def test_misleading_messages_are_fixed(tmp_path, capsys):
    from archscale.data.sources import iter_texts

    assert main(args(tmp_path / "no_such_dir", tmp_path / "r", "--resume", "none")) == 2
    line = one_line_error(capsys)
    assert "no such folder" in line and "--vocab_size" not in line
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"text": "abc\n')
    with pytest.raises(UserError) as e:
        for _ in iter_texts(bad):
            pass
    assert "at at" not in str(e.value) and "column" in str(e.value)


def test_eval_ppl_needs_no_tokenizer(trained, tmp_path, capsys):
    _, run = trained  # its data manifest names no tokenizer
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--output", str(out),
                 "--extrapolation", "1", "--ppl_max_batches", "1", "--device", "cpu"]) == 0
    doc = json.loads(out.read_text())
    assert doc["tokenizer"] is None and doc["results"]["ppl"]["validation"]["1x"]["loss"] > 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--tasks", "phonebook", "--output", str(out)]) == 2
    assert "--tokenizer" in one_line_error(capsys)


# ------------------------------------------------------------------------------------------------ prepare workers
_PREPARE_SCRIPT = """
import sys, time
from archscale.data import prepare as prep, prepare_worker
_encode = prepare_worker.Tokenizer.encode_batch
def _slow_encode(self, *args, **kwargs):  # runs in the spawned workers too (they import this file)
    time.sleep(0.2)  # so the kill lands while the workers are busy, however fast the machine
    return _encode(self, *args, **kwargs)
prepare_worker.Tokenizer.encode_batch = _slow_encode
if __name__ == "__main__":
    prep.UNIT_BYTES = 1 << 15  # many small units
    prep.prepare(sys.argv[1].split(","), sys.argv[2], sys.argv[3], chunk_size=4096, num_workers=2, progress=False)
"""


def _workers_of(proc) -> list:
    return [c for c in proc.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]


def _gone(p) -> bool:
    import psutil

    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_kill_9_of_prepare_takes_its_workers_and_a_rerun_is_identical(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    rng = random.Random(0)
    words = "the of and model data token layer attention state space train loss".split()
    inputs = []
    for i in range(24):
        p = tmp_path / "in" / f"doc{i:02d}.txt"
        p.parent.mkdir(exist_ok=True)
        p.write_text(" ".join(rng.choice(words) for _ in range(12000)))
        inputs.append(str(p))
    tok = tiny_tokenizer(tmp_path)
    script = tmp_path / "prep.py"
    script.write_text(_PREPARE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, str(script), ",".join(inputs)]
    killed = tmp_path / "killed"
    parent = subprocess.Popen(cmd + [str(killed), str(tok)], env=env)
    proc = psutil.Process(parent.pid)
    deadline = time.time() + 60
    while len(_workers_of(proc)) < 2 and time.time() < deadline and parent.poll() is None:
        time.sleep(0.05)
    workers = _workers_of(proc)
    assert len(workers) == 2, "the workers never started"
    while not any(killed.glob("*.bin")) and time.time() < deadline and parent.poll() is None:
        time.sleep(0.05)  # kill once a unit is written: the run is partly done
    assert parent.poll() is None, "prepare finished before the kill; make the input bigger"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 5
    while not all(_gone(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    alive = [w.pid for w in workers if not _gone(w)]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert alive == [], "workers outlived their parent"
    # the re-run finishes the job; its shards equal an uninterrupted run's, byte for byte
    assert subprocess.run(cmd + [str(killed), str(tok)], env=env).returncode == 0
    assert subprocess.run(cmd + [str(tmp_path / "clean"), str(tok)], env=env).returncode == 0
    names = sorted(p.name for p in (tmp_path / "clean").glob("*.bin"))
    assert names and names == sorted(p.name for p in killed.glob("*.bin"))
    for n in names:
        assert (killed / n).read_bytes() == (tmp_path / "clean" / n).read_bytes(), n
    assert not list(killed.glob("*.tmp"))
