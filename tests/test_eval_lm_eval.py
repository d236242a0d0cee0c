"""The lm-eval adapter: log-likelihoods equal a direct computation with our model; an offline lm-eval run on a
tiny local multiple-choice task gives the accuracy those log-likelihoods imply."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from archscale.config import ModelConfig
from archscale.eval.loading import EvalModel
from archscale.models.model import GPT

pytest.importorskip("lm_eval")

from archscale.eval.lm_eval_model import ArchScaleLM  # noqa: E402


class ByteTokenizer:
    """Bytes 0..255 are tokens 1..256; EOS is 0."""
    eos_id = 0
    vocab_size = 257
    path = "bytes"

    def encode(self, text, bos=False, eos=True):
        return [b + 1 for b in text.encode("utf-8")] + ([0] if eos else [])

    def decode(self, ids):
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


class Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def em():
    torch.manual_seed(0)
    cfg = ModelConfig(name="transformer_d2", n_layer=2, n_embd=32, n_head=2, n_query_groups=1, head_size=16,
                      intermediate_size=64, vocab_size=257, block_size=32)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.wte.weight.normal_(0, 1.0)
    return EvalModel(model=model, tokenizer=ByteTokenizer(), train_len=32)


@torch.no_grad()
def direct_logprob(model, ids, n):
    """log p(ids[-n:] | ids[:-n]) with one plain forward pass."""
    x = torch.tensor([ids[:-1]])
    logp = F.log_softmax(model(x).float(), dim=-1)[0]
    return sum(float(logp[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids)))


def test_loglikelihood_equals_direct_computation(em):
    lm = ArchScaleLM(em, batch_size=3, max_length=32)
    tok = em.tokenizer
    pairs = [("The cat sat on the", " mat"), ("Hello ", "world"), ("", "abc"), ("a", " much longer continuation"),
             ("xy", "z")]
    got = lm.loglikelihood([Req(c, x) for c, x in pairs])
    for (ctx, cont), (lp, greedy) in zip(pairs, got):
        c = ctx.rstrip()
        moved = ctx[len(c):] + cont  # trailing spaces belong to the continuation
        ids = ([0] if not c else tok.encode(c, eos=False)) + tok.encode(moved, eos=False)
        n = len(tok.encode(moved, eos=False))
        assert lp == pytest.approx(direct_logprob(em.model, ids, n), abs=1e-4)
        assert isinstance(greedy, bool)
    # greedy flag: True exactly when every continuation token is the model's argmax
    ids = tok.encode("The cat", eos=False)
    with torch.no_grad():
        nxt = int(em.model(torch.tensor([ids]))[0, -1].argmax())
    (_, g1), (_, g2) = lm.score_tokens([(ids + [nxt], 1), (ids + [(nxt + 1) % 257], 1)])
    assert g1 is True and g2 is False


def test_loglikelihood_truncates_long_context_on_the_left(em):
    lm = ArchScaleLM(em, batch_size=2, max_length=16)
    tok = em.tokenizer
    ctx, cont = "0123456789" * 4, "abc"
    (lp, _), = lm.loglikelihood([Req(ctx, cont)])
    ids = tok.encode(ctx + cont, eos=False)
    assert lp == pytest.approx(direct_logprob(em.model, ids[-17:], 3), abs=1e-4)


def test_loglikelihood_rolling_predicts_each_token_once(em):
    tok = em.tokenizer
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = tok.encode(text, eos=False)
    # fits in one window: the sum of log p over the whole text given EOS
    lm = ArchScaleLM(em, batch_size=2, max_length=len(ids) + 1)
    (full,) = lm.loglikelihood_rolling([Req(text)])
    assert full == pytest.approx(direct_logprob(em.model, [0] + ids, len(ids)), abs=1e-3)
    # shorter windows: same tokens scored, each once, with less context
    small = ArchScaleLM(em, batch_size=2, max_length=20)
    windows = small.rolling_windows(ids)
    assert sum(n for _, n in windows) == len(ids) and all(len(t) - 1 <= 20 for t, _ in windows)
    expect = sum(direct_logprob(em.model, t, n) for t, n in windows)
    (got,) = small.loglikelihood_rolling([Req(text)])
    assert got == pytest.approx(expect, abs=1e-3) and got != pytest.approx(full, abs=1e-3)


def test_generate_until_stops_at_stop_string(em):
    lm = ArchScaleLM(em, batch_size=2, max_length=32)
    from archscale.eval.decode import greedy
    ctx = "Once upon a time"
    ids = greedy(em.model, em.tokenizer.encode(ctx, eos=False), 10, eos_id=0)
    full = em.tokenizer.decode(ids)
    out = lm.generate_until([Req(ctx, {"until": [], "max_gen_toks": 10}),
                             Req(ctx, {"until": [full[3:5]], "max_gen_toks": 10})])
    assert out[0] == full
    assert out[1] == full[:full.index(full[3:5])]


def test_offline_lm_eval_multiple_choice(em, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    rows = [{"q": "The sky is", "choices": ["blue", "green", "loud"], "gold": 0},
            {"q": "Two plus two is", "choices": ["four", "five"], "gold": 1},
            {"q": "Cats say", "choices": ["meow", "woof", "moo", "quack"], "gold": 2},
            {"q": "Snow is", "choices": ["white", "black"], "gold": 0}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_utils.py").write_text(
        "import json, datasets\nfrom pathlib import Path\n"
        "def load(**kw):\n"
        "    p = Path(__file__).with_name('rows.jsonl')\n"
        "    return {'test': datasets.Dataset.from_list([json.loads(l) for l in p.read_text().splitlines()])}\n")
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: ''\ncustom_dataset: !function tiny_utils.load\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n")
    lm = ArchScaleLM(em, batch_size=4, max_length=32)
    res = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=TaskManager(
        include_path=str(tmp_path), include_defaults=False), log_samples=False, bootstrap_iters=0)
    acc = res["results"]["tiny_mc"]["acc,none"]
    # the accuracy our own scoring implies
    correct = 0
    for r in rows:
        scores = [lm.loglikelihood([Req(r["q"], " " + c)])[0][0] for c in r["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == r["gold"])
    assert acc == pytest.approx(correct / len(rows))


def test_shipped_example_tasks_run_offline(em):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks_dir = Path(__file__).resolve().parents[1] / "examples" / "lm_eval_tasks"
    lm = ArchScaleLM(em, batch_size=8, max_length=32)
    res = lm_eval.simple_evaluate(model=lm, tasks=["archscale_mc", "archscale_ppl", "archscale_copy"],
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                  limit=3, log_samples=False, bootstrap_iters=0)["results"]
    assert 0.0 <= res["archscale_mc"]["acc,none"] <= 1.0
    assert res["archscale_ppl"]["bits_per_byte,none"] > 0 and math.isfinite(res["archscale_ppl"]["word_perplexity,none"])
    assert res["archscale_copy"]["exact_match,none"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_registered_as_archscale():
    from lm_eval.api.registry import get_model

    assert get_model("archscale") is ArchScaleLM
