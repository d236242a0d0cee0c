"""`archscale export --format hf` for every architecture, and the reverse load.

For each architecture in `ARCHITECTURES` (tiny configs, weights re-drawn at a scale where every part matters):
logits through `transformers` equal ours (<= 1e-4, fp32), greedy `generate` through `transformers` equals
`GPT.generate`, `AutoTokenizer` gives our token ids, and the folder reads back into an identical `GPT`. The
Transformer++ is a native Llama with the mu-P++ multipliers folded in; the negative controls show each fold is
needed. One subprocess loads every folder with `trust_remote_code=True` in a fresh interpreter that never
imported archscale itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_architectures import ARCHS, tiny  # noqa: E402

from archscale.cli import main  # noqa: E402
from archscale.errors import UserError  # noqa: E402
from archscale.eval.loading import EvalModel  # noqa: E402
from archscale.export.hf_folder import write_hf_folder  # noqa: E402
from archscale.export.load import exported_kind, load_exported  # noqa: E402
from archscale.models.model import GPT  # noqa: E402

TOL = 1e-4
VOCAB = 320
ROOT = Path(__file__).resolve().parents[1]
ESSAY = ROOT / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"
TEXTS = ["Lords and Commons of England, consider what Nation it is whereof ye are.",
         "  two  spaces, digits 1234 and a literal <|endoftext|> inside the text\n", "ÿ unicode — ok"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from archscale.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("tok")
    (d / "essay.txt").write_text(ESSAY.read_text()[:60000])
    return train_bpe([str(d / "essay.txt")], VOCAB, str(d / "tokenizer.json"))


def scramble(model: GPT, seed: int = 0) -> GPT:
    """Linear weights N(0, 1/fan_in), norm gains 1 +- 0.2, embedding N(0, 0.5): logits of order 1-10."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
            elif isinstance(module, torch.nn.Embedding):
                module.weight.copy_(0.5 * torch.randn(module.weight.shape, generator=g))
            elif "norm" in name and getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g))
        if not model.config.tie_embeddings:
            w = model.lm_head.weight
            w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))
    return model.eval()


def make_em(arch: str, tokenizer, seed: int = 0, **overrides) -> EvalModel:
    torch.manual_seed(seed)
    model = scramble(GPT(tiny(arch, vocab_size=VOCAB, **overrides)), seed)
    return EvalModel(model=model, tokenizer=tokenizer, train_len=model.config.block_size,
                     run_cfg={"model": model.config.to_dict()})


def prompt_ids(seed: int = 1, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """One exported folder per architecture (fp32), with the EvalModel it came from."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        em = make_em(arch, tokenizer)
        out[arch] = (em, write_hf_folder(em, root / arch))
    return out


def hf_load(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_logits_and_greedy_generate_equal_ours(folders, arch):
    em, folder = folders[arch]
    hf = hf_load(folder)
    expected = "LlamaForCausalLM" if arch == "transformer" else "ArchScaleForCausalLM"
    assert type(hf).__name__ == expected
    idx = prompt_ids()
    with torch.no_grad():
        ours, theirs = em.model(idx), hf(input_ids=idx).logits
    assert ours.shape == theirs.shape == (2, 24, VOCAB)
    assert ours.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    assert (ours - theirs).abs().max().item() <= TOL
    # greedy: same tokens, decoded with caches on both sides (the HF wrapper feeds one token per step)
    lengths = []
    hook = hf.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        want = em.model.generate(idx, 12)
        got = hf.generate(input_ids=idx, attention_mask=torch.ones_like(idx), max_new_tokens=12, do_sample=False,
                          eos_token_id=None)
    hook.remove()
    assert torch.equal(got, want)
    assert len(set(want[:, 24:].flatten().tolist())) > 1, "degenerate continuation: the check would be weak"
    assert lengths[0] == 24 and set(lengths[1:]) == {1}


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_and_files(folders, tokenizer, arch):
    from transformers import AutoTokenizer, GenerationConfig

    _, folder = folders[arch]
    tok = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tok(text)["input_ids"] == tokenizer.encode(text, eos=False), text
        assert tok.decode(tokenizer.encode(text, eos=False)) == tokenizer.decode(tokenizer.encode(text, eos=False))
    assert tok.eos_token_id == tokenizer.eos_id == GenerationConfig.from_pretrained(folder).eos_token_id
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", "archscale_run.json"} <= names
    code = {"configuration_archscale.py", "modeling_archscale.py"}
    assert (code <= names) == (arch != "transformer")
    for f in code & names:  # the folder's code only imports archscale: no second copy of the model
        assert [line for line in (folder / f).read_text().splitlines() if line.startswith(("from", "import"))] \
            and "class " not in (folder / f).read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_reverse_load_is_the_same_model(folders, arch):
    em, folder = folders[arch]
    assert exported_kind(folder) == ("hf-llama" if arch == "transformer" else "hf-archscale")
    ex = load_exported(folder)
    idx = prompt_ids(seed=3)
    with torch.no_grad():
        assert (ex.model(idx) - em.model(idx)).abs().max().item() <= 1e-5
    assert ex.tokenizer_path == folder / "tokenizer.json"


def test_trust_remote_code_in_a_fresh_interpreter(folders, tmp_path):
    """Only transformers is imported by the script; the folders' own code must bring archscale in."""
    script = tmp_path / "load.py"
    script.write_text(
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "out = {}\n"
        "for arch, path in json.loads(sys.argv[1]).items():\n"
        "    assert 'archscale' not in sys.modules or arch != 'first'\n"
        "    m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()\n"
        "    idx = torch.tensor(json.loads(sys.argv[2]))\n"
        "    with torch.no_grad():\n"
        "        out[arch] = [type(m).__name__, m(input_ids=idx).logits.tolist()]\n"
        "print(json.dumps(out))\n")
    idx = prompt_ids(seed=5, batch=1, length=10)
    paths = {a: str(f) for a, (_, f) in folders.items()}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HOME=str(tmp_path / "hf_home"))
    res = subprocess.run([sys.executable, str(script), json.dumps(paths), json.dumps(idx.tolist())],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(got) == set(ARCHS)
    for arch, (name, logits) in got.items():
        em = folders[arch][0]
        with torch.no_grad():
            ours = em.model(idx)
        assert (torch.tensor(logits) - ours).abs().max().item() <= TOL, arch
        assert name == ("LlamaForCausalLM" if arch == "transformer" else "ArchScaleForCausalLM")


# ------------------------------------------------------------------------------------------------- mu-P++ fold
MULTS = dict(residual_scale=0.7, logit_scale=0.45, attn_scale_mult=1.6)


@pytest.mark.parametrize("tie", [False, True])
def test_mup_multipliers_fold_exactly_into_llama(tokenizer, tmp_path, tie):
    em = make_em("transformer", tokenizer, bias=True, tie_embeddings=tie, **MULTS)
    hf = hf_load(write_hf_folder(em, tmp_path / "llama"))
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = prompt_ids()
    with torch.no_grad():
        ours, theirs = em.model(idx), hf(input_ids=idx).logits
    assert (ours - theirs).abs().max().item() <= TOL
    # negative controls: the same weights without any one multiplier are a different model
    for name in MULTS:
        other = GPT(em.model.config.replace(**{name: 1.0}))
        other.load_state_dict(em.model.state_dict())
        with torch.no_grad():
            assert (other.eval()(idx) - theirs).abs().max().item() > 1e-3, name
    # read back: multipliers now 1.0 and folded into the weights, same logits
    ex = load_exported(tmp_path / "llama")
    assert all(getattr(ex.model.config, m) == 1.0 for m in MULTS)
    assert ex.info["folded"] == MULTS
    with torch.no_grad():
        assert (ex.model(idx) - ours).abs().max().item() <= TOL


def test_sharded_and_bf16_folders(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    em = make_em("sambay", tokenizer)
    sharded = write_hf_folder(em, tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    idx = prompt_ids()
    with torch.no_grad():
        ours = em.model(idx)
        assert (hf_load(sharded)(input_ids=idx).logits - ours).abs().max().item() <= TOL
        assert (load_exported(sharded).model(idx) - ours).abs().max().item() <= 1e-5
    bf = write_hf_folder(em, tmp_path / "bf16", dtype="bf16")
    hf = AutoModelForCausalLM.from_pretrained(bf).eval()
    assert hf.model.wte.weight.dtype == torch.bfloat16
    rounded = GPT(em.model.config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in em.model.state_dict().items()})
    with torch.no_grad():
        back = load_exported(bf).model(idx)
        assert (back - rounded.eval()(idx)).abs().max().item() <= 1e-5  # bf16 weights read back exactly
        rel = (hf(input_ids=idx).logits - ours).norm() / ours.norm()
    assert rel < 0.05  # bf16 autocast inside transformers: close, not equal


def test_left_padding_is_refused(folders):
    em, folder = folders["samba"]
    hf = hf_load(folder)
    idx = prompt_ids()
    mask = torch.ones_like(idx)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="left-padded"):
        hf.generate(input_ids=idx, attention_mask=mask, max_new_tokens=2)


# ----------------------------------------------------------------------------------------- CLI, end to end
@pytest.fixture(scope="module")
def runs(tiny_runs):
    return tiny_runs


@pytest.mark.parametrize("arch", ["transformer", "sambay"])
def test_cli_export_then_generate_and_eval_read_it_back(runs, tmp_path, capsys, arch):
    run = runs[arch]
    folder = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(folder)]) == 0
    card = (folder / "README.md").read_text()
    assert f"architecture: `{arch}`" in card and "tokens trained: 384" in card and "final val loss" in card
    capsys.readouterr()
    outs = []
    for ckpt in (run, folder):
        assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "Lords and", "--max_new_tokens", "8",
                     "--temperature", "0"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("Lords and")
    res = []
    for ckpt in (run, folder):
        out = tmp_path / f"{len(res)}.json"
        assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "ppl", "--extrapolation", "1", "--batch_size",
                     "2", "--ppl_max_batches", "2", "--output", str(out)]) == 0
        res.append(json.loads(out.read_text())["results"]["ppl"]["validation"]["1x"]["loss"])
    assert res[0] == pytest.approx(res[1], abs=1e-5)


def test_cli_safetensors_file_reads_back(runs, tmp_path, capsys):
    run = runs["sambay"]
    f = tmp_path / "m.safetensors"
    assert main(["export", "--checkpoint", str(run), "--out", str(f)]) == 0
    capsys.readouterr()
    outs = []
    for ckpt in (run, f):
        args = ["generate", "--checkpoint", str(ckpt), "--prompt", "Truth", "--max_new_tokens", "6",
                "--temperature", "0", "--tokenizer", str(run.parent / "tok.json")]
        assert main(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_one_line_errors(runs, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", "--format", "hf", "--checkpoint", str(runs["transformer"]), "--out",
                 str(tmp_path / "full")]) == 2
    assert "already exists" in capsys.readouterr().err
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="model type 'bert'"):
        load_exported(other)
    folder = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(runs["sambay"]), "--out", str(folder)]) == 0
    from safetensors.torch import load_file, save_file
    sd = load_file(str(folder / "model.safetensors"))
    sd.pop(next(k for k in sd if "mixer" in k))
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="model.safetensors is .* bytes, archscale_manifest.json says"):
        load_exported(folder)  # the manifest notices first (tests/test_trust_export.py tries every tamper)
    from archscale.export.manifest import write_manifest
    write_manifest(folder)  # re-signed: the strict load is the check that is left
    with pytest.raises(UserError, match="1 missing"):
        load_exported(folder)
