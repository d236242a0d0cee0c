"""Drawing helpers the tasks' report panels share (archscale/eval/tasks/*.py, `Panel.draw`)."""

from __future__ import annotations


def bars(ax, docs_scores: list[dict[str, float]], labels: list[str], colors) -> bool:
    """Grouped bars of scores in [0, 1], one colour per results file; False (nothing drawn) when there are none."""
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


def no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} results", ha="center", va="center", transform=ax.transAxes)


def by_length(result: dict) -> list[str]:
    """A per-length result's lengths ("10", "20", ...), in numeric order."""
    return sorted(result["lengths"], key=int)
