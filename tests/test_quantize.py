"""`archscale quantize` (torchao) for every architecture and method, on CPU.

Each (architecture, method): the linears become torchao tensors, the logits move a little (bounded relative
error) but not nothing, the folder reads back to a model whose logits and greedy tokens are *identical* to the
in-memory quantised one, and the quantised weights take far fewer bytes on disk. End to end through the CLI:
quantise a run, then generate and eval from the folder.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("torchao")

from test_architectures import ARCHS, tiny  # noqa: E402

from archscale.cli import main  # noqa: E402
from archscale.errors import UserError  # noqa: E402
from archscale.models.model import GPT  # noqa: E402
from archscale.quantize import METHODS, load_quantized, quantizable_linears, quantize_model, save_quantized  # noqa: E402

# Relative L2 error, quantised vs fp32, of one linear layer (tight: per-channel int8 is ~1%, 4-bit NF4 ~10%) and
# of the logits of a whole random 8-layer model (loose: errors compound through random layers; measured
# int8-weight <= 0.053, int8-dynamic <= 0.10, nf4 <= 0.64 across the architectures).
MAX_LAYER_ERR = {"int8-dynamic": 0.03, "int8-weight": 0.02, "nf4": 0.15}
MAX_MODEL_ERR = {"int8-dynamic": 0.2, "int8-weight": 0.1, "nf4": 0.9}


def scrambled(arch: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    # ArchScale's own GDN head sizes (tiny() shrinks them for speed; 16-wide heads amplify int8 error past the bound)
    model = GPT(tiny(arch, mixer_options={}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / math.sqrt(m.in_features))
            elif isinstance(m, torch.nn.Embedding):
                m.weight.copy_(0.5 * torch.randn(m.weight.shape, generator=g))
    return model.eval()


def ids(seed: int = 1, length: int = 20) -> torch.Tensor:
    return torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_save_load_every_architecture(arch, method, tmp_path):
    ref = scrambled(arch)
    model = scrambled(arch)
    x = ids()
    with torch.no_grad():
        want = ref(x)
        info = quantize_model(model, method)
        got = model(x)
    assert info["quantized"] == [n for n in quantizable_linears(ref) if n not in info["skipped"]]
    assert len(info["quantized"]) >= ref.config.n_layer * 2  # every block's MLP at least
    assert all(type(model.get_submodule(n).weight).__name__ in ("Int8Tensor", "NF4Tensor") for n in info["quantized"])
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-5 < rel < MAX_MODEL_ERR[method], rel
    name = info["quantized"][len(info["quantized"]) // 2]
    lin, lin_ref = model.get_submodule(name), ref.get_submodule(name)
    h = torch.randn(4, 7, lin_ref.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layer_rel = ((lin(h) - lin_ref(h)).norm() / lin_ref(h).norm()).item()
    assert 1e-5 < layer_rel < MAX_LAYER_ERR[method], (name, layer_rel)
    save_quantized(model, info, tmp_path)
    (tmp_path / "archscale_quantized.json").write_text(json.dumps({"method": method, "model": ref.config.to_dict(),
                                                                   **info}))
    back = load_quantized(tmp_path).model
    with torch.no_grad():
        assert torch.equal(back(x), got)
        assert torch.equal(back.generate(x, 6), model.generate(x, 6))


def test_size_on_disk_shrinks(tmp_path):
    from safetensors.torch import save_file

    ref = scrambled("sambay")
    names = set(quantizable_linears(ref))
    fp32 = {k: v for k, v in ref.state_dict().items() if k.rsplit(".", 1)[0] in names and k.endswith("weight")}
    save_file(fp32, str(tmp_path / "fp32.safetensors"))
    sizes = {}
    for method in METHODS:
        model = scrambled("sambay")
        info = quantize_model(model, method)
        d = tmp_path / method
        d.mkdir()
        save_quantized(model, info, d)
        sizes[method] = (d / "model.safetensors").stat().st_size
    base = (tmp_path / "fp32.safetensors").stat().st_size
    rest = sum(v.numel() * 4 for k, v in ref.state_dict().items() if k not in fp32)  # stays fp32
    for method, most in (("int8-dynamic", 0.3), ("int8-weight", 0.3), ("nf4", 0.2)):
        assert sizes[method] - rest < most * base, (method, sizes[method] - rest, base)


def test_cli_quantize_then_generate_and_eval(tiny_runs, tmp_path, capsys):
    run = tiny_runs["sambay"]
    base = tmp_path / "base.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--extrapolation", "1", "--batch_size", "2",
                 "--ppl_max_batches", "2", "--output", str(base)]) == 0
    for method in ("int8-weight", "nf4"):
        q = tmp_path / method
        assert main(["quantize", "--checkpoint", str(run), "--method", method, "--out", str(q)]) == 0
        assert {p.suffix for p in q.iterdir()} <= {".json", ".safetensors"}  # no pickle, no code
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(q), "--prompt", "Lords", "--max_new_tokens", "5",
                     "--temperature", "0"]) == 0
        assert capsys.readouterr().out.startswith("Lords")
        out = tmp_path / f"{method}.json"
        assert main(["eval", "--checkpoint", str(q), "--tasks", "ppl", "--extrapolation", "1", "--batch_size", "2",
                     "--ppl_max_batches", "2", "--output", str(out)]) == 0
        loss = json.loads(out.read_text())["results"]["ppl"]["validation"]["1x"]["loss"]
        ref = json.loads(base.read_text())["results"]["ppl"]["validation"]["1x"]["loss"]
        assert loss != ref and abs(loss - ref) < 0.1
    with pytest.raises(UserError, match="already quantised"):
        from archscale.quantize_cli import quantize_checkpoint
        quantize_checkpoint(tmp_path / "nf4", "int8-weight", tmp_path / "again")
    assert main(["quantize", "--checkpoint", str(run), "--method", "nf4", "--out", str(tmp_path / "nf4")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bad_method_is_refused():
    with pytest.raises(UserError, match="--method"):
        quantize_model(scrambled("transformer"), "int3")
