"""Phonebook and RULER NIAH: exact prompt construction (fixed seed), scoring with stub generators, decoding."""

import re

import pytest
import torch

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.eval import niah, phonebook
from archscale.eval.decode import _full_forward_greedy, greedy, greedy_batch
from archscale.eval.ppl import sliding_window_windows
from archscale.eval.runner import parse_tasks
from archscale.models.model import GPT

REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def words(text):  # a whitespace "tokenizer", so lengths are exact and readable
    return len(text.split())


# ------------------------------------------------------------------------------------------------ phonebook

def test_phonebook_prompt_exact():
    batch = phonebook.make_batch(seed=42, measurement=0, n_entries=4, batch=0, batch_size=2)
    assert batch[0]["prompt"] == (
        "Jesse Crawford: 6572350525\nSamuel Diaz: 6375364833\nEric Johnson: 8761481475\nPamela Wells: 6500689719"
        "\n\nJesse Crawford: 6572350525\nSamuel Diaz: 6375364833\n\nEric Johnson:")
    assert batch[0]["label"] == "8761481475"
    # the seed's per-batch seed int(f"{seed}{jj}{len}{ii}"): same inputs, same batch; another measurement differs
    assert phonebook.make_batch(42, 0, 4, 0, 2) == batch
    assert phonebook.make_batch(42, 1, 4, 0, 2)[0]["prompt"] != batch[0]["prompt"]


@pytest.mark.parametrize("n", [3, 50, 400])
def test_phonebook_structure(n):
    s = phonebook.make_batch(7, 2, n, 0, 1)[0]
    book, shots, query = s["prompt"].split("\n\n")
    entries = book.split("\n")
    assert len(entries) == n and len({e.split(":")[0] for e in entries}) == n  # distinct names
    assert all(re.fullmatch(r"[A-Z][a-z]+ [A-Z][A-Za-z]+: [6-9]\d{9}", e) for e in entries)
    a, b = shots.split("\n")
    assert a in entries and b in entries and a != b
    assert query.endswith(":") and f"{query} {s['label']}" in entries
    assert query[:-1] not in (a.split(":")[0], b.split(":")[0])


def answer_from_book(prompt):
    """A perfect phonebook 'model': looks the queried name up in the book."""
    book, _, query = prompt.split("\n\n")
    return {e.split(": ")[0]: e.split(": ")[1] for e in book.split("\n")}[query[:-1]]


def test_phonebook_scoring_right_and_wrong():
    right = lambda prompts, n: [" " + answer_from_book(p) + "\nJohn Doe: 6000000000" for p in prompts]
    wrong = lambda prompts, n: [" 6000000000\n" for p in prompts]
    r = phonebook.evaluate_phonebook(right, [5, 9], seed=3, num_batches=8, batch_size=3)
    assert {k: (v["mean"], v["std"], v["samples"]) for k, v in r["lengths"].items()} == {
        "5": (1.0, 0.0, 24), "9": (1.0, 0.0, 24)}
    w = phonebook.evaluate_phonebook(wrong, [5], seed=3, num_batches=4, batch_size=3)
    assert w["lengths"]["5"]["mean"] == 0.0 and w["lengths"]["5"]["measurements"] == [0.0] * 4


def test_phonebook_half_right_has_std():
    def alternate(prompts, n):  # right for measurements 0 and 2 only (each measurement = 2 samples here)
        out = []
        for i, p in enumerate(prompts):
            out.append(answer_from_book(p) if (i // 2) % 2 == 0 else "0")
        return out
    r = phonebook.evaluate_phonebook(alternate, [4], seed=1, num_batches=4, batch_size=2)["lengths"]["4"]
    assert r["measurements"] == [1.0, 0.0, 1.0, 0.0] and r["mean"] == 0.5 and r["std"] == pytest.approx(0.5)


def test_phonebook_check_hook_and_bad_lengths():
    class TooShort:
        def check(self, prompts, max_new, what):
            raise UserError(f"{what}: too long")

        def __call__(self, prompts, n):
            raise AssertionError("must not generate")
    with pytest.raises(UserError, match="phonebook: too long"):
        phonebook.evaluate_phonebook(TooShort(), [4])
    with pytest.raises(UserError):
        phonebook.lengths_from(2, 10, 1)
    assert phonebook.lengths_from(10, 40, 10) == [10, 20, 30, 40]


# ------------------------------------------------------------------------------------------------ NIAH

def test_niah_single_1_prompt_exact():
    s = niah.build_samples("niah_single_1", 300, 1, words, seed=0)[0]
    lines = [REPEAT] * 3 + ["One of the special magic numbers for fresh-apple is: 2063731."] + [REPEAT] * 2
    assert s["prompt"] == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the number afterwards.\n" + "\n".join(lines) + "\nWhat is the special magic number for fresh-apple "
        "mentioned in the provided text? The special magic number for fresh-apple mentioned in the provided text is")
    assert s["outputs"] == ["2063731"] and s["haystack_units"] == 5
    assert s["length"] == words(s["input"]) + 128 <= 300  # RULER's length: input + tokens to generate


def test_niah_sizing_grows_with_length():
    small = niah.build_samples("niah_single_1", 300, 3, words, seed=0)
    big = niah.build_samples("niah_single_1", 5000, 3, words, seed=0)
    assert all(s["length"] <= 300 for s in small) and all(s["length"] <= 5000 for s in big)
    # the step is 25 lines at >= 4096: the haystack fills the length to within one step (19 words a line)
    assert all(5000 - s["length"] < 2 * 25 * 19 for s in big)


@pytest.mark.parametrize("task,pattern", [("niah_single_2", r"\d{7}"),
                                          ("niah_single_3", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")])
def test_niah_essay_tasks(task, pattern):
    samples = niah.build_samples(task, 600, 4, words, seed=5)
    kind = "uuid" if task == "niah_single_3" else "number"
    for s in samples:
        (value,) = s["outputs"]
        assert re.fullmatch(pattern, value)
        needle = f"One of the special magic {kind}s for "
        assert s["prompt"].count(needle) == 1 and f"is: {value}." in s["input"]
        assert s["prompt"].startswith(f"A special magic {kind} is hidden within the following text.")
        assert s["prompt"].endswith(f"mentioned in the provided text is")
        assert "Areopagitica".upper() in s["input"] or "liberty" in s["input"].lower()  # the offline essay
        assert s["length"] <= 600


def needle_value(prompt):
    return re.search(r"is: ([^\s]+)\.\n|is: ([^\s]+)\. ", prompt).group(0).split("is: ")[1].rstrip(". \n")


@pytest.mark.parametrize("task", list(niah.TASKS))
def test_niah_scoring_right_and_wrong(task):
    right = lambda prompts, n: [" " + needle_value(p).upper() + ".\nmore text" for p in prompts]  # case-insensitive
    wrong = lambda prompts, n: [" 0000000." for p in prompts]
    r = niah.evaluate_niah(task, right, [300, 400], 5, words, seed=2)
    assert [v["score"] for v in r["lengths"].values()] == [1.0, 1.0]
    w = niah.evaluate_niah(task, wrong, [300], 5, words, seed=2)
    assert w["lengths"]["300"]["score"] == 0.0


def test_string_match_all_as_ruler():
    assert niah.string_match_all(["the answer is 123", "nothing"], [["123"], ["456"]]) == 0.5
    assert niah.string_match_all(["a 1 b"], [["1", "2"]]) == 0.5
    assert niah.postprocess_pred("  12\x0034\t ") == "12\n34"


def test_niah_rejects_lengths_below_generation():
    with pytest.raises(UserError, match="128 generated tokens"):
        niah.evaluate_niah("niah_single_1", lambda p, n: [], [100], 1, words)


# ------------------------------------------------------------------------------------------------ misc

def test_parse_tasks():
    assert parse_tasks("ppl,lm_eval:a,b,phonebook,niah_single_3") == (["ppl", "phonebook", "niah_single_3"], ["a", "b"])
    with pytest.raises(UserError, match="unknown task 'bogus'"):
        parse_tasks("ppl,bogus")


@pytest.mark.parametrize("n,window,stride", [(2, 4, 4), (10, 4, 4), (10, 4, 1), (11, 5, 3), (100, 16, 8)])
def test_sliding_windows_score_every_token_once(n, window, stride):
    scored = []
    for begin, end, k in sliding_window_windows(n, window, stride):
        assert 0 < end - begin <= window and 1 <= k <= end - begin
        scored += list(range(end - k + 1, end + 1))  # targets of the model reading tokens[begin:end]
    assert scored == list(range(1, n))


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(name="transformer_d2", n_layer=2, n_embd=32, n_head=2, n_query_groups=1, head_size=16,
                      intermediate_size=64, vocab_size=64, block_size=16, **kw)
    m = GPT(cfg).eval()
    with torch.no_grad():  # a bigger embedding init, so greedy outputs vary with the prompt
        m.wte.weight.normal_(0, 1.0)
    return m


def test_greedy_batch_equals_one_by_one_and_handles_eos():
    m = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 7, 5, 20, 7, 5)]  # beyond block_size
    one = [greedy(m, p, 6) for p in prompts]
    assert all(len(o) == 6 for o in one)
    assert greedy_batch(m, prompts, 6, batch_size=2) == one
    # EOS: cut before the first EOS
    eos = one[0][2]
    cut = greedy(m, prompts[0], 6, eos_id=eos)
    assert cut == one[0][:one[0].index(eos)]


def test_greedy_uses_model_generate_when_present():
    m = tiny_model()
    calls = []

    def generate(idx, max_new_tokens, temperature=0.0, top_k=None, top_p=None, eos_id=None):
        calls.append((idx.shape, max_new_tokens, temperature, eos_id))
        return _full_forward_greedy(m, idx, max_new_tokens, eos_id)
    m.generate = generate
    p = [3, 4, 5]
    assert greedy(m, p, 4, eos_id=None) == _full_forward_greedy(m, torch.tensor([p]), 4, None)[0, 3:].tolist()
    assert calls == [(torch.Size([1, 3]), 4, 0.0, None)]
