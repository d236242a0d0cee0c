"""The training loop: one process or many (torchrun), the same code.

plan -> model -> parallelize (parallelize.py) -> optimizer / DeepSpeed engine -> loader -> resume ->
loop {accumulate, clip, step, log, eval, save} -> final save.
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
import torch.nn.functional as F
import yaml

from archscale.config import ModelConfig, arch_preset
from archscale.data.loader import GlobalOrderLoader, load_mixture, read_manifest, validation_batches
from archscale.errors import UserError
from archscale.models.model import GPT
from archscale.scaling_rules import RoleRule, default_tokens, resolve_batch_and_lr, resolve_parametrization
from archscale.train import checkpoint as ckpt
from archscale.train.config import PretrainConfig, apply_train_name, rope_scaling_factor, validate
from archscale.train.deepspeed_engine import build_engine, ds_config, to_universal
from archscale.train.deepspeed_engine import loss_scale as ds_loss_scale
from archscale.train.distributed import DistEnv
from archscale.train.distributed import setup as setup_distributed
from archscale.models.varlen import document_ids, document_positions
from archscale.ops.cross_entropy import select_loss
from archscale.train.loggers import Loggers, SystemMonitor, seed_wandb_config
from archscale.train.metrics import Progress, peak_flops
from archscale.train.optim import build_adamw, param_groups, set_lr
from archscale.train.parallelize import parallelize, unwrap
from archscale.train.schedule import lr_at


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
    preset = arch_preset(cfg.train_model)  # e.g. Phi4-mini-Flash's 200,064 tied vocabulary
    vocab = cfg.vocab_size or preset.get("vocab_size") or (manifest or {}).get("vocab_size") or default_vocab
    tie = cfg.tie_embeddings or ("tie_embeddings" not in explicit and preset.get("tie_embeddings", False))
    if not vocab:
        raise UserError(f"{cfg.train_data_dir} has no manifest.json to read the vocab size from; pass --vocab_size")
    if manifest and manifest.get("vocab_size", 0) > vocab:
        raise UserError(f"{cfg.train_data_dir}/manifest.json: data vocab {manifest['vocab_size']} > --vocab_size "
                        f"{vocab}; the model cannot embed those token ids (drop --vocab_size or raise it)")
    hps = cfg.base_hps
    sizes = ModelConfig.from_arch(cfg.train_model, cfg.depth, ar=cfg.ar, vocab_size=int(vocab),
                                  block_size=cfg.ctx_len, rope_base=cfg.rope_base, tie_embeddings=tie,
                                  rope_scaling=rope_scaling_factor(cfg.rope_scaling))
    rules = resolve_parametrization(cfg.parametrization, hps, cfg.depth, sizes.n_layer, sizes.head_size, tie=tie)
    model_cfg = sizes.replace(**rules.model_overrides())
    batch, accum, lr = resolve_batch_and_lr(hps, cfg.micro_bsz, cfg.ctx_len, world_size)
    lr = lr * rules.global_lr_mult
    total = int(cfg.max_tokens if cfg.max_tokens is not None
                else default_tokens(hps, cfg.train_model, cfg.depth, ar=cfg.ar))
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
    run_name = f"{cfg.train_name}_{cfg.train_model}_d{cfg.depth}_ctx{cfg.ctx_len}"
    with torch.device("meta"):
        meta = GPT(model_cfg)
    plan = Plan(run_name=run_name, out_dir=cfg.out_dir or str(Path("runs") / run_name), vocab_size=int(vocab),
                batch_tokens=batch, grad_accum=accum, lr=lr, min_lr=hps.min_lr0, total_tokens=total,
                max_steps=max_steps, warmup_steps=warmup, non_embedding_params=meta.num_params(),
                flops_per_token=meta.flops_per_token(cfg.ctx_len), train_name_settings=applied,
                train_name_unknown=unknown, parametrization=rules.parametrization,
                lr_mult_matrix=rules.matrix.lr_mult, lr_mult_vector=rules.vector.lr_mult,
                wd_matrix=rules.matrix.weight_decay, wd_vector=rules.vector.weight_decay)
    return plan, model_cfg


DRY_RUN_DEFAULT_VOCAB = 32000


def dry_run_summary(cfg: PretrainConfig, explicit: set[str] = frozenset(), world_size: int = 1,
                    warn: Callable[[str], None] = print) -> dict:
    """The fully resolved plan as a JSON-able dict, without data (vocab 32000 unless --vocab_size or a manifest
    says otherwise) and without touching out_dir."""
    plan, m = make_plan(cfg, set(explicit), world_size=world_size, warn=warn, default_vocab=DRY_RUN_DEFAULT_VOCAB)
    with torch.device("meta"):
        meta = GPT(m)
    return {
        "run_name": plan.run_name, "out_dir": plan.out_dir, "model": m.name, "parametrization": plan.parametrization,
        "n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head, "n_kv_head": m.n_query_groups,
        "head_size": m.head_size, "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
        "padded_vocab_size": m.padded_vocab_size, "tie_embeddings": m.tie_embeddings,
        "n_params": meta.num_params(non_embedding=False), "n_params_non_embedding": plan.non_embedding_params,
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
    }


def print_dry_run(cfg: PretrainConfig, explicit: set[str] = frozenset()) -> None:
    """`--dry_run`: the JSON plan on stdout (warnings go to stderr so stdout stays parseable)."""
    summary = dry_run_summary(cfg, explicit, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                              warn=lambda msg: print(msg, file=sys.stderr))
    print(json.dumps(summary, indent=2))


def resolved_yaml(cfg: PretrainConfig, plan: Plan, model_cfg: ModelConfig) -> str:
    return yaml.safe_dump({"pretrain": dataclasses.asdict(cfg), "plan": dataclasses.asdict(plan),
                           "model": model_cfg.to_dict()}, sort_keys=False)


def make_forward(cfg: PretrainConfig, eos_id: Optional[int], return_hidden: bool = False) -> Callable:
    """model, inputs -> logits (or (hidden, head weight) for a chunked loss); with --varlen the documents (from
    EOS) mask attention and reset Mamba states."""
    if not cfg.varlen:
        return lambda model, x: model(x, return_hidden=return_hidden)

    def forward(model, x):
        docs = document_ids(x, eos_id)
        return model(x, doc_ids=docs, position_ids=document_positions(docs) if cfg.reset_position_ids else None,
                     return_hidden=return_hidden)
    return forward


def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device, autocast,
             env: Optional[DistEnv] = None, pad: int = 0, pad_batch: Optional[torch.Tensor] = None,
             forward: Callable = lambda model, x: model(x)) -> float:
    """Mean token loss over all ranks' `batches`. `pad` extra forwards (results discarded) keep every rank at
    the same number of forwards, which sharded models (FSDP2, ZeRO-3) need: their forward is collective."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, token count)
    with torch.no_grad(), autocast():
        for i, batch in enumerate(batches + [pad_batch] * pad):
            batch = batch.to(device)
            logits = forward(model, batch[:, :-1])
            if i >= len(batches):
                continue
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total[0] += loss.item()
            total[1] += batch[:, 1:].numel()
    if env is not None:
        env.sum_(total)
    model.train()
    return float(total[0] / total[1].clamp_min(1))


def check_token_range(batch: torch.Tensor, vocab_size: int, data_dir: str) -> None:
    top = int(batch.max())
    if top >= vocab_size:
        raise UserError(f"{data_dir}: token id {top} >= vocab size {vocab_size}; the shards were made with a "
                        "larger tokenizer (pass the right --vocab_size)")


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


def pretrain(cfg: PretrainConfig, explicit: set[str] = frozenset(),
             log: Callable[[str], None] = print,
             on_step: Optional[Callable[[int], None]] = None) -> Optional[Path]:
    """Train according to `cfg`; returns the run directory (None after `--dry_run`, which trains nothing and
    prints the plan). `explicit` names the flags the user set. `on_step(step)` runs after each optimizer step,
    before that step's checkpoint decision (tests use it to deliver signals at an exact step).

    Under torchrun every process calls this; the strategy (distributed.py) decides how they cooperate. Only
    rank 0 logs, writes metrics.csv and shows the progress bar."""
    if cfg.dry_run:
        print_dry_run(cfg, explicit)
        return None
    strategy = "fsdp" if (cfg.fsdp_save_mem and cfg.strategy == "auto") else cfg.strategy
    validate(cfg)  # before any process group exists, so bad flags fail fast everywhere
    env = setup_distributed(strategy)
    try:
        return _train(cfg, set(explicit), env, log if env.is_main else (lambda msg: None), on_step)
    finally:
        env.close()


def _train(cfg: PretrainConfig, explicit: set[str], env: DistEnv, log: Callable[[str], None],
           on_step: Optional[Callable[[int], None]]) -> Path:
    plan, model_cfg = make_plan(cfg, explicit, world_size=env.world_size, warn=log)
    device = env.device
    out_dir = Path(plan.out_dir)
    ckpt_root = out_dir / "checkpoints"
    val_dir = cfg.val_data_dir or cfg.train_data_dir
    block = cfg.ctx_len + 1
    use_ds = env.strategy == "deepspeed"

    # ---- where to start (every rank reads the shared file system; nothing writes to it yet)
    resume_from = None
    if cfg.resume == "auto":
        resume_from = ckpt.find_latest(ckpt_root, warn=log)
    elif cfg.resume != "none":
        resume_from = Path(cfg.resume)
    elif ckpt.complete_checkpoints(ckpt_root):
        raise UserError(f"--out_dir {out_dir} already holds checkpoints; use --resume auto to continue, or pick "
                        "another --out_dir")
    config_yaml = resolved_yaml(cfg, plan, model_cfg)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(config_yaml)
    env.barrier()

    # ---- model -> parallelize -> optimizer (every rank builds the same init from the same seed)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device)
    act_ckpt = cfg.act_ckpt or cfg.fsdp_save_mem
    compile_blocks = cfg.compile and not cfg.fsdp_save_mem
    if cfg.compile and cfg.fsdp_save_mem:
        log("note: --fsdp_save_mem turns --compile off (as the seed does)")
    bf16, fp16 = cfg.precision == "bf16-mixed", cfg.precision == "fp16-mixed"
    # FSDP2's CPUOffloadPolicy needs an accelerator to offload from; on a CPU machine the shards already live in
    # host memory, so --fsdp_save_mem is activation checkpointing only there.
    cpu_offload = cfg.fsdp_save_mem and env.strategy == "fsdp" and device.type == "cuda"
    if cfg.fsdp_save_mem and not cpu_offload:
        log("note: --fsdp_save_mem on CPU = activation checkpointing (FSDP2 CPU offload needs a GPU to offload from)")
    model = parallelize(model, env, act_ckpt=act_ckpt, compile=compile_blocks, bf16=bf16, cpu_offload=cpu_offload)
    hps = cfg.base_hps
    matrix_rule, vector_rule = plan.group_rules()  # SP: the same rule for both groups
    groups = param_groups(unwrap(model), matrix_rule, vector_rule)
    engine = None
    if use_ds:
        ds_cfg = ds_config(micro_bsz=cfg.micro_bsz, grad_accum=plan.grad_accum, world_size=env.world_size,
                           zero_stage=cfg.zero_stage, precision=cfg.precision, offload=cfg.offload,
                           cuda=device.type == "cuda")
        universal = None
        if resume_from is not None and ckpt.is_deepspeed_checkpoint(resume_from):
            saved_world = torch.load(resume_from / "train_state_rank0.pt", weights_only=False).get("world_size", 1)
            if saved_world != env.world_size:  # ZeRO states are partitioned per rank: go through "universal"
                universal = ckpt_root / f".universal-{resume_from.name}"
                if env.is_main:
                    shutil.rmtree(universal, ignore_errors=True)
                    log(f"converting {resume_from} (ZeRO over {saved_world} ranks) to a universal checkpoint")
                    to_universal(resume_from, universal)
                env.barrier()
                ds_cfg["checkpoint"] = {"load_universal": True}
        engine = build_engine(model, groups, plan.lr, (hps.beta1_0, hps.beta2_0), hps.eps0, ds_cfg)
        ds_cfg.pop("checkpoint", None)
        model, optimizer = engine, engine.optimizer
        if env.is_main:
            (out_dir / "deepspeed_config.json").write_text(json.dumps(ds_cfg, indent=1))
    else:
        optimizer = build_adamw(groups, plan.lr, (hps.beta1_0, hps.beta2_0), hps.eps0)
    scaler = torch.amp.GradScaler(device.type) if (fp16 and not use_ds) else None

    # ---- data: one global sample order, rank r takes micro-batches r, r+W, ... (the same global batches
    # whatever the world size; see GlobalOrderLoader)
    mixture = load_mixture(cfg.data_mixture, cfg.train_data_dir) if cfg.data_mixture else "train"
    loader = GlobalOrderLoader(cfg.train_data_dir, mixture, block_size=block, micro_bsz=cfg.micro_bsz,
                               seed=cfg.seed, rank=env.rank, world_size=env.world_size,
                               num_workers=cfg.num_workers)
    eos_id = (read_manifest(cfg.train_data_dir) or {}).get("eos_id")
    if cfg.varlen and eos_id is None:
        raise UserError(f"--varlen: {cfg.train_data_dir}/manifest.json has no eos_id to find document boundaries "
                        "(prepare the data with `archscale prepare`)")
    loss_fn = select_loss(cfg.loss, model_cfg.vocab_size, zero3=use_ds and cfg.zero_stage == 3)  # --loss
    forward, eval_forward = make_forward(cfg, eos_id, return_hidden=loss_fn.wants_hidden), make_forward(cfg, eos_id)
    val_batches, val_pad, val_filler = [], 0, None
    if cfg.eval_iters > 0:
        everything = list(validation_batches(val_dir, "validation", block_size=block,
                                             micro_bsz=max(1, cfg.micro_bsz), max_batches=cfg.eval_iters))
        for b in everything:
            check_token_range(b, model_cfg.vocab_size, val_dir)
        val_batches = everything[env.rank::env.world_size]
        val_pad = -(-len(everything) // env.world_size) - len(val_batches)
        val_filler = everything[0]
    autocast_dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext

    step, tokens, val_loss = 0, 0, None
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, unwrap(model) if env.strategy == "ddp" else model,
                                     None if use_ds else optimizer, rank=env.rank, engine=engine, warn=log,
                                     ds_universal=universal if use_ds else None)
        if use_ds and universal is not None:
            env.barrier()
            if env.is_main:
                shutil.rmtree(universal, ignore_errors=True)
        saved_batch = state.get("batch_tokens", plan.batch_tokens)
        if saved_batch != plan.batch_tokens:
            raise UserError(f"--resume {resume_from}: it was trained with {saved_batch}-token batches, this run "
                            f"makes {plan.batch_tokens} (the world size changes how --base_hps.b0 is rounded); "
                            "pick --micro_bsz/--base_hps.b0 so that both world sizes give the same batch")
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        if scaler is not None and state.get("grad_scaler"):
            scaler.load_state_dict(state["grad_scaler"])
        step, tokens = state["step"], state["tokens"]
        saved_world = state.get("world_size", 1)
        log(f"resumed from {resume_from} at step {step} ({tokens:,} tokens)"
            + (f"; world size {saved_world} -> {env.world_size}" if saved_world != env.world_size else ""))
    extra_cols = ("loss_scale",) if fp16 else ()
    wb_config, wb_tags = seed_wandb_config(cfg)
    metrics = Loggers(out_dir, cfg.logger, resume_step=step if resume_from is not None else None, extra=extra_cols,
                      config={**wb_config, "plan": dataclasses.asdict(plan)}, run_name=plan.run_name,
                      project=cfg.wandb_project, tags=wb_tags) if env.is_main else None
    monitor = (SystemMonitor(metrics, cfg.monitor_interval, console=log).start()
               if metrics is not None and cfg.monitor_interval > 0 else None)

    def close_loggers() -> None:
        if monitor is not None:
            monitor.stop()
        if metrics is not None:
            metrics.close()

    peak, peak_src = peak_flops(device, torch.bfloat16 if bf16 else torch.float32)
    log(f"run {out_dir}: {model_cfg.name}, {plan.non_embedding_params / 1e6:.2f}M non-embedding params, "
        f"{plan.max_steps} steps x {plan.batch_tokens:,} tokens (accum {plan.grad_accum} x {env.world_size} "
        f"process{'es' if env.world_size > 1 else ''}, {env.strategy}"
        + (f" ZeRO-{cfg.zero_stage}" + (f" offload {cfg.offload}" if cfg.offload != "none" else "") if use_ds else "")
        + f"), {plan.parametrization}, lr {plan.lr * plan.lr_mult_matrix:.3g} matrix / "
        f"{plan.lr * plan.lr_mult_vector:.3g} vector, warmup {plan.warmup_steps} steps, {cfg.precision} on "
        f"{device.type}; peak {peak / 1e9:,.0f} GFLOP/s per process ({peak_src})")

    def save(tag_step: int) -> Path:
        state = {"step": tag_step, "tokens": tokens, "loader": loader.state_dict(), "rng": ckpt.rng_state(),
                 "world_size": env.world_size, "strategy": env.strategy, "batch_tokens": plan.batch_tokens,
                 "grad_scaler": scaler.state_dict() if scaler is not None else None}
        return ckpt.save_checkpoint(ckpt_root, tag_step, unwrap(model) if env.strategy == "ddp" else model,
                                    None if use_ds else optimizer, state, config_yaml, cfg.keep_last,
                                    rank=env.rank, barrier=env.barrier, engine=engine)

    def validate_now() -> float:
        return evaluate(model, val_batches, device, autocast, env, val_pad, val_filler, forward=eval_forward)

    if resume_from is None and cfg.eval_iters > 0:  # sanity pass at start: the curve's first point is the init loss
        val_loss = validate_now()
        if metrics is not None:
            metrics.write(step=0, tokens=0, val_loss=val_loss)
        log(f"step 0: val_loss {val_loss:.4f}")
    last_step = min(plan.max_steps, cfg.max_steps) if cfg.max_steps else plan.max_steps
    progress = Progress(last_step, step, enabled=cfg.progress and env.is_main)
    window_time, window_tokens = 0.0, 0
    last_saved = step if resume_from is not None else -1
    accum = plan.grad_accum
    with _StopFlag() as stop:
        while step < last_step:
            t_start = time.perf_counter()
            lr = lr_at(step, plan.lr, plan.min_lr, plan.warmup_steps, plan.max_steps, cfg.schedule)
            set_lr(optimizer, lr)  # per group: lr * lr_mult (the same groups under every strategy)
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                batch = next(loader)
                check_token_range(batch, model_cfg.vocab_size, cfg.train_data_dir)
                batch = batch.to(device, non_blocking=True)
                sync = model.no_sync() if env.strategy == "ddp" and micro < accum - 1 else nullcontext()
                with sync:
                    with autocast():
                        logits = forward(model, batch[:, :-1])
                    loss = loss_fn(logits, batch[:, 1:], cfg.label_smoothing)
                    if use_ds:
                        engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
                        engine.step()  # steps (clip, update) only at the accumulation boundary
                    elif scaler is not None:
                        scaler.scale(loss / accum).backward()
                    else:
                        (loss / accum).backward()
                loss_sum += loss.detach()  # no .item() here: it would sync the GPU every micro-batch
            if use_ds:
                grad_norm = float(engine.get_global_grad_norm() or 0.0)
                scale = ds_loss_scale(engine)
            else:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                    scale = float(scaler.get_scale())
                else:
                    optimizer.step()
                    scale = None
                optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += plan.batch_tokens
            window_time += time.perf_counter() - t_start
            window_tokens += plan.batch_tokens
            train_loss = env.mean(loss_sum.double() / accum)  # the global batch's loss, on every rank
            if not math.isfinite(train_loss):
                save(step)
                raise RuntimeError(f"loss is {train_loss} at step {step}; checkpoint saved for inspection")

            is_last = step == last_step
            val_loss = None
            if cfg.eval_iters > 0 and (step % cfg.eval_interval == 0 or is_last):
                val_loss = validate_now()
            if step % cfg.log_interval == 0 or is_last or val_loss is not None:
                tok_s = window_tokens / max(window_time, 1e-9)
                if metrics is not None:
                    row = dict(step=step, tokens=tokens, train_loss=train_loss, val_loss=val_loss, lr=lr,
                               grad_norm=grad_norm, tokens_per_sec=tok_s,
                               mfu=tok_s * plan.flops_per_token / (peak * env.world_size))
                    if fp16:
                        row["loss_scale"] = scale
                    row.update({f"lr_{g.get('name', i)}": lr * g.get("lr_mult", 1.0) for i, g in enumerate(groups)})
                    metrics.write(**row)
                progress.update(step, train_loss, tok_s, val_loss, force=True)
                window_time, window_tokens = 0.0, 0
            else:
                progress.update(step, train_loss, window_tokens / max(window_time, 1e-9))
            if on_step is not None:
                on_step(step)
            stop_requested = env.any(stop.signum is not None)  # all ranks stop at the same step
            if step % cfg.save_interval == 0 or is_last or stop_requested:
                save(step)
                last_saved = step
            if stop_requested:
                signum = stop.signum or signal.SIGTERM
                log(f"{signal.Signals(signum).name}: saved checkpoint at step {step}; resume with --resume auto")
                close_loggers()
                env.close()
                sys.exit(128 + signum)
    if last_saved != step:
        save(step)
    close_loggers()
    log(f"done: step {step}, {tokens:,} tokens" + (f", val_loss {val_loss:.4f}" if val_loss is not None else "")
        + f". Run dir: {out_dir}")
    return out_dir
