"""benchmarks/step_breakdown.py: the products' FLOPs it counts equal torch's own FlopCounterMode count for a
model with linear layers and batched products, their time is booked as products and the rest as other ops,
and `bound` is the arithmetic the benchmark docs quote."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sb():
    spec = importlib.util.spec_from_file_location("step_breakdown", ROOT / "benchmarks" / "step_breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_step(model, x):
    h = model[0](x)                                                         # linear with bias: addmm
    h = torch.bmm(h.view(4, 3, 8), h.view(4, 8, 3)).flatten(1)              # batched product
    model[1](torch.relu(h).repeat(1, 2)[:, :16]).square().sum().backward()  # linear without bias: mm


def test_counted_flops_equal_torchs_count(sb):
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(16, 24), torch.nn.Linear(16, 5, bias=False)])
    x = torch.randn(4, 16)
    with FlopCounterMode(display=False) as counter:
        train_step(model, x)
    parts = sb.breakdown(lambda: train_step(model, x), steps=3)
    assert parts["matmul_flop"] == counter.get_total_flops() > 0
    assert parts["matmul_s"] > 0 and parts["other_s"] > 0
    assert len(parts["slowest_other"]) == 5
    assert all(name not in sb.PRODUCTS for name in parts["slowest_other"])
    assert parts["wall_s"] >= parts["matmul_s"] + parts["other_s"]


def test_a_step_without_products_counts_none(sb):
    """Negative control: elementwise work only is all 'other'."""
    x = torch.randn(64, 64, requires_grad=True)
    parts = sb.breakdown(lambda: (x * 2).exp().sum().backward(), steps=2)
    assert parts["matmul_flop"] == 0 and parts["matmul_s"] == 0 and parts["other_s"] > 0


def test_bound_arithmetic(sb):
    base = {"matmul_s": 1.6, "other_s": 0.4}                               # a 2.0 s step
    model = {"matmul_s": 2.1, "other_s": 0.5}
    b = sb.bound(model, base, 0.85)
    assert b["products_only_ratio"] == pytest.approx(2.0 / 2.1)
    assert b["other_budget_s"] == pytest.approx(2.0 / 0.85 - 2.1)


def test_interleaved_takes_each_models_median(sb, monkeypatch):
    """Models in turn, order reversed every round, and each number the median over that model's rounds."""
    order, values = [], iter([1.0, 5.0, 2.0, 7.0, 3.0, 6.0])  # a, b, then b, a, then a, b

    def fake(step, steps=1):
        name = step()
        order.append(name)
        v = next(values)
        return {"wall_s": v, "matmul_s": v, "other_s": 0.0, "untimed_s": 0.0, "matmul_flop": v,
                "slowest_other": {name: v}}

    monkeypatch.setattr(sb, "breakdown", fake)
    parts = sb.interleaved({"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert parts["a"]["matmul_s"] == 3.0 and parts["b"]["matmul_s"] == 5.0   # medians of (1, 7, 3) and (5, 2, 6)


def test_custom_kernel_flops_are_booked_apart(sb):
    """The SSD scan's C++ kernel (a custom op with a registered FLOP formula): its FLOPs are counted as torch's
    FlopCounterMode counts them, apart from the aten products, and its time stays among the other ops."""
    from archscale.kernels import scan_cpu
    from archscale.kernels.ssd import ssd_scan

    if not scan_cpu.available():
        pytest.skip("the C++ CPU module did not build")
    g = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(2, 40, *shape, generator=g).requires_grad_() for shape in ((4, 8), (1, 16), (1, 16)))
    dt, A = torch.rand(2, 40, 4, generator=g), -torch.rand(4, generator=g)

    def step():
        ssd_scan(x, dt, A, B, C, 16, impl="cpu").square().sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    parts = sb.breakdown(step, steps=2)
    assert parts["kernel_flop"] == counter.get_total_flops() > 0
    assert parts["matmul_flop"] == 0 and 0 < parts["kernel_s"] <= parts["other_s"]
    assert "kernels with products inside" in sb.describe("m", parts)
