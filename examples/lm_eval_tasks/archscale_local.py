"""Datasets of the local lm-eval example tasks: JSONL files beside this module, read without any download
(lm-eval's `custom_dataset` hook, so the tasks work from any working directory)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> dict:
    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def quotes_mc(**kwargs):
    return _load("quotes_mc.jsonl")


def milton_ppl(**kwargs):
    return _load("milton_ppl.jsonl")


def copy_words(**kwargs):
    return _load("copy_words.jsonl")
