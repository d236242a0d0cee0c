"""Pre-packed linear weights for CPU inference (`kernels/packed_linear.py`) against the reference `F.linear`, and
a packed model decoding exactly as the plain one for every architecture."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archscale.config import ARCHITECTURES
from archscale.kernels.packed_linear import PackedLinear, available, pack_linears
from archscale.serve.batching import BatchState, decode_step, prefill
from serving_fixtures import tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("shape", [(1, 48), (16, 48), (2, 5, 48), (3, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(shape, bias):
    """Rows 1 / 16 / batched 3-D inputs, with and without bias: F.linear's values to fp32 rounding (1e-5
    relative to the output's scale), and the dense weight is the module's own tensor."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 70, bias=bias)
    packed = PackedLinear(lin)
    assert packed.weight is lin.weight and packed.bias is lin.bias
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_packed_linear_falls_back_for_training_and_autocast():
    """With autograd on (training) the reference runs, so gradients flow; under bf16 autocast too, so the product
    is autocast's (bf16 out, F.linear's values exactly)."""
    lin = nn.Linear(8, 4)
    packed = PackedLinear(lin)
    x = torch.randn(3, 8, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = packed(x.detach()), F.linear(x.detach(), lin.weight, lin.bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_only_plain_fp32_linears_are_swapped():
    class Sub(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(4, 4), Sub(4, 4), nn.Linear(4, 4).bfloat16(), nn.Sequential(nn.Linear(4, 2)))
    assert pack_linears(m) == 2
    assert [type(c).__name__ for c in (m[0], m[1], m[2], m[3][0])] == ["PackedLinear", "Sub", "Linear",
                                                                         "PackedLinear"]
    assert set(m.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias", "3.0.weight",
                                   "3.0.bias"}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_model_decodes_as_the_plain_one(arch):
    """Two rows (prompts of 4 and 7 tokens) prefilled and batch-decoded for 5 steps by the model and by a packed
    copy: logits within 1e-4, the same greedy tokens. Negative control: the output head's packed weight zeroed
    after packing (the packed copy is what runs) moves the logits."""
    model = tiny_model(arch, 97)
    packed = copy.deepcopy(model)
    assert pack_linears(packed) > 0

    def run(m):
        batch, toks, outs = BatchState(m, 2), [], []
        for ids in ([5, 6, 7, 8], [9, 3, 4, 1, 2, 6, 7]):
            logits, cache = prefill(m, ids, 20)
            batch.insert(cache)
            toks.append(int(logits[-1].argmax()))
        with torch.no_grad():
            for _ in range(5):
                out = decode_step(batch, torch.tensor(toks))
                outs.append(out)
                toks = out.argmax(-1).tolist()
        return torch.stack(outs)

    with torch.inference_mode():
        want, got = run(model), run(packed)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert isinstance(packed.lm_head, PackedLinear)
    packed.lm_head.packed = (packed.lm_head.weight.detach() * 0).to_mkldnn()
    with torch.inference_mode():
        assert (run(packed) - want).abs().max() > 1e-3
