"""The training loop: one process or many (torchrun), the same code.

Setup (`Trainer.__init__`): plan -> model -> parallelize (parallelize.py) -> strategy with its optimizer or
DeepSpeed engine (strategy.py) -> loader -> resume -> loggers. Then `fit` loops {`train_step` (accumulate, clip,
update), log, eval, save} -> final save.
Everything that changes between steps (model, optimizer, loader position, RNG, step/token counters) is in the
checkpoint, so `--resume auto` continues with exactly the next batch and reproduces an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml

from archscale.config import LAYOUTS, ModelConfig, arch_preset, resolve_layout
from archscale.layout import LayoutSpec, layer_label
from archscale.data.loader import GlobalOrderLoader, load_mixture, prefetching, read_manifest, validation_batches
from archscale.data.synthetic import SyntheticLoader, synthetic_kind, synthetic_validation_batches
from archscale.errors import NonFiniteError, UserError
from archscale.host_alloc import tune_host_allocator
from archscale.models.model import GPT
from archscale.scaling_rules import RoleRule, resolve_batch_and_lr, resolve_parametrization, tokens_for_params
from archscale.train import checkpoint as ckpt
from archscale.train import meta_init
from archscale.train.config import PretrainConfig, apply_train_name, moe_options, rope_scaling_factor, validate
from archscale.train.curriculum import cut_batch, parse_curriculum
from archscale.train.deepspeed_engine import to_universal
from archscale.train.distributed import DistEnv
from archscale.train.distributed import setup as setup_distributed
from archscale.models.varlen import document_ids, document_positions
from archscale.kernels.cross_entropy import select_loss
from archscale.train.loggers import Loggers, SystemMonitor, seed_wandb_config
from archscale.train.metrics import Progress, peak_flops
from archscale.train.optim import param_groups, set_lr
from archscale.train.grad_compression import parse_grad_compression
from archscale.train.expert_parallel import expert_param_groups, expert_params
from archscale.train.parallel_layout import check_layout, data_world_of, make_layout, run_strategy
from archscale.train.parallelize import unwrap
from archscale.train.pipeline import pipeline_section
from archscale.train.runlock import RunLock
from archscale.train.schedule import lr_at
from archscale.train.strategy import OptimizerSpec, Strategy, evaluate, strategy_for  # noqa: F401 - evaluate


@dataclasses.dataclass
class Plan:
    """Resolved numbers of a run: what will happen, before it happens."""

    run_name: str
    out_dir: str
    vocab_size: int
    batch_tokens: int
    grad_accum: int
    lr: float  # global peak LR: eta0 * sqrt(b / b0) * the parametrization's factor; each group scales it
    min_lr: float
    total_tokens: int
    max_steps: int
    warmup_steps: int
    non_embedding_params: int
    flops_per_token: float
    train_name_settings: dict
    train_name_unknown: list
    parametrization: str = "sp"
    lr_mult_matrix: float = 1.0  # group LR = lr * lr_mult (matrix-like / vector-like roles)
    lr_mult_vector: float = 1.0
    wd_matrix: float = 0.1
    wd_vector: float = 0.1
    layout: str = ""  # the layout spec's name (its layers are in the model config's record)
    params_law: str = ""  # where the token budget's N(d) came from: ArchScale's hand-entered law or the count

    def group_rules(self) -> tuple[RoleRule, RoleRule]:
        """(matrix, vector) optimizer rules."""
        return (RoleRule(self.lr_mult_matrix, self.wd_matrix), RoleRule(self.lr_mult_vector, self.wd_vector))


def make_plan(cfg: PretrainConfig, explicit: set[str], world_size: int = 1,
              warn: Callable[[str], None] = print, default_vocab: Optional[int] = None) -> tuple[Plan, ModelConfig]:
    """Resolve sizes, batch, LRs, token budget and the parametrization. `default_vocab` is used when there is
    neither --vocab_size nor a manifest (the dry run passes 32000)."""
    applied, unknown = apply_train_name(cfg, explicit)
    if unknown:
        warn(f"warning: --train_name {cfg.train_name!r}: unrecognised token(s) {unknown} carry no setting")
    validate(cfg)
    manifest = read_manifest(cfg.train_data_dir)
    if not cfg.layout and cfg.train_model not in LAYOUTS:
        raise UserError(f"unknown --train_model {cfg.train_model!r}; choose one of: {', '.join(sorted(LAYOUTS))} "
                        "(or pass a spec with --layout)")
    spec = resolve_layout(cfg.layout or cfg.train_model)  # --layout FILE_OR_STRING, else the named spec
    preset = arch_preset(spec)  # e.g. Phi4-mini-Flash's 200,064 tied vocabulary
    vocab = cfg.vocab_size or preset.get("vocab_size") or (manifest or {}).get("vocab_size") or default_vocab
    tie = cfg.tie_embeddings or ("tie_embeddings" not in explicit and preset.get("tie_embeddings", False))
    if not vocab and synthetic_kind(cfg.train_data_dir):
        raise UserError(f"--train_data_dir {cfg.train_data_dir}: synthetic data needs --vocab_size")
    if not vocab:
        raise UserError(f"--train_data_dir {cfg.train_data_dir}: no such folder; run `archscale prepare` first"
                        if not Path(cfg.train_data_dir).is_dir() else
                        f"{cfg.train_data_dir} has no manifest.json to read the vocab size from; pass --vocab_size")
    if manifest and manifest.get("vocab_size", 0) > vocab:
        raise UserError(f"{cfg.train_data_dir}/manifest.json: data vocab {manifest['vocab_size']} > --vocab_size "
                        f"{vocab}; the model cannot embed those token ids (drop --vocab_size or raise it)")
    hps = cfg.base_hps
    sizes = ModelConfig.from_arch(spec, cfg.depth, ar=cfg.ar, vocab_size=int(vocab),
                                  block_size=cfg.ctx_len, rope_base=cfg.rope_base, tie_embeddings=tie,
                                  rope_scaling=rope_scaling_factor(cfg.rope_scaling))
    if moe_options(cfg) is not None:  # --moe: every plain feed-forward becomes a mixture of experts
        sizes = sizes.replace(ffn_kind="moe", mixer_options={**sizes.mixer_options, "moe": moe_options(cfg)})
    rules = resolve_parametrization(cfg.parametrization, hps, cfg.depth, sizes.n_layer, sizes.head_size, tie=tie)
    with torch.device("meta"):
        meta = GPT(sizes.replace(**rules.model_overrides()))  # checks the layout (one line naming the layer)
    model_cfg = meta.config  # with every layer's record complete
    # --pp: the ranks of one pipeline share their batches; the data-parallel world is the pipelines
    batch, accum, lr = resolve_batch_and_lr(hps, cfg.micro_bsz, cfg.ctx_len, data_world_of(cfg, world_size))
    check_layout(cfg, world_size, model_cfg.n_layer, accum)
    lr = lr * rules.global_lr_mult
    law_params, law_source = budget_params(spec, cfg, meta)
    total = int(cfg.max_tokens if cfg.max_tokens is not None else tokens_for_params(hps, law_params))
    max_steps = total // batch
    if max_steps < 1:
        raise UserError(f"--max_tokens {total} is less than one optimizer batch ({batch} tokens); raise it or "
                        "lower --base_hps.b0")
    warmup = math.ceil(hps.warmup_tokens0 / batch)
    if warmup > max_steps // 2:
        new = max(1, round(0.1 * max_steps))
        warn(f"warning: --base_hps.warmup_tokens0={hps.warmup_tokens0:g} is over half the run ({total:g} tokens); "
             f"warming up for {new} of {max_steps} steps (10%) instead. Set --base_hps.warmup_tokens0 to choose.")
        warmup = new
    run_name = f"{cfg.train_name}_{spec.name}_d{cfg.depth}_ctx{cfg.ctx_len}"
    if cfg.moe:  # keeps an MoE run's default run dir apart from its dense twin's
        run_name += "_moe" + str(cfg.moe).replace(":", "k") + (f"s{cfg.moe_shared}" if cfg.moe_shared else "")
    plan = Plan(run_name=run_name, out_dir=cfg.out_dir or str(Path("runs") / run_name), vocab_size=int(vocab),
                batch_tokens=batch, grad_accum=accum, lr=lr, min_lr=hps.min_lr0, total_tokens=total,
                max_steps=max_steps, warmup_steps=warmup, non_embedding_params=meta.num_params(),
                flops_per_token=meta.flops_per_token(cfg.ctx_len), train_name_settings=applied,
                train_name_unknown=unknown, parametrization=rules.parametrization,
                lr_mult_matrix=rules.matrix.lr_mult, lr_mult_vector=rules.vector.lr_mult,
                wd_matrix=rules.matrix.weight_decay, wd_vector=rules.vector.weight_decay, layout=spec.name,
                params_law=law_source)
    return plan, model_cfg


def budget_params(spec: LayoutSpec, cfg: PretrainConfig, meta: GPT) -> tuple[float, str]:
    """The token budget's N(d): ArchScale's hand-entered law where the spec keeps one (so plans equal its own),
    else the model's active non-embedding parameters, counted."""
    if spec.law is not None:
        a, b = spec.law
        return spec.n_mult(spec.ar if cfg.ar is None else cfg.ar) * cfg.depth**3, \
            f"ArchScale's law ({a:g} ar^2 + {b:g} ar) d^3"
    return float(meta.num_params(active=True)), "counted (active non-embedding parameters)"


DRY_RUN_DEFAULT_VOCAB = 32000


def dry_run_summary(cfg: PretrainConfig, explicit: set[str] = frozenset(), world_size: int = 1,
                    warn: Callable[[str], None] = print) -> dict:
    """The fully resolved plan as a JSON-able dict, without data (vocab 32000 unless --vocab_size or a manifest
    says otherwise) and without touching out_dir."""
    plan, m = make_plan(cfg, set(explicit), world_size=world_size, warn=warn, default_vocab=DRY_RUN_DEFAULT_VOCAB)
    with torch.device("meta"):
        meta = GPT(m)
    law, _ = budget_params(resolve_layout(cfg.layout or cfg.train_model), cfg, meta)  # the budget's N(d)
    return {
        "run_name": plan.run_name, "out_dir": plan.out_dir, "model": m.name, "parametrization": plan.parametrization,
        "n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head, "n_kv_head": m.n_query_groups,
        "head_size": m.head_size, "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
        "padded_vocab_size": m.padded_vocab_size, "tie_embeddings": m.tie_embeddings,
        "n_params": meta.num_params(non_embedding=False), "n_params_non_embedding": plan.non_embedding_params,
        "n_params_active": meta.num_params(non_embedding=False, active=True),
        "n_params_active_non_embedding": meta.num_params(active=True), "ffn_kinds": sorted(set(m.ffn_kinds)),
        "ctx_len": cfg.ctx_len, "micro_bsz": cfg.micro_bsz, "world_size": world_size,
        "batch_tokens": plan.batch_tokens, "grad_accum": plan.grad_accum, "max_tokens": plan.total_tokens,
        "optimizer_steps": plan.max_steps, "warmup_steps": plan.warmup_steps,
        "warmup_tokens": plan.warmup_steps * plan.batch_tokens, "schedule": cfg.schedule,
        "lr": plan.lr, "min_lr": plan.min_lr, "lr_matrix": plan.lr * plan.lr_mult_matrix,
        "lr_vector": plan.lr * plan.lr_mult_vector, "wd_matrix": plan.wd_matrix, "wd_vector": plan.wd_vector,
        "residual_scale": m.residual_scale, "logit_scale": m.logit_scale, "attn_scale_mult": m.attn_scale_mult,
        "attn_scale": m.attn_scale_mult / math.sqrt(m.head_size), "init_scheme": m.init_scheme,
        "init_std": meta.init_stds(), "flops_per_token": plan.flops_per_token,
        "train_name_settings": plan.train_name_settings,
        # the law against the active parameters (all of them for a dense model; k of E experts for an MoE)
        "n_params_law": law, "n_params_law_deviation": law / meta.num_params(active=True) - 1.0,
        "n_params_law_source": plan.params_law, "layout": layout_summary(m),
        "grad_compression": parse_grad_compression(cfg.grad_compression).describe(),
        "notes": dry_run_notes(cfg),
        **pipeline_section(cfg, m.n_layer, plan.grad_accum),
        **launch_estimates(cfg, m, plan, world_size),
    }


def layout_summary(m: ModelConfig) -> dict:
    """The layout as the dry run shows it: the layout's name and source, one compact line per layer."""
    return {"name": m.arch, "source": m.layout.get("source", ""), "cross_decoder_start": m.cross_decoder_start,
            "layers": [layer_label(layer) for layer in m.layers]}
def launch_estimates(cfg: PretrainConfig, m: ModelConfig, plan: Plan, world_size: int) -> dict:
    """The dry run's "memory" (per-rank peak, fits or not, a suggestion) and "step_time" sections."""
    from archscale.train import memory_model as mm

    on_gpu = cfg.target is not None or cfg.device_memory is not None or torch.cuda.is_available()
    shape = mm.shape_of(dataclasses.replace(cfg, vocab_size=plan.vocab_size), world_size,
                        device="cuda" if on_gpu else "cpu")
    memory = mm.memory_section(m, shape, mm.parse_bytes(cfg.device_memory) if cfg.device_memory else None,
                               cfg.target)
    step = mm.step_time(plan.flops_per_token, plan.batch_tokens, plan.total_tokens, world_size,
                        mm.parameter_counts(m, shape)["params"], shape, target=cfg.target or "h100", mfu=cfg.mfu)
    return {"memory": memory, "step_time": step}


def dry_run_notes(cfg: PretrainConfig) -> list[str]:
    """Where this run deliberately differs from what ArchScale's own script would do with the same flags."""
    notes = []
    if cfg.varlen and cfg.ctx_len == 4096:
        notes.append("ArchScale's `_varlen` silently trains ctx 4096 runs at ctx 8192 with micro-batch 1; archscale "
                     "keeps --ctx_len and --micro_bsz as given (pass --ctx_len 8192 --micro_bsz 1 to match it)")
    return notes


def print_dry_run(cfg: PretrainConfig, explicit: set[str] = frozenset()) -> None:
    """`--dry_run`: the plan on stdout as a table (`--json`: as JSON); warnings go to stderr so stdout stays
    parseable."""
    from archscale.train.dry_run_table import render_dry_run

    summary = dry_run_summary(cfg, explicit, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                              warn=lambda msg: print(msg, file=sys.stderr))
    print(json.dumps(summary, indent=2) if cfg.json else render_dry_run(summary))


def missing_default_validation(cfg: PretrainConfig, block_size: int) -> Optional[str]:
    """Why the training folder, validation's default place, has no validation block (None: it has one, or
    --val_data_dir names a folder, whose problems stay errors). `prepare` gives every split a document, but a
    --val_fraction 0 corpus, or one validation document shorter than a block, leaves none."""
    from archscale.data.loader import _block_counts, _glob_shards

    if cfg.val_data_dir or synthetic_kind(cfg.train_data_dir) or not Path(cfg.train_data_dir).is_dir():
        return None
    files = _glob_shards(Path(cfg.train_data_dir), "validation")
    if not files:
        return f"no validation*.bin in {cfg.train_data_dir}"
    if int(_block_counts(files, block_size).sum()) == 0:
        return (f"{cfg.train_data_dir}/validation*.bin holds fewer than one block of {block_size} tokens "
                f"(--ctx_len {cfg.ctx_len} + 1)")
    return None


def resolved_yaml(cfg: PretrainConfig, plan: Plan, model_cfg: ModelConfig) -> str:
    return yaml.safe_dump({"pretrain": dataclasses.asdict(cfg), "plan": dataclasses.asdict(plan),
                           "model": model_cfg.to_dict()}, sort_keys=False)


class ModelForward:
    """model, inputs -> logits (or (hidden, head weight) for a chunked loss); with --varlen the documents (from
    EOS) mask attention and reset Mamba states. `model_kwargs(inputs)` are those document inputs alone (a
    pipeline hands them to every stage)."""

    def __init__(self, varlen: bool, eos_id: Optional[int], reset_positions: bool, return_hidden: bool):
        self.varlen, self.eos_id, self.reset_positions = varlen, eos_id, reset_positions
        self.return_hidden = return_hidden

    def model_kwargs(self, x: torch.Tensor) -> dict:
        if not self.varlen:
            return {}
        docs = document_ids(x, self.eos_id)
        return {"doc_ids": docs, "position_ids": document_positions(docs) if self.reset_positions else None}

    def __call__(self, model, x: torch.Tensor):
        return model(x, **self.model_kwargs(x), return_hidden=self.return_hidden)


def make_forward(cfg: PretrainConfig, eos_id: Optional[int], return_hidden: bool = False) -> ModelForward:
    return ModelForward(cfg.varlen, eos_id, cfg.reset_position_ids, return_hidden)


def check_token_range(batch: torch.Tensor, vocab_size: int, data_dir: str) -> None:
    top = int(batch.max())
    if top >= vocab_size:
        raise UserError(f"{data_dir}: token id {top} >= vocab size {vocab_size}; the shards were made with a "
                        "larger tokenizer (pass the right --vocab_size)")


def comm_summary(comm) -> str:
    """The final line's DDP traffic: bytes each rank put into the gradient all-reduces (run total, per step)."""
    if comm is None or not comm.steps:
        return ""
    return (f", gradient all-reduce ({comm.spec.describe()}) {comm.total_bytes:,} bytes per rank "
            f"({comm.total_bytes / comm.steps:,.0f} per step)")


class _StopFlag:
    """SIGINT/SIGTERM request a checkpoint and a clean exit at the end of the current step."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)



def varlen_eos_id(cfg: PretrainConfig) -> Optional[int]:
    """The EOS id that separates documents: the data manifest's, else --eos_id (shards without a manifest)."""
    manifest = (read_manifest(cfg.train_data_dir) or {}).get("eos_id")
    if cfg.eos_id is not None and manifest is not None and cfg.eos_id != manifest:
        raise UserError(f"--eos_id {cfg.eos_id}: {cfg.train_data_dir}/manifest.json says eos_id {manifest}; drop "
                        "--eos_id (the manifest is the tokenizer's own)")
    eos_id = manifest if manifest is not None else cfg.eos_id
    if cfg.varlen and eos_id is None:
        raise UserError(f"--varlen: {cfg.train_data_dir} has no manifest.json with an eos_id to find document "
                        "boundaries; pass --eos_id N (the tokenizer's end-of-text id; ArchScale's `_varlen` uses 2, "
                        "its Llama-2 tokenizer's), or prepare the data with `archscale prepare`")
    return eos_id


# Model fields a resumed run may change: the name follows the others, and the context length and RoPE settings
# only change the positions seen (long-context continuation).
RESUMABLE_MODEL_CHANGES = frozenset({"name", "block_size", "rope_base", "rope_scaling", "layout"})


def _model_difference(key: str, old, new) -> str:
    """One changed model field as the resume error names it (a layer record by its first differing layer)."""
    if key == "layers" and isinstance(old, list):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return f"layer {i} {layer_label(a)} -> {layer_label(b)}"
        return f"{len(old)} layers -> {len(new)}"
    return f"{key} {old} -> {new}"


def check_resume_fits(step_dir: Path, cfg: PretrainConfig, plan: Plan, model_cfg: ModelConfig,
                      world_size: int) -> None:
    """The checkpoint's model and batch must be this run's: else a one-line error naming what differs, before
    anything in the run dir is written (every rank checks the same files, so all fail alike)."""
    try:
        saved = yaml.safe_load((Path(step_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return  # an older checkpoint without a readable config: loading it will tell
    if not isinstance(saved, dict):
        return
    old_model, new_model = saved.get("model") or {}, model_cfg.to_dict()
    diff = [_model_difference(k, old_model[k], new_model[k]) for k in new_model
            if k in old_model and k not in RESUMABLE_MODEL_CHANGES and old_model[k] != new_model[k]]
    if diff:
        raise UserError(f"--resume {step_dir}: the checkpoint's model differs from this run's: {', '.join(diff)}; "
                        "resume with the flags it was trained with (its config.yaml), or start a new run in "
                        "another --out_dir")
    was_curriculum = (saved.get("pretrain") or {}).get("curriculum", "none")
    if was_curriculum != cfg.curriculum:  # each step's sequence length (the data order) follows it: keep it
        raise UserError(f"--resume {step_dir}: it was trained with --curriculum {was_curriculum}, this run asks for "
                        f"--curriculum {cfg.curriculum}; the curriculum decides every step's sequence length, so a "
                        "resumed run keeps it (resume with the same --curriculum, or start a new run)")
    old_batch = (saved.get("plan") or {}).get("batch_tokens", plan.batch_tokens)
    if old_batch != plan.batch_tokens:
        pre = saved.get("pretrain") or {}
        was = {"--base_hps.b0": (pre.get("base_hps") or {}).get("b0"), "--micro_bsz": pre.get("micro_bsz"),
               "--ctx_len": pre.get("ctx_len"), "world size": RunCheckpoints.saved_world_size(step_dir)}
        now = {"--base_hps.b0": cfg.base_hps.b0, "--micro_bsz": cfg.micro_bsz, "--ctx_len": cfg.ctx_len,
               "world size": world_size}
        changed = [f"{k} {was[k]:g} -> {now[k]:g}" for k in was if was[k] is not None and was[k] != now[k]]
        why = ("; ".join(changed) + (" (the world size changes how --base_hps.b0 is rounded)"
                                     if "world size" in " ".join(changed) else "")) or "the batch rules differ"
        raise UserError(f"--resume {step_dir}: it was trained with {old_batch}-token batches, this run makes "
                        f"{plan.batch_tokens}: {why}; resume with the batch it was trained with (pick --micro_bsz / "
                        "--base_hps.b0 so that the batch stays the same)")


def take_run_lock(out_dir: Path, env: DistEnv) -> Optional[RunLock]:
    """Rank 0 locks the run dir (creating it); every rank learns whether that worked."""
    lock, error = None, None
    if env.is_main:
        try:
            lock = RunLock(out_dir).acquire()
        except UserError as e:
            error = str(e)
    error = env.broadcast(error)
    if error is not None:
        raise UserError(error)
    return lock


class RunCheckpoints:
    """Every call the trainer makes into checkpoint.py, in one place: where to start, load, save."""

    def __init__(self, root: Path, env: DistEnv, log: Callable[[str], None]):
        self.root, self.env, self.log = root, env, log

    def resume_point(self, resume: str, out_dir: Path) -> Optional[Path]:
        """The checkpoint to start from (None: from scratch). Reads only: nothing is written yet."""
        if resume == "auto":
            return ckpt.find_latest(self.root, warn=self.log)
        if resume != "none":
            if not Path(resume).is_dir():  # refused before the run dir is touched
                raise UserError(f"--resume {resume}: not a usable checkpoint (no such directory); pass a "
                                "checkpoints/step-* dir")
            return Path(resume)
        if ckpt.complete_checkpoints(self.root):
            raise UserError(f"--out_dir {out_dir} already holds checkpoints; use --resume auto to continue, or "
                            "pick another --out_dir")
        return None

    @staticmethod
    def saved_world_size(step_dir: Path) -> int:
        """How many processes wrote `step_dir`: each writes its own train state file."""
        return max(1, len(list(Path(step_dir).glob("train_state_rank*"))))

    def universal_copy(self, step_dir: Path) -> Callable[[], Optional[Path]]:
        """For DeepSpeed: a function that converts `step_dir` to a world-size-free copy when it was saved by
        another number of ranks (ZeRO states are partitioned per rank), returning the copy (else None)."""
        def convert() -> Optional[Path]:
            if step_dir is None or not ckpt.is_deepspeed_checkpoint(step_dir):
                return None
            saved = self.saved_world_size(step_dir)
            if saved == self.env.world_size:
                return None
            universal = self.root / f".universal-{step_dir.name}"
            if self.env.is_main:
                shutil.rmtree(universal, ignore_errors=True)
                self.log(f"converting {step_dir} (ZeRO over {saved} ranks) to a universal checkpoint")
                to_universal(step_dir, universal)
            self.env.barrier()
            return universal
        return convert

    def load(self, step_dir: Path, strategy: Strategy, layers: list | None = None) -> dict:
        """Model and optimizer state into `strategy`'s objects; returns this rank's train state. `layers`: the
        model's layer record, checked against the one saved with the weights."""
        module, optimizer, engine = strategy.state_dict_target()
        if (getattr(strategy, "flat_optimizer_state", False) and not ckpt.is_deepspeed_checkpoint(step_dir)
                and ckpt.verify_checkpoint(step_dir) is None and not ckpt.optim_keyed_by_name(step_dir)):
            raise UserError(f"--resume {step_dir}: saved without --pp (optimizer state keyed by group index), it "
                            "resumes without --pp only (a checkpoint saved with --pp loads with or without it)")
        universal = getattr(strategy, "universal", None)
        state = ckpt.load_checkpoint(step_dir, module, optimizer, rank=self.env.rank, engine=engine, warn=self.log,
                                     ds_universal=universal, layers=layers)
        strategy.after_load(self.env)
        return state

    def save(self, step: int, strategy: Strategy, train_state: dict, config_yaml: str, keep_last: int) -> Path:
        module, optimizer, engine = strategy.state_dict_target()
        return ckpt.save_checkpoint(self.root, step, module, optimizer, train_state, config_yaml, keep_last,
                                    rank=self.env.rank, barrier=self.env.barrier, engine=engine,
                                    flat_optim=getattr(strategy, "flat_optimizer_state", False))

    rng_state = staticmethod(ckpt.rng_state)
    set_rng_state = staticmethod(ckpt.set_rng_state)


@dataclasses.dataclass
class TrainState:
    """The counters that advance with every optimizer step (the rest of the state is in the objects)."""

    step: int = 0
    tokens: int = 0


@dataclasses.dataclass
class StepResult:
    lr: float
    train_loss: float  # the global batch's mean loss (every rank has it)
    grad_norm: float
    applied: bool  # the optimizer update happened
    overflow: bool  # an fp16 loss scaler skipped it
    seconds: float
    seq_len: int = 0  # training sequence length of the step (--curriculum)

    @property
    def finite(self) -> bool:
        """Loss and gradient norm finite (an fp16 loss-scale overflow is the scaler's business, not divergence)."""
        return math.isfinite(self.train_loss) and (math.isfinite(self.grad_norm) or self.overflow)


class _Window:
    """Throughput since the last logged row."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds, self.tokens = 0.0, 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def pretrain(cfg: PretrainConfig, explicit: set[str] = frozenset(),
             log: Callable[[str], None] = print,
             on_step: Optional[Callable[[int], None]] = None) -> Optional[Path]:
    """Train according to `cfg`; returns the run directory (None after `--dry_run`, which trains nothing and
    prints the plan). `explicit` names the flags the user set. `on_step(step)` runs after each optimizer step,
    before that step's checkpoint decision (tests use it to deliver signals at an exact step).

    Under torchrun every process calls this; the strategy (strategy.py) decides how they cooperate. Only
    rank 0 logs, writes metrics.csv and shows the progress bar."""
    if cfg.dry_run:
        print_dry_run(cfg, explicit)
        return None
    validate(cfg)  # before any process group exists, so bad flags fail fast everywhere
    tune_host_allocator()  # a library call skips the CLI's: CPU steps reuse freed pages (host_alloc.py)
    env = setup_distributed(run_strategy(cfg))
    try:
        trainer = Trainer(cfg, set(explicit), env, log if env.is_main else (lambda msg: None))
        try:
            return trainer.fit(on_step)
        finally:
            trainer.close()
    finally:
        env.close()


class Trainer:
    """Setup (plan -> model -> parallelize -> strategy/optimizer -> data -> resume -> loggers) in the
    constructor; `train_step` is one optimizer step; `fit` is the loop around it."""

    def __init__(self, cfg: PretrainConfig, explicit: set[str], env: DistEnv, log: Callable[[str], None]):
        self.cfg, self.env, self.log = cfg, env, log
        self.metrics, self.monitor, self.lock = None, None, None
        self.nonfinite_in_a_row = 0
        # the mesh's shape and this rank's data-parallel position in it (train/parallel_layout.py)
        self.layout = make_layout(cfg, env.strategy, env.world_size, env.rank, env.device)
        self.data_rank, self.data_world = self.layout.data_rank, self.layout.data_world
        self.written = ["config.yaml"]  # what setup wrote into the run dir
        self.plan, self.model_cfg = make_plan(cfg, explicit, world_size=env.world_size, warn=log)
        self.out_dir = Path(self.plan.out_dir)
        self.checkpoints = RunCheckpoints(self.out_dir / "checkpoints", env, log)
        # ---- where to start (every rank reads the shared file system; nothing writes to it yet)
        self.resume_from = self.checkpoints.resume_point(cfg.resume, self.out_dir)
        if self.resume_from is not None:
            check_resume_fits(self.resume_from, cfg, self.plan, self.model_cfg, env.world_size)
        self.last_checkpoint = self.resume_from  # the newest finite checkpoint (every saved one is)
        fresh = not (self.out_dir / "config.yaml").exists()  # a new run dir: a refused setup leaves nothing in it
        self.lock = take_run_lock(self.out_dir, env)
        try:
            self._setup()
        except BaseException:
            if fresh and env.is_main:
                self._forget_new_run_dir()
            self.close()
            raise

    def _forget_new_run_dir(self) -> None:
        """Setup refused a new run (a flag combination checked while building): remove what setup wrote, the
        lock last (unlinked while still held, so no other process can lock the removed file's inode after us),
        and the dir itself when that leaves it empty."""
        for name in self.written:
            (self.out_dir / name).unlink(missing_ok=True)
        if self.lock is not None:
            self.lock.path.unlink(missing_ok=True)
        try:
            self.out_dir.rmdir()
        except OSError:  # not empty: it held something before this run, keep it
            pass

    def _setup(self) -> None:
        cfg, env = self.cfg, self.env
        self.config_yaml = resolved_yaml(cfg, self.plan, self.model_cfg)
        if env.is_main:
            (self.out_dir / "config.yaml").write_text(self.config_yaml)
        env.barrier()
        model = self._build_model()
        self.groups = param_groups(unwrap(model), *self.plan.group_rules())  # SP: one rule for both groups
        if expert_params(unwrap(model)):  # a mixture of experts: its experts in groups of their own
            self.groups = expert_param_groups(self.groups, expert_params(unwrap(model)))
        hps = cfg.base_hps
        self.strategy.build_optimizer(self.groups, OptimizerSpec(
            lr=self.plan.lr, betas=(hps.beta1_0, hps.beta2_0), eps=hps.eps0, accum=self.plan.grad_accum,
            micro_bsz=cfg.micro_bsz, universal_from=self.checkpoints.universal_copy(self.resume_from)))
        if env.is_main:
            for name, text in self.strategy.run_files.items():  # e.g. DeepSpeed's generated config
                (self.out_dir / name).write_text(text)
                self.written.append(name)
        self._build_data()
        self.state = self._resume() if self.resume_from is not None else TrainState()
        self._open_loggers()

    # ---------------------------------------------------------------- setup
    def _build_model(self) -> torch.nn.Module:
        """The layout's strategy builds the model (every rank the same init from the same seed) and parallelizes
        it (strategy.py)."""
        self.strategy = strategy_for(self.layout, self.cfg, self.log)

        def factory(on_meta: bool = False) -> torch.nn.Module:
            """on_meta: on the meta device, for a sharding strategy to initialise after sharding (meta_init)."""
            torch.manual_seed(self.cfg.seed)
            return meta_init.build_on_meta(self.model_cfg) if on_meta else GPT(self.model_cfg)
        return self.strategy.build_model(factory)

    def _build_data(self) -> None:
        """One global sample order; rank r takes micro-batches r, r+W, ... (the same global batches whatever the
        world size; see GlobalOrderLoader). Validation batches are split over ranks."""
        cfg, env = self.cfg, self.env
        block = cfg.ctx_len + 1
        kind = synthetic_kind(cfg.train_data_dir)
        if kind is not None:  # --train_data_dir synthetic[:kind]: generated from the seed, no files
            self.loader = SyntheticLoader(kind, vocab_size=self.plan.vocab_size, block_size=block,
                                          micro_bsz=cfg.micro_bsz, seed=cfg.seed, rank=self.data_rank,
                                          world_size=self.data_world)
        else:
            mixture = load_mixture(cfg.data_mixture, cfg.train_data_dir) if cfg.data_mixture else "train"
            self.loader = GlobalOrderLoader(cfg.train_data_dir, mixture, block_size=block, micro_bsz=cfg.micro_bsz,
                                            seed=cfg.seed, rank=self.data_rank, world_size=self.data_world,
                                            num_workers=cfg.num_workers)
        self.loader = prefetching(self.loader, env.device)  # CUDA: read ahead on a thread, into pinned memory
        eos_id = varlen_eos_id(cfg)
        self.loss_fn = select_loss(cfg.loss, self.model_cfg.vocab_size,  # --loss
                                   zero3=self.strategy.head_only_in_forward)
        self.forward = make_forward(cfg, eos_id, return_hidden=self.loss_fn.wants_hidden)
        self.curriculum = parse_curriculum(cfg.curriculum, cfg.ctx_len)  # None: always --ctx_len
        self.eval_forward = make_forward(cfg, eos_id)
        self.val_batches, self.val_pad, self.val_filler = [], 0, None
        self.validating = cfg.eval_iters > 0
        missing = missing_default_validation(cfg, block) if self.validating else None
        if missing:
            self.log(f"warning: {missing}; training without validation (val_loss stays empty); pass --eval_iters 0 "
                     "to say so, or --val_data_dir DIR")
            self.validating = False
        if self.validating:
            val_dir = cfg.val_data_dir or cfg.train_data_dir
            val_kind = synthetic_kind(val_dir)
            everything = (synthetic_validation_batches(val_kind, vocab_size=self.plan.vocab_size, block_size=block,
                                                       micro_bsz=cfg.micro_bsz, seed=cfg.seed,
                                                       max_batches=cfg.eval_iters) if val_kind else
                          list(validation_batches(val_dir, "validation", block_size=block,
                                                  micro_bsz=max(1, cfg.micro_bsz), max_batches=cfg.eval_iters)))
            for b in everything:
                check_token_range(b, self.model_cfg.vocab_size, val_dir)
            self.val_batches = everything[self.data_rank::self.data_world]
            self.val_pad = -(-len(everything) // self.data_world) - len(self.val_batches)
            self.val_filler = everything[0]
        dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.precision)
        self.autocast = (lambda: torch.autocast(env.device.type, dtype=dtype)) if dtype else nullcontext

    def _resume(self) -> TrainState:
        resume_from = self.resume_from
        state = self.checkpoints.load(resume_from, self.strategy, self.model_cfg.layers)
        self.loader.load_state_dict(state["loader"])
        self.checkpoints.set_rng_state(state["rng"])
        if self.strategy.scaler is not None and state.get("grad_scaler"):
            self.strategy.scaler.load_state_dict(state["grad_scaler"])
        saved_world = state.get("world_size", 1)
        if self.strategy.comm is not None:  # --grad_compression: PowerSGD's error feedback, the byte counts
            note = self.strategy.comm.load_state_dict(state.get("grad_compression"), saved_world == self.env.world_size)
            if note:
                self.log(note)
        self.log(f"resumed from {resume_from} at step {state['step']} ({state['tokens']:,} tokens)"
                 + (f"; world size {saved_world} -> {self.env.world_size}" if saved_world != self.env.world_size
                    else ""))
        return TrainState(step=state["step"], tokens=state["tokens"])

    def _open_loggers(self) -> None:
        cfg, plan, env = self.cfg, self.plan, self.env
        extra_cols = (("loss_scale",) if cfg.precision == "fp16-mixed" else ()) + (
            ("seq_len",) if cfg.curriculum != "none" else ()) + (("comm_bytes",) if self.strategy.comm else ())
        wb_config, wb_tags = seed_wandb_config(cfg)
        if env.is_main:
            self.metrics = Loggers(self.out_dir, cfg.logger, extra=extra_cols,
                                   resume_step=self.state.step if self.resume_from is not None else None,
                                   config={**wb_config, "plan": dataclasses.asdict(plan)}, run_name=plan.run_name,
                                   project=cfg.wandb_project, tags=wb_tags)
            if cfg.monitor_interval > 0:
                self.monitor = SystemMonitor(self.metrics, cfg.monitor_interval,
                                             console=self.log if cfg.monitor_console else None).start()
        self.peak, peak_src = peak_flops(env.device, torch.bfloat16 if cfg.precision == "bf16-mixed"
                                         else torch.float32)
        self.log(f"run {self.out_dir}: {self.model_cfg.name}, {plan.non_embedding_params / 1e6:.2f}M non-embedding "
                 f"params, {plan.max_steps} steps x {plan.batch_tokens:,} tokens (accum {plan.grad_accum} x "
                 f"{env.world_size} process{'es' if env.world_size > 1 else ''}, {self.strategy.describe()}), "
                 f"{plan.parametrization}, lr {plan.lr * plan.lr_mult_matrix:.3g} matrix / "
                 f"{plan.lr * plan.lr_mult_vector:.3g} vector, warmup {plan.warmup_steps} steps, {cfg.precision} on "
                 f"{env.device.type}; peak {self.peak / 1e9:,.0f} GFLOP/s per process ({peak_src})")

    def close(self) -> None:
        if hasattr(getattr(self, "loader", None), "close"):  # the prefetch thread
            self.loader.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    # ---------------------------------------------------------------- one step
    def train_step(self, state: TrainState, batch_iter) -> StepResult:
        """Accumulate `grad_accum` micro-batches from `batch_iter`, clip, update; advances `state`."""
        cfg, plan, strategy, device = self.cfg, self.plan, self.strategy, self.env.device
        t_start = time.perf_counter()
        lr = lr_at(state.step, plan.lr, plan.min_lr, plan.warmup_steps, plan.max_steps, cfg.schedule)
        set_lr(strategy.optimizer, lr)  # per group: lr * lr_mult (the same groups under every strategy)
        seq_len = self.curriculum.length_at(state.step) if self.curriculum is not None else cfg.ctx_len

        def micro_batches():
            for _ in range(plan.grad_accum):
                batch = next(batch_iter)
                check_token_range(batch, self.model_cfg.vocab_size, cfg.train_data_dir)
                yield cut_batch(batch.to(device, non_blocking=True), seq_len)  # --curriculum

        loss_sum = strategy.run_micro_batches(micro_batches(), self.forward, self.loss_fn, cfg.label_smoothing,
                                              self.autocast)
        mean_loss = self.env.mean_tensor(loss_sum.double() / plan.grad_accum)  # the global batch's, on every rank
        # the guard (see _on_nonfinite): no update unless loss and gradient norm are finite, both read in one sync
        outcome = strategy.clip_and_step(loss=mean_loss)
        train_loss = outcome.train_loss
        state.step += 1
        state.tokens += plan.batch_tokens
        return StepResult(lr=lr, train_loss=train_loss, grad_norm=outcome.grad_norm, applied=outcome.applied,
                          overflow=outcome.overflow, seconds=time.perf_counter() - t_start, seq_len=seq_len)

    # ---------------------------------------------------------------- the loop
    def validate_now(self) -> float:
        return self.strategy.evaluate(self.val_batches, self.env.device, self.autocast, self.env, self.val_pad, self.val_filler,
                   forward=self.eval_forward)

    def save(self) -> Path:
        state = self.state
        train_state = {"step": state.step, "tokens": state.tokens, "loader": self.loader.state_dict(),
                       "rng": self.checkpoints.rng_state(), "world_size": self.env.world_size,
                       "strategy": self.env.strategy, "batch_tokens": self.plan.batch_tokens,
                       "grad_scaler": self.strategy.scaler.state_dict() if self.strategy.scaler is not None else None,
                       "grad_compression": self.strategy.comm.state_dict() if self.strategy.comm is not None else None,
                       ckpt.LAYERS_KEY: ckpt.layers_record(self.model_cfg.layers)}
        self.last_checkpoint = self.checkpoints.save(state.step, self.strategy, train_state, self.config_yaml,
                                                     self.cfg.keep_last)
        return self.last_checkpoint

    def _on_nonfinite(self, result: StepResult) -> None:
        """A step whose loss or gradient norm is not finite: its update was not applied (train_step checks
        before the optimizer step) and nothing of it is saved. Stop (exit 3), or skip it with --nonfinite skip
        until more than --nonfinite_max come in a row."""
        cfg, step = self.cfg, self.state.step
        what = (f"loss ({result.train_loss})" if not math.isfinite(result.train_loss)
                else f"gradient norm ({result.grad_norm})")
        good = f"last good checkpoint: {self.last_checkpoint or 'none (no checkpoint was saved yet)'}"
        if result.applied:  # only a strategy that updates on its own could (DeepSpeed; it skips such steps)
            raise NonFiniteError(f"step {step}: non-finite {what} and the update was applied, so the weights are "
                                 f"not finite now; nothing was saved from this step; {good}")
        if cfg.nonfinite == "stop":
            raise NonFiniteError(f"step {step}: non-finite {what}; the update was not applied and nothing was "
                                 f"saved; {good} (resume with --resume auto, e.g. with a lower --base_hps.eta0, "
                                 "or train on with --nonfinite skip)")
        self.nonfinite_in_a_row += 1
        if self.nonfinite_in_a_row > cfg.nonfinite_max:
            raise NonFiniteError(f"step {step}: {self.nonfinite_in_a_row} non-finite steps in a row (the last: "
                                 f"{what}; --nonfinite_max {cfg.nonfinite_max}), giving up; none of them was "
                                 f"applied; {good}")
        self.log(f"step {step}: non-finite {what}; update skipped ({self.nonfinite_in_a_row} in a row, at most "
                 f"{cfg.nonfinite_max})")

    def _report(self, result: StepResult, val_loss: Optional[float], force: bool, window: _Window,
                progress: Progress) -> None:
        """A metrics row (and a forced progress line) on log steps; otherwise just the progress bar."""
        state = self.state
        if not force:
            progress.update(state.step, result.train_loss, window.rate())
            return
        tok_s = window.rate()
        if self.metrics is not None:
            row = dict(step=state.step, tokens=state.tokens, train_loss=result.train_loss, val_loss=val_loss,
                       lr=result.lr, grad_norm=result.grad_norm, tokens_per_sec=tok_s,
                       mfu=tok_s * self.plan.flops_per_token / (self.peak * self.env.world_size))
            if self.cfg.precision == "fp16-mixed":
                row["loss_scale"] = self.strategy.loss_scale()
            if self.curriculum is not None:
                row["seq_len"] = result.seq_len
            if self.strategy.comm is not None:  # bytes this rank all-reduced for the step's gradients
                row["comm_bytes"] = self.strategy.comm.last_step_bytes
            row.update({f"lr_{g.get('name', i)}": result.lr * g.get("lr_mult", 1.0)
                        for i, g in enumerate(self.groups)})
            self.metrics.write(**row)
        progress.update(state.step, result.train_loss, tok_s, val_loss, force=True)
        window.reset()

    def fit(self, on_step: Optional[Callable[[int], None]] = None) -> Path:
        cfg, env, state = self.cfg, self.env, self.state
        val_loss = None
        if self.resume_from is None and self.validating:  # sanity pass: the curve's first point is the init loss
            val_loss = self.validate_now()
            if self.metrics is not None:
                self.metrics.write(step=0, tokens=0, val_loss=val_loss)
            self.log(f"step 0: val_loss {val_loss:.4f}")
        last_step = min(self.plan.max_steps, cfg.max_steps) if cfg.max_steps else self.plan.max_steps
        progress = Progress(last_step, state.step, enabled=cfg.progress and env.is_main)
        window = _Window()
        last_saved = state.step if self.resume_from is not None else -1
        with _StopFlag() as stop:
            while state.step < last_step:
                result = self.train_step(state, self.loader)
                window.add(result.seconds, self.plan.batch_tokens)
                if result.finite:
                    self.nonfinite_in_a_row = 0
                else:
                    self._on_nonfinite(result)
                is_last = state.step == last_step
                val_loss = None
                if self.validating and (state.step % cfg.eval_interval == 0 or is_last):
                    val_loss = self.validate_now()
                self._report(result, val_loss, state.step % cfg.log_interval == 0 or is_last or val_loss is not None,
                             window, progress)
                if on_step is not None:
                    on_step(state.step)
                stop_requested = env.any(stop.signum is not None)  # all ranks stop at the same step
                if state.step % cfg.save_interval == 0 or is_last or stop_requested:
                    self.save()
                    last_saved = state.step
                if stop_requested:
                    signum = stop.signum or signal.SIGTERM
                    self.log(f"{signal.Signals(signum).name}: saved checkpoint at step {state.step}; resume with "
                             "--resume auto")
                    sys.exit(128 + signum)
        if last_saved != state.step:
            self.save()
        self.log(f"done: step {state.step}, {state.tokens:,} tokens"
                 + (f", val_loss {val_loss:.4f}" if val_loss is not None else "") + comm_summary(self.strategy.comm)
                 + f". Run dir: {self.out_dir}")
        return self.out_dir
