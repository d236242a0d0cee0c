"""A layout nobody shipped, from a spec file written here, goes the whole way without editing src/: trained,
evaluated, exported to an HF folder, reloaded (transformers and archscale) and served. Runs record the layers
they built; a record that disagrees with the weights is refused in one line; runs saved before records existed
still load."""

import hashlib
import json
import shutil

import httpx
import pytest
import torch
import yaml

from archscale.cli import main
from archscale.errors import UserError
from archscale.runs import load_run
from serving_fixtures import essay_data, running_server

SPEC = {"name": "mswa", "description": "test hybrid: Mamba, SWA-8, full attention, MoE on the last layer",
        "ar": 16, "layers": "mamba, swa(window=8), attn, attn:moe", "mixer_options": {"moe": {"n_experts": 4}}}
LAYERS = [{"mixer": "mamba", "ffn": "mlp"},
          {"mixer": "swa", "ffn": "mlp", "sliding_window": 8, "use_da": False, "nope": False},
          {"mixer": "attn", "ffn": "mlp", "use_da": False, "nope": False},
          {"mixer": "attn", "ffn": "moe", "use_da": False, "nope": False}]


def pretrain_args(data, out, spec_file, *extra):
    return ["pretrain", "--train_data_dir", str(data), "--layout", str(spec_file), "--depth", "4",
            "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "384",
            "--base_hps.warmup_tokens0", "128", "--eval_iters", "1", "--eval_interval", "100", "--out_dir", str(out),
            "--progress", "false", "--precision", "fp32", *extra]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    essay_data(d)
    (d / "mswa.yaml").write_text(yaml.safe_dump(SPEC))
    assert main(pretrain_args(d / "data", d / "run", d / "mswa.yaml", "--resume", "none")) == 0
    return d


def step_dir(run):
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def rewrite_config(step, edit):
    """Edit a checkpoint's config.yaml and re-seal its checksum, as a hand edit with care would."""
    cfg = yaml.safe_load((step / "config.yaml").read_text())
    edit(cfg["model"])
    text = yaml.safe_dump(cfg, sort_keys=False)
    (step / "config.yaml").write_text(text)
    complete = json.loads((step / "COMPLETE").read_text())
    complete["files"]["config.yaml"] = {"bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (step / "COMPLETE").write_text(json.dumps(complete))


def test_the_run_records_the_layers_it_built(hybrid):
    saved = yaml.safe_load((hybrid / "run" / "config.yaml").read_text())
    assert saved["model"]["layers"] == LAYERS
    assert saved["model"]["layout"]["layers"] == SPEC["layers"] and saved["model"]["arch"] == "mswa"
    assert saved["plan"]["params_law"].startswith("counted")
    run = load_run(hybrid / "run")
    assert run.model_config.layers == LAYERS and run.model.blocks[1].mixer.window == 8


def test_a_new_hybrid_evaluates_exports_reloads_and_serves(hybrid, tmp_path):
    from transformers import AutoModelForCausalLM

    import archscale.export.hf_model  # noqa: F401 (registers the Auto classes: no remote code needed)
    from archscale.data.tokenizer import Tokenizer

    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(hybrid / "run"), "--tasks", "ppl", "--extrapolation", "1",
                 "--batch_size", "2", "--output", str(out)]) == 0
    assert "ppl" in out.read_text()
    folder = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(hybrid / "run"), "--out", str(folder)]) == 0
    assert json.loads((folder / "config.json").read_text())["archscale"]["layers"] == LAYERS
    ours = load_run(hybrid / "run").model
    idx = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    reloaded = load_run(folder).model
    with torch.no_grad():
        ref = ours(idx)
        assert (hf(input_ids=idx).logits - ref).abs().max().item() < 1e-5
        assert (reloaded(idx) - ref).abs().max().item() < 1e-5
    tok = Tokenizer(hybrid / "tok.json")
    ids = tok.encode("Give me the liberty to know", eos=False)
    expected = tok.decode(reloaded.generate(torch.tensor([ids]), 6, temperature=0.0)[0, len(ids):].tolist())
    with running_server(reloaded, tok, max_model_len=128) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Give me the liberty to know", "max_tokens": 6,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected


def test_a_swapped_layer_record_is_a_one_line_error(hybrid, tmp_path):
    """swa and attn have the same tensors: the swapped record would load silently and compute something else
    (shown first, the negative control); the record saved with the weights catches it."""
    from archscale import GPT, ModelConfig

    run = tmp_path / "run"
    shutil.copytree(hybrid / "run", run)
    step = step_dir(run)
    swap = lambda m: m.update(layers=[m["layers"][0], m["layers"][2], m["layers"][1], m["layers"][3]])  # noqa: E731
    good = load_run(run).model
    cfg = yaml.safe_load((step / "config.yaml").read_text())["model"]
    swap(cfg)
    swapped = GPT(ModelConfig.from_dict(cfg))
    swapped.load_state_dict(good.state_dict())  # no error: the danger
    idx = torch.randint(0, 320, (1, 24))
    with torch.no_grad():
        assert (swapped(idx) - good(idx)).abs().max().item() > 1e-3
    rewrite_config(step, swap)
    with pytest.raises(UserError, match=r"layer 1 is attn.* in config.yaml but was trained as swa\(.*sliding_window=8") as e:
        load_run(run)
    assert "\n" not in str(e.value)
    (step / "config.yaml").write_text((step / "config.yaml").read_text() + "# edited\n")  # checksum now wrong
    with pytest.raises(UserError, match="none of the 1 checkpoints is usable .*config.yaml has"):
        load_run(run)


def test_resuming_with_another_layout_names_the_layer(hybrid, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(hybrid / "run", run)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**SPEC, "layers": "mamba, attn, swa(window=8), attn:moe"}))
    assert main(pretrain_args(hybrid / "data", run, other, "--resume", "auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "layer 1 swa(sliding_window=8, use_da=False, nope=False):mlp -> attn(use_da=False, nope=False):mlp" in err


def test_a_run_saved_before_layer_records_still_loads(tiny_runs, tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(tiny_runs["sambay"], run)
    step = step_dir(run)
    rewrite_config(step, lambda m: [m.pop(k) for k in ("layout", "layers", "cross_decoder")])
    new, old = load_run(tiny_runs["sambay"]), load_run(run)
    assert "saved before runs recorded their layers" in capsys.readouterr().err
    assert old.model_config.layers == new.model_config.layers
    idx = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        assert torch.equal(old.model(idx), new.model(idx))
