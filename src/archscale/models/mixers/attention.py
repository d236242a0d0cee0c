"""Attention mixers with grouped-query heads (GQA): full, sliding-window, the YOCO KV layer and cross-attention.

Self-attention layers ("attn", "swa", "kv", "kv_mem") use one fused projection `attn: d -> (H + 2G) * hd`, laid
out as [q (H*hd) | k (G*hd) | v (G*hd)]. A cross-attention layer ("cross") has only its query projection `q_proj`
and reads the K/V that the single "kv" layer produced in this forward pass (YOCO: one KV cache for the whole
cross-decoder). "kv_mem" is the KV layer that also exports its attention output before the output projection as
GMU memory (ArchScale's SambaY-A variants). RoPE rotates q and k in fp32 unless the architecture is NoPE.
Phi4-mini-Flash (`attn_bias`) has biases on the fused q/k/v projection and the output projection, as ArchScale's
`CausalSelfAttention`. With `use_da`, the softmax is replaced by differential attention (`diff_attention.py`).
The kernel choice lives in `archscale.kernels.attention.attend`.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.kernels.attention import attend, flash_attn_func
from archscale.models.cache import KVCache, WindowKVCache
from archscale.models.mixers.base import (BIAS, MATRIX, OUTPUT, VECTOR, ForwardContext, KernelRef, LayerOption,
                                         MixerSpec, SaveEnv, register)
from archscale.models.mixers.diff_attention import DifferentialAttention
from archscale.models.rope import apply_rope

KINDS = ("attn", "swa", "kv", "kv_mem", "cross")


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"not an attention kind: {kind!r}")
        H, G, hd, d = config.n_head, config.n_query_groups, config.head_size, config.n_embd
        self.kind, self.layer_idx = kind, layer_idx
        self.n_head, self.n_query_groups, self.head_size = H, G, hd
        in_bias = config.bias or config.attn_bias
        if kind == "cross":
            self.q_proj = nn.Linear(d, H * hd, bias=in_bias)
        else:
            self.attn = nn.Linear(d, (H + 2 * G) * hd, bias=in_bias)
        self.proj = nn.Linear(H * hd, d, bias=config.bias or config.attn_bias)
        self.scale = config.attn_scale_mult / math.sqrt(hd)
        self.window = config.sliding_window if kind == "swa" else 0
        self.use_rope = not config.nope
        self.diff = DifferentialAttention(hd, layer_idx, config.norm_eps) if config.use_da else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, G, hd = self.n_head, self.n_query_groups, self.head_size
        q_pos0 = ctx.pos
        if self.kind == "cross":
            q = self.q_proj(x).view(B, T, H, hd)
            if self.use_rope:
                q = apply_rope(q, ctx.cos, ctx.sin)
            if ctx.shared_kv is None:
                raise RuntimeError(f"layer {self.layer_idx}: cross-attention runs before the KV layer")
            k, v = ctx.shared_kv
            q = q.transpose(1, 2)
            k_pos0, mask = 0, ctx.shared_kv_mask
        else:
            # q and k are adjacent in the fused output, so RoPE rotates both in one call (half the elementwise
            # kernels of rotating them separately), on the (B, T, heads, hd) layout before the transpose.
            qkv = self.attn(x)
            qk, v = qkv.split(((H + G) * hd, G * hd), dim=-1)
            qk = qk.view(B, T, H + G, hd)
            if self.use_rope:
                qk = apply_rope(qk, ctx.cos, ctx.sin)
            q, k = qk.split((H, G), dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, G, hd).transpose(1, 2)
            k, v, k_pos0, mask = self._cached(k, v, ctx)
            if self.kind in ("kv", "kv_mem"):
                ctx.shared_kv, ctx.shared_kv_mask = (k, v), mask
        docs = ctx.doc_ids  # training only (no cache): queries and keys cover the same positions

        def core(q_, k_, v_):
            return attend(q_, k_, v_, scale=self.scale, q_pos0=q_pos0, k_pos0=k_pos0, window=self.window,
                          q_docs=docs, k_docs=docs, key_mask=mask)

        y = self.diff(q, k, v, core) if self.diff is not None else core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, H * hd)
        if self.kind == "kv_mem":
            ctx.memory = y
        return self.proj(y)

    def _cached(self, k, v, ctx: ForwardContext):
        """Add this step's K/V to the layer's cache; return the keys to attend to, the first one's position and
        an explicit key mask (only for rows at different positions)."""
        if ctx.cache is None:
            return k, v, ctx.pos, None
        if ctx.row_pos is not None:
            k, v, mask = ctx.cache.row_kv(self.layer_idx).append(k, v, ctx.row_pos)
            return k, v, 0, mask
        if self.window:
            state = ctx.state(self.layer_idx, lambda: WindowKVCache(self.window))
            k, v, n_old = state.append(k, v)
            return k, v, ctx.pos - n_old, None
        state = ctx.state(self.layer_idx, lambda: KVCache(ctx.cache.capacity))
        k, v = state.append(k, v)
        return k, v, 0, None


def attention_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    """QK^T and AV per token: 4 * n_head * head_size * T_eff, T_eff = seq_len (min(seq_len, W) for a sliding
    window), not halved for causality (torchtitan's convention); differential attention computes two maps on
    values twice as wide (x1.5)."""
    t_eff = min(seq_len, config.sliding_window) if kind == "swa" else seq_len
    return {"attention": 4 * config.n_head * config.head_size * t_eff * (1.5 if config.use_da else 1.0)}


def _window_problem(value, config: ModelConfig):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return (f"a sliding window is a whole number of tokens >= 1 (got {value!r}): give the layer swa(window=N) or "
                "the spec a sliding_window")
    return None


def _da_problem(value, config: ModelConfig):
    if not isinstance(value, bool):
        return f"da is true or false (got {value!r})"
    if value and (config.n_head % 2 or config.n_query_groups % 2):
        return (f"differential attention pairs heads: n_head={config.n_head} and n_query_groups="
                f"{config.n_query_groups} must both be even")
    return None


def _bool_problem(value, config: ModelConfig):
    return None if isinstance(value, bool) else f"expected true or false (got {value!r})"


LAYER_OPTIONS = (
    LayerOption("sliding_window", ("swa",), ("window",), _window_problem),
    LayerOption("use_da", KINDS, ("da",), _da_problem),
    LayerOption("nope", KINDS, (), _bool_problem),
)

def attention_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token, in the activation dtype: the projection's input (d), q and the attention output (H hd each; the
    output is also out-proj's input), k and v (G hd each; a cross layer reads the KV layer's), RoPE's rotated q/k,
    plus the kernel's fp32 log-sum-exp per head. On CPU a window shorter than the sequence adds its boolean mask
    (2 T bytes per token up to 2W, then the blocked path's 2W-key blocks). Checkpointed, the YOCO KV layer keeps
    the shared K/V (its fused projection output) alive for the cross-decoder, and "kv_mem" its memory too."""
    a, q, kv, T = env.act_bytes, config.n_head * config.head_size, config.n_query_groups * config.head_size, env.seq_len
    if env.act_ckpt:
        if kind in ("kv", "kv_mem"):
            return {"shared_kv": a * (q + 2 * kv), **({"gmu_memory": a * q} if kind == "kv_mem" else {})}
        return {}
    if config.use_da:
        return diff_attention_saved(config, kind, env)
    out = {"attention": a * (config.n_embd + 2 * q + (0 if kind == "cross" else 2 * kv)) + 4 * config.n_head}
    if not config.nope:
        out["rope"] = a * (q + (0 if kind == "cross" else kv))
    W = config.sliding_window
    if env.device == "cpu" and kind == "swa" and 0 < W < T:
        out["window_mask"] = 2 * T if T <= 2 * W else a * (q + 4 * kv) + 2 * W
    return out


def diff_attention_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Differential attention (every attention kind alike, measured): the projection's input (d) and, per query
    channel, q, both maps' outputs at the pair width, the fp32 pair norm's input and output and the fp32
    lambda-weighted difference (5 H hd in the activation dtype + 5 H hd fp32); on CPU the unequal q / v head widths
    send SDPA to its math path, which keeps the attention probabilities (DA_MAP_BYTES per head and key; a window
    shorter than the sequence runs it masked, past 2W on blocks of 2W keys: measured T + 12 W bytes per head)."""
    a, q, T, W = env.act_bytes, config.n_head * config.head_size, env.seq_len, config.sliding_window
    out = {"diff_attention": a * config.n_embd + (5 * a + 20) * q + 2 * config.n_head}
    if env.device == "cpu":
        blocked = kind == "swa" and 0 < 2 * W < T
        out["diff_attention_maps"] = config.n_head * (T + 12 * W if blocked else DA_MAP_BYTES * T)
    return out


DA_MAP_BYTES = 4.0  # per (head, key) on CPU's causal math path (measured at T = 64..256 and 512)


SPEC = register(MixerSpec(
    name="attention",
    kinds=KINDS,
    build=lambda config, layer_idx, kind: Attention(config, layer_idx, kind),
    roles=(("attn.weight", MATRIX), ("q_proj.weight", MATRIX), ("proj.weight", OUTPUT), ("*.bias", BIAS),
           ("diff.lambda_*", VECTOR), ("diff.subln.weight", VECTOR)),
    flops=attention_flops,
    description="GQA softmax attention: full, sliding-window, the YOCO KV layer (optionally exporting its "
                "pre-projection output as GMU memory) and cross-attention to that KV; optional differential attention",
    tests=("tests/test_attention.py::test_attend_matches_naive_training_shapes",
           "tests/test_attention.py::test_differential_attention_matches_formula"),
    state=KVCache,
    varlen="exact: block-diagonal causal mask over documents (one causal call per document past 4K positions)",
    memory_width=lambda config, kind: config.n_head * config.head_size if kind == "kv_mem" else 0,
    saved=attention_saved,
    kernels=(KernelRef("flash_attn_func", lambda: flash_attn_func is not None and torch.cuda.is_available(),
                       "archscale.kernels.attention.attention_mask + SDPA",
                       "tests/test_attention.py::test_flash_attn_matches_sdpa",
                       "on a CUDA machine: pip install flash-attn --no-build-isolation (extra `cuda`)"),),
    layer_options=LAYER_OPTIONS,
    provides=(("kv", ("shared_kv",)), ("kv_mem", ("shared_kv",))),
    needs=(("cross", ("shared_kv",)),),
    stateless_kinds=("cross",),
))
