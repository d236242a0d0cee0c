"""The command lines at their extremes: every bad value of a flag is one line on stderr and exit 2 (never a
traceback, never silently replaced), a refused `pretrain` leaves nothing in a new run dir, `serve` on a busy port
fails before announcing itself, a resume with another --curriculum is refused, and the exit codes mean one thing
each (README, "Exit codes")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from archscale.cli import main

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys, *words: str) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_exit_codes_are_named_once():
    from archscale import errors

    assert (errors.EXIT_OK, errors.EXIT_BAD_INPUT, errors.EXIT_NON_FINITE, errors.EXIT_INTERRUPTED) == (0, 2, 3, 130)
    assert errors.UserError.exit_code == errors.EXIT_BAD_INPUT and errors.NonFiniteError.exit_code == 3
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Exit codes"):]
    for code in ("`0`", "`1`", "`2`", "`3`", "`130`"):
        assert code in table.split("\n## ")[0], code


# ---------------------------------------------------------------------------------------------- bench-serve
@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1:9", "127.0.0.1:8000", "http://", "not a url"])
def test_bench_serve_bad_url_is_one_line(capsys, url):
    assert main(["bench-serve", "--url", url, "--duration", "0.1"]) == 2
    one_error_line(capsys, "--url")


def test_bench_serve_non_utf8_prompts_is_one_line(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--prompts", str(p), "--model", "m"]) == 2
    one_error_line(capsys, "p.txt", "UTF-8")


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--duration", "nan"), ("--duration", "-1"),
                                         ("--max_tokens", "1.5"), ("--temperature", "inf")])
def test_bench_serve_bad_numbers_are_one_line(capsys, flag, value):
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", flag, value]) == 2
    one_error_line(capsys, flag)


# -------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("size", ["abc", "-5GB", "0", "5XB"])
def test_export_bad_max_shard_size_is_one_line(tiny_runs, tmp_path, capsys, size):
    out = tmp_path / "o"
    assert main(["export", "--checkpoint", str(tiny_runs["transformer"]), "--out", str(out),
                 f"--max_shard_size={size}"]) == 2
    one_error_line(capsys, "--max_shard_size")
    assert not out.exists()


# ------------------------------------------------------------------------------------------ eval / lm_eval
@pytest.mark.parametrize("flag, value", [("--extrapolation", "abc"), ("--extrapolation", "0"),
                                         ("--extrapolation", "1,-2"), ("--stride", "0"), ("--stride", "-4"),
                                         ("--window", "0"), ("--max_length", "0"), ("--batch_size", "0"),
                                         ("--ppl_max_batches", "0"), ("--max_seq_lengths", "4k"),
                                         ("--lm_eval_limit", "nan"), ("--num_fewshot", "-1"),
                                         ("--min_eval_len", "0")])
def test_eval_bad_values_are_one_line(tiny_runs, tmp_path, capsys, flag, value):
    assert main(["eval", "--checkpoint", str(tiny_runs["transformer"]), "--tasks", "ppl", "--output",
                 str(tmp_path / "e.json"), flag, value]) == 2
    one_error_line(capsys, flag)
    assert not (tmp_path / "e.json").exists()


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval indexes only --include_path (as in test_lm_eval_cli.py: its built-in index is slow and offline-
    hostile)."""
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__

    def without_builtins(self, *args, **kwargs):
        kwargs["include_defaults"] = False
        init(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", without_builtins)


@pytest.mark.usefixtures("local_tasks_only")
@pytest.mark.parametrize("model_args, words", [(",max_length=abc", ("max_length",)),
                                               (",max_length=1.5", ("max_length",)),
                                               (",max_length=0", ("max_length",)),
                                               (",max_gen_toks=many", ("max_gen_toks",))])
def test_lm_eval_bad_model_args_are_one_line(tiny_runs, capsys, model_args, words):
    assert main(["lm_eval", "--model", "archscale", "--model_args", f"pretrained={tiny_runs['transformer']}"
                 + model_args, "--tasks", "archscale_mc", "--include_path", str(ROOT / "examples" / "lm_eval_tasks"),
                 "--limit", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and all(w in err[0] for w in words), err


@pytest.mark.usefixtures("local_tasks_only")
def test_lm_eval_unknown_task_is_one_line(tiny_runs, capsys):
    assert main(["lm_eval", "--model", "archscale", "--model_args", f"pretrained={tiny_runs['transformer']}",
                 "--tasks", "no_such_task_anywhere", "--include_path", str(ROOT / "examples" / "lm_eval_tasks"),
                 "--limit", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "no_such_task_anywhere" in err[0], err


# ------------------------------------------------------------------------------------------------ pretrain
@pytest.fixture(scope="module")
def data_dir(tiny_runs):
    return tiny_runs["transformer"].parent / "data"


def pretrain_argv(data_dir, out, *extra):
    return ["pretrain", "--train_data_dir", str(data_dir), "--train_model", "transformer", "--depth", "1",
            "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "256",
            "--base_hps.warmup_tokens0", "128", "--eval_iters", "1", "--eval_interval", "100", "--vocab_size", "320",
            "--out_dir", str(out), "--progress", "false", "--precision", "fp32", *extra]


@pytest.mark.parametrize("flag", ["--val_data_dir", "--train_data_dir"])
def test_refused_pretrain_leaves_no_trace_in_a_new_run_dir(data_dir, tmp_path, capsys, flag):
    """A data folder with no shards is refused while the run is being set up (after the run dir was locked and
    its config.yaml written, on the code before): the new run dir keeps neither."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "new_run"
    assert main(pretrain_argv(data_dir, out, "--resume", "none", flag, str(tmp_path / "empty"))) == 2
    one_error_line(capsys, "empty")
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not {".lock", "config.yaml"} & set(left), left


def test_resume_with_another_curriculum_is_refused(data_dir, tmp_path, capsys):
    """The curriculum decides each step's sequence length (the data order): a resumed run must keep it."""
    out = tmp_path / "run"
    assert main(pretrain_argv(data_dir, out, "--resume", "none", "--max_tokens", "128")) == 0
    config = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert main(pretrain_argv(data_dir, out, "--curriculum", "seqlen:start=16,steps=2")) == 2
    one_error_line(capsys, "--curriculum", "none")
    assert (out / "config.yaml").read_text() == config  # not rewritten


# --------------------------------------------------------------------------------------------------- serve
def test_serve_on_a_busy_port_is_one_line_exit_2(tiny_runs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        r = subprocess.run([sys.executable, "-m", "archscale.cli", "serve", "--checkpoint",
                            str(tiny_runs["transformer"]), "--port", str(port)], env=env, capture_output=True,
                           text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and str(port) in lines[0], lines
    assert "serving" not in r.stderr


@pytest.mark.parametrize("flag, value", [("--port", "70000"), ("--port", "http"), ("--max_queue", "0"),
                                         ("--max_batch", "-1")])
def test_serve_bad_numbers_are_one_line(capsys, flag, value):
    assert main(["serve", "--checkpoint", "nowhere", flag, value]) == 2
    one_error_line(capsys, flag)
