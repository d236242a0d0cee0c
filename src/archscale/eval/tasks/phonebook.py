"""`phonebook`: retrieval of a number from a list of names and numbers (archscale/eval/phonebook.py); the report's
"Long context: Phonebook" panel."""

from __future__ import annotations

from archscale.cli_types import positive_int
from archscale.eval.tasks.base import EvalTask, Option, Panel, RunContext

OPTIONS = (
    Option("min_eval_len", type=positive_int, protocol={"native": 10, "archscale": 480}, quick=10,
           help="fewest phonebook entries (native 10, archscale 480)"),
    Option("max_eval_len", type=positive_int, protocol={"native": 40, "archscale": 480}, quick=20,
           help="most phonebook entries (native 40, archscale 480)"),
    Option("eval_len_step", type=positive_int, protocol={"native": 10, "archscale": 1}, quick=10,
           help="entries between swept lengths (native 10)"),
    Option("eval_num_batches", type=positive_int, protocol={"native": 4, "archscale": 32}, quick=4,
           help="batches per length, split over 4 measurements (native 4, archscale 32)"),
    Option("phonebook_batch_size", type=positive_int, protocol={"native": 10, "archscale": 4}, quick=1,
           help="samples per seeded batch (native 10, archscale 4)"),
    Option("phonebook_style", choices=("native", "archscale"), protocol={"native": "native", "archscale": "archscale"},
           help="books and scoring: ours (distinct offline names, lenient) or ArchScale's (the names package, "
                "strict)"),
)


def settle(st: dict, run) -> list[tuple[str, str]]:
    st["phonebook_names"] = "names" if st["phonebook_style"] == "archscale" else "offline"
    if "phonebook" in run.needs and st["phonebook_names"] == "names" and not run.available("names"):
        st["phonebook_names"] = "offline"
        return [("names", "Phonebook books use archscale's offline name lists, not ArchScale's")]
    return []


def plan(ctx: RunContext, name: str, items: list[str]) -> dict:
    from archscale.eval.phonebook import MAX_NEW_TOKENS, lengths_from, plan_phonebook, prompts_of

    st = ctx.settings
    p = plan_phonebook(lengths_from(st["min_eval_len"], st["max_eval_len"], st["eval_len_step"]), ctx.args.seed,
                       st["eval_num_batches"], st["phonebook_batch_size"], st["phonebook_style"],
                       st["phonebook_names"])
    ctx.gen.check(prompts_of(p), MAX_NEW_TOKENS, "phonebook")
    return p


def run(ctx: RunContext, name: str, p: dict) -> dict:
    from archscale.eval.phonebook import evaluate_phonebook

    return evaluate_phonebook(ctx.gen, [], plan=p, stage=ctx.progress.stage, on_length=ctx.on_length(name))


def plan_row(ctx: RunContext, name: str, p: dict, speed) -> tuple[str, float | None]:
    from archscale.eval.estimate import generation_seconds
    from archscale.eval.phonebook import MAX_NEW_TOKENS

    per = {n: [s["prompt"] for m in p["samples"][n] for s in m] for n in p["lengths"]}
    secs = sum(generation_seconds(ctx.em, [len(ctx.gen.encode(x)) for x in v], MAX_NEW_TOKENS, ctx.args.batch_size,
                                  speed) for v in per.values()) if speed else None
    counts = sorted({len(v) for v in per.values()})
    return (f"{', '.join(map(str, p['lengths']))} entries: {'/'.join(map(str, counts))} samples per length, "
            f"{MAX_NEW_TOKENS} new tokens each", secs)


def summary(results: dict) -> list[str]:
    if "phonebook" not in results:
        return []
    return ["phonebook: " + ", ".join(f"{n} entries {v['mean']:.2f}±{v['std']:.2f}"
                                      for n, v in results["phonebook"]["lengths"].items())]


def draw(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    from archscale.eval.panels import by_length, no_data

    any_pb = False
    for i, d in enumerate(docs):
        pb = d["results"].get("phonebook")
        if not pb:
            continue
        any_pb = True
        ns = by_length(pb)
        ax.errorbar([int(n) for n in ns], [pb["lengths"][n]["mean"] for n in ns],
                    yerr=[pb["lengths"][n]["std"] for n in ns], marker="o", capsize=3, label=labels[i],
                    color=colors[i % len(colors)])
    if not any_pb:
        no_data(ax, "phonebook")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("phonebook entries")
    ax.set_ylabel("exact match (mean ± std of 4)")
    ax.set_title("Long context: Phonebook")


TASK = EvalTask(
    names=("phonebook",), example="phonebook", about="phonebook", order=20, options=OPTIONS, settle=settle,
    plan=plan, run=run, plan_row=plan_row, uses_speed=True, summary=summary, panel=Panel(draw, order=20),
    quick_help="Phonebook 10 and 20 entries, 4 samples each",
)
