"""lm-eval's RULER tasks (`lm_eval:niah_single_1`, ...) on an archscale model, offline.

RULER's tasks build their samples when they load: they size every prompt with a Hugging Face tokenizer named in
the task metadata (`tokenizer=` or `pretrained=`; none reaches them when the model is an object, so they crashed),
read Paul Graham's essays from the Hugging Face hub for the essay haystacks, and split sentences with NLTK's punkt
model (a download). `install()` (idempotent) hooks lm-eval's RULER modules before its tasks load:

* the tokenizer: when the metadata names no tokenizer, or names the archscale model being evaluated (its
  `pretrained=` path), RULER counts tokens with that model's own tokenizer (`ArchScaleLM.tok_encode`, so an
  add_bos_token model counts its BOS as lm-eval's HF tokenizers do); any other name goes to RULER's loader;
* the essay haystack: RULER's download is tried first; where it is impossible, archscale's offline essay
  (Milton's *Areopagitica*, ~18K words) is used instead, and a note says so on stderr and in the results;
* sentences: NLTK's punkt when its data is installed, else archscale's regex splitter (with a note).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

NOTES: list[str] = []
_installed = False


def _note(text: str) -> None:
    if text not in NOTES:
        NOTES.append(text)
        print(f"lm_eval: note: {text}", file=sys.stderr, flush=True)


class ModelTokenizer:
    """What RULER's samplers call: `tokenizer(text).input_ids`."""

    def __init__(self, lm):
        self.lm = lm

    def __call__(self, text: str, **_kw):
        return SimpleNamespace(input_ids=self.lm.tok_encode(text))


def _hook_tokenizer(common_utils) -> None:
    from archscale.eval.lm_eval_model import ArchScaleLM

    original = common_utils.get_tokenizer

    def get_tokenizer(tokenizer=None, pretrained=None, **kwargs):
        name = tokenizer or pretrained
        lm = ArchScaleLM.active
        if lm is not None and (name is None or str(name) in lm.names):
            return ModelTokenizer(lm)
        return original(tokenizer, pretrained, **kwargs)

    common_utils.get_tokenizer = get_tokenizer


def _hook_haystack(prepare_niah) -> None:
    from archscale.eval.niah import DEFAULT_ESSAY, essay_words, split_sentences

    original_haystack, original_split = prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize

    def get_haystack(type_haystack):
        try:
            return original_haystack(type_haystack)
        except Exception as e:  # noqa: BLE001 - offline hub: any failure to fetch the essays
            if type_haystack != "essay":
                raise
            _note(f"RULER's essay haystack (Paul Graham's essays, a download) is not available here "
                  f"({type(e).__name__}); using archscale's offline essay {DEFAULT_ESSAY.name} instead")
            return list(essay_words(None))

    def sent_tokenize(text: str) -> list[str]:
        try:
            return original_split(text)
        except LookupError:  # punkt_tab not installed (nltk.download needs the network)
            _note("NLTK's punkt sentence model is not installed; RULER's essay haystacks are split into sentences "
                  "with archscale's regex splitter")
            return split_sentences(text)

    prepare_niah.get_haystack = get_haystack
    prepare_niah.cached_sent_tokenize = sent_tokenize


def ruler_folder():
    """lm-eval's tasks/ruler folder (None without lm-eval)."""
    try:
        import lm_eval.tasks
    except ImportError:
        return None
    from pathlib import Path

    folder = Path(lm_eval.tasks.__file__).parent / "ruler"
    return folder if folder.is_dir() else None


def ruler_task_names() -> set[str]:
    """The tasks (and the `ruler` group) in lm-eval's ruler folder: their YAML file names."""
    folder = ruler_folder()
    return {p.stem for p in folder.glob("*.yaml")} if folder else set()


def wants_ruler(tasks) -> bool:
    names = ruler_task_names()
    return any(t.strip() in names for t in tasks)


def install() -> None:
    """Hook RULER's modules (importing its sampler module costs lm-eval ~30 s: call it only for RULER tasks)."""
    global _installed
    if _installed:
        return
    try:
        import lm_eval.tasks.ruler.common_utils as common_utils
    except ImportError:  # an lm-eval without RULER: nothing to hook
        return
    _hook_tokenizer(common_utils)
    try:
        import lm_eval.tasks.ruler.prepare_niah as prepare_niah  # needs wonderwords and nltk (lm-eval's own rule)
    except ImportError:
        pass  # RULER's own ImportError will say what to install when a task needs it
    else:
        _hook_haystack(prepare_niah)
    _installed = True
