"""The one kernel dispatch (`archscale.kernels.dispatch`): auto / a named implementation / the reference, the
one-line error for an unavailable one, and every kernel choosing through it."""

import ast
import re
from pathlib import Path

import pytest
import torch

from archscale.errors import UserError
from archscale.kernels import attention, cross_entropy, gated_delta, selective_scan, short_conv, ssd
from archscale.kernels.dispatch import Dispatch, Impl, KernelChoiceError, cuda_impl

KERNELS_DIR = Path(__file__).resolve().parents[1] / "src" / "archscale" / "kernels"
CPU = torch.zeros(2)


def toy(fast_ready: bool, **kw) -> Dispatch:
    """fast (needs a flag) -> mid (CUDA only, from a package that may be missing) -> ref."""
    return Dispatch("toy", (
        Impl("fast", lambda **_: "" if fast_ready else "needs the fast thing"),
        cuda_impl("mid", lambda: None, "midpkg"),
        Impl("ref"),
    ), **kw)


def test_auto_picks_the_reference_when_nothing_else_is_available():
    assert toy(False).resolve("auto", x=CPU) == "ref"
    assert toy(False).available(x=CPU) == ["ref"]


def test_auto_picks_the_first_available_in_order():
    """Negative control of the test above: with `fast` available, auto is not the reference."""
    assert toy(True).resolve("auto", x=CPU) == "fast"
    assert toy(True).available(x=CPU) == ["fast", "ref"]


def test_a_named_implementation_runs_when_available():
    assert toy(True).resolve("fast", x=CPU) == "fast"
    assert toy(False).resolve("ref", x=CPU) == "ref"


def test_a_named_unavailable_implementation_is_a_one_line_error():
    with pytest.raises(KernelChoiceError) as e:
        toy(False).resolve("mid", x=CPU)
    msg = str(e.value)
    assert msg == "toy: impl='mid' needs the midpkg package and CUDA tensors; available here: ref (or 'auto')"
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    with pytest.raises(KernelChoiceError, match=r"impl='fast' needs the fast thing; available here: ref \("):
        toy(False).resolve("fast", x=CPU)


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(KernelChoiceError, match=r"^toy: unknown impl 'turbo'; choose one of auto, fast, mid, ref$"):
        toy(True).resolve("turbo", x=CPU)


def test_the_environment_replaces_auto_only(monkeypatch):
    d = toy(True, env_var="TOY_IMPL")
    monkeypatch.setenv("TOY_IMPL", "ref")
    assert d.resolve("auto", x=CPU) == "ref"
    assert d.resolve("fast", x=CPU) == "fast"  # an explicit name is never overridden
    monkeypatch.setenv("TOY_IMPL", "mid")
    with pytest.raises(KernelChoiceError, match=r"impl='mid' \(from TOY_IMPL\) needs the midpkg"):
        d.resolve("auto", x=CPU)
    monkeypatch.setenv("TOY_IMPL", "bogus")
    with pytest.raises(KernelChoiceError, match="^TOY_IMPL='bogus' is not an implementation of toy; choose one of"):
        d.resolve("auto", x=CPU)
    monkeypatch.setenv("TOY_IMPL", " ")
    assert d.resolve("auto", x=CPU) == "fast"  # blank: not set


def test_steps_aside_aliases_and_non_strict_fallback():
    d = Dispatch("toy", (Impl("fast", steps_aside=lambda state=None, **_: state is not None, instead="ref"),
                         Impl("ref")), aliases={"cpu": "fast"})
    assert d.resolve("auto", x=CPU) == "fast"
    assert d.resolve("auto", x=CPU, state=CPU) == "ref"   # a call it does not take: routed, not refused
    assert d.resolve("cpu", x=CPU) == "fast"              # an alias
    assert toy(False, strict=False).resolve("mid", x=CPU) == "ref"  # a preference falls back to the reference
    only_cuda_in_auto = Dispatch("toy", (Impl("flex", in_auto=lambda x, **_: x.is_cuda), Impl("ref")))
    assert only_cuda_in_auto.resolve("auto", x=CPU) == "ref"
    assert only_cuda_in_auto.resolve("flex", x=CPU) == "flex"


def test_the_real_kernels_on_cpu(monkeypatch):
    """What each kernel picks for CPU tensors, and its one-line refusal of a CUDA-only implementation."""
    monkeypatch.delenv(selective_scan.ENV_VAR, raising=False)
    monkeypatch.delenv("ARCHSCALE_ATTN_IMPL", raising=False)
    monkeypatch.setattr(selective_scan.cpu_kernel, "available", lambda: False)
    monkeypatch.setattr(selective_scan.cpu_kernel, "unavailable_reason", lambda: "no compiler")
    assert selective_scan.SCAN.resolve("auto", x=CPU, d_state=4) == "chunked"
    with pytest.raises(KernelChoiceError, match=r"impl='cpu' needs the compiled CPU kernel \(no compiler\); "
                                                r"available here: chunked, ref"):
        selective_scan.SCAN.resolve("cpu", x=CPU, d_state=4)
    assert ssd.SSD.resolve("auto", x=CPU) == "chunked"                     # Mamba-2's SSD: the same module
    assert gated_delta.GATED_DELTA.resolve("auto", x=CPU) == "chunked"      # and Gated DeltaNet's chunk loop
    with pytest.raises(KernelChoiceError, match=r"impl='cpu' needs the C\+\+ CPU module, which did not build "
                                                r"\(no compiler\); available here: chunked, ref"):
        ssd.SSD.resolve("cpu", x=CPU)
    monkeypatch.setattr(selective_scan.cpu_kernel, "available", lambda: True)
    assert selective_scan.SCAN.resolve("auto", x=CPU, d_state=4) == "cpu"
    assert selective_scan.SCAN.resolve("auto", x=CPU, d_state=selective_scan.cpu_kernel.MAX_STATE + 1) == "chunked"
    assert ssd.SSD.resolve("auto", x=CPU) == "cpu" == ssd.SSD.resolve("cpu", x=CPU)
    assert gated_delta.GATED_DELTA.resolve("auto", x=torch.zeros(torch.get_num_threads(), 1, 1, 1)) == "cpu"
    assert cross_entropy.LINEAR_CROSS_ENTROPY.resolve(x=CPU) == "chunked"
    monkeypatch.delenv("ARCHSCALE_CONV_IMPL", raising=False)
    monkeypatch.setattr(short_conv.scan_cpu, "available", lambda: False)
    monkeypatch.setattr(short_conv.scan_cpu, "unavailable_reason", lambda: "no compiler")
    assert short_conv.CONV.resolve("auto", x=CPU) == "torch"
    with pytest.raises(KernelChoiceError, match=r"impl='cpu' needs the C\+\+ CPU module, which did not build "
                                                r"\(no compiler\); available here: torch"):
        short_conv.CONV.resolve("cpu", x=CPU)
    monkeypatch.setattr(short_conv.scan_cpu, "available", lambda: True)
    assert short_conv.CONV.resolve("auto", x=CPU) == "cpu"
    q = torch.zeros(1, 2, 8, 4)
    assert attention.ATTENTION.resolve(x=q, k=q, window=4) == "sdpa"        # flex only on CUDA in auto
    monkeypatch.setenv("ARCHSCALE_ATTN_IMPL", "flex")
    assert attention.ATTENTION.resolve(x=q, k=q, window=4) == ("flex" if attention.flex_attention else "sdpa")
    assert attention.ATTENTION.resolve(x=q, k=q) == "sdpa"                  # no mask cuts in: SDPA's causal path
    monkeypatch.setenv("ARCHSCALE_ATTN_IMPL", "flash")
    assert attention.ATTENTION.resolve(x=q, k=q) == "sdpa"                  # a preference: falls back
    monkeypatch.setenv("ARCHSCALE_ATTN_IMPL", "fast")
    with pytest.raises(KernelChoiceError, match="ARCHSCALE_ATTN_IMPL='fast' is not an implementation of attention"):
        attention.attend(q, q, q, scale=0.5)
    for d in (selective_scan.SCAN, ssd.SSD, gated_delta.GATED_DELTA):
        with pytest.raises(KernelChoiceError, match="CUDA tensors; available here: .*chunked, ref"):
            d.resolve(d.impls[0].name, x=CPU)


def test_every_kernel_chooses_through_the_one_dispatch():
    """No kernel module keeps a dispatch of its own (the three `_resolve_impl` copies are one) and each of the
    kernels that have implementations to choose from declares a `Dispatch`."""
    for path in sorted(KERNELS_DIR.glob("*.py")):
        names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert "_resolve_impl" not in names, path.name
    for mod in (selective_scan, ssd, gated_delta, attention, cross_entropy, short_conv):
        assert any(isinstance(v, Dispatch) for v in vars(mod).values()), mod.__name__


def test_adding_a_mixer_shows_the_dispatch_as_gated_delta_declares_it():
    doc = (KERNELS_DIR.parents[2] / "docs" / "ADDING_A_MIXER.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "Dispatch(" in b)
    source = (KERNELS_DIR / "gated_delta.py").read_text()
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    assert len(lines) >= 6 and all(line in source for line in lines), [l for l in lines if l not in source]
