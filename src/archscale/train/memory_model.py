"""Know before you launch: the predicted peak memory per rank of a training run, and its step time.

`predict_memory(cfg, model_cfg, ...)` adds up, per rank, in bytes:

- model states by strategy (P parameters): single / DDP keep fp32 weights and fp32 gradients (DDP's gradients are
  views into its all-reduce buckets, alive between steps) and AdamW's two fp32 moments: 4 + 4 + 8 B/param; FSDP2
  shards all three (16/N) and all-gathers one block at a time (plus the next one, prefetched) in bf16 under
  bf16-mixed, the root (embedding, head) for the whole forward and backward; DeepSpeed ZeRO keeps bf16 weights:
  stage 0 20, stage 1 4 + 12/N, stage 2 2 + 14/N, stage 3 16/N B/param (Rajbhandari et al. 2020; measured in
  `benchmarks/zero_stages.py`), plus its reduce / all-gather buckets; offload moves the fp32 states to the host;
  a pipeline stage holds its own blocks (`--pp`), an expert-parallel rank 1/ep of the experts (`--ep`); which
  gradients live between steps (`grads_between_steps`: DeepSpeed stage 0's only in the step) and the clip's
  buffers (`clip_buffers`: `--ep`'s float64 norm of the expert gradients);
- activations: for every layer what its mixer and feed-forward declare they save for backward
  (`MixerSpec.saved`, the registry; nothing here names a mixer), the block norms' fp32 inputs, and under autocast
  the bf16 copy of every matmul weight that autograd keeps until that layer's backward; with `--act_ckpt` only
  each block's fp32 input and what outlives a block (GMU memory, YOCO's K/V), plus one block recomputed in
  backward (its saved tensors and as many bytes of their gradients: RECOMPUTE_FACTOR), which happens after the
  loss's buffers are freed (the larger of the two counts);
- the loss: plain logits (bf16 logits, fp32 log-softmax and two fp32 gradients: LOGIT_BYTES per token and vocab
  entry), or the chunked loss's fp32 chunk of logits and hidden-state gradient;
- the allocator's overhead as a factor on everything: 1.0 for the live-tensor census on CPU (what
  `memory_measure.LivePeak` measures), ALLOCATOR_FACTOR_CUDA on a GPU (the caching allocator's reserved over
  allocated; `benchmarks/gpu_check.py` prints the measured ratio beside the prediction).

The peak is the larger of two moments: the start of backward (states, every activation, the loss's buffers) and
the optimizer step (states plus full gradients). `suggest()` names the first of micro_bsz / act_ckpt /
fsdp_save_mem / ZeRO stage that makes a plan fit; `step_time()` turns the model's own FLOP count into tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.mixers.base import SaveEnv, spec_for

GIB = 2 ** 30
# the named GPUs of --target: memory in bytes, dense bf16 peak FLOP/s, the interconnect's bytes/s per GPU
TARGETS = {
    "h100": {"memory": 80 * GIB, "peak_flops": 989e12, "bandwidth": 450e9},
    "h200": {"memory": 141 * 10 ** 9, "peak_flops": 989e12, "bandwidth": 450e9},
    "a100": {"memory": 80 * GIB, "peak_flops": 312e12, "bandwidth": 300e9},
}
DEFAULT_MFU = 0.35  # assumed MFU of a bf16 run on a GPU, not measured here (gpu_check.sh measures it; --mfu)
ALLOCATOR_FACTOR_CUDA = 1.10  # CUDA caching allocator: reserved / allocated at the peak (fragmentation, rounding)
LOGIT_BYTES = 14  # plain loss, per token x vocab entry: bf16 logits, fp32 log-softmax and two fp32 gradients
RECOMPUTE_FACTOR = 2.0  # --act_ckpt: a recomputed block's saved bytes x this while backward runs through it
BUCKET_ELEMENTS = 20_000_000  # DeepSpeed's reduce / all-gather bucket (deepspeed_engine.BUCKET_ELEMENTS)
CLIP_EP_BYTES = 4 + 8 + 8  # --ep clip, per local expert weight: fp32 flat copy, its float64 copy and square


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '141e9', '512MB' -> bytes (GB = 10^9 as GPU vendors write it, GiB = 2^30)."""
    s = str(text).strip().replace(" ", "")
    units = {"tib": 2 ** 40, "gib": GIB, "mib": 2 ** 20, "kib": 2 ** 10, "tb": 10 ** 12, "gb": 10 ** 9,
             "mb": 10 ** 6, "kb": 10 ** 3, "b": 1}
    for unit, mult in units.items():
        if s.lower().endswith(unit):
            number, scale = s[: -len(unit)], mult
            break
    else:
        number, scale = s, 1
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--device_memory {text!r}: give a size such as 80GB, 80GiB or 512MiB")
    return int(value)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the memory model reads from a run: sizes per rank, precision, strategy and memory savers."""

    micro_bsz: int
    ctx_len: int
    precision: str = "bf16-mixed"
    strategy: str = "single"  # single | ddp | fsdp | deepspeed
    world_size: int = 1
    zero_stage: int = 0
    offload: str = "none"
    act_ckpt: bool = False
    fsdp_save_mem: bool = False
    loss: str = "plain"  # plain | chunked (resolved)
    pp: int = 1
    ep: int = 1
    device: str = "cuda"

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def checkpointed(self) -> bool:
        return self.act_ckpt or self.fsdp_save_mem


def shape_of(cfg, world_size: int, device: str = "cuda") -> RunShape:
    """The RunShape of a PretrainConfig (strategy 'auto' resolved as the trainer does)."""
    from archscale.kernels.cross_entropy import select_loss

    strategy = cfg.strategy
    if strategy == "auto":
        strategy = "fsdp" if (world_size > 1 or cfg.fsdp_save_mem) else "single"
    if cfg.pp > 1 and cfg.strategy == "auto":
        strategy = "ddp"
    zero3 = strategy == "deepspeed" and cfg.zero_stage == 3
    return RunShape(micro_bsz=cfg.micro_bsz, ctx_len=cfg.ctx_len, precision=cfg.precision, strategy=strategy,
                    world_size=world_size, zero_stage=cfg.zero_stage if strategy == "deepspeed" else 0,
                    offload=cfg.offload, act_ckpt=cfg.act_ckpt, fsdp_save_mem=cfg.fsdp_save_mem,
                    loss=select_loss(cfg.loss, cfg.vocab_size or 0, zero3=zero3).name if cfg.vocab_size else "plain",
                    pp=cfg.pp, ep=cfg.ep, device=device)


# ------------------------------------------------------------------------------------------------ parameters
def parameter_counts(model_cfg: ModelConfig, shape: RunShape) -> dict[str, float]:
    """Parameters this rank holds before sharding ("params"), the matmul weights autocast copies ("cast"), the
    largest block ("block") and what sits outside blocks ("root"), on a meta-device model."""
    from archscale.models.model import GPT

    with torch.device("meta"):
        model = GPT(model_cfg)
    experts = {id(p) for m in model.modules() if hasattr(m, "expert_parameters") for p in m.expert_parameters()}
    blocks = [sum(p.numel() / (shape.ep if id(p) in experts else 1) for p in b.parameters()) for b in model.blocks]
    block_cast = [sum(p.numel() / (shape.ep if id(p) in experts else 1) for p in b.parameters() if p.ndim >= 2)
                  for b in model.blocks]
    head = model.lm_head.weight.numel()
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    stage = math.ceil(len(blocks) / max(1, shape.pp))  # a pipeline stage's share of the blocks
    own_blocks = sum(sorted(blocks, reverse=True)[:stage]) if shape.pp > 1 else sum(blocks)
    own_cast = sum(sorted(block_cast, reverse=True)[:stage]) if shape.pp > 1 else sum(block_cast)
    # this rank's expert weights (1/ep of every MoE layer's, in its stage's share of the blocks)
    own_experts = sum(p.numel() for p in model.parameters() if id(p) in experts) / shape.ep * stage / len(blocks)
    return {"params": own_blocks + root, "cast": own_cast + head, "block": max(blocks), "root": root,
            "experts": own_experts}


def model_states(counts: dict[str, float], shape: RunShape) -> dict[str, float]:
    """Bytes of parameters, gradients, optimizer states, gathered parameters and buckets on one rank."""
    P, N = counts["params"], max(1, shape.world_size // max(1, shape.pp))
    bf16 = shape.precision != "fp32"
    out = {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "unsharded_params": 0.0, "comm_buckets": 0.0}
    if shape.strategy == "fsdp":
        out = {k: v / N for k, v in out.items()}
        gathered = 2 if bf16 else 4
        # the root is gathered for the whole step; a block and the next one (prefetch), and in backward the
        # block's unsharded gradient plus its fp32 reduce-scatter input
        out["unsharded_params"] = gathered * (counts["root"] + 2 * counts["block"])
        out["comm_buckets"] = (gathered + 4) * counts["block"]
        if shape.fsdp_save_mem and shape.device == "cuda":  # CPUOffloadPolicy: shards and states on the host
            out.update(params=0.0, grads=0.0, optimizer=0.0)
    elif shape.strategy == "deepspeed":
        out = zero_states(P, N, shape)
    return out


def grads_between_steps(states: dict[str, float], counts: dict[str, float], shape: RunShape) -> float:
    """Bytes of gradients alive from one step to the next (so at the start of backward too).

    DDP's gradients are views into its all-reduce buckets, which live on; but with `--ep` the expert weights are
    DTensors DDP ignores, and their gradients are set to None after each step (`zero_grad(set_to_none=True)`).
    DeepSpeed stage 0 under bf16/fp16 (DeepSpeed's FP16_UnfusedOptimizer: our AdamW is not its FusedAdam) makes
    the half-precision gradients in backward and their fp32 copies in its step, and frees both after it: none
    between steps. ZeRO-1/2/3 keep their gradient partitions and buckets."""
    if shape.strategy == "ddp":
        return states["grads"] - 4 * counts["experts"] * (shape.ep > 1)
    if shape.strategy == "deepspeed":
        return 0.0 if shape.zero_stage == 0 and shape.precision != "fp32" else states["grads"]
    return 0.0


def clip_buffers(counts: dict[str, float], shape: RunShape) -> float:
    """Bytes the gradient clip makes on top of the gradients. `--ep`: `ExpertParallel.clip` concatenates the
    local expert gradients into one fp32 tensor (4 B/param) and takes its squared norm in float64 (`.double()`,
    then `.square()`: two 8 B/param temporaries alive together): CLIP_EP_BYTES per local expert weight. The
    dense clip (`clip_grad_norm_`) makes only per-tensor norms."""
    return CLIP_EP_BYTES * counts["experts"] if shape.ep > 1 else 0.0


def zero_states(P: float, N: int, shape: RunShape) -> dict[str, float]:
    """DeepSpeed ZeRO's per-rank model states (bf16 weights, fp32 master + moments + fp32 gradient partition)."""
    stage, half = shape.zero_stage, 2 if shape.precision != "fp32" else 4
    master = 0.0 if shape.offload != "none" else (12 if half == 2 else 8)
    bucket = min(BUCKET_ELEMENTS, P)
    if stage == 0:  # no ZeRO optimizer; bf16/fp16: half-precision gradients and their fp32 copies in the step
        return {"params": half * P, "grads": (half + 4 if half == 2 else 4) * P, "optimizer": master * P,
                "unsharded_params": 0.0, "comm_buckets": 0.0}
    grads = {1: half * P, 2: half * P / N, 3: half * P / N}[stage]
    # plus the fp32 gradient partition every stage keeps (DeepSpeed's own estimators count it too)
    return {"params": half * P / (N if stage == 3 else 1), "grads": grads + 4 * P / N,
            "optimizer": master * P / N, "unsharded_params": half * bucket if stage == 3 else 0.0,
            "comm_buckets": half * bucket}


# ------------------------------------------------------------------------------------------------ activations
def layer_saved(model_cfg: ModelConfig, env: SaveEnv, n_layers: Optional[int] = None) -> list[float]:
    """Bytes per token each layer keeps for backward: its mixer's and feed-forward's declarations (the registry)
    and the two block norms' (`norm_saved`; only the block's input when checkpointed). "per_layer" terms are
    returned separately by `layer_fixed`."""
    d, out = model_cfg.n_embd, []
    for i in range(n_layers if n_layers is not None else model_cfg.n_layer):
        total = 4 * d if env.act_ckpt else 2 * norm_saved(d, env.device)
        for slot, kind in (("mixer", model_cfg.layer_kinds[i]), ("ffn", model_cfg.ffn_kinds[i])):
            terms = spec_for(kind, slot).saved(model_cfg, kind, env)
            total += sum(v for k, v in terms.items() if k != "per_layer")
        out.append(total)
    return out


def norm_saved(d: int, device: str) -> float:
    """Bytes per token an RMSNorm keeps for backward: its fp32 input and 1/rms, and through autograd (CUDA) also
    the normalised input; the CPU kernel (`kernels/rms_norm.py`) recomputes that from the two."""
    return 4 * (d + 1) if device == "cpu" else 4 * (2 * d + 1)


def layer_fixed(model_cfg: ModelConfig, env: SaveEnv) -> float:
    """Bytes per layer that do not grow with the tokens (e.g. a scan's fp32 A), summed over the layers."""
    return sum(spec_for(kind, slot).saved(model_cfg, kind, env).get("per_layer", 0.0)
               for i in range(model_cfg.n_layer)
               for slot, kind in (("mixer", model_cfg.layer_kinds[i]), ("ffn", model_cfg.ffn_kinds[i])))


def activations(model_cfg: ModelConfig, shape: RunShape, counts: dict[str, float]) -> dict[str, float]:
    """Bytes of activations of one micro-batch at the start of backward (the largest moment)."""
    tokens = shape.micro_bsz * shape.ctx_len
    base = SaveEnv(seq_len=shape.ctx_len, act_bytes=shape.act_bytes, act_ckpt=False, device=shape.device)
    n_layers = math.ceil(model_cfg.n_layer / max(1, shape.pp))
    full = layer_saved(model_cfg, base, n_layers)
    recompute = 0.0
    if shape.checkpointed:  # every block's input (and what outlives blocks); in backward one block recomputed
        per_token = sum(layer_saved(model_cfg, dataclasses.replace(base, act_ckpt=True), n_layers))
        # the recomputed block's saved tensors, and the gradients of as many bytes its backward makes from them
        recompute = RECOMPUTE_FACTOR * tokens * max(full)
    else:
        per_token = sum(full)
    # outside the blocks: token ids, the final norm, lm_head's input; RoPE's fp32 cos/sin tables
    d = model_cfg.n_embd
    outside = (8 + norm_saved(d, shape.device) + shape.act_bytes * d + 8 * d
               + (0 if model_cfg.nope else 4 * model_cfg.head_size))
    # autocast's bf16 copies of fp32 weights, kept for backward (not under FSDP2 / DeepSpeed: weights already bf16)
    casts = 2 * counts["cast"] if shape.precision != "fp32" and shape.strategy in ("single", "ddp") else 0.0
    if shape.checkpointed:
        casts *= 1.0 / max(1, model_cfg.n_layer)  # only the recomputed block's
    return {"activations": tokens * (per_token + outside) + layer_fixed(model_cfg, base), "weight_copies": casts,
            "recompute": recompute}


def loss_buffers(model_cfg: ModelConfig, shape: RunShape) -> float:
    """Bytes of the loss at its peak (backward through the head)."""
    tokens, V, d = shape.micro_bsz * shape.ctx_len, model_cfg.padded_vocab_size, model_cfg.n_embd
    if shape.loss == "chunked":
        from archscale.kernels.cross_entropy import default_chunk_rows

        rows = min(tokens, default_chunk_rows(tokens, model_cfg.vocab_size, d))
        # fp32 hidden copy and its gradient, one chunk's fp32 logits, the fp32 head gradient and weight copy
        return 4 * (2 * tokens * d + 2 * rows * V + 2 * V * d)
    return LOGIT_BYTES * tokens * V


# ------------------------------------------------------------------------------------------------ the total
def predict_memory(model_cfg: ModelConfig, shape: RunShape, alloc_factor: Optional[float] = None) -> dict:
    """The per-rank breakdown (bytes) and the predicted peak."""
    counts = parameter_counts(model_cfg, shape)
    states = model_states(counts, shape)
    acts = activations(model_cfg, shape, counts)
    logits = loss_buffers(model_cfg, shape)
    resident = states["params"] + states["optimizer"] + states["unsharded_params"] + states["comm_buckets"]
    grads_between = grads_between_steps(states, counts, shape)
    # a checkpointed block is recomputed after the loss's buffers are freed: the larger of the two counts
    transient = max(logits, acts["recompute"])
    backward = resident + grads_between + acts["activations"] + acts["weight_copies"] + transient
    clip = clip_buffers(counts, shape)
    optimizer = resident + states["grads"] + clip
    factor = alloc_factor if alloc_factor is not None else (ALLOCATOR_FACTOR_CUDA if shape.device == "cuda" else 1.0)
    live = max(backward, optimizer)
    # the breakdown is the peak moment's: at the start of backward only the gradients kept between steps exist;
    # at the optimizer step the activations and the loss's buffers are gone
    at = ({**states, "grads": grads_between, **acts, "logits": logits if logits >= acts["recompute"] else 0.0,
           "recompute": acts["recompute"] if acts["recompute"] > logits else 0.0, "clip": 0.0} if backward >= optimizer else
          {**states, "activations": 0.0, "weight_copies": 0.0, "recompute": 0.0, "logits": 0.0, "clip": clip})
    return {"breakdown_bytes": {**at, "allocator": live * (factor - 1.0)},
            "peak_bytes": live * factor, "peak_at": "backward" if backward >= optimizer else "optimizer step",
            "allocator_factor": factor, "params_per_rank": counts["params"]}


def suggest(model_cfg: ModelConfig, shape: RunShape, device_memory: float) -> Optional[dict]:
    """The first change, in the order a researcher would try them (ArchScale's OOM checklist), whose predicted
    peak fits `device_memory`: --act_ckpt, --fsdp_save_mem, a ZeRO stage (several ranks), halving --micro_bsz."""
    tries = []
    if not shape.checkpointed:
        tries.append(({"act_ckpt": True}, "--act_ckpt"))
    if shape.world_size > 1 and shape.strategy in ("fsdp", "single", "ddp") and not shape.fsdp_save_mem:
        tries.append(({"strategy": "fsdp", "fsdp_save_mem": True}, "--fsdp_save_mem"))
    if shape.world_size > 1:
        for stage in (2, 3):
            if shape.strategy != "deepspeed" or shape.zero_stage < stage:
                tries.append(({"strategy": "deepspeed", "zero_stage": stage, "act_ckpt": True},
                              f"--strategy deepspeed --zero_stage {stage} --act_ckpt"))
    bsz = shape.micro_bsz
    while bsz > 1:
        bsz //= 2
        tries.append(({"micro_bsz": bsz, "act_ckpt": True}, f"--micro_bsz {bsz} --act_ckpt"))
    for change, flags in tries:
        trial = dataclasses.replace(shape, **change)
        peak = predict_memory(model_cfg, trial)["peak_bytes"]
        if peak <= device_memory:
            return {"flags": flags, "change": change, "peak_bytes": peak}
    return None


def memory_section(model_cfg: ModelConfig, shape: RunShape, device_memory: Optional[float] = None,
                   target: Optional[str] = None) -> dict:
    """The dry run's "memory" section: breakdown in GiB, the peak per rank, and the verdict with a suggestion."""
    pred = predict_memory(model_cfg, shape)
    if device_memory is None and target:
        device_memory = TARGETS[target]["memory"]
    out = {"per_rank_peak_gib": pred["peak_bytes"] / GIB, "peak_at": pred["peak_at"],
           "breakdown_gib": {k: v / GIB for k, v in pred["breakdown_bytes"].items()},
           "strategy": shape.strategy, "world_size": shape.world_size, "device": shape.device,
           "allocator_factor": pred["allocator_factor"],
           "assumptions": [f"{shape.precision}, micro_bsz {shape.micro_bsz} x ctx {shape.ctx_len}, "
                           f"{shape.loss} loss, act_ckpt {shape.checkpointed}",
                           "AdamW fp32 moments; activations from each mixer's MixerSpec.saved declaration",
                           f"allocator factor {pred['allocator_factor']:.2f} (caching allocator; 1.0 = live tensors)"]}
    if device_memory is not None:
        fits = pred["peak_bytes"] <= device_memory
        out.update(device_memory_gib=device_memory / GIB, fits=fits)
        if not fits:
            s = suggest(model_cfg, shape, device_memory)
            out["suggestion"] = (f"add {s['flags']} (predicted {s['peak_bytes'] / GIB:.2f} GiB)" if s else
                                 "nothing in micro_bsz / act_ckpt / fsdp_save_mem / ZeRO fits: add GPUs, shorten "
                                 "--ctx_len or pick a smaller --depth")
    return out


# ------------------------------------------------------------------------------------------------ step time
def comm_bytes(params: float, shape: RunShape) -> float:
    """Bytes each rank sends per optimizer step for its data-parallel strategy (ring collectives: 2 (N-1)/N of
    the gradients for an all-reduce; FSDP2 / ZeRO-3 all-gather the weights twice and reduce-scatter once)."""
    N = max(1, shape.world_size // max(1, shape.pp))
    if N == 1:
        return 0.0
    ring = (N - 1) / N
    grad = 4 if shape.strategy in ("ddp", "fsdp") else 2  # DDP / FSDP2 reduce fp32; DeepSpeed bf16
    weights = 2 if shape.precision != "fp32" else 4
    if shape.strategy == "fsdp" or (shape.strategy == "deepspeed" and shape.zero_stage == 3):
        return ring * params * (2 * weights + grad)
    return 2 * ring * params * grad


def step_time(flops_per_token: float, batch_tokens: int, total_tokens: int, world_size: int, params: float,
              shape: RunShape, target: str = "h100", mfu: float = DEFAULT_MFU) -> dict:
    """Seconds per optimizer step: compute (the model's FLOPs over world_size x peak x MFU) plus communication
    (its bytes over the interconnect's bandwidth, not overlapped: an upper bound); tokens/s and the run's wall
    time. `target`: a key of TARGETS."""
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1] (got {mfu})")
    t = TARGETS[target]
    compute = flops_per_token * batch_tokens / (max(1, world_size) * t["peak_flops"] * mfu)
    comm = comm_bytes(params, shape) / t["bandwidth"]
    step = compute + comm
    steps = total_tokens / batch_tokens
    return {"target": target, "seconds_per_step": step, "compute_s": compute, "comm_s": comm,
            "tokens_per_s": batch_tokens / step, "wall_time_h": steps * step / 3600,
            "assumptions": [f"{t['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak per GPU at MFU {mfu:.2f}",
                            f"{comm_bytes(params, shape) / 1e9:.2f} GB per step per rank over "
                            f"{t['bandwidth'] / 1e9:.0f} GB/s, not overlapped with compute",
                            f"FLOPs per token {flops_per_token:.3g} (model.flops_per_token: 3x forward, "
                            "attention included)"]}
