"""`archscale` command line: one command, subcommands.

    archscale prepare ...          tokenize text/jsonl/parquet into LITPKDS shards
    archscale tokenizer train ...  train a byte-level BPE tokenizer
    archscale pretrain ...         train a model (ArchScale-compatible flags; --help lists them all)
    archscale layout SPEC ...      what a layout spec builds (per-layer table); --check runs the contract on it
    archscale generate ...         sample text from a checkpoint (cached decoding)
    archscale export ...           a Hugging Face folder (--format hf) or one safetensors file
    archscale eval / report ...    evaluate a checkpoint (ppl, Phonebook, RULER NIAH, lm-eval) / plot the results
    archscale lm_eval ARGS...      lm-eval's own command line, our model registered (--model archscale)
    archscale sweep / analyze / fit ...   scaling studies: run a study file, tabulate it, fit L = A X^-b + C
    archscale compare ...          X vs Y at equal compute as one command: study, fits, gap, crossover, verdict
    archscale quantize ...         int8 / NF4 weights (torchao) into a folder eval and generate read
    archscale serve / bench-serve ...     OpenAI-compatible server with continuous batching / its load-test client
    archscale reason ...           GSM8K / MATH / AIME answers through a server or a checkpoint: pass@1, pass@k
    archscale demo                 Transformer++ vs SambaY on a small public-domain corpus, minutes on a CPU
    archscale doctor               check this machine before a launch (versions, kernels, port, disk, data)

Bad input raises `UserError`, printed on one line with exit code 2 (no traceback). Every exit code is named in
`archscale.errors` (EXIT_*) and listed in README.md, "Exit codes".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from archscale.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, UserError
from archscale.progress import Progress, add_progress_flag
from archscale.train.args import explicit_flags, parse_pretrain, pretrain_parser  # noqa: F401 (the CLI's API)

COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {}


def command(name: str, help: str):
    def register(fn):
        COMMANDS[name] = (help, fn)
        return fn
    return register


command("doctor", "check this machine: torch/CUDA/NCCL, mixer kernels, compiler, torchrun port, disk, data")(lambda argv: __import__("archscale.doctor", fromlist=["main"]).main(argv))  # noqa: E501


@command("pretrain", "train a model (ArchScale-compatible flags)")
def cmd_pretrain(argv: list[str]) -> int:
    from archscale.train.trainer import pretrain

    cfg, explicit = parse_pretrain(argv)
    pretrain(cfg, explicit)
    return 0


@command("layout", "what a layout spec builds: per-layer table, totals, mu-P++ roles; --check runs the contract")
def cmd_layout(argv: list[str]) -> int:
    from archscale.layout_cli import main as layout_main

    return layout_main(argv)


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
    add_progress_flag(p)
    a = p.parse_args(argv)
    kwargs = dict(val_fraction=a.val_fraction, chunk_size=a.chunk_size, max_length=a.max_length, shuffle=a.shuffle,
                  text_key=a.text_key, seed=a.seed, progress=a.progress)
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
    from archscale.outputs import writable_dir, writable_file

    out = Path(a.out)
    if out.is_dir() or str(a.out).endswith(os.sep):
        writable_dir(out, "--out")
    else:
        writable_file(out, "--out")
    tok = train_bpe(a.input, a.vocab_size, a.out)
    print(f"wrote {a.out}: vocab {tok.vocab_size}, eos id {tok.eos_id}")
    return 0


@command("generate", "sample text from a checkpoint, run dir, exported HF folder or quantized folder")
def cmd_generate(argv: list[str]) -> int:
    from archscale.eval.generate import generate_text
    from archscale.runs import load_run

    p = argparse.ArgumentParser(prog="archscale generate")
    p.add_argument("--checkpoint", required=True, help="run dir (uses its latest checkpoint), checkpoints/step-*, "
                                                       "an `archscale export` folder or an `archscale quantize` folder")
    p.add_argument("--tokenizer", default=None, help="default: the run's recorded tokenizer / the folder's own")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k filter")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling mass (e.g. 0.95)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    check_generate_args(a)
    run = load_run(a.checkpoint, tokenizer=True, tokenizer_path=a.tokenizer)  # checks its vocab fits the model
    print(generate_text(run.model, run.tokenizer, a.prompt, a.max_new_tokens, a.temperature, a.top_k or None,
                        a.seed, top_p=a.top_p))
    return 0


def check_generate_args(a) -> None:
    checks = [(a.max_new_tokens >= 0, f"--max_new_tokens must be >= 0, got {a.max_new_tokens}"),
              (a.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {a.temperature}"),
              (a.top_k >= 0, f"--top_k must be >= 0 (0 = off), got {a.top_k}"),
              (a.top_p is None or 0 < a.top_p <= 1, f"--top_p must be in (0, 1], got {a.top_p}")]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


@command("export", "a Hugging Face folder of any architecture (--format hf), or one safetensors file")
def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="archscale export", description=(
        "--format hf: a folder transformers opens with AutoModelForCausalLM / AutoTokenizer (the Transformer++ as "
        "native Llama, other architectures with trust_remote_code=True). --format safetensors: one file of fp32 "
        "weights with the model config as metadata (any checkpoint format, any world size)."))
    p.add_argument("--checkpoint", required=True, help="run dir (uses its latest checkpoint) or checkpoints/step-*")
    p.add_argument("--out", required=True, help="output folder (hf) or .safetensors file")
    p.add_argument("--format", choices=["hf", "safetensors"], default=None,
                   help="default: safetensors when --out ends in .safetensors, else hf")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="hf: weight dtype")
    p.add_argument("--max_shard_size", default="5GB", help="hf: shard model.safetensors above this size")
    p.add_argument("--tokenizer", default=None, help="hf: override the run's recorded tokenizer")
    add_progress_flag(p)
    a = p.parse_args(argv)
    fmt = a.format or ("safetensors" if a.out.endswith(".safetensors") else "hf")
    if fmt == "safetensors":
        from archscale.export.consolidate import consolidate
        with Progress(show=a.progress).stage(f"export: consolidating {a.checkpoint} into {a.out}", log=False):
            written = consolidate(a.checkpoint, a.out)
        print(f"wrote {written}")
        return 0
    from archscale.export.hf_folder import export_hf
    out = export_hf(a.checkpoint, a.out, dtype=a.dtype, max_shard_size=a.max_shard_size, tokenizer=a.tokenizer,
                    progress=Progress(show=a.progress))
    print(f"wrote {out}")
    return 0


@command("quantize", "int8 (dynamic or weight-only) or NF4 weights with torchao -> a folder eval/generate read")
def cmd_quantize(argv: list[str]) -> int:
    from archscale.quantize import METHODS
    from archscale.quantize_cli import quantize_checkpoint

    p = argparse.ArgumentParser(prog="archscale quantize", description=(
        "Post-training quantisation of every linear layer with torchao (CPU or CUDA). The folder holds the "
        "quantised tensors (safetensors) and a JSON recipe; pass it to eval / generate as --checkpoint. "
        "See docs/QUANTIZATION.md."))
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints/step-*, or an exported HF folder")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, help="override the run's recorded tokenizer")
    add_progress_flag(p)
    a = p.parse_args(argv)
    recipe = quantize_checkpoint(a.checkpoint, a.method, a.out, tokenizer=a.tokenizer,
                                 progress=Progress(show=a.progress))
    print(f"wrote {a.out}: {a.method} ({recipe['library']}), {len(recipe['quantized'])} linear layers quantised"
          + (f", {len(recipe['skipped'])} kept in fp32" if recipe["skipped"] else ""))
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


@command("lm_eval", "lm-evaluation-harness's own command line with archscale's model: --model archscale "
                    "--model_args pretrained=RUN ...")
def cmd_lm_eval(argv: list[str]) -> int:
    from archscale.eval.lm_eval_cli import run_lm_eval
    return run_lm_eval(argv)


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


@command("compare", "which architecture scales better: runs a study, fits L(C) per arch, gap/crossover/verdict")
def cmd_compare(argv: list[str]) -> int:
    from archscale.studies.compare_cli import compare_main
    return compare_main(argv)


@command("serve", "OpenAI-compatible completions server (continuous batching) for a checkpoint")
def cmd_serve(argv: list[str]) -> int:
    from archscale.serve.cli import serve_main
    return serve_main(argv)


@command("bench-serve", "load-test an OpenAI-compatible server: latency percentiles, TTFT, ITL, tokens/s")
def cmd_bench_serve(argv: list[str]) -> int:
    from archscale.serve.cli import bench_main
    return bench_main(argv)


@command("reason", "reasoning eval (gsm8k, math, aime24) through a server or a checkpoint: pass@1, pass@k")
def cmd_reason(argv: list[str]) -> int:
    from archscale.reason.cli import reason_main
    return reason_main(argv)


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: archscale <command> [flags]   (archscale <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help}" for name, (help, _) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return EXIT_OK
    if argv[0] in ("-V", "--version"):
        from archscale import __version__
        print(__version__)
        return EXIT_OK
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"archscale: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from archscale.host_alloc import tune_host_allocator

    tune_host_allocator()  # before any tensor: CPU steps reuse freed pages instead of faulting them in again
    try:
        return COMMANDS[name][1](rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as e:  # a full disk or a read-only path is the environment, not a bug: one line
        from archscale.outputs import environment_error, os_error_line

        found = environment_error(e) if not isinstance(e, SystemExit) else None
        if found is None:
            raise
        print(f"error: {os_error_line(found)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
