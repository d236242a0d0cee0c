"""Flags of `archscale eval` and `archscale report` (registered in archscale.cli)."""

from __future__ import annotations

import argparse

from archscale.cli_types import nonnegative_int, positive_float, positive_int, positive_int_list, seed_int
from archscale.errors import UserError
from archscale.progress import add_progress_flag


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, like every other UserError
        raise UserError(f"{self.prog}: {message}")


def eval_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="archscale eval", description=(
        "Evaluate a checkpoint. Tasks: ppl (validation loss at 1x..kx the training length, and sliding-window "
        "perplexity of --ppl_file), phonebook, niah_single_1, niah_single_2, niah_single_3 (RULER), "
        "lm_eval:TASK[,TASK...] (lm-evaluation-harness). See docs/EVALUATION.md."))
    p.add_argument("--checkpoint", required=True, help="run dir (latest complete checkpoint) or checkpoints/step-*")
    p.add_argument("--tasks", required=True, help="comma-separated, e.g. ppl,phonebook,niah_single_1,lm_eval:archscale_mc")
    p.add_argument("--output", required=True, help="results JSON file")
    p.add_argument("--batch_size", type=positive_int, default=8, help="sequences per forward pass / decoding batch")
    p.add_argument("--max_length", type=positive_int, default=None,
                   help="longest context fed to the model (default: 4x the training length for ppl/phonebook/niah; "
                        "the training length for lm-eval contexts)")
    p.add_argument("--tokenizer", default=None, help="override the tokenizer recorded in the run's data manifest")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 = autocast")
    p.add_argument("--seed", type=seed_int, default=42)
    p.add_argument("--quick", action="store_true",
                   help="a few samples at short lengths (ppl 1x,2x on 4 batches; Phonebook 10 and 20 entries, 4 "
                        "samples each; NIAH 2 samples at the training length): to see every task work on a CPU; "
                        "explicit flags win")
    add_progress_flag(p)
    p.add_argument("--protocol", default="native", choices=["native", "archscale", "archscale-strict"],
                   help="defaults of the flags left unset: archscale's own (native), ArchScale's (archscale; "
                        "falls back to offline name/key lists without the names/wonderwords packages), or "
                        "ArchScale's with no fallback (archscale-strict). See docs/EVALUATION.md")
    g = p.add_argument_group("ppl")
    g.add_argument("--extrapolation", type=positive_int_list, default=None,
                   help="context multiples of the training length (native: 1,2,4; archscale: 1,2,3,4 at training "
                        "length 4096, else 1,2)")
    g.add_argument("--ppl_selection", default=None, choices=["all", "archscale"],
                   help="validation samples: every block in file order (native) or ArchScale's 200 (archscale)")
    g.add_argument("--val_data_dir", default=None, help="override the run's validation shards folder")
    g.add_argument("--ppl_max_batches", type=positive_int, default=None, help="cap on validation batches (default: all)")
    g.add_argument("--ppl_file", default=None, help="UTF-8 text file for sliding-window perplexity")
    g.add_argument("--window", type=positive_int, default=None, help="sliding window in tokens (default: training length)")
    g.add_argument("--stride", type=positive_int, default=None, help="tokens between window starts (default: window // 2)")
    g = p.add_argument_group("phonebook")
    g.add_argument("--min_eval_len", type=positive_int, default=None, help="fewest phonebook entries (native 10, archscale 480)")
    g.add_argument("--max_eval_len", type=positive_int, default=None, help="most phonebook entries (native 40, archscale 480)")
    g.add_argument("--eval_len_step", type=positive_int, default=None, help="entries between swept lengths (native 10)")
    g.add_argument("--eval_num_batches", type=positive_int, default=None,
                   help="batches per length, split over 4 measurements (native 4, archscale 32)")
    g.add_argument("--phonebook_batch_size", type=positive_int, default=None,
                   help="samples per seeded batch (native 10, archscale 4)")
    g.add_argument("--phonebook_style", default=None, choices=["native", "archscale"],
                   help="books and scoring: ours (distinct offline names, lenient) or ArchScale's (the names "
                        "package, strict)")
    g = p.add_argument_group("niah")
    g.add_argument("--max_seq_lengths", type=positive_int_list, default=None,
                   help="comma-separated token lengths (native: the training length; archscale: 4096)")
    g.add_argument("--niah_samples", type=positive_int, default=None, help="samples per length (native 100; RULER 500)")
    g.add_argument("--niah_keys", default=None, choices=["offline", "wonderwords"],
                   help="needle key vocabulary: our word lists or RULER's (the wonderwords package)")
    g.add_argument("--haystack_file", default=None, help="essay haystack text (default: Milton's Areopagitica)")
    g = p.add_argument_group("lm_eval")
    g.add_argument("--lm_eval_include", action="append", default=None, help="folder of local task YAMLs (repeatable)")
    g.add_argument("--lm_eval_limit", type=positive_float, default=None, help="examples per task (or a fraction if < 1)")
    g.add_argument("--num_fewshot", type=nonnegative_int, default=None)
    g.add_argument("--lm_eval_metadata", default=None,
                   help="JSON handed to lm-eval tasks, as lm-eval's --metadata, e.g. '{\"max_seq_lengths\":[4096]}' "
                        "for its RULER tasks (default lengths: --max_seq_lengths, else lm-eval's)")
    return p


def run_eval(argv: list[str]) -> int:
    from archscale.eval.runner import run, summary_lines

    args = eval_parser().parse_args(argv)  # every number through a parser type (archscale.cli_types)
    doc = run(args)
    for line in summary_lines(doc):
        print(line)
    print(f"wrote {args.output}")
    return 0


def run_report(argv: list[str]) -> int:
    from archscale.eval.report import draw_report

    p = _Parser(prog="archscale report", description="Grouped summary plot of `archscale eval` results "
                                                     "(standard / long-context / extrapolation).")
    p.add_argument("results", nargs="+", help="results JSON files (one series each)")
    p.add_argument("--out", required=True, help="output PNG")
    a = p.parse_args(argv)
    draw_report(a.results, a.out)
    print(f"wrote {a.out}")
    return 0
