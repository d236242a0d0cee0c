"""Tokenizers: a Hugging Face `tokenizer.json` or a SentencePiece `.model`, behind one small interface.

Conventions (ArchScale's): `encode(text)` appends EOS and adds no BOS. Special-token strings that occur *inside*
the text (for instance a literal "<|endoftext|>" in a web page) are encoded as ordinary text, never as the special
id, so a document cannot fake a document boundary (SentencePiece behaves this way already; for `tokenizer.json`
we set `encode_special_tokens`). `decode` keeps special tokens of Hugging Face tokenizers visible.

`train_bpe` trains a byte-level BPE (GPT-2 style pre-tokenization, every byte in the base alphabet) whose round
trip is exact for any UTF-8 text; "<|endoftext|>" is its EOS (id 0).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from archscale.errors import UserError

# Tried in this order when the tokenizer does not declare its EOS (tokenizer_config.json next to it).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
BPE_EOS = "<|endoftext|>"

HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"


def _resolve(path: str | os.PathLike) -> tuple[Path, str]:
    """Return (file, kind) for a tokenizer file or a folder holding one."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / HF_FILE).is_file():
            return p / HF_FILE, "huggingface"
        if (p / SP_FILE).is_file():
            return p / SP_FILE, "sentencepiece"
        raise UserError(f"--tokenizer {path}: the folder holds neither {HF_FILE} nor {SP_FILE}")
    if not p.exists():
        raise UserError(f"--tokenizer {path}: no such file or folder")
    if not p.is_file():
        raise UserError(f"--tokenizer {path}: not a file or folder")
    if p.suffix == ".json":
        return p, "huggingface"
    if p.suffix == ".model":
        return p, "sentencepiece"
    # Unknown extension: sniff (tokenizer.json is JSON text, a SentencePiece model is a binary protobuf).
    try:
        with open(p, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as e:
        raise UserError(f"--tokenizer {path}: cannot read it ({e.strerror})") from None
    return p, ("huggingface" if head.startswith(b"{") else "sentencepiece")


def _config_token(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A loaded tokenizer. `kind` is "huggingface" or "sentencepiece"; `path` the file it was loaded from."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        file, kind = _resolve(path)
        self.path = str(file.resolve())
        self.kind = kind
        if kind == "huggingface":
            self._load_hf(file, eos_token)
        else:
            self._load_sp(file, eos_token)

    # ------------------------------------------------------------------------------------------ loading
    def _load_hf(self, file: Path, eos_token: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception with a parse message
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"--tokenizer {file}: cannot load it as a Hugging Face tokenizer.json ({msg})") from None
        try:
            tok.encode_special_tokens = True  # literal "<|endoftext|>" in a document is text, not EOS
        except AttributeError:  # tokenizers < 0.19 cannot; special-token strings in text then map to their ids
            pass
        self._hf = tok
        self._sp = None
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = (max(vocab.values()) + 1) if vocab else 0

        declared_eos = declared_bos = None
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
                declared_eos = _config_token(data.get("eos_token"))
                declared_bos = _config_token(data.get("bos_token"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                pass  # an unreadable config is not fatal: fall back to the usual names

        if eos_token is not None:
            eos = tok.token_to_id(eos_token)
            if eos is None:
                raise UserError(f"--tokenizer {file}: has no token {eos_token!r} to use as EOS")
        else:
            eos = None
            for name in ([declared_eos] if declared_eos else []) + list(EOS_CANDIDATES):
                eos = tok.token_to_id(name)
                if eos is not None:
                    break
            if eos is None:
                raise UserError(f"--tokenizer {file}: no end-of-text token found (looked for "
                                f"{', '.join(EOS_CANDIDATES)}); add one to the tokenizer")
        self.eos_id: int = int(eos)
        bos = None
        for name in ([declared_bos] if declared_bos else []) + list(BOS_CANDIDATES):
            bos = tok.token_to_id(name)
            if bos is not None:
                break
        self.bos_id: int | None = None if bos is None else int(bos)

    def _load_sp(self, file: Path, eos_token: str | None) -> None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            ok = sp.Load(str(file))
        except Exception as e:  # OSError / RuntimeError with a protobuf message
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"--tokenizer {file}: cannot load it as a SentencePiece model ({msg})") from None
        if not ok:
            raise UserError(f"--tokenizer {file}: cannot load it as a SentencePiece model")
        self._sp = sp
        self._hf = None
        self.vocab_size = int(sp.GetPieceSize())
        if eos_token is not None:
            eos = sp.PieceToId(eos_token)
            if eos == sp.unk_id() and eos_token != sp.IdToPiece(sp.unk_id()):
                raise UserError(f"--tokenizer {file}: has no piece {eos_token!r} to use as EOS")
        else:
            eos = sp.eos_id()
        if eos < 0:
            raise UserError(f"--tokenizer {file}: the SentencePiece model has no EOS piece (trained with eos_id=-1)")
        self.eos_id = int(eos)
        self.bos_id = None if sp.bos_id() < 0 else int(sp.bos_id())

    # ------------------------------------------------------------------------------------------ use
    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, kind={self.kind!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, bos_id={self.bos_id})")

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            if self.bos_id is None:
                raise UserError(f"tokenizer {self.path} has no BOS token; encode without bos=True")
            ids = [self.bos_id] + ids
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, bos: bool = False, eos: bool = True) -> list[int]:
        """Token ids of `text`, EOS appended (unless eos=False), BOS prepended only if bos=True."""
        if self._hf is not None:
            ids = list(self._hf.encode(text, add_special_tokens=False).ids)
        else:
            ids = list(self._sp.EncodeAsIds(text))
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = True) -> list[list[int]]:
        """`encode` of many texts at once (uses the tokenizer's own threads)."""
        texts = list(texts)
        if not texts:
            return []
        if self._hf is not None:
            fast = getattr(self._hf, "encode_batch_fast", None) or self._hf.encode_batch
            encs = fast(texts, add_special_tokens=False)
            out = [list(e.ids) for e in encs]
        else:
            out = [list(x) for x in self._sp.EncodeAsIds(texts)]
        return [self._wrap(ids, bos, eos) for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp.DecodeIds(ids)


# ---------------------------------------------------------------------------------------------- training

def train_bpe(files: list[str], vocab_size: int, out_path: str, min_frequency: int = 2,
              text_key: str = "text") -> Tokenizer:
    """Train a byte-level BPE on `files` and save it as a tokenizer.json at `out_path`; return it loaded.

    `files` may be anything `archscale prepare` reads (.txt, .jsonl, .jsonl.gz, .parquet, or folders of them);
    each document is one training text. `out_path` may be a folder (then `out_path/tokenizer.json`).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from archscale.data.sources import iter_texts, list_input_files

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise UserError(f"--vocab_size must be an integer >= 257 (256 byte tokens + EOS), got {vocab_size}")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise UserError(f"min_frequency must be a positive integer, got {min_frequency}")
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    inputs = list_input_files(list(files))  # UserError for missing / unsupported / empty folders

    out = Path(out_path).expanduser()
    if out.is_dir() or str(out_path).endswith(os.sep):
        out = out / HF_FILE
    if out.parent.exists() and not out.parent.is_dir():
        raise UserError(f"--out {out_path}: {out.parent} is not a folder")

    counts = {"docs": 0}

    def texts():
        for f in inputs:
            for _, text in iter_texts(f.path, text_key):
                if text.strip():
                    counts["docs"] += 1
                    yield text

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(texts(), trainer)  # a UserError raised while reading propagates unchanged
    if counts["docs"] == 0:
        names = ", ".join(str(f) for f in files)
        raise UserError(f"--input {names}: no text to train on (all documents are empty)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp), pretty=True)
    os.replace(tmp, out)
    return Tokenizer(out)
