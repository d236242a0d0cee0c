"""Evaluation that means what ArchScale's means: `ppl` equals the run's own logged validation loss (document masking
for --varlen runs), and the `--protocol archscale` settings (validation sample selection, extrapolation factors,
Phonebook books and strict scoring) against ArchScale's definitions reimplemented here from its source."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from archscale.cli import main
from tests.test_train import rows
from tests.test_varlen import EOS, docs_dataset


def _train(tmp: Path, varlen: bool) -> Path:
    data = docs_dataset(tmp / "data", doc_len=(10, 60), n_tokens=12000)
    argv = ["pretrain", "--train_data_dir", str(data), "--train_model", "transformer", "--depth", "1",
            "--ctx_len", "64", "--micro_bsz", "2", "--base_hps.b0", "256", "--max_tokens", "1024",
            "--base_hps.warmup_tokens0", "256", "--eval_iters", "3", "--eval_interval", "100",
            "--out_dir", str(tmp / "run"), "--progress", "false", "--precision", "fp32", "--resume", "none"]
    if varlen:
        argv += ["--varlen", "--reset_position_ids"]
    assert main(argv) == 0
    return tmp / "run"


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "plain"])
def test_ppl_equals_the_runs_logged_validation_loss(tmp_path, varlen):
    """The same blocks (ctx + 1 tokens, micro_bsz per batch, eval_iters batches) give the trainer's val_loss at the
    last step; on a --varlen run only the document-masked forward does (the plain one differs by > 1e-3)."""
    from archscale.eval.loading import load_eval_model
    from archscale.eval.ppl import validation_extrapolation

    run = _train(tmp_path, varlen)
    logged = [float(r["val_loss"]) for r in rows(run) if r["val_loss"]][-1]
    out = tmp_path / "e.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--extrapolation", "1", "--batch_size", "2",
                 "--ppl_max_batches", "3", "--output", str(out), "--device", "cpu"]) == 0
    v = json.loads(out.read_text())["results"]["ppl"]["validation"]
    assert v["1x"]["loss"] == pytest.approx(logged, rel=1e-6, abs=1e-6)
    assert v["masking"] == (f"documents (eos_id {EOS})" if varlen else "none")
    em = load_eval_model(run, device="cpu", need_tokenizer=False)
    em.forward = lambda model, x: model(x)  # what `eval` did before it read the run's masking
    plain = validation_extrapolation(em, tmp_path / "data", [1], 2, 3)["1x"]["loss"]
    if varlen:
        assert abs(plain - logged) > 1e-3, (plain, logged)
    else:
        assert plain == pytest.approx(logged, rel=1e-6)
    if varlen:  # --protocol archscale: 1x and 2x (ctx 64 is not 4096) over ArchScale's 200 samples, cycled
        check_archscale_ppl(run, tmp_path)


def check_archscale_ppl(run: Path, tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    from archscale.data.format import open_shard
    from archscale.eval.loading import load_eval_model

    out = tmp_path / "a.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "ppl", "--protocol", "archscale", "--batch_size", "8",
                 "--output", str(out), "--device", "cpu"]) == 0
    v = json.loads(out.read_text())["results"]["ppl"]["validation"]
    assert set(k for k in v if k.endswith("x")) == {"1x", "2x"} and v["samples"] == 200
    em = load_eval_model(run, device="cpu", need_tokenizer=False)
    order = upstream_validation_order(tmp_path / "data", 129)
    distinct = sorted(set(order))
    rows = torch.from_numpy(np.stack([open_shard(f)[b * 129:(b + 1) * 129] for f, b in distinct]).astype(np.int64))
    sums = {}
    with torch.no_grad():
        for k in (1, 2):  # a separate forward per length, as validate() does; per-sample mean losses
            logits = em.forward(em.model, rows[:, :64 * k])
            per = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:64 * k + 1], reduction="none").mean(1)
            sums[k] = sum(float(per[distinct.index(s)]) for s in order)
    assert v["1x"]["loss"] == pytest.approx(sums[1] / 200, rel=1e-5)
    assert v["2x"]["loss"] == pytest.approx(sums[2] / 200, rel=1e-5)


# ------------------------------------------------------------------------ ArchScale's validation sample selection
def upstream_validation_order(data_dir: Path, block_size: int, n_samples: int = 200) -> list[tuple[str, int]]:
    """lit_gpt/packed_dataset.py + pretrain.py at ArchScale 1fbcceb, from their definitions: the sorted
    validation*.bin list, random.seed(12345); random.shuffle; PackedDataset(n_chunks=8, shuffle=False,
    drop_last=True) reads n_chunks files at a time (all of them when fewer), restarting at file 0 when fewer than
    n_chunks remain, each file's chunk_size // block_size blocks in order; 200 validation iterations of batch 1."""
    from archscale.data.format import read_header

    files = sorted(str(p) for p in data_dir.glob("validation*.bin"))
    random.seed(12345)
    random.shuffle(files)
    n_chunks, file_idx, out = 8, 0, []
    while len(out) < n_samples:
        if n_chunks > len(files[file_idx:]):
            file_idx = 0
        k = min(n_chunks, len(files))
        group = files[file_idx:file_idx + k]
        file_idx += k
        for f in group:
            out += [(f, b) for b in range(read_header(f)[1] // block_size)]
    return out[:n_samples]


def test_archscale_validation_order_and_factors(tmp_path):
    from archscale.data.format import write_shard
    from archscale.eval.ppl import archscale_batches, archscale_block_order, archscale_factors

    rng = np.random.default_rng(0)
    for i in range(11):  # 11 files: one group of 8 is read, the last 3 never (drop_last), as upstream
        write_shard(tmp_path / f"validation_{i:04d}.bin", rng.integers(0, 300, 300), np.uint16)
    ours = [(str(f), b) for f, b in archscale_block_order(tmp_path, 65)]
    assert ours == upstream_validation_order(tmp_path, 65)
    assert len({f for f, _ in ours}) == 8 and len(ours) == 200 and ours[32] == ours[0]  # 8 files x 4 blocks, cycled
    batch = next(archscale_batches(tmp_path, 65, 3))
    from archscale.data.format import open_shard
    assert batch.shape == (3, 65) and batch[2].tolist() == open_shard(ours[2][0])[2 * 65:3 * 65].tolist()
    assert archscale_factors(4096, False) == [1, 2, 3, 4] and archscale_factors(8192, True) == [1, 2, 3, 4]
    assert archscale_factors(8192, False) == [1, 2] and archscale_factors(128, False) == [1, 2]


# ------------------------------------------------------------------------------------- ArchScale's Phonebook
def upstream_phonebook_batch(seed: str, batch_size: int, length: int) -> list[tuple[str, str]]:
    """eval_phonebook.py's PhoneBookDataset at ArchScale 1fbcceb, from its definition: random.seed(int(seed)), then
    per sample `length` entries "{names.get_full_name()}: {10 digits, the first 6-9}", three distinct entries by
    random.sample (two few-shot, one query), prompt = book + "\\n\\n" + e_a + "\\n" + e_b + "\\n\\n" + query_name + ":",
    label = the queried entry's number."""
    import names

    random.seed(int(seed))
    out = []
    for _ in range(batch_size):
        book = []
        for _ in range(length):
            name = names.get_full_name()
            digits = [random.randint(6, 9)] + [random.randint(0, 9) for _ in range(9)]
            book.append(f"{name}: {''.join(map(str, digits))}")
        a, b, c = random.sample(list(range(len(book))), 3)
        question = book[c].split(":")[0] + ":"
        out.append(("\n".join(book) + "\n\n" + book[a] + "\n" + book[b] + "\n\n" + question,
                    book[c].split(":")[1].strip()))
    return out


def upstream_correct(decoded_with_special_tokens: str, label: str) -> bool:
    """ArchScale's scoring: the first line of the decoded generation (special tokens kept), stripped."""
    return label == str(decoded_with_special_tokens.split("\n")[0].strip())


@pytest.mark.parametrize("n_entries", [3, 25])
def test_archscale_phonebook_books_are_upstreams(n_entries):
    pytest.importorskip("names")
    from archscale.eval.phonebook import make_batch

    state = random.getstate()
    try:
        for jj, ii in ((0, 0), (3, 1)):
            ours = make_batch(42, jj, n_entries, ii, 4, style="archscale")
            assert [(s["prompt"], s["label"]) for s in ours] == upstream_phonebook_batch(f"42{jj}{n_entries}{ii}", 4,
                                                                                         n_entries)
    finally:
        random.setstate(state)


class FixedModel:
    """A 'model' whose greedy continuation is fixed token ids (with a tokenizer mapping ids <-> characters)."""

    def __init__(self, continuation: list[int]):
        import torch

        self.continuation = continuation
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self.weight])

    def generate(self, idx, max_new_tokens, temperature=0.0, eos_id=None, **_):
        import torch

        new = (self.continuation + [eos_id] * max_new_tokens)[:max_new_tokens]
        return torch.cat([idx, torch.tensor([new] * idx.shape[0], dtype=torch.long)], dim=1)


class CharTokenizer:
    eos_id = 0

    def encode(self, text, eos=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("generated", ["6123456789\nBob", "\n6123456789", "\n6123456789\nBob", "6123456789<EOS>",
                                       " 6123456789 \n", "61234567890"])
def test_strict_scoring_is_upstreams(generated):
    """What the model generates (<EOS> = the EOS token) -> right or wrong exactly as ArchScale scores it (which
    decodes EOS as text), and the lenient native scoring accepts the two forms ArchScale rejects."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from archscale.eval.phonebook import extract_prediction
    from archscale.eval.runner import ModelTextGenerator

    label = "6123456789"
    ids = [ord(c) for c in generated.replace("<EOS>", "\0")]
    em = SimpleNamespace(model=FixedModel(ids), tokenizer=CharTokenizer(), autocast=nullcontext)
    gen = ModelTextGenerator(em, batch_size=2, limit=100, limit_why="test")
    strict = gen(["Ann: "], 20, mark_eos=True)[0]
    upstream_text = generated.replace("<EOS>", "</s>") + ("</s>" * 20 if "<EOS>" in generated else "")
    assert (extract_prediction(strict, "strict") == label) == upstream_correct(upstream_text, label)
    lenient = extract_prediction(gen(["Ann: "], 20)[0], "lenient") == label
    assert lenient == (generated != "61234567890")


def test_protocol_defaults_explicit_flags_and_missing_packages(monkeypatch):
    from archscale.errors import UserError
    from archscale.eval import protocol
    from archscale.eval_cli import eval_parser

    def args(*extra):
        return eval_parser().parse_args(["--checkpoint", "x", "--tasks", "ppl", "--output", "o.json", *extra])

    st, notes = protocol.resolve(args(), 128, False, {"ppl", "phonebook"})
    assert (st["extrapolation"], st["ppl_selection"], st["eval_num_batches"] * st["phonebook_batch_size"]) == \
        ("1,2,4", "all", 40) and st["max_seq_lengths"] == "128" and not notes
    st, _ = protocol.resolve(args("--protocol", "archscale", "--eval_num_batches", "8"), 4096, False, set())
    assert (st["extrapolation"], st["ppl_selection"], st["eval_num_batches"], st["phonebook_batch_size"],
            st["niah_samples"], st["max_seq_lengths"], st["min_eval_len"]) == ("1,2,3,4", "archscale", 8, 4, 500,
                                                                               "4096", 480)
    monkeypatch.setattr(protocol, "_available", lambda module: False)
    st, notes = protocol.resolve(args("--protocol", "archscale"), 128, False, {"phonebook", "niah_single_1"})
    assert st["phonebook_names"] == "offline" and st["niah_keys"] == "offline" and len(notes) == 2
    with pytest.raises(UserError, match="archscale-strict needs the `names` package"):
        protocol.resolve(args("--protocol", "archscale-strict"), 128, False, {"phonebook"})


# ------------------------------------------------------------------------------- RULER through lm-eval, offline
@pytest.mark.slow
def test_ruler_niah_through_lm_eval_with_our_tokenizer_offline(tiny_runs, tmp_path, capsys, monkeypatch):
    """`archscale eval --tasks lm_eval:niah_single_1,lm_eval:niah_single_2 --lm_eval_metadata ...` and
    `archscale lm_eval --model archscale ... --metadata ...` run lm-eval's RULER tasks: lengths reach RULER, its
    prompts are sized with the run's tokenizer, and the essay task runs on the offline haystack and says so.
    (One test: importing RULER's sampler costs lm-eval ~30 s, paid once.)"""
    pytest.importorskip("wonderwords")
    pytest.importorskip("nltk")
    run = tiny_runs["transformer"]
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "lm_eval:niah_single_1,lm_eval:niah_single_2",
                 "--lm_eval_metadata", '{"max_seq_lengths": [1024]}', "--max_length", "1024", "--lm_eval_limit",
                 "2", "--output", str(out), "--device", "cpu", "--batch_size", "2"]) == 0
    doc = json.loads(out.read_text())
    tasks = doc["results"]["lm_eval"]["tasks"]
    assert set(tasks) == {"niah_single_1", "niah_single_2"}
    assert all(0.0 <= tasks[t]["1024"] <= 1.0 for t in tasks)  # "4096" is -1: lm-eval's mark for a length not run
    assert any("offline essay" in n for n in doc["notes"]) and "offline essay" in capsys.readouterr().err

    from lm_eval.tasks.ruler import prepare_niah

    from archscale.eval.niah import ruler_words

    ours = ruler_words()  # our NIAH's --niah_keys wonderwords: RULER's vocabulary exactly
    assert len(ours) == len(prepare_niah.WORDS) and ours[0] == prepare_niah.WORDS[0]
    assert ours[len(ours) - 1] == prepare_niah.WORDS[-1]
    import bisect

    words = prepare_niah.WORDS  # sorted: membership by bisection (a set of 6M strings costs seconds)
    for i in random.Random(0).sample(range(len(ours)), 200):
        j = bisect.bisect_left(words, ours[i])
        assert j < len(words) and words[j] == ours[i]

    from lm_eval.tasks import TaskManager

    from archscale.eval.ruler_offline import ruler_folder

    init = TaskManager.__init__  # lm-eval's full catalogue takes a minute to index: its RULER folder only
    monkeypatch.setattr(TaskManager, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "include_defaults": False}))
    res = tmp_path / "lm"
    assert main(["lm_eval", "--model", "archscale", "--model_args", f"pretrained={run},max_length=1024",
                 "--tasks", "niah_single_1", "--metadata", '{"max_seq_lengths": [1024]}', "--limit", "1",
                 "--include_path", str(ruler_folder()), "--device", "cpu", "--output_path", str(res)]) == 0
    (result,) = res.rglob("results_*.json")
    assert 0.0 <= json.loads(result.read_text())["results"]["niah_single_1"]["1024,none"] <= 1.0
