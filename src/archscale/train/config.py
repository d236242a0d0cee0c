"""`archscale pretrain` configuration: one dataclass (the CLI is derived from it) and ArchScale's
`--train_name` tokens, translated into explicit fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from archscale.errors import UserError
from archscale.data.synthetic import synthetic_kind
from archscale.scaling_rules import PARAMETRIZATIONS, BaseHyperparameters
from archscale.train.curriculum import parse_curriculum
from archscale.train.deepspeed_engine import check_options as check_deepspeed_options
from archscale.train.distributed import check_strategy
from archscale.train.grad_compression import check_grad_compression
from archscale.train.schedule import SCHEDULES


@dataclass
class PretrainConfig:
    """Everything a pretraining run needs. Flags mirror ArchScale's `pretrain.py` plus explicit ones."""

    train_data_dir: str = "data/train"  # train*.bin shards (archscale prepare) | synthetic[:markov|:uniform]
    val_data_dir: Optional[str] = None  # folder of validation*.bin shards (default: train_data_dir)
    data_mixture: Optional[str] = None  # JSON file {"prefix": weight}; default {"train": 1.0}
    train_model: str = "transformer"  # architecture: a shipped layout's name (archscale layout --list)
    layout: Optional[str] = None  # a layout instead of --train_model: spec file, name or "[mamba2, swa] * L" (LAYOUTS.md)
    depth: int = 8  # number of blocks; width, heads and the token budget follow from it (ArchScale's --depth)
    ctx_len: int = 4096  # training sequence length in tokens
    max_tokens: Optional[float] = None  # token budget; default t0 * N(d) / N(d0)
    train_name: str = "scaling"  # seed-style name; its tokens set the fields below (logged)
    resume: str = "auto"  # auto | none | PATH to a checkpoint dir
    base_hps: BaseHyperparameters = field(default_factory=BaseHyperparameters)
    vocab_size: Optional[int] = None  # default: the dataset manifest's vocab size
    micro_bsz: int = 2  # sequences per forward pass per process; gradient accumulation makes up the batch
    out_dir: Optional[str] = None  # default runs/<train_name>_<model>_d<depth>_ctx<ctx_len>
    parametrization: str = "sp"  # sp | mup (original mu-P, `_ori_mup`) | mup++ (`mup`); see scaling_rules
    ar: Optional[int] = None  # aspect ratio override: width = ar * depth, heads = depth, so head_size = ar
    tie_embeddings: bool = False  # share the input embedding and the output head (`_tie` in --train_name)
    rope_base: float = 10000.0  # RoPE base (`_rbase_N` in --train_name)
    rope_scaling: str = "none"  # none | linear:F (position interpolation by F, e.g. linear:2 to double the context)
    varlen: bool = False  # variable-length training: attention and Mamba state stay inside EOS-separated documents
    reset_position_ids: bool = False  # with --varlen: RoPE positions restart at every document (seed: not reset)
    schedule: str = "linear"  # linear | cosine | wsd
    label_smoothing: float = 0.0  # cross-entropy label smoothing in [0, 1)
    loss: str = "auto"  # auto | plain | chunked (linear CE over token chunks); auto: chunked above 100K vocab

    moe: Optional[str] = None  # E:k = a mixture of E experts, k per token, as every layer's feed-forward (e.g. 8:2)
    moe_shared: int = 0  # --moe: shared experts every token also uses
    moe_aux_coef: float = 1e-3  # --moe: Switch load-balancing loss coefficient (ArchScale's 1e-3)
    moe_z_coef: float = 0.0  # --moe: router z-loss coefficient (ST-MoE uses 1e-3)
    ep: int = 1  # expert parallelism: each group of --ep ranks splits the experts and exchanges tokens (all-to-all)
    pp: int = 1  # pipeline parallelism: the blocks cut into --pp stages on --pp ranks (the rest is data parallel)
    pp_schedule: str = "1f1b"  # --pp: gpipe | 1f1b | interleaved1f1b (two stages per rank)
    pp_layers: Optional[str] = None  # --pp: blocks per stage, comma-separated (e.g. 6,2); default as even as possible

    precision: str = "bf16-mixed"  # fp32 | bf16-mixed | fp16-mixed (dynamic loss scaling; for GPUs)
    fp16_scale_window: int = 1000  # fp16-mixed: clean steps before the loss scale doubles
    curriculum: str = "none"  # none | seqlen:start=S,steps=N[,schedule=linear|root]
    strategy: str = "auto"  # auto (single for one process, fsdp otherwise) | single | ddp | fsdp | deepspeed
    grad_compression: str = "none"  # --strategy ddp: none | fp16 | bf16 | powersgd:rank=R[,start=S] (DDP comm hooks)
    zero_stage: int = 2  # --strategy deepspeed: ZeRO stage 0..3
    offload: str = "none"  # --strategy deepspeed: none | optimizer | params (params needs ZeRO 3)
    act_ckpt: bool = False  # activation checkpointing per block
    compile: bool = False  # torch.compile per block (after checkpointing, before sharding)
    seed: int = 3407  # seeds the init, the data order and every RNG
    eos_id: Optional[int] = None  # --varlen on shards without manifest.json (lit-gpt/TinyLlama; ArchScale's `_varlen` uses 2)
    nonfinite: str = "stop"  # a step with a non-finite loss or grad norm (never applied): stop (exit 3) | skip
    nonfinite_max: int = 10  # --nonfinite skip: give up (exit 3) when more steps than this in a row are non-finite
    eval_interval: int = 1000  # optimizer steps between validations (plus one at the end)
    eval_iters: int = 20  # validation batches per evaluation
    log_interval: int = 10  # optimizer steps between metrics.csv rows
    save_interval: int = 1000  # optimizer steps between checkpoints (plus one at the end)
    keep_last: int = 3  # checkpoints to keep (0 = all)
    num_workers: int = 1  # logical loader streams per rank
    fsdp_save_mem: bool = False  # ArchScale's long-context flag: --act_ckpt + FSDP2 CPU offload, no compile
    max_steps: Optional[int] = None  # stop after this many optimizer steps (debugging); the schedule is unchanged
    progress: bool = True  # console progress bar
    logger: str = "csv"  # csv,tensorboard,wandb (comma-separated); W&B is offline without WANDB_API_KEY
    monitor_interval: float = 0.0  # seconds between system samples (CPU %, RAM, per-GPU util/mem/temp); 0 = off
    monitor_console: bool = False  # also print each system sample on the console (default: system.csv/loggers only)
    wandb_project: str = "archscale"  # W&B project (with --logger wandb)
    dry_run: bool = False  # print the fully resolved plan as a table and exit (no data needed with --vocab_size)
    json: bool = False  # with --dry_run: print the plan as JSON instead of a table
    device_memory: Optional[str] = None  # --dry_run: memory per GPU (e.g. 80GB, 80GiB): says whether the plan fits
    target: Optional[str] = None  # --dry_run: h100 | h200 | a100: its memory, peak FLOP/s and bandwidth
    mfu: float = 0.35  # --dry_run: model FLOPs utilisation assumed for the step-time estimate
    gradient_checkpointing: bool = False  # the seed guide's spelling of --act_ckpt (accepted with a note)


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")

# token -> (field, value). The name is split on "_"; multi-token keys are matched first.
TRAIN_NAME_TOKENS: dict[tuple[str, ...], tuple[str, object]] = {
    ("ori", "mup"): ("parametrization", "mup"),
    ("mup",): ("parametrization", "mup++"),
    ("tie",): ("tie_embeddings", True),
    ("rbase",): ("rope_base", 640000.0),
    ("varlen",): ("varlen", True),
    ("ls",): ("label_smoothing", 0.1),
    ("wsd",): ("schedule", "wsd"),
    ("cosine",): ("schedule", "cosine"),
}
# Naming conventions that carry no setting (they only name the run).
TRAIN_NAME_NEUTRAL = {"scaling", "hp", "sweep", "demo", "run", "test", "baseline"}


def parse_train_name(name: str) -> tuple[dict[str, object], list[str]]:
    """Return ({field: value}, unknown_tokens) for a seed-style `--train_name`.

    Tokens with digits (e.g. `lr4e-4`, `bs8388608`, `d16`) are treated as free-form labels.
    """
    parts = [p for p in name.lower().split("_") if p]
    settings: dict[str, object] = {}
    unknown: list[str] = []
    i = 0
    keys = sorted(TRAIN_NAME_TOKENS, key=len, reverse=True)
    while i < len(parts):
        for key in keys:
            if tuple(parts[i:i + len(key)]) == key:
                fld, value = TRAIN_NAME_TOKENS[key]
                settings[fld] = value
                i += len(key)
                break
        else:
            tok = parts[i]
            if tok not in TRAIN_NAME_NEUTRAL and not any(c.isdigit() for c in tok):
                unknown.append(tok)
            i += 1
    return settings, unknown


def apply_train_name(cfg: PretrainConfig, explicit: set[str]) -> tuple[dict[str, object], list[str]]:
    """Set fields from `cfg.train_name` unless the user gave that flag explicitly. Returns (applied, unknown)."""
    settings, unknown = parse_train_name(cfg.train_name)
    applied = {}
    for fld, value in settings.items():
        if fld in explicit:
            continue
        setattr(cfg, fld, value)
        applied[fld] = value
    return applied, unknown


# Help for BaseHyperparameters fields that carry no comment in scaling_rules.py.
_HPS_HELP = {"weight_decay0": "AdamW weight decay", "eps0": "AdamW epsilon",
             "warmup_tokens0": "tokens of linear LR warmup", "beta1_0": "AdamW beta1", "beta2_0": "AdamW beta2"}


def _comments(cls) -> dict[str, str]:
    """`name: type = default  # comment` -> {name: comment} from the class source."""
    import inspect
    import io
    import tokenize

    out, line_name = {}, {}
    src = inspect.getsource(cls)
    for i, line in enumerate(src.splitlines(), 1):
        head = line.strip().split(":", 1)[0]
        if head.isidentifier() and ":" in line:
            line_name[i] = head
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] in line_name:
            out[line_name[tok.start[0]]] = tok.string.lstrip("#").strip()
    return out


def field_help() -> dict[str, str]:
    """Help text of every pretrain flag (`base_hps.X` included), from the dataclasses' field comments."""
    helps = {k: v for k, v in _comments(PretrainConfig).items()}
    hps = {**_HPS_HELP, **_comments(BaseHyperparameters)}
    helps.update({f"base_hps.{k}": f"{v} (mu-P++ base value)" for k, v in hps.items()})
    return helps


def _hps_checks(h: BaseHyperparameters) -> list[tuple[bool, str]]:
    def pos(name):
        v = getattr(h, name)
        return (isinstance(v, (int, float)) and v > 0, f"--base_hps.{name} must be positive (got {v})")

    return [pos("eta0"), pos("b0"), pos("t0"), pos("d0"), pos("hd0"), pos("eps0"),
            (h.min_lr0 >= 0, f"--base_hps.min_lr0 must be >= 0 (got {h.min_lr0})"),
            (h.weight_decay0 >= 0, f"--base_hps.weight_decay0 must be >= 0 (got {h.weight_decay0})"),
            (h.warmup_tokens0 >= 0, f"--base_hps.warmup_tokens0 must be >= 0 (got {h.warmup_tokens0})"),
            (0 <= h.beta1_0 < 1 and 0 <= h.beta2_0 < 1,
             f"--base_hps.beta1_0 / beta2_0 must be in [0, 1) (got {h.beta1_0}, {h.beta2_0})")]


# the seed guide's spellings (ArchScale's README / torchtitan): accepted, translated, noted on stderr
PRECISION_ALIASES = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "32": "fp32", "bf16-true": "bf16-mixed"}
TARGET_NAMES = ("h100", "h200", "a100")


def apply_aliases(cfg: PretrainConfig, note=None) -> None:
    """`--gradient_checkpointing` -> `--act_ckpt`, `--precision bf16` -> `bf16-mixed` (idempotent)."""
    import sys

    note = note or (lambda msg: print(msg, file=sys.stderr))
    if cfg.gradient_checkpointing:
        cfg.gradient_checkpointing, cfg.act_ckpt = False, True
        note("note: --gradient_checkpointing is the seed guide's name for --act_ckpt (per-block activation "
             "checkpointing); using --act_ckpt")
    if cfg.precision in PRECISION_ALIASES:
        new = PRECISION_ALIASES[cfg.precision]
        note(f"note: --precision {cfg.precision} means {new} here (autocast, fp32 master weights)")
        cfg.precision = new


def validate(cfg: PretrainConfig) -> None:
    apply_aliases(cfg)
    checks = _hps_checks(cfg.base_hps) + [
        (cfg.depth >= 1, f"--depth must be >= 1 (got {cfg.depth})"),
        (cfg.ctx_len >= 1, f"--ctx_len must be >= 1 (got {cfg.ctx_len})"),
        (cfg.micro_bsz >= 1, f"--micro_bsz must be >= 1 (got {cfg.micro_bsz})"),
        (cfg.max_tokens is None or cfg.max_tokens > 0, f"--max_tokens must be positive (got {cfg.max_tokens})"),
        (cfg.precision in ("fp32", "bf16-mixed", "fp16-mixed"),
         f"--precision must be fp32 or bf16-mixed, or fp16-mixed on GPUs (got {cfg.precision!r})"),
        (cfg.schedule in SCHEDULES, f"--schedule must be {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]} "
         f"(got {cfg.schedule!r})"),
        (cfg.offload == "none" or cfg.strategy == "deepspeed",
         "--offload is a DeepSpeed option (add --strategy deepspeed); FSDP2's CPU offload is --fsdp_save_mem"),
        (not (cfg.fsdp_save_mem and cfg.strategy in ("ddp", "deepspeed")),
         f"--fsdp_save_mem offloads FSDP2 shards to the CPU; it does not combine with --strategy {cfg.strategy} "
         "(use --act_ckpt there)"),
        (cfg.parametrization in PARAMETRIZATIONS,
         f"--parametrization {cfg.parametrization!r} is unknown; choose sp, mup (original mu-P) or mup++"),
        (cfg.ar is None or (cfg.ar >= 2 and cfg.ar % 2 == 0),
         f"--ar must be an even number >= 2 (got {cfg.ar}): head_size = ar must be even for RoPE"),
        (cfg.eval_interval >= 1 and cfg.log_interval >= 1 and cfg.save_interval >= 1,
         "--eval_interval, --log_interval and --save_interval must be >= 1"),
        (cfg.keep_last >= 0, "--keep_last must be >= 0"),
        (0.0 <= cfg.label_smoothing < 1.0, "--label_smoothing must be in [0, 1)"),
        (cfg.loss in ("auto", "plain", "chunked"), f"--loss must be auto, plain or chunked (got {cfg.loss!r})"),
        (cfg.resume in ("auto", "none") or bool(cfg.resume), "--resume must be auto, none or a checkpoint path"),
        (not cfg.reset_position_ids or cfg.varlen or parse_train_name(cfg.train_name)[0].get("varlen", False),
         "--reset_position_ids needs --varlen (documents come from EOS)"),
        (cfg.monitor_interval >= 0, "--monitor_interval must be >= 0 seconds"),
        (cfg.nonfinite in ("stop", "skip"), f"--nonfinite must be stop or skip (got {cfg.nonfinite!r})"),
        (cfg.nonfinite_max >= 1, f"--nonfinite_max must be >= 1 (got {cfg.nonfinite_max})"),
        (cfg.eos_id is None or cfg.eos_id >= 0, f"--eos_id must be >= 0 (got {cfg.eos_id})"),
        (cfg.fp16_scale_window >= 1, f"--fp16_scale_window must be >= 1 (got {cfg.fp16_scale_window})"),
        (cfg.pp >= 1, f"--pp must be >= 1 (got {cfg.pp})"),
        (cfg.pp_schedule in PP_SCHEDULES,
         f"--pp_schedule {cfg.pp_schedule!r} is unknown; choose {', '.join(PP_SCHEDULES)}"),
        (cfg.target is None or cfg.target in TARGET_NAMES,
         f"--target {cfg.target!r} is unknown; choose {', '.join(TARGET_NAMES)} (or give --device_memory)"),
        (0 < cfg.mfu <= 1, f"--mfu must be in (0, 1] (got {cfg.mfu})"),
        (not (cfg.data_mixture and synthetic_kind(cfg.train_data_dir)),
         "--data_mixture mixes shard prefixes; it does not combine with --train_data_dir synthetic"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    moe_options(cfg)
    check_strategy(cfg.strategy)
    check_grad_compression(cfg.grad_compression, cfg.strategy, cfg.precision)
    parse_curriculum(cfg.curriculum, cfg.ctx_len)
    check_deepspeed_options(cfg.zero_stage, cfg.offload)
    if cfg.device_memory is not None:
        from archscale.train.memory_model import parse_bytes
        parse_bytes(cfg.device_memory)
    rope_scaling_factor(cfg.rope_scaling)
    from archscale.train.loggers import parse_logger_names
    parse_logger_names(cfg.logger)


def moe_options(cfg: PretrainConfig) -> dict | None:
    """`--moe E:k` (+ --moe_shared, coefficients) -> the moe mixer's options; None without --moe."""
    if cfg.moe is None:
        if cfg.ep != 1:
            raise UserError(f"--ep {cfg.ep} splits the experts of a mixture of experts: add --moe E:k")
        return None
    experts, _, k = str(cfg.moe).partition(":")
    if not (experts.isdigit() and k.isdigit() and 1 <= int(k) <= int(experts)):
        raise UserError(f"--moe {cfg.moe!r}: use E:k with 1 <= k <= E, e.g. --moe 8:2")
    if cfg.moe_shared < 0 or cfg.moe_aux_coef < 0 or cfg.moe_z_coef < 0:
        raise UserError("--moe_shared, --moe_aux_coef and --moe_z_coef must be >= 0")
    if cfg.ep < 1 or int(experts) % cfg.ep:
        raise UserError(f"--ep {cfg.ep} must be >= 1 and divide the {experts} experts of --moe {cfg.moe}")
    return dict(n_experts=int(experts), top_k=int(k), n_shared=cfg.moe_shared, aux_coef=cfg.moe_aux_coef,
                z_coef=cfg.moe_z_coef)


def rope_scaling_factor(spec: str) -> float:
    """`--rope_scaling none|linear:F` -> F (1.0 for none)."""
    if spec in ("none", "", None):
        return 1.0
    kind, _, value = str(spec).partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = 0.0
    if kind != "linear" or factor < 1.0:
        raise UserError(f"--rope_scaling {spec!r}: use none or linear:F with F >= 1 (e.g. linear:2)")
    return factor
