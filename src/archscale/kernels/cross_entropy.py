"""The language-model loss: plain cross-entropy on logits, or a chunked linear cross-entropy that never holds
the (tokens, vocab) logits.

`select_loss("auto" | "plain" | "chunked", vocab_size)` returns a `LossFn`; `loss_fn(model_out, targets,
label_smoothing, ignore_index)` is the mean token loss. With `loss_fn.wants_hidden` the model is called with
`return_hidden=True` and gives `(hidden * logit_scale, lm_head.weight)`, as ArchScale's model does for its fused
linear cross-entropy (used there above 100k vocab: Phi4-mini-Flash's 200,064 tokens, whose fp32 logits for 8K
tokens take 6.5 GB, and their gradient as much again).

Chunked path (`chunked_linear_cross_entropy`): a custom autograd function walks the tokens in chunks; each
chunk's logits (fp32, only the first `vocab_size` rows of the weight: padded rows never enter, exactly as
`logits[..., :vocab_size]`) give that chunk's loss and, at once, its logit gradient, which is folded into the
hidden-state and weight gradients and dropped (Liger-Kernel's scheme). Backward only scales the stored gradients
by the incoming gradient. Label smoothing and ignore_index follow `torch.nn.functional.cross_entropy`.
On CUDA, Liger-Kernel's fused Triton kernel runs instead when `liger_kernel` is installed (`LINEAR_CROSS_ENTROPY`).

Plain path (`cross_entropy`, ``ARCHSCALE_LOSS_IMPL=cpu|torch`` for auto): on CPU the C++ module of
`kernels/scan_cpu.py` computes each row's loss and its logit gradient in one pass over the row (the gradient is
kept and handed to autograd, as the chunked path does); through autograd `F.cross_entropy` reads and writes the
(tokens, vocab) logits ~6 times, ~70 ms of a ~1.1 s training step at 2,048 tokens x 8,192 vocab. Elsewhere (CUDA,
no compiler, inside `torch.compile`) it is `F.cross_entropy`; tests/test_cross_entropy_cpu.py checks both
against float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from archscale.errors import UserError
from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl, cuda_impl

LOSS_CHOICES = ("auto", "plain", "chunked")
CHUNKED_VOCAB_THRESHOLD = 100_000  # ArchScale switches to its fused linear cross-entropy above this vocab

try:  # optional CUDA kernel
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # type: ignore
except Exception:  # pragma: no cover - not installed on CPU machines
    liger_fused_linear_cross_entropy = None


def _cpu_unavailable(logits: torch.Tensor, **call) -> str:
    return scan_cpu.unavailable_for(logits, **call)


CROSS_ENTROPY = Dispatch("cross entropy", (Impl("cpu", _cpu_unavailable), Impl("torch")),
                         env_var="ARCHSCALE_LOSS_IMPL")

LINEAR_CROSS_ENTROPY = Dispatch("chunked loss", (
    cuda_impl("liger", lambda: liger_fused_linear_cross_entropy, "liger-kernel"),
    Impl("chunked"),
))


def default_chunk_rows(n_rows: int, vocab_size: int, width: int) -> int:
    """Rows per chunk so that a chunk's logits take about as much memory as the hidden state (Liger's rule)."""
    per_chunk = math.ceil(n_rows / max(1, math.ceil(vocab_size / width)))
    return max(1, 1 << (per_chunk - 1).bit_length())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, label_smoothing, ignore_index, chunk_rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h32, w32 = hidden.float(), weight[:vocab_size].float()
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        grad_h = torch.empty_like(h32) if need_h else None
        # the full (padded) shape: rows past vocab_size keep a zero gradient, as slicing the logits gives them
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        eps, total = label_smoothing, h32.new_zeros(())
        for s in range(0, h32.shape[0], chunk_rows):
            h, t, m = h32[s:s + chunk_rows], safe_targets[s:s + chunk_rows], valid[s:s + chunk_rows]
            z = h @ w32.T  # (chunk, vocab) fp32
            lse = torch.logsumexp(z, dim=-1)
            rows = lse - (1.0 - eps) * z.gather(1, t[:, None])[:, 0]
            if eps:
                rows = rows - (eps / vocab_size) * z.sum(dim=-1)
            total = total + torch.where(m, rows, torch.zeros_like(rows)).sum()
            if not (need_h or need_w):
                continue
            g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g.scatter_add_(1, t[:, None], torch.full_like(lse[:, None], -(1.0 - eps)))
            if eps:
                g.sub_(eps / vocab_size)
            g.mul_(m[:, None])  # ignored tokens contribute nothing
            if need_h:
                torch.mm(g, w32, out=grad_h[s:s + chunk_rows])
            if need_w:
                grad_w[:vocab_size].addmm_(g.T, h)
        n_valid = valid.sum()
        # kept on ctx, not saved: backward scales them in place and hands them over (dropping its reference, so
        # autograd can take the weight gradient as .grad without a copy). A weight-sized second buffer would be
        # the biggest allocation of the whole loss.
        ctx.grads = (grad_h, grad_w, n_valid)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / n_valid  # nan when every token is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("chunked_linear_cross_entropy: a second backward through the same loss (its "
                               "gradients are computed in forward and handed over once); recompute the loss")
        grad_h, grad_w, n_valid = ctx.grads
        ctx.grads = None
        scale = grad_out / n_valid
        gh = grad_h.mul_(scale).to(ctx.dtypes[0]) if grad_h is not None else None
        gw = grad_w.mul_(scale).to(ctx.dtypes[1]) if grad_w is not None else None
        del grad_h, grad_w
        return gh, gw, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 vocab_size: int, label_smoothing: float = 0.0, ignore_index: int = -100,
                                 chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden (N, d) @ weight[:vocab_size].T` against `targets (N,)`, computed chunk by
    chunk in fp32 (equal to `F.cross_entropy(logits.float(), ...)` up to rounding), never holding (N, vocab)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden (N, d) and targets (N,) expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    rows = chunk_rows or default_chunk_rows(hidden.shape[0], vocab_size, hidden.shape[1])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, vocab_size, float(label_smoothing),
                                            int(ignore_index), rows)


class _FusedCrossEntropy(torch.autograd.Function):
    """The C++ kernel's mean loss; its gradient (computed in forward, already / valid rows) handed over once. No
    value is read on the host (the trainer's step allows one read, the loss and the grad norm together)."""

    @staticmethod
    def forward(ctx, logits, targets, label_smoothing, ignore_index):
        losses, grad, n_valid = scan_cpu.cross_entropy_rows(logits, targets, ignore_index, label_smoothing)
        ctx.grad = grad  # not saved: backward scales it in place (usually not at all) and gives it away
        return losses.sum() / n_valid  # nan when every token is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grad is None:
            raise RuntimeError("cross_entropy: a second backward through the same loss (its gradient is computed "
                               "in forward and handed over once); recompute the loss")
        grad, ctx.grad = ctx.grad, None
        return scan_cpu.scale_loss_grad(grad, grad_out), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
                  ignore_index: int = -100, impl: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) (any float dtype; computed in fp32) against targets (N,), as
    `F.cross_entropy(logits.float(), targets, label_smoothing=..., ignore_index=...)` up to fp32 rounding."""
    x = logits.float()
    if torch.compiler.is_compiling() or CROSS_ENTROPY.resolve(impl, logits=x) != "cpu" or x.dim() != 2:
        return F.cross_entropy(x, targets, label_smoothing=label_smoothing, ignore_index=ignore_index)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _FusedCrossEntropy.apply(x, targets.long(), float(label_smoothing), int(ignore_index))


@dataclass(frozen=True)
class LossFn:
    """Mean token loss of a model output: logits (B, T, V) for "plain", (hidden, lm_head weight) for "chunked"."""

    name: str  # "plain" | "chunked"
    vocab_size: int

    @property
    def wants_hidden(self) -> bool:
        return self.name == "chunked"

    def __call__(self, model_out, targets: torch.Tensor, label_smoothing: float = 0.0,
                 ignore_index: int = -100) -> torch.Tensor:
        if self.name == "plain":
            return cross_entropy(model_out.flatten(0, 1), targets.flatten(), label_smoothing, ignore_index)
        hidden, weight = model_out
        hidden, targets = hidden.flatten(0, 1), targets.flatten()
        if LINEAR_CROSS_ENTROPY.resolve(x=hidden) == "liger":
            return liger_fused_linear_cross_entropy(hidden, weight[:self.vocab_size], targets,
                                                    ignore_index=ignore_index, label_smoothing=label_smoothing)
        return chunked_linear_cross_entropy(hidden, weight, targets, self.vocab_size, label_smoothing, ignore_index)


def select_loss(choice: str, vocab_size: int, zero3: bool = False) -> LossFn:
    """`--loss`: "plain", "chunked", or "auto" (chunked above CHUNKED_VOCAB_THRESHOLD tokens of vocab). Under
    DeepSpeed ZeRO-3 the head weight is gathered only inside lm_head's own forward, which the chunked loss skips:
    auto is plain there and chunked is refused."""
    if choice not in LOSS_CHOICES:
        raise UserError(f"--loss must be one of {', '.join(LOSS_CHOICES)} (got {choice!r})")
    if choice == "chunked" and zero3:
        raise UserError("--loss chunked does not combine with --strategy deepspeed --zero_stage 3 (the head weight "
                        "is partitioned outside lm_head's forward); use --loss plain or another strategy")
    if choice == "auto":
        choice = "chunked" if vocab_size > CHUNKED_VOCAB_THRESHOLD and not zero3 else "plain"
    return LossFn(choice, vocab_size)
