"""`archscale pretrain --dry_run`'s table: the plan (`trainer.dry_run_summary`) in sections a person reads.

Rendered from the summary dict alone, so `--dry_run` and `--dry_run --json` cannot disagree. Keys this module
does not name still appear, under "more", so whatever a later change adds to the summary is shown without
editing this printer.
"""

from __future__ import annotations

# (section, keys) in reading order; a key missing from the summary is skipped
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("run", ("run_name", "out_dir")),
    ("model", ("model", "n_layer", "n_embd", "n_head", "n_kv_head", "head_size", "intermediate_size", "ffn_kinds",
               "vocab_size", "padded_vocab_size", "tie_embeddings")),
    ("parameters", ("n_params", "n_params_non_embedding", "n_params_active", "n_params_active_non_embedding",
                    "n_params_law", "n_params_law_deviation")),
    ("tokens and steps", ("max_tokens", "ctx_len", "micro_bsz", "world_size", "grad_accum", "batch_tokens",
                          "optimizer_steps", "warmup_steps", "warmup_tokens", "flops_per_token")),
    ("learning rate", ("schedule", "lr", "min_lr", "lr_matrix", "lr_vector", "wd_matrix", "wd_vector")),
    ("parametrization", ("parametrization", "train_name_settings", "residual_scale", "logit_scale",
                         "attn_scale_mult", "attn_scale", "init_scheme", "init_std")),
)
NOTES = "notes"
COUNTS = ("n_params", "n_params_non_embedding", "n_params_active", "n_params_active_non_embedding", "n_params_law")


def format_value(key: str, value) -> str:
    """One value on one line: counts with their M/B size, floats to 4 significant digits, dicts as k=v."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int) or (key in COUNTS and isinstance(value, float) and value.is_integer()):
        text = f"{int(value):,}"
        return f"{text} ({_size(value)})" if key in COUNTS or key == "max_tokens" else text
    if isinstance(value, float):
        return f"{value:+.2%}" if key.endswith("deviation") else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_value(str(k), v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(key, v) for v in value) or "-"
    return str(value)


def _size(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def _rows(summary: dict, keys) -> list[str]:
    return [f"  {k:<31} {format_value(k, summary[k])}" for k in keys if k in summary]


def render_dry_run(summary: dict) -> str:
    """The summary as text: known sections, then "more" (keys no section names), then the notes."""
    known = {k for _, keys in SECTIONS for k in keys} | {NOTES}
    lines = [f"pretrain plan (--dry_run: nothing trained or written; --json for this as JSON)"]
    for title, keys in SECTIONS:
        rows = _rows(summary, keys)
        if rows:
            lines += [title, *rows]
    extra = [k for k in summary if k not in known]
    if extra:
        lines += ["more", *_rows(summary, extra)]
    notes = summary.get(NOTES) or []
    lines += ["notes (where this run differs from ArchScale's code)", *[f"  - {n}" for n in notes]] if notes else \
        ["notes: none (nothing here differs from what ArchScale's code would do)"]
    return "\n".join(lines)
