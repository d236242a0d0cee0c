"""Load a trained model and sample from it (incremental decoding with caches: `GPT.generate`)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.model import GPT
from archscale.train import checkpoint as ckpt


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir (newest complete checkpoint), a checkpoints/ dir, or one checkpoints/step-* dir."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--checkpoint {path}: no such file or directory")
    if (path / "COMPLETE").exists():
        return path
    for root in (path / "checkpoints", path):
        found = ckpt.find_latest(root, warn=lambda m: None)
        if found is not None:
            return found
    raise UserError(f"--checkpoint {path}: no complete checkpoint found (expected checkpoints/step-*)")


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """Return (model in eval mode, the run's resolved config dict). `path` may also be an exported HF folder,
    a quantized folder or an exported safetensors file."""
    from archscale.export.load import exported_kind, load_exported

    if exported_kind(path):
        ex = load_exported(path, device)
        return ex.model.eval(), ex.run_cfg
    step_dir = resolve_checkpoint(path)
    run_cfg = yaml.safe_load((step_dir / "config.yaml").read_text())
    model = GPT(ModelConfig(**run_cfg["model"]))
    ckpt.load_checkpoint(step_dir, model, None)
    return model.to(device).eval(), run_cfg


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             eos_id: int | None = None, generator: torch.Generator | None = None,
             top_p: float | None = None) -> torch.Tensor:
    """Append up to `max_new_tokens` tokens to idx (B, T) with the model's cached decoding; greedy when
    temperature == 0."""
    return model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                          generator=generator)


def generate_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, top_p: float | None = None) -> str:
    ids = tokenizer.encode(prompt, bos=False, eos=False) if prompt else [tokenizer.eos_id]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature, top_k, eos_id=tokenizer.eos_id, generator=gen,
                   top_p=top_p)
    new = [t for t in out[0, len(ids):].tolist() if t != tokenizer.eos_id]
    return prompt + tokenizer.decode(new)
