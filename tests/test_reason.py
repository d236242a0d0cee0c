"""`archscale reason`: answer extraction and equivalence on tricky answers, unbiased pass@k, and end-to-end runs
through our server (a model that always answers "7": known scores) and through a checkpoint (== the endpoint)."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from archscale.cli import main
from archscale.reason.runner import ks_for, pass_at_k
from archscale.reason.tasks import TASKS, extract, gold_for, is_correct, last_boxed
from serving_fixtures import make_run, running_server, tiny_model, tiny_tokenizer

DATA = Path(__file__).parent / "data" / "reason"
GSM, MATH, AIME = TASKS["gsm8k"], TASKS["math"], TASKS["aime24"]


@pytest.mark.parametrize("completion, gold, ok", [
    ("3 + 4 = 7 apples.\n#### 7", "7", True),
    ("The total is 1,234 dollars.\n#### 1,234", "1234", True),
    ("So he pays $18.00. The answer is $18.00.", "18", True),
    ("Half of 1.5 is 0.75, so the answer is 3/4.", "0.75", True),  # fraction vs decimal
    ("She has 5 apples, eats 2, then buys 4: 5 - 2 + 4 = 7", "7", True),  # the last number
    ("The temperature fell to -5 degrees. The answer is -5.", "-5", True),
    ("It takes 42 minutes.", "42", True),  # units after the number
    ("#### 17", "18", False),  # wrong
    ("The answer is 7, not 17. 17 is what the others said.", "17", False),  # "answer is" beats the last number
    ("I do not know.", "7", False),  # no number at all
])
def test_gsm8k_extraction_and_equality(completion, gold, ok):
    assert is_correct(GSM, extract(GSM, completion), gold) is ok


def test_gsm8k_gold_from_a_solution():
    assert gold_for(GSM, {"answer": "3 * 4 = <<3*4=12>>12 cookies\n#### 1,200"}) == "1,200"
    assert is_correct(GSM, "1200", gold_for(GSM, {"answer": "x\n#### 1,200"}))


@pytest.mark.parametrize("completion, gold, ok", [
    ("so $x = \\boxed{0.5}$", "\\frac{1}{2}", True),  # decimal vs fraction
    ("\\boxed{\\dfrac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", True),  # \dfrac, \sqrt3
    ("The side is \\boxed{5\\text{ cm}}.", "5", True),  # units
    ("\\boxed{x = 3}", "3", True),  # an equation vs its value
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", True),  # nested braces, rationalised
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("First \\boxed{4}, then correcting: \\boxed{3}", "3", True),  # the last boxed answer counts
    ("\\boxed{4}", "3", False),  # wrong
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    ("the answer is 3", "3", False),  # MATH needs a boxed answer
])
def test_math_extraction_and_math_verify(completion, gold, ok):
    assert is_correct(MATH, extract(MATH, completion), gold) is ok


def test_math_gold_from_a_solution_and_aime_integers():
    assert gold_for(MATH, {"solution": "so it is $\\boxed{\\frac{\\sqrt{3}}{2}}$."}) == "\\frac{\\sqrt{3}}{2}"
    assert last_boxed("\\boxed{\\frac{a}{\\sqrt{b}}} and more") == "\\frac{a}{\\sqrt{b}}"
    assert last_boxed("no box here") is None
    assert is_correct(AIME, extract(AIME, "\\boxed{033}"), "33")
    assert not is_correct(AIME, extract(AIME, "\\boxed{34}"), "33")
    assert is_correct(AIME, extract(AIME, "\\boxed{31}"), str(31))


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """pass@k as the fraction of k-subsets of the samples holding a correct one (its definition)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (5, 2), (6, 5), (3, 3)])
def test_unbiased_pass_at_k_equals_its_definition(n, c):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert ks_for(n)[-1] == n and ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6]


def constant_model(tok, answer: str):
    """A tiny transformer that answers `answer` (one token) whatever the prompt: every block writes zero into the
    residual stream, every token embeds to one vector, and lm_head maps that vector to the answer's token."""
    (target,) = tok.encode(answer, eos=False)
    model = tiny_model("transformer", tok.vocab_size)
    with torch.no_grad():
        for block in model.blocks:
            block.mixer.proj.weight.zero_()
            block.mlp.w3.weight.zero_()
        e = torch.randn(model.config.n_embd)
        model.wte.weight.copy_(e.expand_as(model.wte.weight))
        model.lm_head.weight.zero_()
        model.lm_head.weight[target] = e
    return model


def read_jsonl(p):
    return [json.loads(line) for line in Path(p).read_text().splitlines()]


def test_gsm8k_end_to_end_through_our_server(tmp_path, capsys):
    """Golds 7, 60, 7, 18 and a model that always says "7": pass@1 = pass@2 = 0.5, per item as expected."""
    tok = tiny_tokenizer(tmp_path)
    model = constant_model(tok, "7")
    with running_server(model, tok, name="seven", max_model_len=256) as (url, engine):
        out = tmp_path / "r" / "gsm.json"
        assert main(["reason", "--task", "gsm8k", "--data", str(DATA / "gsm8k.jsonl"), "--endpoint", url,
                     "--samples", "2", "--max_tokens", "1", "--temperature", "0.7", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["results"]["reason"]["gsm8k"]
    assert doc["run_name"] == "seven" and s["items"] == 4 and s["samples"] == 2
    assert s["pass@1"] == 0.5 and s["pass@k"] == {"1": 0.5, "2": 0.5}
    rows = read_jsonl(out.with_suffix(".items.jsonl"))
    assert [r["id"] for r in rows] == ["apples", "pens", "change", "laps"]
    assert [r["n_correct"] for r in rows] == [2, 0, 2, 0]
    assert rows[0]["completions"] == ["7", "7"] and rows[0]["predictions"] == ["7", "7"]
    assert rows[1]["gold"] == "60" and rows[0]["prompt"].startswith("Question: Mia has 3 apples")
    assert "pass@1 0.500" in capsys.readouterr().out
    from archscale.eval.report import reasoning_scores
    assert reasoning_scores(doc) == {"gsm8k\npass@1": 0.5, "gsm8k\npass@2": 0.5}  # the report's bars
    png = tmp_path / "report.png"
    assert main(["report", str(out), "--out", str(png)]) == 0 and png.stat().st_size > 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("reasonrun"))


@pytest.mark.parametrize("task", ["math", "aime24"])
def test_checkpoint_and_endpoint_give_the_same_samples(run_dir, tmp_path, task):
    """--checkpoint (our engine in process) and --endpoint (our server on the same run) draw identical seeded
    samples, and both score them the same way."""
    from archscale.serve.cli import load_served_model

    data = str(DATA / f"{task}.jsonl")
    common = ["--task", task, "--data", data, "--samples", "3", "--max_tokens", "6", "--temperature", "1.0",
              "--seed", "11"]
    assert main(["reason", *common, "--checkpoint", str(run_dir), "--output", str(tmp_path / "ck.json")]) == 0
    sm = load_served_model(str(run_dir))
    with running_server(sm.model, sm.tokenizer, name="run", max_model_len=256) as (url, _):
        assert main(["reason", *common, "--endpoint", url, "--output", str(tmp_path / "ep.json")]) == 0
    ck, ep = read_jsonl(tmp_path / "ck.items.jsonl"), read_jsonl(tmp_path / "ep.items.jsonl")
    assert [r["completions"] for r in ck] == [r["completions"] for r in ep]
    assert all(len(r["completions"]) == 3 for r in ck)
    assert len({c for r in ck for c in r["completions"]}) > 1  # sampling, not one repeated answer
    s_ck = json.loads((tmp_path / "ck.json").read_text())["results"]["reason"][task]
    s_ep = json.loads((tmp_path / "ep.json").read_text())["results"]["reason"][task]
    assert s_ck["pass@k"] == s_ep["pass@k"] and s_ck["items"] == len(read_jsonl(data))


def test_bad_data_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer here"}\n')
    assert main(["reason", "--task", "gsm8k", "--data", str(bad), "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:1" in err[0] and '"answer"' in err[0]
