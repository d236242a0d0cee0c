"""`niah_single_1`, `niah_single_2`, `niah_single_3`: RULER's needle in a haystack (archscale/eval/niah.py); the
report's "Long context: RULER NIAH" panel."""

from __future__ import annotations

from archscale.cli_types import positive_int, positive_int_list
from archscale.eval.tasks.base import EvalTask, Option, Panel, RunContext

NAMES = ("niah_single_1", "niah_single_2", "niah_single_3")
OPTIONS = (
    Option("max_seq_lengths", type=positive_int_list, protocol={"native": None, "archscale": "4096"}, quick=None,
           help="comma-separated token lengths (native: the training length; archscale: 4096)"),
    Option("niah_samples", type=positive_int, protocol={"native": 100, "archscale": 500}, quick=2,
           help="samples per length (native 100; RULER 500)"),
    Option("niah_keys", choices=("offline", "wonderwords"), protocol={"native": "offline", "archscale": "wonderwords"},
           help="needle key vocabulary: our word lists or RULER's (the wonderwords package)"),
    Option("haystack_file", help="essay haystack text (default: Milton's Areopagitica)"),
)


def settle(st: dict, run) -> list[tuple[str, str]]:
    if st["max_seq_lengths"] is None:
        st["max_seq_lengths"] = str(run.train_len)
    if set(NAMES) & run.needs and st["niah_keys"] == "wonderwords" and not run.available("wonderwords"):
        st["niah_keys"] = "offline"
        return [("wonderwords", "NIAH keys come from archscale's offline word lists, not RULER's")]
    return []


def plan(ctx: RunContext, name: str, items: list[str]) -> dict:
    from archscale.eval.niah import TOKENS_TO_GENERATE, plan_niah

    st, gen = ctx.settings, ctx.gen
    lengths = [int(x) for x in str(st["max_seq_lengths"]).split(",") if x.strip()]
    p = plan_niah(name, lengths, st["niah_samples"], lambda s: len(gen.encode(s)), ctx.args.seed,
                  ctx.args.haystack_file, keys=st["niah_keys"])
    gen.check([s["prompt"] for v in p.values() for s in v], TOKENS_TO_GENERATE, name)
    return p


def run(ctx: RunContext, name: str, p: dict) -> dict:
    from archscale.eval.niah import evaluate_niah

    return evaluate_niah(name, ctx.gen, [], 0, None, ctx.args.seed, ctx.args.haystack_file, plan=p,
                         stage=ctx.progress.stage, on_length=ctx.on_length(name))


def plan_row(ctx: RunContext, name: str, p: dict, speed) -> tuple[str, float | None]:
    from archscale.eval.estimate import generation_seconds
    from archscale.eval.niah import TOKENS_TO_GENERATE

    secs = sum(generation_seconds(ctx.em, [s["length"] - TOKENS_TO_GENERATE for s in v], TOKENS_TO_GENERATE,
                                  ctx.args.batch_size, speed) for v in p.values()) if speed else None
    counts = sorted({len(v) for v in p.values()})
    return (f"{', '.join(map(str, p))} tokens: {'/'.join(map(str, counts))} samples per length, "
            f"{TOKENS_TO_GENERATE} new tokens each", secs)


def summary(results: dict) -> list[str]:
    return [f"{t}: " + ", ".join(f"{n} tokens {v['score']:.2f}" for n, v in results[t]["lengths"].items())
            for t in NAMES if t in results]


def draw(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    from archscale.eval.panels import by_length, no_data

    any_niah = False
    for i, d in enumerate(docs):
        for task, ls in zip(NAMES, ("-", "--", ":")):
            r = d["results"].get(task)
            if not r:
                continue
            any_niah = True
            ns = by_length(r)
            ax.plot([int(n) for n in ns], [r["lengths"][n]["score"] for n in ns], ls, marker="o",
                    color=colors[i % len(colors)], label=f"{labels[i]} {task}")
    if any_niah:
        ax.set_xscale("log", base=2)
    else:
        no_data(ax, "NIAH")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("RULER string match")
    ax.set_title("Long context: RULER NIAH")


TASK = EvalTask(
    names=NAMES, group="niah", example="niah_single_1", about="niah_single_1, niah_single_2, niah_single_3 (RULER)",
    order=30, options=OPTIONS, settle=settle, plan=plan, run=run, plan_row=plan_row, uses_speed=True,
    summary=summary, panel=Panel(draw, order=30), quick_help="NIAH 2 samples at the training length",
)
