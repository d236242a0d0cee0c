"""The language model: token embedding -> blocks -> final norm -> (logit scale) -> lm_head.

`GPT(config)(idx)` returns logits of shape (B, T, vocab_size). `GPT.generate` decodes incrementally with an
`InferenceCache` (KV caches, SWA windows, Mamba states, the shared YOCO KV). Read top to bottom; every mixer
lives in its own file beside this one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.attention import ForwardContext
from archscale.models.block import Block
from archscale.models.cache import InferenceCache
from archscale.models.generation import generate
from archscale.models.norm import make_norm
from archscale.models.rope import rope_cache


# Linears that write into the residual stream: GPT-2's 1/sqrt(2L) init under SP.
OUTPUT_PROJECTIONS = ("mixer.proj", "mixer.out_proj", "mlp.w3")


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        kinds = config.layer_kinds
        # YOCO: the cross-decoder (GMU / cross-attention layers) needs only the last prompt position at prefill
        self.cross_start = next((i for i, k in enumerate(kinds) if k in ("cross", "gmu")), None)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None, last_only: bool = False,
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for idx (B, T); (B, 1, vocab) for the last position when `last_only`.

        With `cache`, idx continues the cached sequence (positions cache.pos..) and the cache is updated; a
        cross-decoder then sees only the last position when `last_only` (its layers keep no state of their own,
        so the prompt's other positions are never needed: YOCO's linear-time prefill).
        Variable-length training: `doc_ids` (B, T) keeps every mixer inside its document (attention masks, Mamba
        state resets); `position_ids` (B, T), each < T, gives RoPE positions (default: 0..T-1, the seed's behaviour;
        `models/varlen.document_positions` gives per-document positions).
        """
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if cache is not None and (doc_ids is not None or position_ids is not None):
            raise ValueError("doc_ids / position_ids are for training-style forwards, not cached decoding")
        cos = sin = None
        if not self.config.nope:
            if position_ids is not None:
                cos, sin = self.rope(T, idx.device)  # positions inside documents are < T (no host sync)
                cos, sin = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # (B, T, 1, hd/2)
            else:
                cos, sin = self.rope(pos + T, idx.device)
                cos, sin = cos[pos:].unsqueeze(1), sin[pos:].unsqueeze(1)  # (T, 1, hd/2)
        ctx = ForwardContext(pos=pos, cos=cos, sin=sin, cache=cache, doc_ids=doc_ids)
        x = self.wte(idx).float()
        for i, block in enumerate(self.blocks):
            if last_only and i == self.cross_start and x.shape[1] > 1:
                x = x[:, -1:]
                ctx.pos = pos + T - 1
                if ctx.memory is not None:
                    ctx.memory = ctx.memory[:, -1:]
                if cos is not None:
                    ctx.cos, ctx.sin = cos[-1:], sin[-1:]
            x = block(x, ctx)
        if last_only:
            x = x[:, -1:]
        if cache is not None:
            cache.pos = pos + T
        x = self.ln_f(x)
        if self.config.logit_scale != 1.0:
            x = x * self.config.logit_scale
        logits = self.lm_head(x)
        if self.config.padded_vocab_size != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return logits

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Token ids (B, T + new): the prompt then up to max_new_tokens decoded with caches (greedy at
        temperature 0; top-k / nucleus sampling otherwise). Stops early once every row has produced eos_id;
        rows that finished earlier are padded with eos_id."""
        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_id=eos_id, generator=generator)

    def rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for positions 0..T-1, cached and grown on demand (not a buffer: never checkpointed)."""
        if self._rope is None or self._rope[0].shape[0] < T or self._rope[0].device != device:
            n = max(T, self.config.block_size)
            self._rope = rope_cache(n, self.config.head_size, self.config.rope_base, device=device,
                                    linear_scaling=self.config.rope_scaling)
        cos, sin = self._rope
        return cos[:T], sin[:T]

    # -------------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight according to `config.init_scheme`.

        sp  (seed default): linears N(0, init_std); output projections (OUTPUT_PROJECTIONS) further divided by
            sqrt(2L) (GPT-2); embedding N(0, embed_init_std), or N(0, init_std) when tied.
        mup: linears keep PyTorch's default kaiming-uniform init (U(+-1/sqrt(fan_in))) times `w_init_mult`;
            untied lm_head is zero; embedding as above. `config.init_stds()` lists the resulting stds.
        """
        cfg = self.config
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        # Modules with their own init first (norms, Mamba's A/D/dt/conv, differential-attention lambdas), then
        # every Linear by the scheme, except the ones marked `_no_reinit` (Mamba's dt_proj keeps the spec init).
        for module in self.modules():
            if module is not self and not isinstance(module, (nn.Linear, nn.Embedding)) \
                    and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and getattr(module.weight, "_no_reinit", False):
                continue
            if isinstance(module, nn.Linear):
                if cfg.init_scheme == "mup":
                    module.reset_parameters()
                    if cfg.w_init_mult != 1.0:
                        module.weight.mul_(cfg.w_init_mult)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                else:
                    std = std_out if name.endswith(OUTPUT_PROJECTIONS) else cfg.init_std
                    nn.init.normal_(module.weight, 0.0, std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
        if cfg.tie_embeddings:
            nn.init.normal_(self.wte.weight, 0.0, cfg.init_std)
        else:
            nn.init.normal_(self.wte.weight, 0.0, cfg.embed_init_std)
            if cfg.init_scheme == "mup":
                nn.init.zeros_(self.lm_head.weight)

    # ------------------------------------------------------------------------------------------------ counts
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; non_embedding excludes the token embedding and lm_head (tied or not)."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if non_embedding and (name.startswith("wte.") or name.startswith("lm_head.")):
                continue
            total += p.numel()
        return total

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Analytic FLOPs per token: 2*N per matmul parameter plus attention scores/values and SSM scans.

        N counts every matmul weight, lm_head included (the embedding is a lookup). Each attention layer adds
        4 * n_head * head_size * T_eff (QK^T and AV), T_eff = seq_len (min(seq_len, W) for sliding windows), not
        halved for causality (torchtitan's convention); differential attention computes two maps on values twice
        as wide (x1.5). A Mamba layer's scan adds about 9 * d_inner * d_state. Training = 3x forward.
        """
        cfg = self.config
        n_matmul = self.num_params(non_embedding=True) + cfg.padded_vocab_size * cfg.n_embd
        extra = 0.0
        for kind in cfg.layer_kinds:
            if kind in ("attn", "kv", "cross", "swa"):
                t_eff = min(seq_len, cfg.sliding_window) if kind == "swa" else seq_len
                extra += 4 * cfg.n_head * cfg.head_size * t_eff * (1.5 if cfg.use_da else 1.0)
            elif kind in ("mamba", "mamba_mem"):
                extra += 9 * cfg.mamba_expand * cfg.n_embd * cfg.d_state
        forward = 2 * n_matmul + extra
        return float(3 * forward if training else forward)
