"""`ppl`: validation loss at 1x..kx the training length (length extrapolation) and sliding-window perplexity of
--ppl_file (archscale/eval/ppl.py); the report's "Extrapolation" panel."""

from __future__ import annotations

from archscale.cli_types import positive_int, positive_int_list
from archscale.errors import UserError
from archscale.eval.tasks.base import EvalTask, Option, Panel, RunContext

OPTIONS = (
    Option("extrapolation", type=positive_int_list, protocol={"native": "1,2,4", "archscale": None}, quick="1,2",
           help="context multiples of the training length (native: 1,2,4; archscale: 1,2,3,4 at training "
                "length 4096, else 1,2)"),
    Option("ppl_selection", choices=("all", "archscale"), protocol={"native": "all", "archscale": "archscale"},
           help="validation samples: every block in file order (native) or ArchScale's 200 (archscale)"),
    Option("val_data_dir", help="override the run's validation shards folder"),
    Option("ppl_max_batches", type=positive_int, protocol={"native": None, "archscale": None}, quick=4,
           help="cap on validation batches (default: all)"),
    Option("ppl_file", help="UTF-8 text file for sliding-window perplexity"),
    Option("window", type=positive_int, help="sliding window in tokens (default: training length)"),
    Option("stride", type=positive_int, help="tokens between window starts (default: window // 2)"),
)


def factors_label(factors: list[int]) -> str:
    return ",".join(f"{k}x" for k in factors)


def settle(st: dict, run) -> list:
    from archscale.eval.ppl import archscale_factors

    if st["extrapolation"] is None:
        st["extrapolation"] = ",".join(str(k) for k in archscale_factors(run.train_len, run.varlen))
    return []


def plan(ctx: RunContext, name: str, items: list[str]) -> dict:
    from archscale.eval.loading import validation_dir
    from archscale.eval.ppl import count_validation_samples

    args, st, T, limit, why = ctx.args, ctx.settings, ctx.em.train_len, ctx.gen.limit, ctx.gen.limit_why
    factors = sorted({int(x) for x in str(st["extrapolation"]).split(",") if x.strip()})
    if not factors or factors[0] < 1:
        raise UserError(f"--extrapolation needs positive integers, got {st['extrapolation']!r}")
    if factors[-1] * T > limit:
        raise UserError(f"--extrapolation {factors[-1]}x = {factors[-1] * T} tokens is longer than the {limit} "
                        f"tokens allowed ({why}); raise --max_length")
    window = args.window or T
    if args.ppl_file and window > limit:
        raise UserError(f"--window {window} is longer than the {limit} tokens allowed ({why})")
    val_dir = validation_dir(ctx.em, args.val_data_dir)
    samples = count_validation_samples(val_dir, factors[-1] * T + 1, args.batch_size, st["ppl_max_batches"],
                                       st["ppl_selection"])
    return {"factors": factors, "window": window, "val_dir": val_dir, "samples": samples}


def run(ctx: RunContext, name: str, p: dict) -> dict:
    from archscale.eval.ppl import sliding_window_ppl, validation_extrapolation

    args, st, em = ctx.args, ctx.settings, ctx.em
    with ctx.progress.stage(f"ppl {factors_label(p['factors'])}", p["samples"], "samples") as bar:
        r = {"validation": validation_extrapolation(em, p["val_dir"], p["factors"], args.batch_size,
                                                    st["ppl_max_batches"], st["ppl_selection"], on_batch=bar.advance),
             "val_data_dir": str(p["val_dir"])}
    if args.ppl_file:
        stride = args.stride or max(1, p["window"] // 2)
        with ctx.progress.stage(f"ppl {args.ppl_file}"):
            r["file"] = sliding_window_ppl(em, args.ppl_file, p["window"], stride, args.batch_size)
    return r


def plan_row(ctx: RunContext, name: str, p: dict, speed) -> tuple[str, float | None]:
    length = p["factors"][-1] * ctx.em.train_len
    secs = p["samples"] * length * ctx.em.model.flops_per_token(length, training=False) / speed[0] if speed else None
    return f"{factors_label(p['factors'])}: {p['samples']} samples of {length} tokens", secs


def summary(results: dict) -> list[str]:
    if "ppl" not in results:
        return []
    v = results["ppl"]["validation"]
    lines = ["ppl: " + ", ".join(f"val_loss@{k} {v[k]['loss']:.3f} (ppl {v[k]['ppl']:.1f})"
                                 for k in v if k.endswith("x"))]
    if "file" in results["ppl"]:
        f = results["ppl"]["file"]
        lines.append(f"ppl file: loss {f['loss']:.3f}, ppl {f['ppl']:.1f}, {f['bits_per_byte']:.3f} bits/byte")
    return lines


def draw(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    from archscale.eval.panels import no_data

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
        no_data(ax, "ppl")
    ax.set_xlabel("context (tokens); dashed: training length")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Extrapolation")


TASK = EvalTask(
    names=("ppl",), example="ppl", order=10, options=OPTIONS, settle=settle, plan=plan, run=run, plan_row=plan_row,
    uses_speed=True, summary=summary, panel=Panel(draw, order=40), quick_help="ppl 1x,2x on 4 batches",
    about="ppl (validation loss at 1x..kx the training length, and sliding-window perplexity of --ppl_file)",
    needs_tokenizer=lambda args: bool(args.ppl_file),  # validation shards are token ids: foreign ones have none
)
