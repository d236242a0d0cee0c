"""Layouts as data (archscale/layout.py, models/layout_rules.py): the grammar, the shipped specs, validation that
names the layer and the rule, per-layer options, and the record every run keeps of the layers it built."""

import json

import pytest
import torch
import yaml

from archscale import GPT, ModelConfig
from archscale.config import ARCHITECTURES, LAYOUTS, resolve_layout
from archscale.errors import UserError
from archscale.layout import LayoutSpec, expand_layers, layer_label

V = 97


def build(ref, depth=4, **kw):
    kw = {"ar": 16, "vocab_size": V, "block_size": 64, **kw}
    return GPT(ModelConfig.from_layout(ref, depth, **kw))


# ---------------------------------------------------------------------------------------------------- grammar
def test_counts_patterns_and_rest():
    kinds = lambda expr, L: [e.mixer for e in expand_layers(expr, L, "mlp", "t")]  # noqa: E731
    assert kinds("[mamba, swa] * L/2, mamba_mem, kv, [gmu, cross] * rest", 8) == \
        ["mamba", "swa", "mamba", "swa", "mamba_mem", "kv", "gmu", "cross"]
    assert kinds("[swa, swa, swa, attn] * L", 6) == ["swa", "swa", "swa", "attn", "swa", "swa"]  # cyclic, truncated
    assert kinds("attn, mamba * 3L/4, attn * rest", 8) == ["attn"] + ["mamba"] * 6 + ["attn"]
    assert kinds("[attn, mamba] * 4, gdn", 5) == ["attn", "mamba", "attn", "mamba", "gdn"]  # COUNT counts layers
    entries = expand_layers("swa(window=512, da):moe, attn(nope=false)", 2, "mlp", "t")
    assert (entries[0].ffn, dict(entries[0].options)) == ("moe", {"window": 512, "da": True})
    assert (entries[1].ffn, dict(entries[1].options)) == ("mlp", {"nope": False})


@pytest.mark.parametrize("expr,depth,message", [
    ("attn * L/3", 4, "L/3 in .* is not a whole number of layers at depth 4"),
    ("attn * L, mamba", 4, "make 5 layers but the depth is 4"),
    ("attn * rest, mamba * rest", 4, "only one segment may use 'rest'"),
    ("[attn, swa * 2", 4, "unbalanced brackets"),
    ("attn * two", 4, "'two' .* is not a layer count"),
    ("Attn * L", 4, "is not a layer"),
    ("attn * 2 * 2", 4, "more than one"),
])
def test_grammar_errors_are_one_line(expr, depth, message):
    with pytest.raises(UserError, match=message) as e:
        expand_layers(expr, depth, "mlp", "t")
    assert "\n" not in str(e.value)


def test_file_json_and_one_line_forms_build_the_same_model(tmp_path):
    spec = {"name": "hyb", "ar": 16, "layers": "[mamba2, swa] * rest", "sliding_window": 8}
    (tmp_path / "h.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "h.json").write_text(json.dumps(spec))
    one_line = "[mamba2, swa] * rest; name=hyb; ar=16; sliding_window=8"
    records = [build(ref).config.layers for ref in (str(tmp_path / "h.yaml"), str(tmp_path / "h.json"), one_line)]
    assert records[0] == records[1] == records[2]
    assert records[0][1] == {"mixer": "swa", "ffn": "mlp", "sliding_window": 8, "use_da": False, "nope": False}


def test_spec_file_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlayers: attn * L\nwindow: 3\n")
    with pytest.raises(UserError, match=r"bad.yaml: unknown key\(s\) \['window'\]"):
        resolve_layout(str(bad))
    bad.write_text("name: x\nlayers: attn * L\nar: big\n")
    with pytest.raises(UserError, match="ar must be int"):
        resolve_layout(str(bad))
    bad.write_bytes(b"\xff\xfe name")
    with pytest.raises(UserError, match="cannot read it"):
        resolve_layout(str(bad))
    with pytest.raises(UserError, match="no such file"):
        resolve_layout(str(tmp_path / "missing.yaml"))
    with pytest.raises(UserError, match="not a shipped layout name"):
        resolve_layout("nosuchname")


# ------------------------------------------------------------------------------------------- shipped specs
def test_the_sixteen_named_architectures_are_shipped_specs():
    assert len(ARCHITECTURES) == 16 and all(s.source == "architectures.yaml" for s in ARCHITECTURES.values())
    assert set(ARCHITECTURES) <= set(LAYOUTS)
    for name, spec in ARCHITECTURES.items():
        assert isinstance(spec, LayoutSpec) and spec.law is not None, name  # ArchScale's hand-entered laws kept
        depth = 8 if spec.use_da else 4 * spec.depth_multiple
        cfg = ModelConfig.from_arch(name, depth, ar=16, vocab_size=V)
        assert cfg.layout == spec.to_dict() and len(cfg.layers) == depth


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("ref,message", [
    ("cross, attn * rest", r"layer 0 \(cross:mlp\): reads shared kv but no earlier layer produces it"),
    ("gmu, attn * rest", r"layer 0 \(gmu:mlp\): reads memory but no earlier layer produces it"),
    ("attn(window=4) * L", r"layer 0 \(attn:mlp\): option 'window' does not apply .*applies to: swa"),
    ("attn(da) * L", r"layer 0 \(attn:mlp\): option da: differential attention pairs heads"),
    ("swa(window=0) * L", r"option window: a sliding window is a whole number of tokens >= 1"),
    ("swa * L", r"option sliding_window: .*got 0\): give the layer swa\(window=N\) or the spec a sliding_window"),
    ("attn(bogus=1) * L", r"option 'bogus' does not apply .*no layer kind takes 'bogus'"),
    ("foo * L", r"layer 0 \(foo:mlp\): no mixer registered for layer kind 'foo'"),
    ("attn:bar * L", r"no ffn registered for layer kind 'bar'"),
    ("[mamba, kv, mamba, cross] * L; yoco=true", r"layer 2 \(mamba:mlp\): is in the YOCO cross-decoder"),
    ("[mamba, swa(window=4)] * rest; yoco=true", r"exactly one layer producing the shared KV"),
    ("attn * L/2, kv, cross * rest; depth_multiple=4", r"needs a depth divisible by 4 \(got 6\)"),
])
def test_a_spec_that_cannot_work_is_one_line_naming_layer_and_rule(ref, message):
    with pytest.raises(UserError, match=message) as e:
        with torch.device("meta"):
            build(ref, depth=6 if "depth_multiple" in ref else 4)
    assert "\n" not in str(e.value)


def test_dry_run_refuses_a_broken_layout_in_one_line(capsys):
    from archscale.cli import main

    argv = ["pretrain", "--layout", "cross, attn * rest", "--depth", "2", "--vocab_size", "64", "--dry_run"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "layer 0 (cross:mlp): reads shared kv" in err and len(err.splitlines()) == 1


# ----------------------------------------------------------------------------------------- per-layer options
def test_per_layer_options_change_only_their_layer():
    torch.manual_seed(0)
    idx = torch.randint(0, V, (1, 24))
    model = build("swa(window=4), attn(nope), attn(da), attn", depth=4, n_query_groups=2)
    blocks = model.blocks
    assert blocks[0].mixer.window == 4 and blocks[3].mixer.window == 0
    assert not blocks[1].mixer.use_rope and blocks[0].mixer.use_rope
    assert blocks[2].mixer.diff is not None and all(blocks[i].mixer.diff is None for i in (0, 1, 3))
    wider = build("swa(window=8), attn(nope), attn(da), attn", depth=4, n_query_groups=2)
    wider.load_state_dict(model.state_dict())
    with torch.no_grad():  # the same weights: only the window differs, and only beyond position 4
        a, b = model(idx), wider(idx)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)  # (different kernels: rounding only)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_flops_follow_each_layers_window():
    small = build("swa(window=4) * L", depth=2).flops_per_token(64, training=False)
    large = build("swa(window=32) * L", depth=2).flops_per_token(64, training=False)
    per_layer = 4 * 2 * 16  # 4 x n_head x head_size per key seen
    assert large - small == pytest.approx(2 * per_layer * (32 - 4))


def test_named_law_and_counted_law_in_the_dry_run():
    from archscale.train.args import parse_pretrain
    from archscale.train.trainer import dry_run_summary

    for argv, name, source in ((["--train_model", "sambay"], "sambay", "ArchScale's law (14.5 ar^2 + 144 ar) d^3"),
                               (["--layout", "[mamba, swa(window=64)] * rest"], "custom",
                                "counted (active non-embedding parameters)")):
        cfg, explicit = parse_pretrain([*argv, "--depth", "4", "--vocab_size", "64"])
        summary = dry_run_summary(cfg, explicit, warn=lambda m: None)
        assert summary["n_params_law_source"] == source
        assert summary["layout"]["name"] == name and len(summary["layout"]["layers"]) == 4
    assert summary["layout"]["layers"][1] == "swa(sliding_window=64, use_da=False, nope=False):mlp"
    assert summary["n_params_law"] == summary["n_params_active_non_embedding"]  # counted: the model itself
