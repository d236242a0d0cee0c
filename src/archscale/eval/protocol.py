"""`archscale eval --protocol`: which settings a flag left unset takes (docs/EVALUATION.md has the full table).

* `native` (default): archscale's own choices, fast on small models: extrapolation 1x/2x/4x over every validation
  block; Phonebook 40 samples per length over 10..40 entries with offline names and lenient scoring; NIAH 100
  samples at the training length with offline keys; lm-eval contexts of the training length.
* `archscale`: ArchScale's (github.com/microsoft/ArchScale, commit 1fbcceb): `pretrain.py`'s `validate()`
  (factors 1..4 at training length 4096, 1..2 otherwise; 200 validation samples in its loader's order, cycled),
  `eval_phonebook.py`'s defaults (480 entries, 4 measurements x 8 batches x 4 = 128 samples, the `names`
  package's books, strict scoring), RULER's NIAH (500 samples at 4096 tokens, `wonderwords` keys) and a
  `max_length` of 4096 for lm-eval (its `eval.py`). Where `names` or `wonderwords` is not installed it falls back
  to our offline lists and says so in the results' `notes`.
* `archscale-strict`: the same, but a missing package is an error (the numbers are then ArchScale's or none).

`--quick` (any protocol): a few samples at short lengths, to see every task work on a CPU in about a minute (the
scores are too noisy to compare models): ppl at 1x/2x on at most 4 batches, Phonebook at 10 and 20 entries with 4
samples each (one per measurement), NIAH with 2 samples at the training length.

An explicit flag always wins over `--quick` and the protocol default; the results record the protocol and every
resolved value.
"""

from __future__ import annotations

from archscale.errors import UserError

PROTOCOLS = ("native", "archscale", "archscale-strict")

# flag -> default per protocol (None: computed from the run, see resolve())
DEFAULTS = {
    "native": {"extrapolation": "1,2,4", "ppl_selection": "all", "min_eval_len": 10, "max_eval_len": 40,
               "eval_len_step": 10, "eval_num_batches": 4, "phonebook_batch_size": 10, "phonebook_style": "native",
               "niah_samples": 100, "max_seq_lengths": None, "niah_keys": "offline", "lm_eval_max_length": None},
    "archscale": {"extrapolation": None, "ppl_selection": "archscale", "min_eval_len": 480, "max_eval_len": 480,
                  "eval_len_step": 1, "eval_num_batches": 32, "phonebook_batch_size": 4,
                  "phonebook_style": "archscale", "niah_samples": 500, "max_seq_lengths": "4096",
                  "niah_keys": "wonderwords", "lm_eval_max_length": 4096},
}
DEFAULTS["archscale-strict"] = DEFAULTS["archscale"]
for _d in DEFAULTS.values():
    _d.setdefault("ppl_max_batches", None)  # None: every validation batch
# --quick, on top of the protocol's defaults (explicit flags still win)
QUICK = {"extrapolation": "1,2", "ppl_max_batches": 4, "min_eval_len": 10, "max_eval_len": 20, "eval_len_step": 10,
         "eval_num_batches": 4, "phonebook_batch_size": 1, "niah_samples": 2, "max_seq_lengths": None}


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def resolve(args, train_len: int, varlen: bool, needs: set[str]) -> tuple[dict, list[str]]:
    """The settings for `args.protocol` with explicit flags on top, and notes on every fallback. `needs`: the
    built-in tasks that will run (a missing package matters only to the task that uses it)."""
    from archscale.eval.ppl import archscale_factors

    protocol = getattr(args, "protocol", None) or "native"
    if protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    out = dict(DEFAULTS[protocol])
    if getattr(args, "quick", False):
        out.update(QUICK)
    for key in out:
        given = getattr(args, key, None)
        if given is not None:
            out[key] = given
    if out["extrapolation"] is None:
        out["extrapolation"] = ",".join(str(k) for k in archscale_factors(train_len, varlen))
    if out["max_seq_lengths"] is None:
        out["max_seq_lengths"] = str(train_len)
    out["phonebook_names"] = "names" if out["phonebook_style"] == "archscale" else "offline"
    notes = []
    missing = []
    if "phonebook" in needs and out["phonebook_names"] == "names" and not _available("names"):
        missing.append(("names", "Phonebook books use archscale's offline name lists, not ArchScale's"))
        out["phonebook_names"] = "offline"
    niah = any(t.startswith("niah_") for t in needs)
    if niah and out["niah_keys"] == "wonderwords" and not _available("wonderwords"):
        missing.append(("wonderwords", "NIAH keys come from archscale's offline word lists, not RULER's"))
        out["niah_keys"] = "offline"
    for package, consequence in missing:
        if protocol == "archscale-strict":
            raise UserError(f"--protocol archscale-strict needs the `{package}` package: pip install {package} "
                            f"(or 'archscale[eval]'); --protocol archscale runs without it ({consequence})")
        notes.append(f"`{package}` is not installed: {consequence}")
    out["protocol"] = protocol
    return out, notes
