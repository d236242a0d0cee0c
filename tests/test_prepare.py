"""`prepare`: inputs -> LITPKDS shards + manifest; exact content, deterministic split, resume, bad inputs."""

import gzip
import hashlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from archscale.data import prepare as prep_mod
from archscale.data.format import HEADER_SIZE, open_shard, read_header
from archscale.data.prepare import prepare
from archscale.data.tokenizer import train_bpe
from archscale.errors import UserError

WORDS = ("the of and model data token layer attention state space train loss café naïve straße 東京 データ "
         "мир 😀").split()
CHUNK = 64


def _doc(rng: random.Random, tag: str) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    return f"{tag}: {body}" + rng.choice(["", "\n", " .\r\n"])


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    (d / "corpus.txt").write_text("\n".join(_doc(rng, "doc") for _ in range(300)), encoding="utf-8")
    train_bpe([str(d / "corpus.txt")], vocab_size=300, out_path=str(d / "tokenizer.json"))
    return str(d / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(tok_path):
    return prep_mod.Tokenizer(tok_path)


def _write_corpus(root: Path, seed: int = 1) -> tuple[list[str], list[tuple[str, int, str]]]:
    """Write one input of each kind; return (the --input args, [(file key, doc index, text)] in prepare order)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs: list[tuple[str, int, str]] = []
    # .jsonl (line numbers are the indices; a blank line is skipped)
    with open(root / "a.jsonl", "w", encoding="utf-8") as f:
        line = 0
        for i in range(60):
            text = _doc(rng, f"a{i}")
            f.write(json.dumps({"text": text, "id": i}) + "\n")
            line += 1
            docs.append(("a.jsonl", line, text))
            if i == 10:
                f.write("\n")
                line += 1
    # .txt: one document
    text = _doc(rng, "b0") * 3
    (root / "b.txt").write_bytes(text.encode("utf-8"))
    docs.append(("b.txt", 0, text))
    # .parquet in several row groups
    import pyarrow as pa
    import pyarrow.parquet as pq

    ptexts = [_doc(rng, f"c{i}") for i in range(70)]
    pq.write_table(pa.table({"id": list(range(70)), "text": ptexts}), root / "c.parquet", row_group_size=16)
    docs += [("c.parquet", i, t) for i, t in enumerate(ptexts)]
    # .jsonl.gz
    with gzip.open(root / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        for i in range(40):
            text = _doc(rng, f"d{i}")
            f.write(json.dumps({"text": text}) + "\n")
            docs.append(("d.jsonl.gz", i + 1, text))
    # a folder: nested .txt files (sorted by relative path), an ignored README
    (root / "e" / "sub").mkdir(parents=True)
    (root / "e" / "README.md").write_text("not an input")
    for name in ["e/z.txt", "e/a.txt", "e/sub/m.txt"]:
        text = _doc(rng, name)
        (root / name).write_text(text, encoding="utf-8")
    for name in ["e/a.txt", "e/sub/m.txt", "e/z.txt"]:
        docs.append((name, 0, (root / name).read_bytes().decode("utf-8")))
    args = [str(root / n) for n in ["a.jsonl", "b.txt", "c.parquet", "d.jsonl.gz", "e"]]
    return args, docs


def _is_val(key: str, idx: int, val_fraction: float, seed: int = 42) -> bool:
    """The documented split rule, computed independently."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}\x00{key}\x00{idx}".encode(), digest_size=8).digest(), "little")
    return h < val_fraction * 2.0 ** 64


def _read_split(out: Path, manifest: dict, split: str) -> np.ndarray:
    files = manifest["splits"][split]["files"]
    on_disk = sorted(p.name for p in out.glob(f"{split}*.bin"))
    assert sorted(files) == on_disk
    parts = []
    for name in files:
        dtype, n = read_header(out / name)
        assert dtype == np.uint16 and 0 < n <= manifest["chunk_size"]
        parts.append(np.asarray(open_shard(out / name)))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    assert tokens.size == 0 or tokens[-1] == eos
    docs, start = [], 0
    for i in np.flatnonzero(tokens == eos):
        docs.append(tokens[start:i + 1].tolist())
        start = i + 1
    return docs


def _snapshot(out: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in sorted(out.glob("*.bin"))}


def test_all_formats_exact_content_and_manifest(tmp_path, tok_path, tok):
    args, docs = _write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    m = prepare(args, str(out), tok_path, val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    assert m == json.loads((out / "manifest.json").read_text())
    assert (m["format"], m["version"], m["dtype"], m["chunk_size"]) == ("LITPKDS", 1, "uint16", CHUNK)
    assert (m["tokenizer"], m["tokenizer_kind"]) == (tok_path, "huggingface")
    assert (m["vocab_size"], m["eos_id"], m["bos_id"]) == (tok.vocab_size, 0, None)
    assert [i["key"] for i in m["inputs"]] == ["a.jsonl", "b.txt", "c.parquet", "d.jsonl.gz",
                                               "e/a.txt", "e/sub/m.txt", "e/z.txt"]

    for split in ("train", "validation"):
        want = [t for k, i, t in docs if _is_val(k, i, 0.2) == (split == "validation")]
        tokens = _read_split(out, m, split)
        got = _split_docs(tokens, tok.eos_id)
        assert [tok.decode(d[:-1]) for d in got] == want  # exact text, order kept, each followed by EOS
        assert got == [tok.encode(t) for t in want]
        assert m["splits"][split]["documents"] == len(want)
        assert m["splits"][split]["tokens"] == tokens.size == sum(len(tok.encode(t)) for t in want)
        assert all(f.startswith(split + "_") for f in m["splits"][split]["files"])
    assert 0 < m["splits"]["validation"]["documents"] < 0.4 * len(docs)
    # per-input counts add up
    assert sum(i["documents"]["train"] + i["documents"]["validation"] for i in m["inputs"]) == len(docs)
    # nothing temporary is left behind
    assert not list(out.rglob("*.tmp"))


def test_final_partial_chunk_is_kept(tmp_path, tok_path, tok):
    text = " ".join(WORDS) * 7
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    n = len(tok.encode(text))
    assert n % CHUNK != 0 and n > 2 * CHUNK
    m = prepare([str(tmp_path / "one.txt")], str(tmp_path / "out"), tok_path, val_fraction=0.0, chunk_size=CHUNK,
                num_workers=0, progress=False)
    files = m["splits"]["train"]["files"]
    assert files == [f"train_one_{k:010d}.bin" for k in range(n // CHUNK + 1)]
    sizes = [read_header(tmp_path / "out" / f)[1] for f in files]
    assert sizes == [CHUNK] * (n // CHUNK) + [n % CHUNK]
    assert os.path.getsize(tmp_path / "out" / files[-1]) == HEADER_SIZE + 2 * (n % CHUNK)
    assert _read_split(tmp_path / "out", m, "train").tolist() == tok.encode(text)


def test_val_fraction_zero_and_one(tmp_path, tok_path):
    args, docs = _write_corpus(tmp_path / "in")
    m0 = prepare(args, str(tmp_path / "o0"), tok_path, val_fraction=0.0, chunk_size=CHUNK, num_workers=0,
                 progress=False)
    assert m0["splits"]["validation"] == {"documents": 0, "tokens": 0, "files": []}
    assert m0["splits"]["train"]["documents"] == len(docs)
    assert not list((tmp_path / "o0").glob("validation*"))
    m1 = prepare(args, str(tmp_path / "o1"), tok_path, val_fraction=1.0, chunk_size=CHUNK, num_workers=0,
                 progress=False)
    assert m1["splits"]["train"]["documents"] == 0 and m1["splits"]["validation"]["documents"] == len(docs)
    assert m1["splits"]["validation"]["tokens"] == m0["splits"]["train"]["tokens"]


def test_split_independent_of_workers_and_order(tmp_path, tok_path, tok):
    args, docs = _write_corpus(tmp_path / "in")
    kw = dict(val_fraction=0.25, chunk_size=CHUNK, progress=False)
    m0 = prepare(args, str(tmp_path / "w0"), tok_path, num_workers=0, **kw)
    m2 = prepare(args, str(tmp_path / "w2"), tok_path, num_workers=2, **kw)
    assert m0["splits"] == m2["splits"]
    assert _snapshot(tmp_path / "w0").keys() == _snapshot(tmp_path / "w2").keys()
    for name, (_, _, data) in _snapshot(tmp_path / "w0").items():
        assert (tmp_path / "w2" / name).read_bytes() == data
    # the same documents land in validation when the inputs come in another order
    mr = prepare(list(reversed(args)), str(tmp_path / "rev"), tok_path, num_workers=0, **kw)
    val = lambda out, m: sorted(map(tuple, _split_docs(_read_split(out, m, "validation"), tok.eos_id)))
    assert val(tmp_path / "rev", mr) == val(tmp_path / "w0", m0)
    assert mr["splits"]["validation"]["documents"] == sum(_is_val(k, i, 0.25) for k, i, _ in docs)


def test_max_length_splits_long_documents(tmp_path, tok_path, tok):
    args, docs = _write_corpus(tmp_path / "in")
    m = prepare(args[:2], str(tmp_path / "out"), tok_path, val_fraction=0.0, chunk_size=CHUNK, max_length=5,
                num_workers=0, progress=False)
    got = _split_docs(_read_split(tmp_path / "out", m, "train"), tok.eos_id)
    want = []
    for k, _, t in docs:
        if k in ("a.jsonl", "b.txt"):
            ids = tok.encode(t, eos=False)
            if len(ids) + 1 <= 5:
                want.append(ids + [tok.eos_id])  # short enough: kept whole
            else:
                want += [ids[a:a + 4] + [tok.eos_id] for a in range(0, len(ids), 4)]
    assert got == want
    assert max(len(d) for d in got) == 5 and any(len(d) < 5 for d in got)
    # no token is lost: the pieces concatenate back to the documents
    assert sum(len(d) - 1 for d in got) == sum(len(tok.encode(t, eos=False)) for k, _, t in docs
                                               if k in ("a.jsonl", "b.txt"))


def test_shuffle_permutes_within_split_deterministically(tmp_path, tok_path, tok):
    args, _ = _write_corpus(tmp_path / "in")
    kw = dict(val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    plain = prepare(args, str(tmp_path / "plain"), tok_path, **kw)
    s1 = prepare(args, str(tmp_path / "s1"), tok_path, shuffle=True, **kw)
    s2 = prepare(args, str(tmp_path / "s2"), tok_path, shuffle=True, **kw)
    for split in ("train", "validation"):
        a = _split_docs(_read_split(tmp_path / "plain", plain, split), tok.eos_id)
        b = _split_docs(_read_split(tmp_path / "s1", s1, split), tok.eos_id)
        assert sorted(map(tuple, a)) == sorted(map(tuple, b))
        assert plain["splits"][split]["tokens"] == s1["splits"][split]["tokens"]
    a = _split_docs(_read_split(tmp_path / "plain", plain, "train"), tok.eos_id)
    b = _split_docs(_read_split(tmp_path / "s1", s1, "train"), tok.eos_id)
    assert a != b
    assert _snapshot(tmp_path / "s1").keys() == _snapshot(tmp_path / "s2").keys()
    for name, (_, _, data) in _snapshot(tmp_path / "s1").items():
        assert (tmp_path / "s2" / name).read_bytes() == data


def test_resume_redoes_only_unfinished_inputs(tmp_path, tok_path):
    args, _ = _write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    kw = dict(val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    m1 = prepare(args, str(out), tok_path, **kw)
    first = _snapshot(out)
    a_files = [f for f in first if f.startswith(("train_a_", "validation_a_"))]
    assert len(a_files) >= 3

    # simulate a crash while "a.jsonl" was being written: no done record, a damaged shard, a missing shard,
    # a shard the record never listed and a temp file
    (out / ".prepare" / "a.done.json").unlink()
    with open(out / a_files[0], "r+b") as f:
        f.truncate(HEADER_SIZE + 3)
    (out / a_files[1]).unlink()
    (out / "train_a_0000000099.bin").write_bytes(b"junk")
    (out / "train_a_0000000100.bin.tmp").write_bytes(b"junk")
    (out / "manifest.json").unlink()
    time.sleep(0.02)

    m2 = prepare(args, str(out), tok_path, **kw)
    assert m2 == m1
    second = _snapshot(out)
    assert second.keys() == first.keys()
    assert not list(out.rglob("*.tmp"))
    for name, (mtime, ino, data) in first.items():
        assert second[name][2] == data
        if name in a_files:
            assert second[name][1] != ino or second[name][0] != mtime  # rewritten
        else:
            assert second[name][:2] == (mtime, ino)  # finished inputs were not touched

    # nothing to do: no shard is rewritten, the manifest is the same
    time.sleep(0.02)
    m3 = prepare(args, str(out), tok_path, **kw)
    assert m3 == m1
    third = _snapshot(out)
    assert {k: v[:2] for k, v in third.items()} == {k: v[:2] for k, v in second.items()}


def test_resume_redoes_unit_whose_recorded_shard_is_damaged(tmp_path, tok_path):
    args, _ = _write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    kw = dict(val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    m1 = prepare(args, str(out), tok_path, **kw)
    data = (out / "train_c_0000000000.bin").read_bytes()
    (out / "train_c_0000000000.bin").write_bytes(data[:HEADER_SIZE + 10])  # truncated, record still there
    m2 = prepare(args, str(out), tok_path, **kw)
    assert m2 == m1
    assert (out / "train_c_0000000000.bin").read_bytes() == data


def test_changed_settings_or_foreign_dir_is_refused(tmp_path, tok_path):
    args, _ = _write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    prepare(args[:2], str(out), tok_path, val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    with pytest.raises(UserError, match=r"--output_dir .*chunk_size: 64 -> 128.*new --output_dir or delete it"):
        prepare(args[:2], str(out), tok_path, val_fraction=0.2, chunk_size=128, num_workers=0, progress=False)
    with pytest.raises(UserError, match=r"inputs: 2 -> 3 files"):
        prepare(args[:3], str(out), tok_path, val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    other = tmp_path / "tok2"
    train_bpe([args[0]], vocab_size=280, out_path=str(other))
    with pytest.raises(UserError, match="tokenizer_sha256"):
        prepare(args[:2], str(out), str(other), val_fraction=0.2, chunk_size=CHUNK, num_workers=0, progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train_slimpajama_0_0000000000.bin").write_bytes(b"x")
    with pytest.raises(UserError, match=r"train_slimpajama_0_0000000000\.bin"):
        prepare(args[:1], str(foreign), tok_path, num_workers=0, progress=False)


def test_folder_of_small_files_is_grouped(tmp_path, tok_path, monkeypatch):
    d = tmp_path / "many"
    d.mkdir()
    rng = random.Random(5)
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(_doc(rng, f"f{i}"), encoding="utf-8")
    m = prepare([str(d)], str(tmp_path / "o1"), tok_path, val_fraction=0.0, chunk_size=4096, num_workers=0,
                progress=False)
    assert m["splits"]["train"]["files"] == ["train_many-f00_0000000000.bin"]  # one unit, one shard
    monkeypatch.setattr(prep_mod, "UNIT_BYTES", 1)
    m = prepare([str(d)], str(tmp_path / "o2"), tok_path, val_fraction=0.0, chunk_size=4096, num_workers=0,
                progress=False)
    assert m["splits"]["train"]["files"] == [f"train_many-f{i:02d}_0000000000.bin" for i in range(12)]


def test_same_file_names_in_two_folders(tmp_path, tok_path, tok):
    for sub in ("wiki", "books"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "train.jsonl").write_text(json.dumps({"text": f"{sub} text"}) + "\n")
    m = prepare([str(tmp_path / "wiki" / "train.jsonl"), str(tmp_path / "books" / "train.jsonl")],
                str(tmp_path / "out"), tok_path, val_fraction=0.0, num_workers=0, progress=False)
    assert m["splits"]["train"]["files"] == ["train_wiki-train_0000000000.bin", "train_books-train_0000000000.bin"]
    got = _split_docs(_read_split(tmp_path / "out", m, "train"), tok.eos_id)
    assert [tok.decode(d[:-1]) for d in got] == ["wiki text", "books text"]
    with pytest.raises(UserError, match="included twice"):
        prepare([str(tmp_path / "wiki"), str(tmp_path / "wiki" / "train.jsonl")], str(tmp_path / "o2"), tok_path,
                num_workers=0, progress=False)


def test_text_key_and_empty_documents(tmp_path, tok_path, tok):
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"content": "one"}, {"content": "  \n"}, {"content": None},
                                                    {"content": "two"}]) + "\n")
    (tmp_path / "empty.txt").write_text("")
    m = prepare([str(p), str(tmp_path / "empty.txt")], str(tmp_path / "out"), tok_path, val_fraction=0.0,
                text_key="content", num_workers=0, progress=False)
    got = _split_docs(_read_split(tmp_path / "out", m, "train"), tok.eos_id)
    assert [tok.decode(d[:-1]) for d in got] == ["one", "two"]
    assert [i["skipped_empty"] for i in m["inputs"]] == [2, 1]


# ------------------------------------------------------------------------------------------- bad inputs

def _bad(tmp_path, tok_path, inputs, match, **kw):
    out = tmp_path / "out_bad"
    with pytest.raises(UserError, match=match) as ei:
        prepare([str(x) for x in inputs], str(out), tok_path, num_workers=kw.pop("num_workers", 0), progress=False,
                **kw)
    assert "\n" not in str(ei.value)
    assert not (out / "manifest.json").exists()
    return ei


def test_bad_input_paths(tmp_path, tok_path):
    _bad(tmp_path, tok_path, [tmp_path / "missing.jsonl"], r"--input .*missing\.jsonl: no such file")
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "notes.md").write_text("x")
    _bad(tmp_path, tok_path, [tmp_path / "nodata"], r"nodata: the folder holds no \.txt")
    (tmp_path / "t.csv").write_text("text\nx\n")
    _bad(tmp_path, tok_path, [tmp_path / "t.csv"], r"t\.csv: unsupported file type")
    (tmp_path / "ok.txt").write_text("fine")
    with pytest.raises(UserError, match=r"nope\.json"):
        prepare([str(tmp_path / "ok.txt")], str(tmp_path / "o"), str(tmp_path / "nope.json"), progress=False)


def test_all_empty_is_an_error(tmp_path, tok_path):
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.jsonl").write_text('{"text": ""}\n\n{"text": "   "}\n')
    _bad(tmp_path, tok_path, [tmp_path / "e1.txt", tmp_path / "e2.jsonl"], r"no text found \(all 3 documents are empty\)")


def test_non_utf8_txt_and_jsonl(tmp_path, tok_path):
    (tmp_path / "bad.txt").write_bytes(b"fine line\nsecond \xff\xfe line\n")
    _bad(tmp_path, tok_path, [tmp_path / "bad.txt"], r"bad\.txt:2: not valid UTF-8")
    lines = [json.dumps({"text": "ok"}).encode()] * 2 + [b'{"text": "caf\xe9"}']
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _bad(tmp_path, tok_path, [tmp_path / "bad.jsonl"], r"bad\.jsonl:3: not valid UTF-8")


def test_bad_jsonl_lines(tmp_path, tok_path):
    (tmp_path / "j1.jsonl").write_text('{"text": "a"}\n{"text": "b",}\n')
    _bad(tmp_path, tok_path, [tmp_path / "j1.jsonl"], r"j1\.jsonl:2: not valid JSON")
    (tmp_path / "j2.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n\n{"body": "c", "id": 3}\n')
    _bad(tmp_path, tok_path, [tmp_path / "j2.jsonl"], r"j2\.jsonl:4: no 'text' field \(fields: body, id\)")
    (tmp_path / "j3.jsonl").write_text('{"text": 5}\n')
    _bad(tmp_path, tok_path, [tmp_path / "j3.jsonl"], r"j3\.jsonl:1: field 'text' is a int")
    (tmp_path / "j4.jsonl").write_text('["text"]\n')
    _bad(tmp_path, tok_path, [tmp_path / "j4.jsonl"], r"j4\.jsonl:1: expected a JSON object")


def test_bad_gzip_and_parquet(tmp_path, tok_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = gzip.compress(("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(2000)) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    _bad(tmp_path, tok_path, [tmp_path / "cut.jsonl.gz"], r"cut\.jsonl\.gz:\d+: corrupt or truncated gzip")
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "nocol.parquet")
    _bad(tmp_path, tok_path, [tmp_path / "nocol.parquet"], r"nocol\.parquet: no column 'text' \(columns: body\)")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    _bad(tmp_path, tok_path, [tmp_path / "ints.parquet"], r"ints\.parquet: column 'text' has type int64")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    _bad(tmp_path, tok_path, [tmp_path / "junk.parquet"], r"junk\.parquet: cannot read it as Parquet")


def test_error_in_worker_process_propagates(tmp_path, tok_path):
    args, _ = _write_corpus(tmp_path / "in")
    (tmp_path / "in" / "zbad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    _bad(tmp_path, tok_path, args + [tmp_path / "in" / "zbad.jsonl"], r"zbad\.jsonl:3: not valid JSON",
         num_workers=2, chunk_size=CHUNK)


@pytest.mark.parametrize("kw, match", [
    (dict(val_fraction=1.5), "--val_fraction"),
    (dict(chunk_size=0), "--chunk_size"),
    (dict(max_length=1), "--max_length"),
    (dict(num_workers=-1), "--num_workers"),
    (dict(text_key=""), "--text_key"),
])
def test_bad_arguments(tmp_path, tok_path, kw, match):
    (tmp_path / "ok.txt").write_text("fine")
    with pytest.raises(UserError, match=match):
        prepare([str(tmp_path / "ok.txt")], str(tmp_path / "out"), tok_path, progress=False, **kw)


def _hash(key: str, idx: int, seed: int = 42) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{key}\x00{idx}".encode(), digest_size=8).digest(), "little")


def _txt_corpus(root: Path, n: int) -> list[str]:
    root.mkdir(parents=True)
    rng = random.Random(5)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(_doc(rng, f"t{i}"), encoding="utf-8")
    return sorted(f"in/doc{i:02d}.txt" for i in range(n))


def test_small_corpus_still_gets_one_validation_document_the_lowest_hash(tmp_path, tok_path, tok, capsys):
    """--val_fraction 0.01 of 16 documents: the hash rule alone picks none (checked below), so the document of
    lowest hash goes to validation, prepare says so, and a re-run keeps the same shards."""
    keys = _txt_corpus(tmp_path / "in", 16)
    assert not any(_is_val(k, 0, 0.001) for k in keys)  # the rule alone would leave validation empty
    out = tmp_path / "out"
    m = prepare([str(tmp_path / "in")], str(out), tok_path, val_fraction=0.001, chunk_size=CHUNK, num_workers=0)
    lowest = min(keys, key=lambda k: _hash(k, 0))
    assert m["splits"]["validation"]["documents"] == 1 and m["splits"]["train"]["documents"] == 15
    text = (tmp_path / lowest).read_text(encoding="utf-8")
    assert _read_split(out, m, "validation").tolist() == tok.encode(text)
    err = capsys.readouterr().err
    assert f"the document of lowest hash ({lowest}) goes there" in err, err
    before = _snapshot(out)
    again = prepare([str(tmp_path / "in")], str(out), tok_path, val_fraction=0.001, chunk_size=CHUNK,
                    num_workers=0, progress=False)
    assert again["splits"] == m["splits"] and _snapshot(out) == before
    (out / "manifest.json").unlink()  # as after a crash before the end: the re-run gives the same split
    (out / ".prepare" / next(p.name for p in (out / ".prepare").glob("*.done.json"))).unlink()
    assert prepare([str(tmp_path / "in")], str(out), tok_path, val_fraction=0.001, chunk_size=CHUNK,
                   num_workers=0, progress=False)["splits"] == m["splits"]


def test_train_keeps_the_highest_hash_document_when_every_hash_falls_into_validation(tmp_path, tok_path):
    keys = _txt_corpus(tmp_path / "in", 3)
    assert all(_is_val(k, 0, 0.9999) for k in keys)
    m = prepare([str(tmp_path / "in")], str(tmp_path / "out"), tok_path, val_fraction=0.9999, chunk_size=CHUNK,
                num_workers=0, progress=False)
    assert (m["splits"]["train"]["documents"], m["splits"]["validation"]["documents"]) == (1, 2)
    highest = max(keys, key=lambda k: _hash(k, 0))
    assert [i["key"] for i in m["inputs"] if i["tokens"] and _hash(i["key"], 0) == _hash(highest, 0)] == [highest]


def test_a_single_document_corpus_is_one_line_before_any_work(tmp_path, tok_path):
    (tmp_path / "one.txt").write_text("just one document", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")  # blank: not a document
    with pytest.raises(UserError, match=r"a single document cannot be split into train and validation; add "
                                        r"documents, or pass --val_fraction 0"):
        prepare([str(tmp_path / "one.txt"), str(tmp_path / "blank.txt")], str(tmp_path / "out"), tok_path,
                val_fraction=0.01, num_workers=0, progress=False)
    assert not (tmp_path / "out").exists()  # refused before the output folder was made
    m = prepare([str(tmp_path / "one.txt")], str(tmp_path / "out"), tok_path, val_fraction=0.0, num_workers=0,
                progress=False)
    assert m["splits"]["train"]["documents"] == 1
