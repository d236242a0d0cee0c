"""Progress of the long commands (archscale.progress): a rich bar on a terminal, one line per stage when the
stream is not a terminal, nothing under --progress false. Checked on the helper itself and on export, quantize,
reason, bench-serve and sweep (eval: tests/test_eval_progress.py)."""

import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from archscale.cli import main
from archscale.progress import Progress, parse_bool
from serving_fixtures import make_run, running_server, tiny_model, tiny_tokenizer

DATA = Path(__file__).parent / "data" / "reason"


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_the_helper_draws_on_a_terminal_writes_a_line_otherwise_and_is_quiet_when_asked():
    tty, log, quiet = FakeTTY(), io.StringIO(), io.StringIO()
    for stream, show in ((tty, True), (log, True), (quiet, False)):
        p = Progress(show=show, stream=stream)
        with p.stage("phonebook 20 entries", total=3, unit="samples") as bar:
            for _ in range(3):
                bar.advance()
        with p.stage("export: writing out/"):
            pass
        with p.stage("export: loading run/", log=False):  # drawn on a terminal only
            pass
    assert log.getvalue() == "phonebook 20 entries: 3 samples ...\nexport: writing out/ ...\n"
    assert quiet.getvalue() == ""
    drawn = tty.getvalue()
    assert "\x1b[" in drawn and "3/3" in drawn and "samples" in drawn and "..." not in drawn
    assert "export: loading run/" in drawn
    assert Progress(stream=tty).live and not Progress(stream=log).live and not Progress(False, tty).live
    assert parse_bool("false") is False and parse_bool("True") is True
    with pytest.raises(Exception):
        parse_bool("maybe")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("progressrun"))


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_export_and_quantize_name_their_stages(run_dir, tmp_path, capsys, monkeypatch, command):
    extra = ["--method", "int8-weight"] if command == "quantize" else []
    assert main([command, "--checkpoint", str(run_dir), "--out", str(tmp_path / "a"), *extra]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[1].split()[0] for ln in lines if ln.startswith(f"{command}:")] == (
        ["converting", "writing"] if command == "export" else ["int8-weight", "writing"])  # loading: no line, so
    # a refused checkpoint stays a one-line error (tests/test_trust.py); a terminal still shows its bar
    assert main([command, "--checkpoint", str(run_dir), "--out", str(tmp_path / "b"), *extra,
                 "--progress", "false"]) == 0
    assert capsys.readouterr().err == ""
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main([command, "--checkpoint", str(run_dir), "--out", str(tmp_path / "c"), *extra]) == 0
    assert "\x1b[" in tty.getvalue() and f"{command}: loading" in tty.getvalue()
    assert f"{command}: writing" in tty.getvalue()


def test_reason_and_bench_serve_show_samples_done_and_time_left(tmp_path, capsys, monkeypatch):
    tok = tiny_tokenizer(tmp_path)
    model = tiny_model("transformer", tok.vocab_size)
    runs = iter(range(3))  # a fresh --output each time: a rerun on the same one resumes, sampling nothing
    reason = lambda: ["reason", "--task", "gsm8k", "--data", str(DATA / "gsm8k.jsonl"), "--samples", "2",  # noqa: E731
                      "--max_tokens", "2", "--output", str(tmp_path / f"r{next(runs)}.json")]
    bench = ["bench-serve", "--concurrency", "2", "--duration", "0.6", "--max_tokens", "2"]
    with running_server(model, tok, max_model_len=256) as (url, _):
        assert main([*reason(), "--endpoint", url]) == 0
        assert main([*bench, "--url", url]) == 0
        err = capsys.readouterr().err.splitlines()
        assert "reason gsm8k: 8 samples ..." in err and "bench-serve tiny: 1 s ..." in err, err
        assert main([*reason(), "--endpoint", url, "--progress", "false"]) == 0
        assert main([*bench, "--url", url, "--progress", "false"]) == 0
        assert capsys.readouterr().err == ""
        tty = FakeTTY()
        monkeypatch.setattr(sys, "stderr", tty)
        assert main([*reason(), "--endpoint", url]) == 0
        assert main([*bench, "--url", url]) == 0
    drawn = tty.getvalue()
    assert "8/8" in drawn.split("reason gsm8k")[-1] and "left" in drawn.split("bench-serve tiny")[-1]


def test_sweep_shows_runs_done_and_the_running_ones_step(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "fake.py"  # a stand-in for pretrain: logs step 7 in its run dir, then finishes
    fake.write_text("import sys, time, pathlib\nargs = dict(a[2:].split('=', 1) for a in sys.argv[1:])\n"
                    "d = pathlib.Path(args['out_dir']); d.mkdir(parents=True, exist_ok=True)\n"
                    "(d / 'metrics.csv').write_text('step,tokens\\n7,70\\n')\ntime.sleep(1.0)\n")
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"out_dir": str(tmp_path / "study"), "command": f"{sys.executable} {fake}",
                                     "runs": [{"name": "a"}, {"name": "b"}], "base": {"depth": 1}}))
    assert main(["sweep", str(study), "--resume", "none"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"sweep s: 2 runs ..." in err, err
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    study.write_text(study.read_text().replace(str(tmp_path / "study"), str(tmp_path / "again")))
    assert main(["sweep", str(study)]) == 0
    drawn = tty.getvalue()
    assert "2/2" in drawn and "a step 7" in drawn and "runs" in drawn
    monkeypatch.undo()
    study.write_text(study.read_text().replace(str(tmp_path / "again"), str(tmp_path / "quiet")))
    assert main(["sweep", str(study), "--progress", "false"]) == 0
    assert capsys.readouterr().err == ""


def test_prepare_reports_off_a_terminal_and_is_quiet_with_progress_false(tmp_path, capsys):
    tiny_tokenizer(tmp_path)
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document number {i} " * 20)
    argv = ["prepare", "--input", str(tmp_path / "in"), "--tokenizer", str(tmp_path / "tok.json"), "--num_workers", "0"]
    assert main([*argv, "--output_dir", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().err.startswith("prepare: ")
    assert main([*argv, "--output_dir", str(tmp_path / "b"), "--progress", "false"]) == 0
    assert capsys.readouterr().err == ""
