"""`archscale eval --protocol`: which settings a flag left unset takes (docs/EVALUATION.md has the full table).
Each task declares its own (`Option.protocol` and `Option.quick` in archscale/eval/tasks/); this module applies
them and each task's `settle` (values computed from the run, fallbacks for missing packages).

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

from types import SimpleNamespace

from archscale.errors import UserError
from archscale.eval.tasks.base import NO_QUICK

PROTOCOLS = ("native", "archscale", "archscale-strict")


def _protocol_options(tasks):
    return [o for t in tasks for o in t.options if o.protocol is not None]


def defaults(protocol: str, quick: bool = False) -> dict:
    """Every task's protocol settings (`Option.protocol`, archscale-strict takes archscale's), --quick's on top;
    None: computed from the run by the task's `settle`."""
    from archscale.eval.tasks import all_tasks

    key = "archscale" if protocol == "archscale-strict" else protocol
    out = {}
    for o in _protocol_options(all_tasks()):
        out[o.name] = o.protocol.get(key)
        if quick and o.quick is not NO_QUICK:
            out[o.name] = o.quick
    return out


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def resolve(args, train_len: int, varlen: bool, needs: set[str]) -> tuple[dict, list[str]]:
    """The settings for `args.protocol` with explicit flags on top, and notes on every fallback. `needs`: the
    tasks that will run (a missing package matters only to the task that uses it)."""
    from archscale.eval.tasks import all_tasks

    protocol = getattr(args, "protocol", None) or "native"
    if protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    out = defaults(protocol, quick=getattr(args, "quick", False))
    for key in out:
        given = getattr(args, key, None)
        if given is not None:
            out[key] = given
    run = SimpleNamespace(train_len=train_len, varlen=varlen, needs=set(needs), available=_available)
    missing = [m for task in all_tasks() if task.settle for m in task.settle(out, run)]
    notes = []
    for package, consequence in missing:
        if protocol == "archscale-strict":
            raise UserError(f"--protocol archscale-strict needs the `{package}` package: pip install {package} "
                            f"(or 'archscale[eval]'); --protocol archscale runs without it ({consequence})")
        notes.append(f"`{package}` is not installed: {consequence}")
    out["protocol"] = protocol
    return out, notes
