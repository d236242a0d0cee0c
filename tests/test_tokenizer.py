"""Tokenizer wrapper (tokenizer.json / SentencePiece) and byte-level BPE training."""

import json
import random

import pytest

from archscale.data.tokenizer import Tokenizer, train_bpe
from archscale.errors import UserError

WORDS = ("the of and model data token layer attention state space mamba train loss café naïve über "
         "straße 東京 データ 模型 мир привет 😀 🚀").split()

TRICKY = [
    "hello world",
    "  leading spaces and trailing  ",
    "tabs\tand\r\nwindows\r\nnewlines\n\n",
    "naïve café Zürich — “quotes” ‘single’ …",
    "日本語のテキストと中文和한국어",
    "emoji 😀🚀👩‍👩‍👧 and flags 🇫🇷",
    "combining e\u0301 vs é, zero width\u200bjoiner",
    "never seen: Ωμέγα ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x07 control",
    "",
]


def _corpus(n_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    (d / "a.txt").write_text("\n".join(_corpus(100, 1)), encoding="utf-8")
    with open(d / "b.jsonl", "w", encoding="utf-8") as f:
        for doc in _corpus(60, 2):
            f.write(json.dumps({"text": doc}) + "\n")
    tok = train_bpe([str(d / "a.txt"), str(d / "b.jsonl")], vocab_size=320, out_path=str(d / "tok" / "tokenizer.json"))
    return tok, d


def test_train_bpe_properties(bpe):
    tok, d = bpe
    assert tok.kind == "huggingface"
    assert tok.path == str((d / "tok" / "tokenizer.json").resolve())
    assert (d / "tok" / "tokenizer.json").is_file()
    assert not list((d / "tok").glob("*.tmp"))
    assert tok.eos_id == 0 and tok.bos_id is None
    assert 257 < tok.vocab_size <= 320  # 256 bytes + EOS + some merges
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    # merges were learnt: a frequent word is one token
    assert len(tok.encode("attention", eos=False)) < len("attention")


@pytest.mark.parametrize("text", TRICKY)
def test_bpe_round_trip_exact(bpe, text):
    tok, _ = bpe
    ids = tok.encode(text, eos=False)
    assert tok.decode(ids) == text
    full = tok.encode(text)
    assert full == ids + [tok.eos_id]  # EOS appended, nothing prepended
    assert tok.decode(full) == text + "<|endoftext|>"
    assert all(0 <= i < tok.vocab_size for i in full)


def test_literal_special_token_in_text_is_not_eos(bpe):
    tok, _ = bpe
    text = "end <|endoftext|> not really"
    ids = tok.encode(text, eos=False)
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_encode_batch_matches_encode_and_bos_missing(bpe):
    tok, _ = bpe
    texts = TRICKY[:6]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, eos=False) == [tok.encode(t, eos=False) for t in texts]
    assert tok.encode_batch([]) == []
    with pytest.raises(UserError, match="no BOS"):
        tok.encode("x", bos=True)


def test_load_from_folder_or_file(bpe):
    tok, d = bpe
    by_dir = Tokenizer(d / "tok")
    by_file = Tokenizer(str(d / "tok" / "tokenizer.json"))
    for t in (by_dir, by_file):
        assert (t.path, t.kind, t.vocab_size, t.eos_id, t.bos_id) == (tok.path, "huggingface", tok.vocab_size, 0, None)
        assert t.encode(TRICKY[3]) == tok.encode(TRICKY[3])


def test_tokenizer_config_declares_eos_and_bos(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.add_special_tokens(["<|endoftext|>", "<s>", "</s>"])  # ids 0, 1, 2
    hf.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer(tmp_path)
    assert (t.eos_id, t.bos_id) == (0, 1)  # first of the usual names; "<s>" as BOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    t = Tokenizer(tmp_path)
    assert t.eos_id == 2
    assert t.encode("", bos=True) == [1, 2]


def test_missing_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    hf = HF(models.BPE())
    hf.add_special_tokens(["<pad>"])
    path = tmp_path / "noeos.json"
    hf.save(str(path))
    with pytest.raises(UserError, match=r"noeos\.json.*end-of-text"):
        Tokenizer(path)


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(UserError, match="nope.json"):
        Tokenizer(tmp_path / "nope.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty.*neither tokenizer.json nor tokenizer.model"):
        Tokenizer(tmp_path / "empty")
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="broken.json"):
        Tokenizer(bad)
    badsp = tmp_path / "broken.model"
    badsp.write_bytes(b"\x00\x01garbage")
    with pytest.raises(UserError, match="broken.model"):
        Tokenizer(badsp)


def test_train_bpe_bad_inputs(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text " * 50, encoding="utf-8")
    with pytest.raises(UserError, match="vocab_size"):
        train_bpe([str(good)], vocab_size=256, out_path=str(tmp_path / "t.json"))
    with pytest.raises(UserError, match="missing.txt"):
        train_bpe([str(tmp_path / "missing.txt")], vocab_size=300, out_path=str(tmp_path / "t.json"))
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="no text"):
        train_bpe([str(empty)], vocab_size=300, out_path=str(tmp_path / "t.json"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt:2: not valid UTF-8"):
        train_bpe([str(good), str(latin1)], vocab_size=300, out_path=str(tmp_path / "t.json"))
    assert not (tmp_path / "t.json").exists()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    src = d / "corpus.txt"
    src.write_text("\n".join(_corpus(400, 3)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(src), model_prefix=str(d / "tokenizer"), vocab_size=100, model_type="bpe",
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return d


def test_sentencepiece_load_encode_eos(sp_model):
    t = Tokenizer(sp_model / "tokenizer.model")
    assert t.kind == "sentencepiece"
    assert t.vocab_size == 100
    assert (t.eos_id, t.bos_id) == (2, 1)
    text = "the model and the data"
    ids = t.encode(text)
    assert ids[-1] == 2 and ids[0] != 1
    assert ids[:-1] == t.encode(text, eos=False)
    assert t.encode(text, bos=True, eos=False) == [1] + ids[:-1]
    assert t.decode(ids[:-1]) == text
    assert t.encode_batch([text, "layer state"]) == [ids, t.encode("layer state")]
    # a folder holding tokenizer.model loads the same model
    t2 = Tokenizer(sp_model)
    assert t2.path == t.path and t2.encode(text) == ids
