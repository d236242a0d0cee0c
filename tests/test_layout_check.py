"""`archscale layout SPEC --check`: the contract passes on sound layouts, and each check fails on a layout built
to break exactly it (mixers registered here, through the registry, and removed afterwards)."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from archscale.cli import main
from archscale.config import resolve_layout
from archscale.layout_check import check_layout
from archscale.models.mixers import base
from archscale.models.mixers.base import MATRIX, MixerSpec, register


@dataclass
class RunningMean:
    total: torch.Tensor
    count: int


class CumulativeMean(nn.Module):
    """y_t = W (mean of x_0..x_t). `keep_state`: decoding continues the running mean (else each call starts
    afresh: cached decoding breaks); `docs`: restart at document starts (else documents leak); `gain`: multiply
    the output by (width / 16)^2 (its scale then grows with width: the coordinate check breaks); `zero`: output 0."""

    def __init__(self, config, layer_idx, kind):
        super().__init__()
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.layer_idx, self.kind, self.width = layer_idx, kind, config.n_embd

    def forward(self, x, ctx):
        B, T, _ = x.shape
        state = None if self.kind == "forgetful" else ctx.state(
            self.layer_idx, lambda: RunningMean(x.new_zeros(B, 1, x.shape[2]), 0))
        total = x.cumsum(1) + (state.total if state is not None else 0)
        count = (torch.arange(1, T + 1, dtype=x.dtype) + (state.count if state is not None else 0)).repeat(B, 1)
        if ctx.doc_ids is not None and self.kind != "leaky":  # restart at every document start
            for b in range(B):
                for d in ctx.doc_ids[b].unique():
                    at = (ctx.doc_ids[b] == d).nonzero().flatten()
                    total[b, at] = x[b, at].cumsum(0)
                    count[b, at] = torch.arange(1, len(at) + 1, dtype=x.dtype)
        if state is not None:
            state.total, state.count = total[:, -1:].detach(), state.count + T
        y = self.proj(total / count[..., None])
        if self.kind == "gain":
            y = y * (self.width / 16) ** 2
        return y * 0 if self.kind == "zero" else y


KINDS = ("cummean", "forgetful", "leaky", "gain", "zero", "miscounted")


@pytest.fixture
def broken_mixers():
    spec = register(MixerSpec(
        name="test_cummean", kinds=KINDS, build=CumulativeMean, roles=(("proj.weight", MATRIX),),
        flops=lambda config, kind, T: {"scan": 1e9} if kind == "miscounted" else {},
        description="test-only mixers that break one contract check each",
        tests=("tests/test_layout_check.py::test_each_check_fails_on_the_layout_that_breaks_it",),
        state=RunningMean, varlen="exact unless kind 'leaky'"))
    yield spec
    del base.REGISTRY[spec.name]
    for kind in spec.kinds:
        del base._BY_KIND["mixer", kind]


def verdicts(ref, depth=4, coordinates=False):
    return {v.check: v for v in check_layout(resolve_layout(ref), depth, coordinates=coordinates)}


def test_the_contract_passes_on_a_sound_custom_mixer(broken_mixers):
    got = verdicts("[cummean, attn] * L", coordinates=True)
    assert all(v.ok for v in got.values()), {k: v.detail for k, v in got.items() if not v.ok}


@pytest.mark.parametrize("ref,failing", [
    ("[zero, zero] * L", {"information flows, causally", "every parameter learns"}),
    ("[miscounted, attn] * L", {"FLOPs match FlopCounterMode"}),
    ("[forgetful, attn] * L", {"decode == forward"}),
    ("[leaky, attn] * L", {"packed == separate documents"}),
    ("[gain, gain] * L", {"coordinate check (mu-P++)"}),
])
def test_each_check_fails_on_the_layout_that_breaks_it(broken_mixers, ref, failing):
    got = verdicts(ref, coordinates="gain" in ref)
    assert {k for k, v in got.items() if not v.ok} == failing, {k: v.detail for k, v in got.items()}


def test_a_cross_decoder_with_no_kv_fails_validation():
    got = verdicts("[mamba, swa(window=4)] * L/2, cross * rest")
    assert list(got) == ["layout is valid"] and not got["layout is valid"].ok
    assert "reads shared kv but no earlier layer produces it" in got["layout is valid"].detail


def test_the_command_prints_the_table_and_the_verdicts(capsys):
    assert main(["layout", "sambay", "--depth", "4", "--ctx", "256", "--check"]) == 0
    out = capsys.readouterr().out
    for text in ("sambay at depth 4", "mamba_mem:mlp", "kv(nope):mlp", "MambaState", "last 127 K/V",
                 "ArchScale's law", "PASS  information flows, causally", "PASS  coordinate check (mu-P++)",
                 "PASS  packed == separate documents", "matrix (init: output)"):
        assert text in out, text


def test_the_command_fails_on_a_broken_layout(broken_mixers, capsys):
    assert main(["layout", "[zero, zero] * L", "--depth", "2", "--check"]) == 1
    captured = capsys.readouterr()
    assert "FAIL  information flows, causally: positions after the change did not see it" in captured.out
    assert "contract checks failed" in captured.err
    assert main(["layout", "cross * L", "--depth", "2"]) == 2  # not valid: one line, no table
    assert "reads shared kv" in capsys.readouterr().err
