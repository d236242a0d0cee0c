"""Loggers fan-out (metrics.csv, TensorBoard events, W&B offline runs) read back, and the system monitor."""

import csv
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from archscale.errors import UserError
from archscale.train.loggers import Loggers, SystemMonitor, parse_logger_names, seed_wandb_config

ROWS = [dict(step=0, tokens=0, val_loss=5.0),
        dict(step=10, tokens=2560, train_loss=4.0, lr=1e-3, grad_norm=0.5, tokens_per_sec=1000.0, mfu=0.01,
             lr_matrix=5e-4, lr_vector=1e-3),
        dict(step=20, tokens=5120, train_loss=3.0, val_loss=3.5, lr=5e-4, grad_norm=0.25, tokens_per_sec=1200.0,
             mfu=0.012, lr_matrix=2.5e-4, lr_vector=5e-4)]


def test_csv_and_tensorboard_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = Loggers(tmp_path, "csv,tensorboard")
    for r in ROWS:
        log.write(**r)
    log.log_system({"system/cpu_percent": 42.0, "system/ram_percent": 10.0})
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "tokens", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "mfu"]
    assert [r["train_loss"] for r in rows] == ["", "4", "3"] and rows[2]["val_loss"] == "3.5"
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in ea.Scalars(tag)]  # noqa: E731
    assert scalars("train/loss") == [(10, 4.0), (20, 3.0)]
    assert scalars("val/loss") == [(0, 5.0), (20, 3.5)]
    assert [s for s, _ in scalars("val/ppl")] == [0, 20]
    assert scalars("val/ppl")[1][1] == pytest.approx(math.exp(3.5), rel=1e-6)
    assert scalars("train/lr_matrix") == [(10, pytest.approx(5e-4)), (20, pytest.approx(2.5e-4))]  # float32
    assert scalars("perf/tokens_per_sec")[-1] == (20, 1200.0)
    assert scalars("train/grad_norm")[0] == (10, 0.5)
    assert scalars("system/cpu_percent") == [(20, 42.0)]
    assert "memory/rss_gb" in ea.Tags()["scalars"]
    sysrows = list(csv.DictReader(open(tmp_path / "system.csv")))
    assert sysrows[0]["step"] == "20" and float(sysrows[0]["system/cpu_percent"]) == 42.0


def test_tensorboard_resume_purges_steps_past_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = Loggers(tmp_path, "tensorboard")
    for step in (10, 20, 30):
        log.write(step=step, train_loss=float(step))
    log.close()
    time.sleep(1.1)  # a new event file (its name carries the time in seconds)
    log = Loggers(tmp_path, "tensorboard", resume_step=20)  # resumed from the step-20 checkpoint
    log.write(step=30, train_loss=99.0)
    log.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(10, 10.0), (20, 20.0), (30, 99.0)]


def read_wandb_records(path: Path):
    """Records of a W&B `.wandb` file: a 7-byte header (':W&B', magic, version), then LevelDB-log-format
    blocks of 32 KiB holding length-prefixed protobuf `Record`s (full / first / middle / last chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind == 2 else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")

    class Cfg:  # PretrainConfig-like
        train_model, depth, ctx_len, max_tokens, train_name, parametrization = "sambay", 8, 4096, 1e11, \
            "scaling_mup", "mup++"

        class base_hps:
            eta0, b0 = 4e-4, 2097152

    config, tags = seed_wandb_config(Cfg())
    log = Loggers(tmp_path, "csv,wandb", config=config, tags=tags, run_name="sambay_d8")
    assert log.wandb.mode == "offline"
    for r in ROWS:
        log.write(**r)
    log.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.time() + 30  # wandb-core may still be flushing the file after finish() returns
    while True:
        records = read_wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            break
        time.sleep(0.2)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert list(run.tags) == ["sambay", "depth_8", "scaling_mup"] and run.display_name == "sambay_d8"
    cfg = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert cfg["model_architecture"] == "sambay" and cfg["scaling_method"] == "muP++"
    assert cfg["learning_rate"] == 4e-4 and cfg["batch_size"] == 2097152 and cfg["context_length"] == 4096
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    by_step = {h["_step"]: h for h in history}
    assert by_step[20]["train/loss"] == 3.0 and by_step[20]["val/loss"] == 3.5
    assert by_step[20]["val/ppl"] == pytest.approx(math.exp(3.5))
    assert by_step[10]["train/lr_vector"] == 1e-3 and by_step[10]["perf/mfu"] == 0.01
    assert by_step[0]["val/loss"] == 5.0 and "train/loss" not in by_step[0]


def test_system_monitor_samples_into_system_csv(tmp_path):
    import psutil

    samples = []
    mon = SystemMonitor(samples.append, interval=0.05).start()
    time.sleep(0.4)
    mon.stop()
    assert len(samples) >= 2
    s = samples[-1]
    assert 0.0 <= s["system/cpu_percent"] <= 100.0 and 0 < s["system/ram_percent"] < 100
    assert s["system/ram_total_gb"] == pytest.approx(psutil.virtual_memory().total / 1024 ** 3)
    assert s["system/process_rss_gb"] > 0
    # into Loggers: a system.csv row per sample; the console only when asked
    log = Loggers(tmp_path, "csv")
    log.write(step=5, train_loss=1.0)
    lines = []
    SystemMonitor(log, interval=1, console=lines.append).sample()
    log.close()
    assert lines and lines[0].startswith("[system] CPU")
    rows = list(csv.DictReader(open(tmp_path / "system.csv")))
    assert len(rows) == 1 and rows[0]["step"] == "5" and float(rows[0]["system/ram_percent"]) > 0


def test_system_monitor_is_quiet_and_logs_one_tensorboard_point_per_step(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = Loggers(tmp_path, "csv,tensorboard")
    mon = SystemMonitor(log, interval=1)  # no console
    for step in (1, 2, 3):
        log.write(step=step, train_loss=1.0)
        for _ in range(4):  # a monitor faster than the steps
            mon.sample()
    log.close()
    assert capsys.readouterr().out == ""
    assert len(list(csv.DictReader(open(tmp_path / "system.csv")))) == 12  # every sample, with its time
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("system/cpu_percent")] == [1, 2, 3]  # not more points than steps


def test_pretrain_keeps_the_monitor_off_the_console(dataset, tmp_path, capsys):
    from archscale.cli import main
    from tests.test_train import args

    run = tmp_path / "run"
    assert main(args(dataset, run, "--resume", "none", "--max_steps", "3", "--monitor_interval", "0.01")) == 0
    out = capsys.readouterr().out
    assert "[system]" not in out
    assert len(list(csv.DictReader(open(run / "system.csv")))) >= 1


def test_bad_logger_names_and_missing_packages(tmp_path, monkeypatch):
    assert parse_logger_names("csv, TensorBoard,csv") == ["csv", "tensorboard"]
    with pytest.raises(UserError, match="unknown logger"):
        parse_logger_names("csv,mlflow")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"pip install 'archscale\[wandb\]'"):
        Loggers(tmp_path, "wandb")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match=r"archscale\[tensorboard\]"):
        Loggers(tmp_path, "tensorboard")
    with pytest.raises(UserError, match="monitor_interval"):
        SystemMonitor(lambda m: None, interval=0)
