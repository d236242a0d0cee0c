"""RULER's single-needle tasks (niah_single_1/2/3), built offline.

As RULER (NVIDIA/RULER, and its port in lm-eval's `ruler` tasks) defines them:

* needle: "One of the special magic {numbers|uuids} for {key} is: {value}." The key is an "adjective-noun"
  word; the value a 7-digit number (niah_single_1/2) or a UUID4 (niah_single_3).
* haystack: niah_single_1 repeats "The grass is green. The sky is blue. The sun is yellow. Here we go. There and
  back again." (lines joined by "\\n", the needle inserted as one more line at a random place); niah_single_2/3
  use an essay: the needle is inserted between sentences at a depth drawn from 40 evenly spaced depths 0..100%.
* prompt: the template "A special magic {number|uuid} is hidden within the following text. Make sure to memorize
  it. I will quiz you about the {number|uuid} afterwards.\\n{context}\\nWhat is the special magic {number|uuid}
  for {key} mentioned in the provided text?" followed by " The special magic {number|uuid} for {key} mentioned in
  the provided text is" (the answer prefix); greedy decoding of 128 tokens.
* sizing: the haystack grows in steps (25 lines, 5 below 4096 tokens; 500 essay words) until the prompt plus the
  128 generated tokens would pass `max_seq_length`; a sample that does not fit shrinks by one step.
* score: RULER's `string_match_all`: the fraction of reference values that occur (case-insensitively) in the
  prediction (stripped, control characters replaced by newlines), averaged over samples.

Offline differences (documented in docs/EVALUATION.md): RULER's essay haystack is Paul Graham's essays, a
download; ours is John Milton's *Areopagitica* (1644, public domain, shipped in `archscale/eval/data/`), repeated
when a length needs more words than it has, or any text file given with `--haystack_file`. Sentences are split
with a regex instead of NLTK punkt, keys come from our own adjective/noun lists (`keys="offline"`) or, with
`keys="wonderwords"` (--niah_keys), from RULER's `wonderwords` vocabulary, and
below 4096 tokens the essay step is max(10, length // 8) words instead of 500 (so a 256-token model still gets a
haystack).
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from archscale.errors import UserError
from archscale.eval.loading import read_user_text
from archscale.progress import no_stage

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
            "{type_needle_v} for {query} mentioned in the provided text?")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TOKENS_TO_GENERATE = 128
DEPTHS = [int(round(x)) for x in (100 * i / 39 for i in range(40))]  # np.round(np.linspace(0, 100, 40))

# task -> (haystack type, needle key type, needle value type)
TASKS = {
    "niah_single_1": ("repeat", "words", "numbers"),
    "niah_single_2": ("essay", "words", "numbers"),
    "niah_single_3": ("essay", "words", "uuids"),
}

ADJECTIVES = """
able absent acidic agile airy amber ancient angry arctic artful ashen awake bitter blank bold brave brief bright
brisk broad bronze calm candid careful cheap chilly civil clever cloudy coastal cold cosmic cozy crisp curly
daring dark dear deep dense distant dizzy dry dusty eager early earnest easy elder empty equal exotic faint
famous fancy fierce flat fluffy fond frail free fresh frosty gentle giant glad golden grand gray green hasty
hidden hollow honest humble icy idle jolly keen kind large lazy little lively lofty loud lucky lunar mellow
merry mighty misty modern modest narrow neat nimble noble odd olive pale plain polite proud quick quiet rapid
rare rich rocky rosy round royal rusty sandy scarlet shiny silent silver simple sleepy slow smooth snowy solid
spicy steady stormy strong sunny sweet swift tall tame tender tidy tiny true vast velvet vivid warm wary wild
wise witty young zealous
""".split()

NOUNS = """
acorn anchor apple arrow attic badge bakery ballot banjo barrel basket beacon bell bicycle blanket boat bonnet
bottle bridge bucket button cabin camera candle canyon carpet castle cellar chair chapel cherry chimney circus
cliff clock cloud comet compass copper cottage crayon crown cup curtain desert diamond dolphin donkey dragon
drum eagle engine falcon feather fence fiddle forest fountain garden garlic glacier globe guitar hammer harbor
helmet hill honey island jacket jungle kettle kitten ladder lantern lemon library lighthouse lizard magnet
maple marble meadow mirror mountain needle orchard otter oyster paddle palace parrot pebble pencil pepper piano
pillow planet pocket pond puppet quilt rabbit radio raven ribbon river rocket saddle sailor scarf shadow shovel
signal spoon squirrel statue stove sunset teapot temple thimble tiger tower trumpet tulip turtle valley violin
wagon walnut whistle window wizard yacht
""".split()

WORDS = sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS})


class PairWords(Sequence):
    """Every "adjective-noun" pair as a lazy sequence (RULER's list has ~6 million entries: building it takes
    seconds, drawing an index from this one is the same uniform choice)."""

    def __init__(self, adjectives, nouns):
        self.adjectives, self.nouns = sorted(set(adjectives)), sorted(set(nouns))

    def __len__(self) -> int:
        return len(self.adjectives) * len(self.nouns)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, n = divmod(i, len(self.nouns))
        return f"{self.adjectives[a]}-{self.nouns[n]}"


@lru_cache(maxsize=1)
def ruler_words() -> PairWords:
    """RULER's key vocabulary: "adjective-noun" over the `wonderwords` package's adjective and noun lists (as
    lm-eval's ruler/prepare_niah.py builds its WORDS)."""
    try:
        import wonderwords
    except ImportError:
        raise UserError("RULER's NIAH keys come from the `wonderwords` package: pip install wonderwords (or "
                        "'archscale[eval]')") from None
    cats = wonderwords.RandomWord()._categories
    return PairWords(cats["adjectives"], cats["nouns"])


def key_words(source: str):
    return ruler_words() if source == "wonderwords" else WORDS

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_ESSAY = DATA_DIR / "areopagitica.txt"


@lru_cache(maxsize=4)
def essay_words(path: str | None = None) -> tuple[str, ...]:
    p = Path(path) if path else DEFAULT_ESSAY
    text = read_user_text(p, "--haystack_file")
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    if len(words) < 50:
        raise UserError(f"--haystack_file {p}: too little text for a haystack ({len(words)} words)")
    return words


_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """A regex sentence splitter (NLTK punkt in RULER): split after . ! ? (and closing quotes) + whitespace."""
    out, start = [], 0
    for m in _SENT_END.finditer(text):
        piece = text[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


def random_value(rng: random.Random, kind: str, words: list[str] = WORDS) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return rng.choice(words)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def make_input(rng: random.Random, num_haystack: int, type_haystack: str, type_needle_k: str, type_needle_v: str,
               essay: tuple[str, ...] = (), words: list[str] = WORDS) -> tuple[str, list[str], str]:
    """(input text, [answer], query key) with `num_haystack` haystack units (lines or essay words)."""
    key = random_value(rng, type_needle_k, words)
    value = random_value(rng, type_needle_v, words)
    needle = NEEDLE.format(type_needle_v=type_needle_v, key=key, value=value)
    if type_haystack == "essay":
        reps = math.ceil(num_haystack / len(essay))
        words = (essay * reps)[:num_haystack]
        sents = split_sentences(" ".join(words).strip())
        pos = int(len(sents) * (rng.choice(DEPTHS) / 100))
        context = " ".join(p for p in (" ".join(sents[:pos]), needle, " ".join(sents[pos:])) if p)
    else:
        lines = [REPEAT_HAYSTACK] * num_haystack
        lines.insert(rng.randrange(num_haystack) if num_haystack > 0 else 0, needle)
        context = "\n".join(lines)
    # one needle, one query: RULER's singular form of the template
    template = TEMPLATE.replace("Some", "A").replace("are all", "is").replace("are", "is")
    text = template.format(type_needle_v=type_needle_v[:-1], context=context, query=key)
    return text, [value], key


def answer_prefix(type_needle_v: str, query: str) -> str:
    return f"The special magic {type_needle_v[:-1]} for {query} mentioned in the provided text is"


def build_samples(task: str, max_seq_length: int, num_samples: int, count_tokens, seed: int = 42,
                  haystack_file: str | None = None, tokens_to_generate: int = TOKENS_TO_GENERATE,
                  keys: str = "offline") -> list[dict]:
    """RULER's samples for one task and length; `count_tokens(text) -> int` with the model's tokenizer; `keys`:
    "offline" (our word lists) or "wonderwords" (RULER's)."""
    if task not in TASKS:
        raise UserError(f"unknown NIAH task {task!r}; choose one of {', '.join(TASKS)}")
    type_haystack, type_k, type_v = TASKS[task]
    words = key_words(keys)
    essay = essay_words(haystack_file) if type_haystack == "essay" else ()
    if type_haystack == "essay":
        incremental = 500 if max_seq_length >= 4096 else max(10, max_seq_length // 8)
    else:
        incremental = 25 if max_seq_length >= 4096 else 5

    sizing = random.Random(seed * 1_000_003 + max_seq_length)
    num_haystack = incremental
    while True:  # grow until the prompt + generation would pass the length
        text, answer, _ = make_input(sizing, num_haystack, type_haystack, type_k, type_v, essay, words)
        total = count_tokens(text + " ".join(answer))
        if total + tokens_to_generate > max_seq_length:
            num_haystack -= incremental
            break
        if num_haystack > max_seq_length:
            break
        num_haystack += incremental
    num_haystack = max(num_haystack, 1)

    rng = random.Random(seed * 7_919 + max_seq_length * 31 + list(TASKS).index(task))
    samples = []
    for index in range(num_samples):
        used = num_haystack
        while True:
            state = rng.getstate()
            text, answer, key = make_input(rng, used, type_haystack, type_k, type_v, essay, words)
            length = count_tokens(text) + tokens_to_generate
            if length <= max_seq_length or used <= 1:
                break
            rng.setstate(state)  # same needle, smaller haystack
            used = max(1, used - incremental)
        prefix = answer_prefix(type_v, key)
        samples.append({"index": index, "input": text, "prompt": text + " " + prefix, "outputs": answer,
                        "length": length, "max_length": max_seq_length, "haystack_units": used, "keys": keys})
    return samples


def postprocess_pred(pred: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    return sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
               for p, ref in zip(preds, refs)) / len(preds)


def plan_niah(task: str, lengths: list[int], num_samples: int, count_tokens, seed: int = 42,
              haystack_file: str | None = None, tokens_to_generate: int = TOKENS_TO_GENERATE,
              keys: str = "offline") -> dict:
    if not lengths or any(n <= tokens_to_generate for n in lengths):
        raise UserError(f"{task}: --max_seq_lengths must each exceed the {tokens_to_generate} generated tokens, "
                        f"got {lengths}")
    return {n: build_samples(task, n, num_samples, count_tokens, seed, haystack_file, tokens_to_generate, keys)
            for n in lengths}


def evaluate_niah(task: str, generator, lengths: list[int], num_samples: int, count_tokens, seed: int = 42,
                  haystack_file: str | None = None, tokens_to_generate: int = TOKENS_TO_GENERATE,
                  plan: dict | None = None, stage=None, on_length=None) -> dict:
    """`generator(prompts, max_new_tokens) -> list[str]`; per length the mean RULER score in [0, 1]. `stage` and
    `on_length`: progress and partial results, as in phonebook.evaluate_phonebook."""
    plan = plan or plan_niah(task, lengths, num_samples, count_tokens, seed, haystack_file, tokens_to_generate)
    lengths = list(plan)
    check = getattr(generator, "check", None)
    if check is not None:
        check([s["prompt"] for n in lengths for s in plan[n]], tokens_to_generate, task)
    results = {}
    for n in lengths:
        samples = plan[n]
        with (stage or no_stage)(f"{task} {n} tokens", len(samples), "samples") as bar:
            outputs = generator([s["prompt"] for s in samples], tokens_to_generate,
                                **({"on_batch": bar.advance} if stage else {}))
        preds = [postprocess_pred(o) for o in outputs]
        per = [string_match_all([p], [s["outputs"]]) for p, s in zip(preds, samples)]
        results[str(n)] = {"score": sum(per) / len(per), "samples": len(samples),
                           "mean_prompt_tokens": sum(s["length"] - tokens_to_generate for s in samples) / len(samples),
                           "haystack_units": samples[0]["haystack_units"],
                           "example_prediction": preds[0][:200], "example_answer": samples[0]["outputs"][0]}
        if on_length is not None:
            on_length(str(n), results[str(n)])
    type_haystack, _, type_v = TASKS[task]
    return {"metric": "string_match_all", "unit": "tokens", "haystack": type_haystack,
            "haystack_file": str(haystack_file or DEFAULT_ESSAY) if type_haystack == "essay" else None,
            "needle_value": type_v, "keys": plan[lengths[0]][0].get("keys", "offline") if plan[lengths[0]] else None,
            "tokens_to_generate": tokens_to_generate, "seed": seed, "lengths": results}
