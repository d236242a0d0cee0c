"""The researcher's "will my idea work here" button: the per-architecture contract, callable on any layout.

`check_layout(spec, depth)` builds the spec at a tiny width and runs what the test suite proves for every shipped
architecture, each check returning a verdict instead of stopping at the first failure:

- causal: changing token t never moves logits before t; information flows: it moves every logit after t;
- every parameter learns: one backward gives every parameter a non-zero gradient (no dead branch);
- FLOPs: the analytic count (`GPT.flops_per_token`) within 5% of torch's FlopCounterMode;
- decode == forward: cached decoding in pieces gives the full forward's logits;
- packed == separate: two documents packed with document masking give the logits each gives alone;
- coordinate check: under mu-P++ the residual stream keeps its scale as the width doubles.

The same functions back the tests (`tests/model_checks.py`): a failure raises `ContractFailure` (an
AssertionError) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.layout import LayoutSpec

VOCAB = 97


class ContractFailure(AssertionError):
    pass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractFailure(message)


@dataclass
class Verdict:
    check: str
    ok: bool
    detail: str


def check_information_flows(model, vocab: int = VOCAB, T: int = 23, t: int = 11) -> str:
    """Change token t: logits before t must not move (causality), logits at every later position must (a
    recurrent model's influence may decay to ~1e-8 after a few positions at its initial dt: any change counts).
    Past logits must be bit-identical, except where tokens are routed (a mixture of experts: parameters one token
    only partly uses), whose grouped expert matmuls change their summation order when one token changes experts:
    there within 1e-6 of the logits' scale (seen: 5e-7)."""
    idx = torch.randint(0, vocab, (2, T))
    other = idx.clone()
    other[:, t] = (other[:, t] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx), model(other)
    grouped = _routes_tokens(model)
    leak = (a[:, :t] - b[:, :t]).abs().max().item()
    _require(leak <= (1e-6 * a.abs().max().item() if grouped else 0.0),
             f"a past position saw a future token (its logits moved by {leak:.1e})")
    moved = (a[:, t + 1:] - b[:, t + 1:]).abs().amax(dim=(0, 2))
    _require(bool((moved > 0).all()), f"positions after the change did not see it: {moved.tolist()}")
    return f"causal; every later position moved (smallest change {moved.min().item():.1e})"


def _routes_tokens(model) -> bool:
    from archscale.models import accounting

    config = getattr(model, "config", None)
    return config is not None and any(accounting.active_fraction(config, n) < 1 for n, _ in model.named_parameters())


def check_every_parameter_learns(model, vocab: int = VOCAB, T: int = 24) -> str:
    """One backward: every parameter gets a gradient that is not zero."""
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, vocab, (2, T + 1))
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().max() > 0)]
    _require(not dead, f"parameters without gradient: {dead}")
    return f"all {sum(1 for _ in model.parameters())} parameter tensors have non-zero gradients"


def check_flops(model, T: int = 32, rel: float = 0.05) -> str:
    """Analytic forward FLOPs vs FlopCounterMode (SDPA's math backend, so attention shows up as matmuls; terms
    named *_elementwise / *_solve are not matmuls the counter sees and are left out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from archscale.models import accounting

    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randint(0, VOCAB, (1, T)))
    counted = counter.get_total_flops() / T
    ours = sum(v for k, v in accounting.flops_breakdown(model, T).items() if not k.endswith(("_elementwise", "_solve")))
    _require(abs(ours - counted) <= rel * counted, f"analytic {ours:.4g} FLOPs/token vs counted {counted:.4g}")
    return f"analytic {ours:.4g} vs counted {counted:.4g} FLOPs/token ({ours / counted - 1:+.1%})"


def check_decode_equals_forward(model, T: int = 20, atol: float = 2e-5) -> str:
    """The sequence fed through the cache in pieces (prefill, single tokens, a chunk) == one full forward."""
    from archscale.models.cache import InferenceCache

    idx = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        full = model(idx)
        cache = InferenceCache(capacity=T)
        parts = [model(idx[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 9), (9, 16), (16, T)]]
    err = (torch.cat(parts, dim=1) - full).abs().max().item()
    _require(err <= atol + 1e-4 * full.abs().max().item(), f"cached decoding differs from the forward by {err:.2e}")
    return f"max |difference| {err:.1e}"


def check_packed_equals_separate(model, eos: int = 0, atol: float = 2e-5) -> str:
    """Two documents packed with document masking give each one's logits alone; the control: without the mask
    the second document sees the first."""
    from archscale.models.varlen import document_ids

    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, VOCAB, (9,), generator=g), torch.randint(1, VOCAB, (12,), generator=g)
    a[-1] = eos
    packed = torch.cat([a, b])[None]
    with torch.no_grad():
        out = model(packed, doc_ids=document_ids(packed, eos))
        alone = torch.cat([model(a[None]), model(b[None])], dim=1)
        leak = (model(packed)[:, len(a):] - alone[:, len(a):]).abs().max().item()
    err = (out - alone).abs().max().item()
    _require(err <= atol + 1e-4 * alone.abs().max().item(), f"packed documents differ from separate ones by {err:.2e}")
    return f"max |difference| {err:.1e} (without the document mask: {leak:.1e})"


def coordinate_spread(spec: LayoutSpec, depths: tuple[int, int], parametrization: str, ar: int = 16,
                      steps: int = 4, lr: float = 1e-2) -> float:
    """Largest max/min ratio over widths of the last block's mean |output| after steps 2..`steps` of AdamW at a
    high LR (so a wrong rule shows in a few steps); ~1 when the parametrization transfers across widths."""
    from archscale.models.model import GPT
    from archscale.scaling_rules import BaseHyperparameters, resolve_parametrization
    from archscale.train.optim import build_adamw, param_groups, set_lr

    hps = BaseHyperparameters(d0=depths[0], hd0=ar)
    per_depth = []
    for depth in depths:
        cfg = tiny_config(spec, depth, ar=ar, vocab=256)
        rules = resolve_parametrization(parametrization, hps, depth, cfg.n_layer, cfg.head_size)
        torch.manual_seed(0)
        model = GPT(cfg.replace(**rules.model_overrides()))
        opt = build_adamw(param_groups(model, rules.matrix, rules.vector), lr * rules.global_lr_mult, (0.9, 0.95), 1e-8)
        set_lr(opt, lr * rules.global_lr_mult)
        seen: list[float] = []
        model.blocks[-1].register_forward_hook(lambda mod, inp, out: seen.append(out.abs().mean().item()))
        data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
        for _ in range(steps + 1):
            F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        per_depth.append(seen[2:])
    return max(max(v) / min(v) for v in zip(*per_depth))


def check_coordinates(spec: LayoutSpec, bound: float = 3.0) -> str:
    """mu-P++ at two widths (the depth and twice it): the residual stream's scale must stay within `bound`x
    (measured 1.05-2.5 on the shipped families); SP, which does not transfer, is shown beside it."""
    base = max(spec.depth_multiple, 2)
    depths = (base, 2 * base)
    mupp, sp = coordinate_spread(spec, depths, "mup++"), coordinate_spread(spec, depths, "sp")
    _require(mupp < bound, f"mu-P++ residual scale changes {mupp:.2f}x between depths {depths} (bound {bound}x; "
                           f"SP: {sp:.2f}x)")
    return f"flat under mu-P++: {mupp:.2f}x across depths {depths[0]}->{depths[1]} (SP: {sp:.2f}x)"


def tiny_config(spec: LayoutSpec, depth: int, ar: int = 16, vocab: int = VOCAB, window: int = 5) -> ModelConfig:
    """The spec at a tiny width (whatever sizes its preset fixes), windows short enough to matter at T ~ 20."""
    heads = depth
    rotary = spec.preset.get("rotary_dim", 0) * ar // spec.preset.get("head_size", 128)  # the same fraction
    return ModelConfig.from_layout(
        spec, depth, ar=ar, vocab_size=vocab, block_size=64, n_head=heads, n_query_groups=max(1, heads // 4),
        head_size=ar, n_embd=ar * heads, intermediate_size=4 * ar * heads, padded_vocab_size=0,
        sliding_window=window if spec.sliding_window else 0, rotary_dim=rotary - rotary % 2)


MODEL_CHECKS: dict[str, Callable] = {
    "information flows, causally": check_information_flows,
    "every parameter learns": check_every_parameter_learns,
    "FLOPs match FlopCounterMode": check_flops,
    "decode == forward": check_decode_equals_forward,
    "packed == separate documents": check_packed_equals_separate,
}


def _verdict(name: str, run: Callable[[], str]) -> Verdict:
    try:
        return Verdict(name, True, run())
    except ContractFailure as e:
        return Verdict(name, False, str(e))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken mixer may fail any way; the verdict says how
        return Verdict(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def check_layout(spec: LayoutSpec, depth: int, coordinates: bool = True,
                 build: Callable[[ModelConfig], torch.nn.Module] | None = None) -> list[Verdict]:
    """Every contract check on `spec` at `depth` (tiny width). `build` makes the model (default GPT; tests pass
    one that breaks it on purpose)."""
    from archscale.models.model import GPT

    build = build or GPT
    try:
        cfg = tiny_config(spec, depth)
        build(cfg)
    except UserError as e:
        return [Verdict("layout is valid", False, str(e))]
    verdicts = [Verdict("layout is valid", True, f"{cfg.n_layer} layers at width {cfg.n_embd}")]
    for name, check in MODEL_CHECKS.items():
        torch.manual_seed(0)
        model = build(cfg)
        verdicts.append(_verdict(name, lambda: check(model if name == "every parameter learns" else model.eval())))
    if coordinates:
        verdicts.append(_verdict("coordinate check (mu-P++)", lambda: check_coordinates(spec)))
    return verdicts
