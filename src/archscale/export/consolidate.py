"""`archscale export`: any checkpoint -> one safetensors file of fp32 model weights.

Works for every strategy and world size: DCP checkpoints (single / DDP / FSDP2, any number of shards) are read
into one unsharded model through `torch.distributed.checkpoint` (no process group needed); DeepSpeed checkpoints
(any ZeRO stage) through DeepSpeed's zero_to_fp32. The file holds every parameter under its model name (tied
weights are written under both names, so `model.load_state_dict(load_file(...))` is strict-clean) and, as
metadata, the model config (`archscale_model_config`, JSON) and the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from archscale.runs import load_run


def consolidate(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `out` (.safetensors) from a run dir, its checkpoints/ dir, or one checkpoints/step-* dir."""
    from safetensors.torch import save_file

    run = load_run(checkpoint)  # weights only, from either format
    step_dir, run_cfg = run.step_dir, run.run_config
    tensors = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in run.model.state_dict().items()}
    meta = json.loads((step_dir / "COMPLETE").read_text())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "archscale_model_config": json.dumps(run_cfg["model"]),
                                           "step": str(meta.get("step", "")), "source": str(step_dir)})
    return out
