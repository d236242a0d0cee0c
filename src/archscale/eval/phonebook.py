"""Phonebook retrieval (ArchScale's evaluation scripts, after "Repeat After Me", arXiv 2402.01032).

A sample with `n` entries:

    {name_1}: {phone_1}\\n ... {name_n}: {phone_n}\\n\\n{e_a}\\n{e_b}\\n\\n{name_c}:

`e_a`, `e_b` are two entries of the book repeated as few-shot examples, `e_c` the queried entry (a, b, c
distinct); the label is `phone_c`, a 10-digit number whose first digit is 6-9. Names are "First Last" from
`archscale.eval.names` (distinct within one book, so the answer is unambiguous). The model decodes greedily up to
20 new tokens; the prediction is the first generated line, stripped; the metric is exact string match.

Two styles of book and scoring:

* "native" (above): our offline names, distinct in a book; the phone number one randint; lenient scoring (the
  text is stripped before its first line is taken, and generation is cut at EOS, so a leading newline or a
  number followed by EOS still counts).
* "archscale" (`eval_phonebook.py` at ArchScale's commit 1fbcceb): names from the `names` package
  (`names.names_package_full_name`), repeats allowed as there; the number digit by digit (randint(6, 9), then
  nine randint(0, 9)); strict scoring: the first line of the raw decoded text, stripped, where a generated EOS
  stays in the text (ArchScale decodes without skipping special tokens), so "\n6123456789" and
  "6123456789<eos>" are wrong. With the `offline` name source (the `names` package missing, --protocol
  archscale only) the books use our lists and are not ArchScale's.

For each length `n` in range(min_len, max_len + 1, step): 4 measurements jj = 0..3, each `num_batches // 4`
batches ii of `batch_size` samples, batch (jj, ii) built from `random.Random(int(f"{seed}{jj}{n}{ii}"))` as the
seed does; the result is the mean and (population) std of the 4 measurement accuracies.
"""

from __future__ import annotations

import random
import statistics

from archscale.errors import UserError
from archscale.eval.names import capacity, full_name
from archscale.progress import no_stage

MAX_NEW_TOKENS = 20
MEASUREMENTS = 4
EOS_MARK = "<eos>"  # what a strict-scoring generator appends where the model generated EOS


def phone_number(rng: random.Random) -> str:
    return str(rng.randint(6_000_000_000, 9_999_999_999))


def make_sample(n_entries: int, rng: random.Random) -> dict:
    if n_entries < 3:
        raise UserError(f"phonebook needs at least 3 entries per book (two few-shot + one query), got {n_entries}")
    if n_entries > capacity() // 2:
        raise UserError(f"phonebook: {n_entries} entries is more than the offline name lists support "
                        f"({capacity() // 2}); use a smaller --max_eval_len")
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n_entries:
        name = full_name(rng)
        if name not in seen:
            seen.add(name)
            names.append(name)
    entries = [f"{name}: {phone_number(rng)}" for name in names]
    a, b, c = rng.sample(range(n_entries), 3)
    query = entries[c].split(":")[0] + ":"
    prompt = "\n".join(entries) + "\n\n" + entries[a] + "\n" + entries[b] + "\n\n" + query
    return {"prompt": prompt, "label": entries[c].split(": ")[1], "name": names[c], "entries": n_entries}


def make_archscale_sample(n_entries: int, rng: random.Random, name_source: str = "names") -> dict:
    """ArchScale's PhoneBookDataset.rand_num(n_entries) with its global `random` replaced by `rng`."""
    from archscale.eval.names import full_name, names_package_full_name

    if n_entries < 3:
        raise UserError(f"phonebook needs at least 3 entries per book (two few-shot + one query), got {n_entries}")
    draw = names_package_full_name if name_source == "names" else full_name
    entries = []
    for _ in range(n_entries):
        name = draw(rng)
        phone = str(rng.randint(6, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(9))
        entries.append(f"{name}: {phone}")
    a, b, c = rng.sample(list(range(n_entries)), 3)
    query = entries[c].split(":")[0] + ":"
    prompt = "\n".join(entries) + "\n\n" + entries[a] + "\n" + entries[b] + "\n\n" + query
    return {"prompt": prompt, "label": entries[c].split(":")[1].strip(), "name": query[:-1], "entries": n_entries}


def make_batch(seed: int, measurement: int, n_entries: int, batch: int, batch_size: int,
               style: str = "native", name_source: str = "names") -> list[dict]:
    rng = random.Random(int(f"{seed}{measurement}{n_entries}{batch}"))
    if style == "archscale":
        return [make_archscale_sample(n_entries, rng, name_source) for _ in range(batch_size)]
    return [make_sample(n_entries, rng) for _ in range(batch_size)]


def extract_prediction(generated: str, scoring: str = "lenient") -> str:
    """lenient: strip, then the first line; strict (ArchScale's): the first line, then strip."""
    if scoring == "strict":
        return generated.split("\n")[0].strip()
    return generated.replace(EOS_MARK, "").strip().split("\n")[0].strip()


def lengths_from(min_len: int, max_len: int, step: int) -> list[int]:
    if min_len < 3 or max_len < min_len or step < 1:
        raise UserError(f"phonebook lengths: need 3 <= --min_eval_len <= --max_eval_len and --eval_len_step >= 1 "
                        f"(got {min_len}, {max_len}, {step})")
    return list(range(min_len, max_len + 1, step))


def plan_phonebook(lengths: list[int], seed: int = 42, num_batches: int = 4, batch_size: int = 10,
                   style: str = "native", name_source: str = "names") -> dict:
    """The samples: {"lengths": [...], "samples": {n: [measurement 0 samples, ..., measurement 3 samples]}}."""
    per_measurement = max(1, num_batches // MEASUREMENTS)
    samples = {n: [[s for ii in range(per_measurement)
                    for s in make_batch(seed, jj, n, ii, batch_size, style, name_source)]
                   for jj in range(MEASUREMENTS)] for n in lengths}
    names = ("names package" if name_source == "names" else "offline lists") if style == "archscale" else \
        "offline lists (distinct)"
    return {"lengths": list(lengths), "samples": samples, "seed": seed, "per_measurement": per_measurement,
            "batch_size": batch_size, "style": style, "names": names,
            "scoring": "strict" if style == "archscale" else "lenient"}


def prompts_of(plan: dict) -> list[str]:
    return [s["prompt"] for n in plan["lengths"] for m in plan["samples"][n] for s in m]


def evaluate_phonebook(generator, lengths: list[int], seed: int = 42, num_batches: int = 4,
                       batch_size: int = 10, plan: dict | None = None, stage=None, on_length=None) -> dict:
    """`generator(prompts, max_new_tokens) -> list[str]` (the continuation text); it may have
    `check(prompts, max_new_tokens, what)` raising UserError when a prompt is too long for the model.
    `stage(label, total)` (archscale.progress.Progress.stage) shows each length's progress (then the generator
    gets `on_batch`); `on_length(n, result)` is called as each length finishes (partial results)."""
    plan = plan or plan_phonebook(lengths, seed, num_batches, batch_size)
    lengths, per_measurement = plan["lengths"], plan["per_measurement"]
    scoring = plan.get("scoring", "lenient")
    info = {k: plan[k] for k in ("style", "names", "scoring") if k in plan}
    seed, batch_size = plan["seed"], plan["batch_size"]
    check = getattr(generator, "check", None)
    if check is not None:  # fail on the longest prompts before spending time on the short ones
        check(prompts_of(plan), MAX_NEW_TOKENS, "phonebook")
    plan = plan["samples"]
    results = {}
    for n in lengths:
        samples = [s for m in plan[n] for s in m]
        prompts = [s["prompt"] for s in samples]
        with (stage or no_stage)(f"phonebook {n} entries", len(prompts), "samples") as bar:
            extra = {"on_batch": bar.advance} if stage else {}
            outputs = generator(prompts, MAX_NEW_TOKENS, mark_eos=True, **extra) if scoring == "strict" else \
                generator(prompts, MAX_NEW_TOKENS, **extra)
        k = 0
        accs = []
        for m in plan[n]:
            correct = 0
            for s in m:
                correct += int(extract_prediction(outputs[k], scoring) == s["label"])
                k += 1
            accs.append(correct / len(m))
        results[str(n)] = {"mean": statistics.fmean(accs), "std": statistics.pstdev(accs), "measurements": accs,
                           "samples": len(samples), "example_prediction": extract_prediction(outputs[0], scoring),
                           "example_label": samples[0]["label"]}
        if on_length is not None:
            on_length(str(n), results[str(n)])
    return {"metric": "exact_match", "unit": "entries", "measurements": MEASUREMENTS,
            "batches_per_measurement": per_measurement, "batch_size": batch_size, "seed": seed,
            "max_new_tokens": MAX_NEW_TOKENS, **info, "lengths": results}
