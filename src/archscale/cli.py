"""`archscale` command line: one command, subcommands.

    archscale prepare ...          tokenize text/jsonl/parquet into LITPKDS shards
    archscale tokenizer train ...  train a byte-level BPE tokenizer
    archscale pretrain ...         train a model (seed-compatible flags; --help lists them all)
    archscale generate ...         sample text from a checkpoint (cached decoding)
    archscale export ...           consolidate any checkpoint into one safetensors file
    archscale eval / report ...    evaluate a checkpoint (ppl, Phonebook, RULER NIAH, lm-eval) / plot the results
    archscale sweep / analyze / fit ...   scaling studies: run a study file, tabulate it, fit L = A X^-b + C
    archscale demo                 Transformer++ vs SambaY on a small public-domain corpus, minutes on a CPU

Bad input raises `UserError`, printed on one line with exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Sequence

from archscale.errors import UserError

COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {}


def command(name: str, help: str):
    def register(fn):
        COMMANDS[name] = (help, fn)
        return fn
    return register


def explicit_flags(argv: Sequence[str]) -> set[str]:
    """Names of the flags the user typed (`--base_hps.b0=1` -> 'base_hps.b0')."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def pretrain_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    from archscale.train.config import PretrainConfig

    p = ArgumentParser(prog="archscale pretrain", description="Pretrain a language model on LITPKDS shards.",
                       default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the flags below")
    p.add_class_arguments(PretrainConfig, nested_key=None, as_group=False)
    return p


def parse_pretrain(argv: list[str]):
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig

    # The deepspeed/torchrun launchers may pass --local_rank; it is read from the environment instead.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    # A boolean flag given bare (`--dry_run`, `--compile`) means true.
    bools = {f"--{f.name}" for f in dataclasses.fields(PretrainConfig) if f.type in (bool, "bool")}
    argv = [f"{a}=true" if a in bools and (i + 1 == len(argv) or argv[i + 1].startswith("--")) else a
            for i, a in enumerate(argv)]
    ns = pretrain_parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(PretrainConfig)}
    hps = values["base_hps"]
    if not isinstance(hps, BaseHyperparameters):
        hps = BaseHyperparameters(**{k: v for k, v in vars(hps).items()})
    values["base_hps"] = hps
    return PretrainConfig(**values), explicit_flags(argv)


@command("pretrain", "train a model (seed-compatible flags)")
def cmd_pretrain(argv: list[str]) -> int:
    from archscale.train.trainer import pretrain

    cfg, explicit = parse_pretrain(argv)
    pretrain(cfg, explicit)
    return 0


@command("prepare", "tokenize .txt/.jsonl(.gz)/.parquet into train_*/validation_* LITPKDS shards")
def cmd_prepare(argv: list[str]) -> int:
    from archscale.data.prepare import prepare

    p = argparse.ArgumentParser(prog="archscale prepare", description=cmd_prepare.__doc__)
    p.add_argument("--input", nargs="+", required=True, help="files or folders (.txt, .jsonl, .jsonl.gz, .parquet)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, SentencePiece .model, or a folder with one")
    p.add_argument("--val_fraction", type=float, default=0.01, help="fraction of documents for validation")
    p.add_argument("--chunk_size", type=int, default=2049 * 1024, help="tokens per shard file")
    p.add_argument("--max_length", type=int, default=None, help="long-context preparation: keep documents of up to N tokens (EOS included) whole, split longer ones "
                        "into N-token pieces each ending in EOS")
    p.add_argument("--shuffle", action="store_true", help="shuffle document order (seeded)")
    p.add_argument("--num_workers", type=int, default=None, help="tokenizer processes (default: min(4, cores))")
    p.add_argument("--text_key", default="text", help="JSONL field / parquet column holding the text")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args(argv)
    kwargs = dict(val_fraction=a.val_fraction, chunk_size=a.chunk_size, max_length=a.max_length, shuffle=a.shuffle,
                  text_key=a.text_key, seed=a.seed)
    if a.num_workers is not None:
        kwargs["num_workers"] = a.num_workers
    manifest = prepare(a.input, a.output_dir, a.tokenizer, **kwargs)
    splits = manifest["splits"]
    print(f"wrote {a.output_dir}: " + ", ".join(
        f"{k} {v['documents']:,} docs / {v['tokens']:,} tokens in {len(v['files'])} files" for k, v in splits.items()))
    return 0


@command("tokenizer", "tokenizer tools: `archscale tokenizer train --input ... --vocab_size N --out tokenizer.json`")
def cmd_tokenizer(argv: list[str]) -> int:
    from archscale.data.tokenizer import train_bpe

    p = argparse.ArgumentParser(prog="archscale tokenizer")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE on text files")
    t.add_argument("--input", nargs="+", required=True, help="text files")
    t.add_argument("--vocab_size", type=int, required=True)
    t.add_argument("--out", required=True, help="output tokenizer.json")
    a = p.parse_args(argv)
    tok = train_bpe(a.input, a.vocab_size, a.out)
    print(f"wrote {a.out}: vocab {tok.vocab_size}, eos id {tok.eos_id}")
    return 0


@command("generate", "sample text from a checkpoint or run dir")
def cmd_generate(argv: list[str]) -> int:
    from archscale.eval.generate import generate_text, load_model

    p = argparse.ArgumentParser(prog="archscale generate")
    p.add_argument("--checkpoint", required=True, help="run dir (uses its latest checkpoint) or checkpoints/step-*")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k filter")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling mass (e.g. 0.95)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from archscale.data.tokenizer import Tokenizer

    model, _ = load_model(a.checkpoint)
    print(generate_text(model, Tokenizer(a.tokenizer), a.prompt, a.max_new_tokens, a.temperature, a.top_k or None,
                        a.seed, top_p=a.top_p))
    return 0


@command("export", "consolidate any checkpoint (DCP shards or DeepSpeed ZeRO) into one safetensors file")
def cmd_export(argv: list[str]) -> int:
    from archscale.export.consolidate import consolidate

    p = argparse.ArgumentParser(prog="archscale export")
    p.add_argument("--checkpoint", required=True, help="run dir (uses its latest checkpoint) or checkpoints/step-*")
    p.add_argument("--out", required=True, help="output .safetensors file (fp32 weights + model config metadata)")
    a = p.parse_args(argv)
    print(f"wrote {consolidate(a.checkpoint, a.out)}")
    return 0


@command("demo", "fetch a public-domain corpus, train a Transformer++ and a SambaY of equal size on CPU, compare")
def cmd_demo(argv: list[str]) -> int:
    from archscale.demo import DEFAULT_MINUTES, run_demo

    p = argparse.ArgumentParser(prog="archscale demo")
    p.add_argument("--work_dir", default="runs/demo", help="where data, tokenizer, the runs and the plot go")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help="approximate training time of both models together (sets the shared token budget)")
    p.add_argument("--cache_dir", default=None, help="corpus download cache (default ~/.cache/archscale)")
    a = p.parse_args(argv)
    run_demo(a.work_dir, minutes=a.minutes, cache_dir=a.cache_dir)
    return 0


@command("eval", "evaluate a checkpoint: ppl, phonebook, niah_single_1/2/3, lm_eval:TASK -> JSON")
def cmd_eval(argv: list[str]) -> int:
    from archscale.eval_cli import run_eval
    return run_eval(argv)


@command("report", "plot `archscale eval` results as a grouped summary PNG")
def cmd_report(argv: list[str]) -> int:
    from archscale.eval_cli import run_report
    return run_report(argv)


@command("sweep", "run a study file: a grid/list of pretrain runs with status, resume, --dry_run, --emit slurm")
def cmd_sweep(argv: list[str]) -> int:
    from archscale.studies.cli import sweep_main
    return sweep_main(argv)


@command("analyze", "tabulate a study dir (params, tokens, FLOPs, val_loss; best LR/batch) -> CSV, Markdown, PNG")
def cmd_analyze(argv: list[str]) -> int:
    from archscale.studies.cli import analyze_main
    return analyze_main(argv)


@command("fit", "fit L = A*X^-b + C (FLOPs/tokens/params) with bootstrap CIs, plot and extrapolate")
def cmd_fit(argv: list[str]) -> int:
    from archscale.studies.cli import fit_main
    return fit_main(argv)


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: archscale <command> [flags]   (archscale <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help}" for name, (help, _) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from archscale import __version__
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"archscale: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][1](rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
