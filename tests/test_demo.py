"""`archscale demo`'s comparison: two architectures under one recipe, one plot, one table, reuse on a re-run."""

import dataclasses
import json

from archscale.config import ModelConfig
from archscale.demo import DEMO_DEPTH, DEMO_MODELS, DemoSettings, compare, plot_validation_curves
from archscale.models.model import non_embedding_params
from archscale.train.metrics import read_metrics

TINY_MODELS = (("Transformer++", "transformer", 8), ("SambaY", "sambay", 8))  # width 32 at depth 4
TINY = DemoSettings(ctx_len=32, micro_bsz=4, steps=6, evals=2, eval_iters=2, eta0=3e-3, hd0=8)


def test_demo_models_have_equal_non_embedding_parameters():
    """The demo's claim 'equal parameters': within 1% (measured 3,803,392 vs 3,827,760)."""
    (_, arch_a, ar_a), (_, arch_b, ar_b) = DEMO_MODELS
    n_a = non_embedding_params(ModelConfig.from_arch(arch_a, DEMO_DEPTH, ar=ar_a, vocab_size=4096))
    n_b = non_embedding_params(ModelConfig.from_arch(arch_b, DEMO_DEPTH, ar=ar_b, vocab_size=4096))
    assert abs(n_a - n_b) / n_a < 0.01, (n_a, n_b)


def test_compare_trains_both_plots_one_png_prints_both_rows_and_reuses(dataset, tmp_path, capsys):
    work = tmp_path / "demo"
    summaries, png = compare(dataset, work, TINY, models=TINY_MODELS, progress=False)
    out = capsys.readouterr().out

    assert [s.arch for s in summaries] == ["transformer", "sambay"]
    for s in summaries:
        rows = read_metrics(work / s.arch / "metrics.csv")
        vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
        assert len(vals) == 3  # step 0 + every 3 steps of 6
        assert s.final_val_loss == vals[-1]
        assert s.tokens == int(rows[-1]["tokens"]) == TINY.max_tokens == 6 * 4 * 32
        assert s.tokens_per_sec > 0 and not s.reused
        assert (work / s.arch / "demo_result.json").is_file()
    n_t, n_s = (s.params for s in summaries)
    assert n_t == non_embedding_params(ModelConfig.from_arch("transformer", DEMO_DEPTH, ar=8, vocab_size=256))
    assert n_s == non_embedding_params(ModelConfig.from_arch("sambay", DEMO_DEPTH, ar=8, vocab_size=256))

    assert png == work / "comparison.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = plot_validation_curves(summaries, tmp_path / "again.png")
    assert [c[0].split(" (")[0] for c in curves] == ["Transformer++", "SambaY"]
    assert all(xs == [0, 3 * 128, 6 * 128] for _, xs, _ in curves)

    table_rows = [row for row in map(str.split, out.splitlines()) if len(row) == 7 and row[1].endswith("_d4")]
    assert [row[:2] for row in table_rows] == [["Transformer++", "transformer_d4"], ["SambaY", "sambay_d4"]], out
    for row, s in zip(table_rows, summaries):  # params, tokens, val loss as printed
        assert row[2:5] == [f"{s.params / 1e6:.2f}M", f"{s.tokens:,}", f"{s.final_val_loss:.4f}"], row

    # A second run with the same settings reuses both runs (no training: metrics.csv untouched).
    mtimes = [(work / a / "metrics.csv").stat().st_mtime_ns for _, a, _ in TINY_MODELS]
    again, _ = compare(dataset, work, TINY, models=TINY_MODELS, progress=False)
    out = capsys.readouterr().out
    assert out.count("reusing the finished run") == 2, out
    assert [s.reused for s in again] == [True, True]
    assert [s.final_val_loss for s in again] == [s.final_val_loss for s in summaries]
    assert [(work / a / "metrics.csv").stat().st_mtime_ns for _, a, _ in TINY_MODELS] == mtimes


def test_compare_retrains_a_run_whose_settings_changed_or_that_did_not_finish(dataset, tmp_path, capsys):
    work = tmp_path / "demo"
    compare(dataset, work, TINY, models=TINY_MODELS[:1], progress=False)
    capsys.readouterr()
    longer = dataclasses.replace(TINY, steps=9)
    (summary,), _ = compare(dataset, work, longer, models=TINY_MODELS[:1], progress=False)
    out = capsys.readouterr().out
    assert "removing" in out and "reusing" not in out
    assert summary.tokens == 9 * 4 * 32 and not summary.reused
    saved = json.loads((work / "transformer" / "demo_result.json").read_text())
    assert saved["settings"]["max_tokens"] == 9 * 4 * 32

    (work / "transformer" / "demo_result.json").unlink()  # as after an interrupted run
    compare(dataset, work, longer, models=TINY_MODELS[:1], progress=False)
    assert "removing" in capsys.readouterr().out
