"""Reasoning tasks: the prompt, the answer extraction and the equivalence check of GSM8K, MATH and AIME 2024.

Expected JSONL fields (one problem per line; `id` optional, defaults to the line number; a `prompt` field, when
present, is sent verbatim instead of the task's template):

- gsm8k:  {"question": str, "answer": str}  where answer is GSM8K's solution ending "#### 72", or just "72".
- math:   {"problem": str, "answer": str}   the reference answer in LaTeX ("\\frac{1}{2}"); or, instead of
          "answer", MATH's "solution" (its last \\boxed{...} is the answer).
- aime24: {"problem": str, "answer": str | int}   an integer 0..999.

Extraction and equivalence:
- GSM8K: the number after "####" if the completion has one, else after the last "answer is", else the last number
  in the completion (lm-eval's flexible extraction); "$1,234.50", "1234.5" and "2469/2" are the same number.
- MATH / AIME: the content of the completion's last \\boxed{...} (the MATH paper's extraction), compared with the
  reference by math-verify (Hugging Face's checker, the one lighteval uses): LaTeX forms (\\dfrac, \\sqrt3),
  decimals vs fractions, units in \\text{...}, "x = 3" vs "3" and intervals are equivalent when they are equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from archscale.errors import UserError


@dataclass(frozen=True)
class Task:
    name: str
    question_field: str
    template: str
    stop: tuple[str, ...]


TASKS = {
    "gsm8k": Task("gsm8k", "question", "Question: {question}\nAnswer: Let's think step by step.",
                  ("\n\nQuestion:", "\nQuestion:")),
    "math": Task("math", "problem", "Problem: {problem}\nPut the final answer in \\boxed{{}}.\nSolution:",
                 ("\n\nProblem:",)),
    "aime24": Task("aime24", "problem", "Problem: {problem}\nThe answer is an integer from 0 to 999; put it in "
                   "\\boxed{{}}.\nSolution:", ("\n\nProblem:",)),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"--task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]


def prompt_for(task: Task, item: dict) -> str:
    if isinstance(item.get("prompt"), str):
        return item["prompt"]
    return task.template.format(**{task.question_field: item[task.question_field]})


def gold_for(task: Task, item: dict) -> str:
    """The reference answer as a string, from the item's fields (see the module docstring)."""
    if task.name == "gsm8k":
        if item.get("answer") is None:
            raise KeyError("answer")
        ans = str(item["answer"])
        return ans.split("####")[-1].strip()
    if "answer" in item and item["answer"] is not None:
        return str(item["answer"]).strip()
    boxed = last_boxed(str(item.get("solution", "")))
    if boxed is None:
        raise KeyError("answer")
    return boxed


def check_item(task: Task, item: dict, line: int, path: str) -> None:
    """Everything scoring will read, checked now (before any sampling): a prompt or question that is text, and a
    reference answer (a non-empty string or number; MATH: or a solution with a \\boxed answer)."""
    need = f'"{task.question_field}" and "answer"' + (' (or "solution")' if task.name == "math" else "")
    where = f"--data {path}:{line}: a {task.name} item"
    if not isinstance(item.get("prompt", item.get(task.question_field)), str):
        raise UserError(f"{where} needs {need} fields (\"{task.question_field}\" or \"prompt\" as text)")
    answer = item.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise UserError(f"{where}: \"answer\" must be a string or a number, got {type(answer).__name__}")
    if "answer" not in item and not (task.name == "math" and "solution" in item):
        raise UserError(f"{where} needs {need} fields")
    try:
        gold = gold_for(task, item)
    except KeyError:
        raise UserError(f"{where}: no \"answer\", and its \"solution\" has no \\boxed{{...}} answer") from None
    if not gold:
        raise UserError(f"{where}: the reference answer is empty")


# ------------------------------------------------------------------------------------------------- GSM8K
_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\$?\s?\.\d+")


def parse_number(text: str) -> Fraction | None:
    """'$1,234.50' -> 2469/2; '-3/4' -> -3/4; None when it is not a number."""
    s = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_gsm8k(completion: str) -> str | None:
    for marker in ("####", "answer is"):
        i = completion.rfind(marker)
        if i >= 0:
            m = _NUMBER.search(completion, i + len(marker))
            if m:
                return m.group(0).strip()
    found = _NUMBER.findall(completion)
    return found[-1].strip() if found else None


def gsm8k_equal(pred: str | None, gold: str) -> bool:
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(gold)
    return a is not None and b is not None and a == b


# ---------------------------------------------------------------------------------------------- MATH/AIME
def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):].strip().split()  # "\boxed 5"
        return rest[0].rstrip(".$") if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def math_equal(pred: str | None, gold: str) -> bool:
    """math-verify's equivalence of two LaTeX answers (each read as a $...$ expression)."""
    if pred is None or not pred.strip():
        return False
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    g = parse(f"$\\boxed{{{gold}}}$", extraction_config=config)
    p = parse(f"$\\boxed{{{pred}}}$", extraction_config=config)
    if not g:  # a reference math-verify cannot read: fall back to an exact string match
        return pred.strip() == gold.strip()
    return bool(p) and bool(verify(g, p))


def extract(task: Task, completion: str) -> str | None:
    return extract_gsm8k(completion) if task.name == "gsm8k" else last_boxed(completion)


def is_correct(task: Task, pred: str | None, gold: str) -> bool:
    if task.name == "gsm8k":
        return gsm8k_equal(pred, gold)
    if task.name == "aime24":
        n = parse_number(pred or "")
        g = parse_number(gold)
        if n is not None and g is not None:  # integers: exact, no tolerance
            return n == g
    return math_equal(pred, gold)
