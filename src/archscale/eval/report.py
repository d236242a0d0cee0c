"""`archscale report`: one PNG summarising eval results, grouped as ArchScale reports them:
standard (lm-eval scores), long context (Phonebook accuracy vs entries, RULER NIAH score vs tokens),
extrapolation (validation loss vs context length) and reasoning (`archscale reason` pass@1 and pass@K). Each
results file is one series (its run name)."""

from __future__ import annotations

import json
from pathlib import Path

from archscale.errors import UserError

# the headline metric of an lm-eval task, in order of preference (accuracy-like, higher is better, in [0, 1])
MAIN_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc")


def load_results(paths: list[str]) -> list[dict]:
    docs = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except FileNotFoundError:
            raise UserError(f"{p}: no such file") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: not a results JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
            raise UserError(f"{p}: not an `archscale eval` results file (no 'results')")
        doc.setdefault("run_name", Path(p).stem)
        docs.append(doc)
    return docs


def _label(doc: dict, i: int, labels: list[str]) -> str:
    name = doc.get("run_name") or f"run{i}"
    if doc.get("step") is not None:
        name += f" @{doc['step']}"
    return name if name not in labels else f"{name} ({i})"


def standard_scores(doc: dict) -> dict[str, float]:
    out = {}
    for task, metrics in (doc["results"].get("lm_eval") or {}).get("tasks", {}).items():
        for m in MAIN_METRICS:
            if isinstance(metrics.get(m), (int, float)):
                out[f"{task}\n{m}"] = float(metrics[m])
                break
    return out


def reasoning_scores(doc: dict) -> dict[str, float]:
    """`archscale reason` summaries: pass@1 and pass@K (K = the samples drawn) per task."""
    out = {}
    for task, r in (doc["results"].get("reason") or {}).items():
        out[f"{task}\npass@1"] = float(r["pass@1"])
        k = max(r.get("pass@k", {}), key=int, default=None)
        if k is not None and k != "1":
            out[f"{task}\npass@{k}"] = float(r["pass@k"][k])
    return out


def _bars(ax, docs_scores: list[dict[str, float]], labels: list[str], colors) -> bool:
    import numpy as np

    names = sorted({k for s in docs_scores for k in s})
    if not names:
        return False
    width = 0.8 / len(docs_scores)
    x = np.arange(len(names))
    for i, s in enumerate(docs_scores):
        ax.bar(x + i * width - 0.4 + width / 2, [s.get(n, np.nan) for n in names], width, label=labels[i],
               color=colors[i % len(colors)])
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylim(0, 1)
    return True


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} results", ha="center", va="center", transform=ax.transAxes)


def draw_report(paths: list[str], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = load_results(paths)
    labels: list[str] = []
    for i, d in enumerate(docs):
        labels.append(_label(d, i, labels))
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5 * len(_PANELS), 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes, _PANELS):
        panel(ax, docs, labels, colors)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_p, dpi=110)
    plt.close(fig)


def _standard_panel(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    if _bars(ax, [standard_scores(d) for d in docs], labels, colors):
        ax.set_ylabel("score")
    else:
        _no_data(ax, "lm-eval")
    ax.set_title("Standard (lm-eval)")


def _phonebook_panel(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    any_pb = False
    for i, d in enumerate(docs):
        pb = d["results"].get("phonebook")
        if not pb:
            continue
        any_pb = True
        ns = sorted(pb["lengths"], key=int)
        ax.errorbar([int(n) for n in ns], [pb["lengths"][n]["mean"] for n in ns],
                    yerr=[pb["lengths"][n]["std"] for n in ns], marker="o", capsize=3, label=labels[i],
                    color=colors[i % len(colors)])
    if not any_pb:
        _no_data(ax, "phonebook")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("phonebook entries")
    ax.set_ylabel("exact match (mean ± std of 4)")
    ax.set_title("Long context: Phonebook")


def _niah_panel(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    any_niah = False
    styles = {"niah_single_1": "-", "niah_single_2": "--", "niah_single_3": ":"}
    for i, d in enumerate(docs):
        for task, ls in styles.items():
            r = d["results"].get(task)
            if not r:
                continue
            any_niah = True
            ns = sorted(r["lengths"], key=int)
            ax.plot([int(n) for n in ns], [r["lengths"][n]["score"] for n in ns], ls, marker="o",
                    color=colors[i % len(colors)], label=f"{labels[i]} {task}")
    if any_niah:
        ax.set_xscale("log", base=2)
    else:
        _no_data(ax, "NIAH")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("RULER string match")
    ax.set_title("Long context: RULER NIAH")


def _extrapolation_panel(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    any_ext = False
    for i, d in enumerate(docs):
        v = (d["results"].get("ppl") or {}).get("validation")
        if not v:
            continue
        any_ext = True
        ks = sorted((k for k in v if k.endswith("x")), key=lambda k: int(k[:-1]))
        ax.plot([v[k]["context"] for k in ks], [v[k]["loss"] for k in ks], marker="o", label=labels[i],
                color=colors[i % len(colors)])
        if d.get("train_length"):
            ax.axvline(d["train_length"], color=colors[i % len(colors)], alpha=0.3, ls="--")
    if any_ext:
        ax.set_xscale("log", base=2)
    else:
        _no_data(ax, "ppl")
    ax.set_xlabel("context (tokens); dashed: training length")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Extrapolation")


def _reasoning_panel(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    if _bars(ax, [reasoning_scores(d) for d in docs], labels, colors):
        ax.set_ylabel("accuracy")
    else:
        _no_data(ax, "reasoning")
    ax.set_title("Reasoning (archscale reason)")


_PANELS = (_standard_panel, _phonebook_panel, _niah_panel, _extrapolation_panel, _reasoning_panel)
