"""`--compile` (regional: one torch.compile per block, `train/parallelize.apply_compile`) against eager.

Compile is slow on CPU (~20 s cold per model with inductor), so: every architecture through the
aot_eager_decomp_partition backend (dynamo, AOTAutograd, inductor's decompositions and its forward/backward
partitioner: all of inductor's pipeline but code generation; plain aot_eager trips over a stride in the traced
Mamba backward that inductor's path does not produce), and inductor itself on the Transformer++ block. Tolerance:
fp32, 1e-5 relative on the loss and on every parameter gradient (norm of the difference over the reference's
norm, floored at 1% of the largest gradient norm: a few vectors, e.g. differential attention's lambdas, get
gradients of ~1e-5 that are sums of cancelling terms, where a changed rounding order moves the last digits).
"""

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.config import ARCHITECTURES
from archscale.models.mixers import ForwardContext
from archscale.train.parallelize import apply_compile


def tiny(arch):
    depth = 8 if ARCHITECTURES[arch].use_da else 4  # differential attention pairs KV heads: depth // 4 even
    return ModelConfig.from_arch(arch, depth, ar=8, vocab_size=64, block_size=16, sliding_window=4)


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_compiled_matches_eager(arch, backend):
    torch.manual_seed(0)
    model = GPT(tiny(arch))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ref_loss, ref_grads = loss_and_grads(model, x, y)
    torch._dynamo.reset()
    apply_compile(model, backend=backend)
    loss, grads = loss_and_grads(model, x, y)
    assert abs(float(loss - ref_loss)) <= 1e-5 * float(ref_loss), arch
    floor = 0.01 * max(float(b.norm()) for b in ref_grads)
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
        assert float((a - b).norm()) <= 1e-5 * max(float(b.norm()), floor), (arch, name)


def test_transformer_block_traces_as_one_graph():
    """No graph break inside a Transformer++ block (dynamo's explain; no code generation, so it is quick)."""
    torch.manual_seed(0)
    model = GPT(tiny("transformer"))
    cos, sin = model.rope(16, torch.device("cpu"))
    ctx = ForwardContext(pos=0, cos=cos.unsqueeze(1), sin=sin.unsqueeze(1))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.blocks[0])(torch.randn(2, 16, model.config.n_embd), ctx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.slow
def test_every_architecture_compiles_and_matches_eager():
    for arch in sorted(ARCHITECTURES):
        assert_compiled_matches_eager(arch, "aot_eager_decomp_partition")


@pytest.mark.slow
def test_inductor_compiled_transformer_matches_eager():
    assert_compiled_matches_eager("transformer", "inductor")
