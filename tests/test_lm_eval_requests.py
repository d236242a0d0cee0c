"""Every lm-eval request type through our adapter and through lm-eval's own HF model (on the run's
`archscale export --format hf` folder of a Transformer++), request by request: loglikelihood, loglikelihood_rolling,
and generate_until with each generation setting (until, max_gen_toks, its max_new_tokens alias, do_sample=False
with a temperature, sampling restricted to one token by top_k or top_p (the
deterministic cases two implementations can share), left truncation of long contexts), plus the
one case lm-eval's HF model refuses (a generation budget that leaves no context)."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from archscale.cli import main  # noqa: E402

MAX_LENGTH = 48


@pytest.fixture(scope="module")
def pair(tiny_runs, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    from archscale.eval.lm_eval_model import ArchScaleLM

    run = tiny_runs["transformer"]
    folder = tmp_path_factory.mktemp("hf") / "export"
    assert main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(folder)]) == 0
    ours = ArchScaleLM.create_from_arg_string(f"pretrained={run},max_length={MAX_LENGTH},batch_size=2,device=cpu")
    theirs = HFLM(pretrained=str(folder), device="cpu", batch_size=2, max_length=MAX_LENGTH, dtype="float32")
    return ours, theirs


def requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


TEXT = ("Lords and Commons of England, consider what Nation it is whereof ye are, and whereof ye are the governours: "
        "a Nation not slow and dull, but of a quick, ingenious, and piercing spirit.")


def test_loglikelihood_and_rolling_match_lm_evals_hf_model(pair):
    ours, theirs = pair
    ll = [("Lords and Commons of", " England"), ("", "a Nation"), (TEXT, " spirit"), ("consider what ", "Nation")]
    a, b = ours.loglikelihood(requests("loglikelihood", ll)), theirs.loglikelihood(requests("loglikelihood", ll))
    for (lp_a, g_a), (lp_b, g_b) in zip(a, b):
        assert lp_a == pytest.approx(lp_b, abs=1e-4) and g_a == g_b
    roll = [(TEXT,), (TEXT * 3,)]  # the second spans several max_length windows
    a = ours.loglikelihood_rolling(requests("loglikelihood_rolling", roll))
    b = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", roll))
    assert a == pytest.approx(b, abs=1e-3)


SETTINGS = {
    "greedy_until": {"until": [","], "do_sample": False, "max_gen_toks": 12},
    "max_gen_toks": {"until": [], "max_gen_toks": 5},
    "max_new_tokens_alias": {"until": [], "max_new_tokens": 5},
    "do_sample_false_with_temperature": {"until": [], "do_sample": False, "temperature": 0.7, "max_gen_toks": 8},
    "sampling_top_k_1": {"until": [], "do_sample": True, "temperature": 0.8, "top_k": 1, "max_gen_toks": 8},
    "near_greedy_top_p": {"until": [], "do_sample": True, "temperature": 1.0, "top_p": 1e-6, "max_gen_toks": 8},
    "long_context_truncated": {"until": [], "max_gen_toks": 16},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_generate_until_matches_lm_evals_hf_model(pair, name, monkeypatch):
    from archscale.eval import lm_eval_model

    ours, theirs = pair
    seen = []
    real = lm_eval_model.greedy_batch
    monkeypatch.setattr(lm_eval_model, "greedy_batch", lambda m, prompts, *a, **k: seen.extend(prompts) or
                        real(m, prompts, *a, **k))
    contexts = [TEXT * 2, "Lords and Commons"] if name == "long_context_truncated" else ["Lords and", "a Nation not"]
    args = [(c, dict(SETTINGS[name])) for c in contexts]
    a = ours.generate_until(requests("generate_until", args))
    b = theirs.generate_until(requests("generate_until", [(c, dict(k)) for c, k in args]))
    assert a == b
    if name == "long_context_truncated":  # the model read the last max_length - max_gen_toks tokens, as HF's does
        ids = ours.tok_encode(contexts[0])
        assert len(ids) > MAX_LENGTH and seen[0] == ids[-(MAX_LENGTH - 16):]
    if name in ("max_gen_toks", "max_new_tokens_alias"):  # the 5-token budget is honoured (not the default 256)
        longer = ours.generate_until(requests("generate_until", [(c, {"until": [], "max_gen_toks": 30})
                                                                 for c in contexts]))
        assert all(x and y.startswith(x) and len(x) < len(y) for x, y in zip(a, longer)), (a, longer)


def test_sampling_is_seeded_and_differs_from_greedy(pair):
    import torch

    ours, _ = pair
    args = [("Lords and", {"until": [], "do_sample": True, "temperature": 5.0, "max_gen_toks": 16})]
    torch.manual_seed(1)
    first = ours.generate_until(requests("generate_until", args))
    torch.manual_seed(1)
    assert ours.generate_until(requests("generate_until", args)) == first
    greedy = ours.generate_until(requests("generate_until", [("Lords and", {"until": [], "max_gen_toks": 16})]))
    assert first != greedy


def test_a_budget_that_leaves_no_context_is_refused_like_lm_evals_hf_model(pair):
    from archscale.errors import UserError

    ours, theirs = pair
    args = [("Lords and", {"until": [], "max_gen_toks": MAX_LENGTH})]
    with pytest.raises(UserError, match="leaves no room"):
        ours.generate_until(requests("generate_until", args))
    with pytest.raises(AssertionError, match="must be less than"):
        theirs.generate_until(requests("generate_until", [(c, dict(k)) for c, k in args]))


def test_add_bos_token_prepends_bos(pair):
    from archscale.errors import UserError
    from archscale.eval.lm_eval_model import ArchScaleLM

    ours, _ = pair
    if ours.tok.bos_id is None:
        with pytest.raises(UserError, match="no beginning-of-sequence"):
            ArchScaleLM(ours.em, add_bos_token=True)
        return
    lm = ArchScaleLM(ours.em, add_bos_token=True)
    assert lm.tok_encode("Lords")[0] == ours.tok.bos_id
