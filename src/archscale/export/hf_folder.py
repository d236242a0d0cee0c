"""`archscale export --format hf`: a run or checkpoint -> a folder `transformers` opens by itself.

    config.json, model.safetensors (or shards + index), generation_config.json, tokenizer.json,
    tokenizer_config.json, README.md (model card), archscale_run.json (the training config, for provenance),
    archscale_manifest.json (every other file's size and sha256, checked when archscale reads the folder back)

The Transformer++ becomes a native `LlamaForCausalLM` (mu-P multipliers folded into the weights, `export/hf.py`);
every other model an `ArchScaleForCausalLM` (`export/hf_model.py`) whose folder carries two one-line Python files
importing archscale, loaded with `trust_remote_code=True`. Both folders also record the archscale `ModelConfig`
(`config.json` key "archscale"), so `archscale eval / generate` read them back (`export/load.py`) without running
any of their code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from archscale.errors import UserError
from archscale.progress import Progress
from archscale.export.manifest import write_manifest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RUN_FILE = "archscale_run.json"


def fresh_out_dir(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: already exists and is not an empty folder; choose a new path")
    return out


def write_atomically(out: str | Path, fill) -> Path:
    """Call `fill(tmp_dir)` on a fresh temp folder beside `out`, then rename it to `out` (never half-written)."""
    out = fresh_out_dir(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if out.exists():
            out.rmdir()  # empty (checked by fresh_out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_files(tokenizer, out: Path, max_length: int) -> None:
    """tokenizer.json (+ tokenizer_config.json naming EOS) that encode exactly as archscale's `Tokenizer`: no
    BOS/EOS added by a post-processor, and special-token strings inside text split as text."""
    if getattr(tokenizer, "kind", None) != "huggingface":
        raise UserError(f"tokenizer {getattr(tokenizer, 'path', tokenizer)}: export needs a Hugging Face "
                        "tokenizer.json (SentencePiece models are not converted yet)")
    data = json.loads(Path(tokenizer.path).read_text(encoding="utf-8"))
    data["post_processor"] = None  # archscale adds no special tokens when encoding; neither may HF
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    eos = tokenizer.decode([tokenizer.eos_id])
    bos = tokenizer.decode([tokenizer.bos_id]) if tokenizer.bos_id is not None else None
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "bos_token": bos,
           "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
           "clean_up_tokenization_spaces": False, "model_max_length": max_length}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _final_losses(run_dir: Path | None) -> dict:
    from archscale.train.metrics import read_metrics

    path = (run_dir / "metrics.csv") if run_dir else None
    if path is None or not path.is_file():
        return {}
    rows = read_metrics(path)
    out = {}
    for key in ("train_loss", "val_loss"):
        vals = [(r.get("tokens"), r[key]) for r in rows if r.get(key)]
        if vals:
            out[key] = (float(vals[-1][1]), vals[-1][0])
    return out


def model_card(em, cfg, kind: str, dtype: str) -> str:
    pre = em.run_cfg.get("pretrain") or {}
    losses = _final_losses(em.run_dir)
    tokens = max((int(t) for _, t in losses.values() if t), default=None)
    params = sum(p.numel() for p in {id(p): p for p in em.model.parameters()}.values())
    load = ("AutoModelForCausalLM.from_pretrained(DIR)" if kind == "llama" else
            "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # needs `pip install archscale[hf]`")
    lines = [f"# {cfg.name} (archscale)", "",
             f"- architecture: `{cfg.arch}` ({cfg.n_layer} layers, width {cfg.n_embd}, {params:,} parameters); "
             f"layers: {', '.join(cfg.layer_kinds)}",
             f"- exported as: {'LlamaForCausalLM (native)' if kind == 'llama' else 'ArchScaleForCausalLM'}, {dtype}",
             f"- training data: {pre.get('train_data_dir') or 'not recorded'}",
             f"- tokens trained: {tokens:,}" if tokens else "- tokens trained: not recorded",
             f"- training context: {cfg.block_size} tokens; vocabulary {cfg.vocab_size}"]
    for key, (val, tok) in losses.items():
        lines.append(f"- final {key.replace('_', ' ')}: {val:.4f} nats/token (at {int(tok):,} tokens)")
    if em.step is not None:
        lines.append(f"- checkpoint step: {em.step}")
    lines += ["", "Trained with archscale (a re-founding of github.com/microsoft/ArchScale).", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(DIR)", f"model = {load}", "```", ""]
    return "\n".join(lines)


def _build_hf_model(model, tokenizer, dtype: torch.dtype):
    """(kind, the transformers model) holding `model`'s weights."""
    from transformers import GenerationConfig

    from archscale.export.hf import llama_incompatibility, to_llama_model

    cfg = model.config
    ids = dict(eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id)
    if llama_incompatibility(cfg) is None:
        folded = cfg.replace(residual_scale=1.0, logit_scale=1.0, attn_scale_mult=1.0)
        hf = to_llama_model(model, dtype=dtype, archscale=folded.to_dict(),
                            archscale_folded={m: getattr(cfg, m) for m in
                                              ("residual_scale", "logit_scale", "attn_scale_mult")}, **ids)
        kind = "llama"
    else:
        from archscale.export.hf_model import AUTO_MAP, ArchScaleConfig, ArchScaleForCausalLM

        hf_cfg = ArchScaleConfig(archscale=cfg.to_dict(), auto_map=dict(AUTO_MAP), **ids)
        with torch.device("meta"):
            hf = ArchScaleForCausalLM(hf_cfg)
        hf.model.load_state_dict(model.state_dict(), strict=True, assign=True)
        if cfg.tie_embeddings:
            hf.model.lm_head.weight = hf.model.wte.weight
        hf = hf.to(dtype).eval()
        kind = "archscale"
    hf.generation_config = GenerationConfig(**ids)
    return kind, hf


def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", max_shard_size: str = "5GB",
              tokenizer: str | None = None, progress: Progress | None = None) -> Path:
    """Write the folder; returns its path. `checkpoint`: a run dir, checkpoints/ dir or step dir."""
    from archscale.eval.loading import load_eval_model

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    shard = shard_bytes(max_shard_size)
    out = fresh_out_dir(out)
    progress = progress or Progress(show=False)
    with progress.stage(f"export: loading {checkpoint}", log=False):
        em = load_eval_model(checkpoint, device="cpu", tokenizer=tokenizer)
    return write_hf_folder(em, out, dtype, shard, progress)


def shard_bytes(size: str | int) -> int:
    """`--max_shard_size` ("5GB", "500MB", "1000000") in bytes, as huggingface_hub reads it; a one-line error for
    anything else (it would raise deep inside save_pretrained, after the model was built)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        n = int(size) if isinstance(size, int) or str(size).isdigit() else parse_size_to_int(str(size))
    except (ValueError, TypeError):
        n = None
    if not isinstance(n, int) or n <= 0:
        raise UserError(f"--max_shard_size {size!r}: want a positive size such as 5GB, 500MB or a byte count")
    return n


def write_hf_folder(em, out: str | Path, dtype: str = "fp32", max_shard_size: str | int = "5GB",
                    progress: Progress | None = None) -> Path:
    """The folder for an `EvalModel` (model + tokenizer + run config), written atomically."""
    fresh_out_dir(out)
    progress = progress or Progress(show=False)
    with progress.stage(f"export: converting to a transformers model ({dtype})"):
        kind, hf = _build_hf_model(em.model, em.tokenizer, DTYPES[dtype])

    def fill(tmp: Path) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our stage line names the step; --progress false means no output
        try:
            hf.save_pretrained(tmp, max_shard_size=max_shard_size)
        finally:
            hf_logging.enable_progress_bar()
        if kind == "archscale":
            from archscale.export.hf_model import (CONFIGURATION_FILE, CONFIGURATION_SOURCE, MODELING_FILE,
                                                   MODELING_SOURCE)
            (tmp / CONFIGURATION_FILE).write_text(CONFIGURATION_SOURCE)
            (tmp / MODELING_FILE).write_text(MODELING_SOURCE)
        tokenizer_files(em.tokenizer, tmp, em.model.config.block_size)
        (tmp / RUN_FILE).write_text(json.dumps(em.run_cfg, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(em, em.model.config, kind, dtype))
        write_manifest(tmp)  # last: it lists every file above with its sha256

    with progress.stage(f"export: writing {out}"):
        return write_atomically(out, fill)
