"""`pretrain --dry_run` prints a table rendered from `dry_run_summary`; `--dry_run --json` prints that dict."""

import json

from archscale.cli import main
from archscale.train.dry_run_table import SECTIONS, render_dry_run

ARGV = ["pretrain", "--train_model", "sambay", "--depth", "8", "--vocab_size", "32000", "--ctx_len", "1024",
        "--train_name", "scaling_mup", "--max_tokens", "2e8", "--train_data_dir", "/nonexistent", "--dry_run"]


def test_dry_run_is_a_table_of_the_same_numbers_as_the_json(capsys):
    assert main(ARGV + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(ARGV) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("pretrain plan") and "--json" in lines[0]
    for title in ("run", "model", "parameters", "tokens and steps", "learning rate", "parametrization"):
        assert title in lines, title
    row = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines if ln.startswith("  ") and not ln.startswith("  -")}
    assert row["model"] == "sambay_d8" and row["parametrization"] == "mup++"
    assert row["optimizer_steps"] == f"{plan['optimizer_steps']:,}"
    assert row["n_params_non_embedding"].startswith(f"{plan['n_params_non_embedding']:,} (")
    assert row["lr_matrix"] == f"{plan['lr_matrix']:.4g}" and row["batch_tokens"] == f"{plan['batch_tokens']:,}"
    known = {k for _, keys in SECTIONS for k in keys}
    later = {"grad_compression", "memory", "step_time", "layout", "n_params_law_source"}  # added by later work
    assert set(plan) - known <= {"notes"} | later  # every other key has its place
    assert all(k in row for k in later)  # shown under "more"


def test_keys_the_printer_does_not_know_are_still_shown():
    summary = {"model": "transformer_d2", "n_params": 1_234_567, "notes": ["a note"],
               "memory": {"params_gib": 0.5, "activations_gib": 1.25}, "step_time": 0.0123, "layout": "A,A,M"}
    text = render_dry_run(summary)
    lines = text.splitlines()
    more = lines.index("more")
    assert lines[more + 1:more + 4] == ["  memory                          params_gib=0.5, activations_gib=1.25",
                                        "  step_time                       0.0123",
                                        "  layout                          A,A,M"]
    assert "  n_params                        1,234,567 (1.23M)" in lines and "  - a note" in lines
