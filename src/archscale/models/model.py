"""The language model: token embedding -> blocks -> final norm -> (logit scale) -> lm_head.

`GPT(config)(idx)` returns logits of shape (B, T, vocab_size). `GPT.generate` decodes incrementally with an
`InferenceCache` (KV caches, SWA windows, Mamba states, the shared YOCO KV). Read top to bottom; every mixer
lives in its own file beside this one.
"""

from __future__ import annotations

import torch
from torch import nn

from archscale.config import ModelConfig
import archscale.models.accounting as accounting
from archscale.models.block import Block
from archscale.models.cache import InferenceCache
from archscale.models.generation import generate
from archscale.models.layout_rules import complete
from archscale.models.mixers import ForwardContext
from archscale.models.norm import make_norm
from archscale.models.rope import rope_cache


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config = complete(config)  # every layer's options filled in, the layout checked
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.aux_loss: torch.Tensor | None = None  # set by forward (see there)
        # YOCO: the cross-decoder (the layers after the one KV layer) needs only the last prompt position at
        # prefill: its layers keep no state of their own
        self.cross_start = config.cross_decoder_start
        for _ in accounting.named_roles(self):  # every parameter has a role (one-line error otherwise)
            pass
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None, last_only: bool = False,
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, vocab) for idx (B, T); (B, 1, vocab) for the last position when `last_only`.
        With `return_hidden`, (final hidden state x logit_scale (B, T, n_embd), lm_head.weight) instead, for a
        loss that applies the head chunk by chunk (`kernels/cross_entropy.py`; padded weight rows are its to drop).

        With `cache`, idx continues the cached sequence (positions cache.pos..) and the cache is updated; a
        cross-decoder then sees only the last position when `last_only` (its layers keep no state of their own,
        so the prompt's other positions are never needed: YOCO's linear-time prefill).
        Variable-length training: `doc_ids` (B, T) keeps every mixer inside its document (attention masks, Mamba
        state resets); `position_ids` (B, T), each < T, gives RoPE positions (default: 0..T-1, ArchScale's behaviour;
        `models/varlen.document_positions` gives per-document positions).
        """
        T = idx.shape[1]
        pos = cache.pos if cache is not None else 0
        if cache is not None and (doc_ids is not None or position_ids is not None):
            raise ValueError("doc_ids / position_ids are for training-style forwards, not cached decoding")
        ctx = self.context(T, idx.device, pos=pos, cache=cache, doc_ids=doc_ids, position_ids=position_ids)
        x = self.embed(idx)
        x = self.run_blocks(x, ctx, enumerate(self.blocks), cross_start=self.cross_start if last_only else None)
        # the weighted training losses layers added (a mixture of experts' load balancing); the trainer adds it
        self.aux_loss = sum(ctx.aux_losses) if ctx.aux_losses else None
        if last_only:
            x = x[:, -1:]
        if cache is not None:
            cache.pos = pos + T
        return output_head(self.config, self.ln_f, self.lm_head, x, return_hidden)

    # The forward's pieces, in order; a pipeline stage (train/pipeline.py) runs the same ones on its part.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the fp32 residual stream (B, T, n_embd)."""
        return self.wte(idx).float()

    def context(self, T: int, device: torch.device, pos: int = 0, cache: InferenceCache | None = None,
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> ForwardContext:
        """What every block reads besides the residual stream: RoPE tables for positions pos..pos+T-1 (or
        `position_ids`), the cache, the documents. Needs no weights, so any pipeline stage builds its own."""
        cos = sin = None
        if self.config.uses_rope:
            if position_ids is not None:
                cos, sin = self.rope(T, device)  # positions inside documents are < T (no host sync)
                cos, sin = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # (B, T, 1, hd/2)
            else:
                cos, sin = self.rope(pos + T, device)
                cos, sin = cos[pos:].unsqueeze(1), sin[pos:].unsqueeze(1)  # (T, 1, hd/2)
        return ForwardContext(pos=pos, cos=cos, sin=sin, cache=cache, doc_ids=doc_ids)

    @staticmethod
    def run_blocks(x: torch.Tensor, ctx: ForwardContext, blocks, cross_start: int | None = None) -> torch.Tensor:
        """`blocks` ((index, block) pairs) over x. With `cross_start` (decoding's `last_only`), the cross-decoder
        from that layer on sees only the last position (YOCO's linear-time prefill)."""
        for i, block in blocks:
            if i == cross_start and x.shape[1] > 1:
                ctx.pos = ctx.pos + x.shape[1] - 1
                x = x[:, -1:]
                if ctx.memory is not None:
                    ctx.memory = ctx.memory[:, -1:]
                if ctx.cos is not None:
                    ctx.cos, ctx.sin = ctx.cos[-1:], ctx.sin[-1:]
            x = block(x, ctx)
        return x

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
            dim = self.config.rotary_dim or self.config.head_size
            self._rope = rope_cache(n, dim, self.config.rope_base, device=device,
                                    linear_scaling=self.config.rope_scaling)
        cos, sin = self._rope
        return cos[:T], sin[:T]

    # -------------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight according to its role (`models/accounting.py`) and `config.init_scheme`.

        First every submodule's own init, children before parents (so a mixer's own init, e.g. Mamba's dt_proj,
        wins over its Linears' defaults); then the parametrization's (`accounting.apply_init`): sp draws N(0,
        init_std) for Linear weights with GPT-2's 1/sqrt(2L) on output projections, mup keeps the modules' init;
        both multiply by w_init_mult. Embedding N(0, embed_init_std), or N(0, init_std) when tied; an untied lm_head
        is N(0, init_std) x w_init_mult under sp and zero under mup. `init_stds()` lists the resulting stds.
        """
        cfg = self.config
        for module in reversed(list(self.modules())):
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        accounting.apply_init(self, cfg)
        if cfg.tie_embeddings:
            nn.init.normal_(self.wte.weight, 0.0, cfg.init_std)
            return
        nn.init.normal_(self.wte.weight, 0.0, cfg.embed_init_std)
        if cfg.init_scheme == "mup":
            nn.init.zeros_(self.lm_head.weight)
        else:
            nn.init.normal_(self.lm_head.weight, 0.0, cfg.init_std * cfg.w_init_mult)

    def init_stds(self) -> dict[str, float]:
        return accounting.init_stds(self)

    # ------------------------------------------------------------------------------------------------ counts
    def num_params(self, non_embedding: bool = True, active: bool = False) -> int:
        """Parameters; non_embedding excludes the token embedding and lm_head (tied or not); `active` counts only
        the parameters one token uses (a mixture of experts: k of its E routed experts)."""
        return accounting.num_params(self, non_embedding, active)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Analytic FLOPs per token (`accounting.flops_breakdown`): 2 x every matmul weight (lm_head included)
        plus each mixer's attention / scan / conv terms. Training = 3x forward."""
        forward = sum(accounting.flops_breakdown(self, seq_len).values())
        return float(3 * forward if training else forward)


def output_head(config: ModelConfig, ln_f: nn.Module, lm_head: nn.Linear, x: torch.Tensor,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Final norm -> logit scale -> lm_head (logits cut to the real vocabulary); with `return_hidden`, the scaled
    hidden state and the head weight instead. Shared with the last pipeline stage (train/pipeline.py)."""
    x = ln_f(x)
    if config.logit_scale != 1.0:
        x = x * config.logit_scale
    if return_hidden:
        return x, lm_head.weight
    logits = lm_head(x)
    if config.padded_vocab_size != config.vocab_size:
        logits = logits[..., : config.vocab_size]
    return logits


def non_embedding_params(config: ModelConfig) -> int:
    """Non-embedding parameters of `config`, counted on a meta-device model (no memory)."""
    with torch.device("meta"):
        return GPT(config).num_params(non_embedding=True)
