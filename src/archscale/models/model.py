"""The language model: token embedding -> blocks -> final norm -> (logit scale) -> lm_head.

`GPT(config)(idx)` returns logits of shape (B, T, vocab_size). Read top to bottom; every mixer lives in its own
file beside this one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.block import Block
from archscale.models.norm import RMSNorm
from archscale.models.rope import rope_cache


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        cos, sin = self.rope(T, idx.device)
        x = self.wte(idx).float()
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.ln_f(x)
        if self.config.logit_scale != 1.0:
            x = x * self.config.logit_scale
        logits = self.lm_head(x)
        if self.config.padded_vocab_size != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return logits

    def rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for positions 0..T-1, cached and grown on demand (not a buffer: never checkpointed)."""
        if self._rope is None or self._rope[0].shape[0] < T or self._rope[0].device != device:
            n = max(T, self.config.block_size)
            self._rope = rope_cache(n, self.config.head_size, self.config.rope_base, device=device)
        cos, sin = self._rope
        return cos[:T], sin[:T]

    # -------------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight according to `config.init_scheme`.

        sp  (seed default): linears N(0, init_std); output projections (attn.proj, mlp.w3) further divided by
            sqrt(2L) (GPT-2); embedding N(0, embed_init_std), or N(0, init_std) when tied.
        mup: linears keep PyTorch's default kaiming-uniform init (U(+-1/sqrt(fan_in))) times `w_init_mult`;
            untied lm_head is zero; embedding as above. `config.init_stds()` lists the resulting stds.
        """
        cfg = self.config
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if cfg.init_scheme == "mup":
                    module.reset_parameters()
                    if cfg.w_init_mult != 1.0:
                        module.weight.mul_(cfg.w_init_mult)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                else:
                    std = std_out if name.endswith(("attn.proj", "mixer.proj", "mlp.w3")) else cfg.init_std
                    nn.init.normal_(module.weight, 0.0, std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
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
        """Analytic FLOPs per token: 2*N per matmul parameter plus attention scores/values.

        N counts every matmul weight, lm_head included (the embedding is a lookup). Attention adds
        4 * n_head * head_size * T_eff per layer forward (QK^T and AV), T_eff = seq_len, not halved for
        causality (torchtitan's convention). Training = 3x forward (backward is twice the forward).
        """
        cfg = self.config
        n_matmul = self.num_params(non_embedding=True) + cfg.padded_vocab_size * cfg.n_embd
        attn = cfg.n_layer * 4 * cfg.n_head * cfg.head_size * seq_len
        forward = 2 * n_matmul + attn
        return float(3 * forward if training else forward)
