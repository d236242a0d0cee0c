"""`archscale report`: one PNG summarising eval results, one panel per task that draws one (`EvalTask.panel`,
archscale/eval/tasks/), grouped as ArchScale reports them: standard (lm-eval scores), long context (Phonebook
accuracy vs entries, RULER NIAH score vs tokens), extrapolation (validation loss vs context length) and reasoning
(`archscale reason` pass@1 and pass@K). Each results file is one series (its run name)."""

from __future__ import annotations

import json
from pathlib import Path

from archscale.errors import UserError
from archscale.eval.tasks.lm_eval import MAIN_METRICS, standard_scores  # noqa: F401 - importable here, as before
from archscale.eval.tasks.reason import reasoning_scores  # noqa: F401 - the tasks' files now hold them


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


def draw_report(paths: list[str], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archscale.eval.tasks import all_tasks

    docs = load_results(paths)
    labels: list[str] = []
    for i, d in enumerate(docs):
        labels.append(_label(d, i, labels))
    panels = sorted((t.panel for t in all_tasks() if t.panel is not None), key=lambda p: p.order)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes[0], panels):
        panel.draw(ax, docs, labels, colors)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_p, dpi=110)
    plt.close(fig)
