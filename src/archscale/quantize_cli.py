"""`archscale quantize`: load any checkpoint or export, quantise it (`archscale.quantize`), write the folder.
Apart from `quantize.py` because it loads runs (`archscale.runs`), which read quantised folders back."""

from __future__ import annotations

import json
from pathlib import Path

from archscale.errors import UserError
from archscale.progress import Progress
from archscale.quantize import METHODS, RECIPE_FILE, quantize_model, save_quantized


def quantize_checkpoint(checkpoint: str | Path, method: str, out: str | Path, tokenizer: str | None = None,
                        progress: Progress | None = None) -> dict:
    """Load any checkpoint / export, quantise it on CPU, write the folder. Returns the recipe written."""
    import torchao

    from archscale.eval.loading import load_eval_model
    from archscale.export.hf_folder import RUN_FILE, fresh_out_dir, tokenizer_files, write_atomically
    from archscale.export.load import exported_kind
    from archscale.export.manifest import write_manifest

    if method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    fresh_out_dir(out)
    if exported_kind(checkpoint) == "quantized":
        raise UserError(f"--checkpoint {checkpoint}: already quantised; quantise the original checkpoint")
    progress = progress or Progress(show=False)
    with progress.stage(f"quantize: loading {checkpoint}", log=False):
        em = load_eval_model(checkpoint, device="cpu", tokenizer=tokenizer)
    with progress.stage(f"quantize: {method} on the linear layers"):
        info = quantize_model(em.model, method)
    recipe = {"method": method, "library": f"torchao {torchao.__version__}", "model": em.model.config.to_dict(),
              "source": str(checkpoint), **info}

    def fill(tmp: Path) -> None:
        save_quantized(em.model, info, tmp)
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        (tmp / RUN_FILE).write_text(json.dumps(em.run_cfg, indent=2, default=str) + "\n")
        tokenizer_files(em.tokenizer, tmp, em.model.config.block_size)
        write_manifest(tmp)  # last: every file above with its sha256

    with progress.stage(f"quantize: writing {out}"):
        write_atomically(out, fill)
    return recipe
