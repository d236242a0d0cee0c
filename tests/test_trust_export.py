"""Exports and quantised folders verify themselves like checkpoints: every file of an `archscale export --format hf`
or `archscale quantize` folder is listed with its sha256 in `archscale_manifest.json`, checked at load, and the
recorded config is checked against the tensors' shapes (vocab, layers, widths) and its own field types before a
model is built. A tampered, truncated, bit-flipped or mis-sized folder is refused in one line naming the file or
field; an untampered one still loads in archscale and in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from archscale.cli import main  # noqa: E402
from archscale.errors import UserError  # noqa: E402
from archscale.export.load import load_exported  # noqa: E402

try:  # the tests below that re-sign a tampered folder must also show the old code failing (it had no manifest)
    from archscale.export.manifest import MANIFEST_FILE, write_manifest
except ImportError:  # pragma: no cover - only on the code before the manifest existed
    MANIFEST_FILE = "archscale_manifest.json"

    def write_manifest(folder):
        return None


@pytest.fixture(scope="module")
def exports(tiny_runs, tmp_path_factory):
    """A native-Llama folder (the Transformer++), an archscale folder (SambaY), an int8 quantised folder."""
    root = tmp_path_factory.mktemp("exports")
    out = {"llama": root / "llama", "archscale": root / "archscale", "quant": root / "quant"}
    assert main(["export", "--checkpoint", str(tiny_runs["transformer"]), "--out", str(out["llama"])]) == 0
    assert main(["export", "--checkpoint", str(tiny_runs["sambay"]), "--out", str(out["archscale"])]) == 0
    assert main(["quantize", "--checkpoint", str(tiny_runs["transformer"]), "--method", "int8-weight",
                 "--out", str(out["quant"])]) == 0
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def refused(folder, *words: str) -> str:
    with pytest.raises(UserError) as e:
        load_exported(folder)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_untampered_folders_carry_a_manifest_and_load(exports):
    from archscale.train.safe_io import sha256_file

    for kind, folder in exports.items():
        listed = json.loads((folder / MANIFEST_FILE).read_text())["files"]
        on_disk = {p.name for p in folder.iterdir() if p.name != MANIFEST_FILE}
        assert set(listed) == on_disk, kind
        for name, entry in listed.items():
            assert entry["sha256"] == sha256_file(folder / name) and entry["bytes"] == (folder / name).stat().st_size
        assert load_exported(folder).model is not None


def test_transformers_still_loads_the_folder(exports):
    """The manifest is one more JSON file beside the ones transformers reads: its own loading is unchanged."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exports["llama"]).eval()
    ours = load_exported(exports["llama"]).model
    x = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=0)


def flip_bit(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x10
    p.write_bytes(bytes(b))


def overwrite_4k(p: Path) -> None:
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 4096] = bytes(4096)
    p.write_bytes(bytes(b))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def edit_json(p: Path, edit) -> None:
    d = json.loads(p.read_text())
    edit(d)
    p.write_text(json.dumps(d))


def wrong_vocab(d):
    d["archscale"]["vocab_size"] += 64
    d["vocab_size"] = d.get("vocab_size", 0) + 64


TAMPERS = {  # what a hostile or broken copy does to a folder -> the file the error must name
    "config vocab_size": ("config.json", lambda f: edit_json(f / "config.json", wrong_vocab)),
    "weights 4 KiB overwritten": ("model.safetensors", lambda f: overwrite_4k(f / "model.safetensors")),
    "weights bit flip": ("model.safetensors", lambda f: flip_bit(f / "model.safetensors")),
    "weights truncated": ("model.safetensors", lambda f: truncate(f / "model.safetensors")),
    "weights missing": ("model.safetensors", lambda f: (f / "model.safetensors").unlink()),
    "tokenizer edited": ("tokenizer.json", lambda f: (f / "tokenizer.json").write_text("{}")),
    "manifest missing": (MANIFEST_FILE, lambda f: (f / MANIFEST_FILE).unlink()),
    "manifest not JSON": (MANIFEST_FILE, lambda f: (f / MANIFEST_FILE).write_text("{oops")),
}


@pytest.mark.parametrize("kind", ["llama", "archscale"])
@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_tampered_folder_is_refused_naming_the_file(exports, tmp_path, kind, tamper):
    folder = copy(exports[kind], tmp_path)
    name, do = TAMPERS[tamper]
    do(folder)
    refused(folder, name)


QUANT_TAMPERS = {
    "recipe model n_layer": ("archscale_quantized.json",
                             lambda f: edit_json(f / "archscale_quantized.json",
                                                 lambda d: d["model"].update(n_layer="two"))),
    "recipe method": ("archscale_quantized.json",
                      lambda f: edit_json(f / "archscale_quantized.json", lambda d: d.update(method="nf4"))),
    "tensor bit flip": ("model.safetensors", lambda f: flip_bit(f / "model.safetensors")),
    "tensor truncated": ("model.safetensors", lambda f: truncate(f / "model.safetensors")),
}


@pytest.mark.parametrize("tamper", sorted(QUANT_TAMPERS))
def test_tampered_quantized_folder_is_refused(exports, tmp_path, tamper):
    folder = copy(exports["quant"], tmp_path)
    name, do = QUANT_TAMPERS[tamper]
    do(folder)
    refused(folder, name)


# --------------------------------------------------------- a consistent manifest over an inconsistent folder
# (a buggy writer, or someone who re-signed after editing): the config is still checked against the tensors.
CONFIG_EDITS = {
    "vocab_size +64": ("vocab_size", lambda a: a.update(vocab_size=a["vocab_size"] + 64)),
    "vocab_size -1": ("vocab_size", lambda a: a.update(vocab_size=a["vocab_size"] - 1)),
    "n_layer +4": ("n_layer", lambda a: a.update(n_layer=a["n_layer"] + 4)),  # still a valid SambaY depth
    "n_layer 2.5": ("n_layer", lambda a: a.update(n_layer=2.5)),
    "n_layer true": ("n_layer", lambda a: a.update(n_layer=True)),
    "n_embd x2": ("n_embd", lambda a: a.update(n_embd=a["n_embd"] * 2)),
    "rope_base string": ("rope_base", lambda a: a.update(rope_base="ten thousand")),
    "norm_eps NaN": ("norm_eps", lambda a: a.update(norm_eps=float("nan"))),
    "intermediate_size +8": ("intermediate_size", lambda a: a.update(intermediate_size=a["intermediate_size"] + 8)),
    "unknown field": ("frobnicate", lambda a: a.update(frobnicate=1)),
}


@pytest.mark.parametrize("kind", ["llama", "archscale"])
@pytest.mark.parametrize("edit", sorted(CONFIG_EDITS))
def test_config_that_disagrees_with_the_tensors_is_refused(exports, tmp_path, kind, edit):
    folder = copy(exports[kind], tmp_path)
    field, do = CONFIG_EDITS[edit]
    edit_json(folder / "config.json", lambda d: do(d["archscale"]))
    write_manifest(folder)
    refused(folder, "config.json", field)


@pytest.mark.parametrize("edit", ["vocab_size +64", "n_layer 2.5", "n_embd x2", "rope_base string"])
def test_quantized_recipe_that_disagrees_with_the_tensors_is_refused(exports, tmp_path, edit):
    folder = copy(exports["quant"], tmp_path)
    field, do = CONFIG_EDITS[edit]
    edit_json(folder / "archscale_quantized.json", lambda d: do(d["model"]))
    write_manifest(folder)
    refused(folder, "archscale_quantized.json", field)


def test_quantized_tensor_of_the_wrong_shape_is_refused(exports, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = copy(exports["quant"], tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in sd if k.endswith("qdata"))
    sd[name] = sd[name][:-1].contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata=meta)
    write_manifest(folder)
    refused(folder, "model.safetensors")


def test_safetensors_file_with_a_bad_config_is_one_line(tiny_runs, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    assert main(["export", "--checkpoint", str(tiny_runs["transformer"]), "--out", str(path)]) == 0
    with safe_open(str(path), framework="pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for field, value in (("n_layer", 1.5), ("rope_base", "x"), ("vocab_size", 10 ** 6)):
        cfg = json.loads(meta["archscale_model_config"])
        cfg[field] = value
        save_file(sd, str(path), metadata={**meta, "archscale_model_config": json.dumps(cfg)})
        refused(path, field)


def test_cli_on_a_tampered_folder_is_one_line_exit_2(exports, tmp_path, capsys):
    folder = copy(exports["llama"], tmp_path)
    overwrite_4k(folder / "model.safetensors")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "Lords", "--max_new_tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0], err
