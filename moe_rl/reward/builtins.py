"""Built-in rewards with verl's signature: ``math`` (final answer, symbolic equivalence) and ``exact_match``.

Owns final-answer extraction and the comparison. Extraction looks only at the response's tail (its
last ``TAIL_CHARS`` = 300 characters, verl's ``math_dapo`` / ``gsm8k`` clip) and has two modes
(``reward.math_mode``):

* ``strict`` (the default) -- the last complete ``\\boxed{...}`` (nested braces allowed), else the
  last ``Answer: ...`` line; nothing else is an answer. This is verl 0.9.1's ``math_dapo`` (which
  tries the ``Answer:`` line first and then the last ``\\boxed{}`` of the final 100 characters) and
  the spirit of its ``gsm8k`` ``method="strict"`` (only a marked answer counts): a response that just
  mentions the right number somewhere, or a truncated chain that happens to end on it, scores 0.
* ``flexible`` -- as strict, else the last number in the tail (signs, thousands separators, decimals
  and ``a/b`` fractions): verl's ``gsm8k`` ``method="flexible"``. Lenient, and hackable by RL.

The comparison: ``math`` through ``math-verify`` (``parse`` + ``verify``: ``\\frac{1}{2}`` equals
``0.5``), ``exact_match`` as normalised strings (case, surrounding whitespace and ``$``, inner runs of
spaces, a trailing period). math-verify's own timeouts use SIGALRM, so these run in a process's main
thread: the reward pool's workers (``moe_rl.reward.pool``).
"""

from __future__ import annotations

import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

__all__ = [
    "MATH_MODES",
    "TAIL_CHARS",
    "exact_match_score",
    "extract_answer",
    "last_boxed",
    "math_flexible_score",
    "math_score",
    "normalize",
]

TAIL_CHARS = 300  # verl 0.9.1 math_dapo.compute_score / gsm8k._SOLUTION_CLIP_CHARS
MATH_MODES = ("strict", "flexible")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # verl math_dapo's Minerva pattern


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none
    or the last one is never closed (verl's ``last_boxed_only_string``). One pass: linear in ``len(text)``."""
    start = None
    for m in _BOX.finditer(text):
        start = m.end()
    if start is None:
        return None
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer in the last ``TAIL_CHARS`` of a response (``mode`` as in the module docstring); None if none."""
    if mode not in MATH_MODES:
        raise ValueError(f"reward.math_mode={mode!r}: expected one of {list(MATH_MODES)}")
    tail = text[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        answer = lines[-1].strip().rstrip(".").strip()
        return answer or None
    if mode == "flexible":
        numbers = _NUMBER.findall(tail)
        return numbers[-1].replace(",", "").replace(" ", "") if numbers else None
    return None


def _parse(text: str):
    return parse(f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def math_score(
    data_source=None, solution_str: str = "", ground_truth=None, extra_info=None, mode: str = "strict"
) -> float:
    """1.0 when the response's final answer (``extract_answer(solution_str, mode)``) equals ``ground_truth``
    symbolically (math-verify), else 0.0. Strict by default: an unmarked answer scores 0."""

    answer = extract_answer(solution_str, mode)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    if normalize(answer) == normalize(truth):
        return 1.0
    gold, pred = _parse(truth), _parse(answer)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


def math_flexible_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None) -> float:
    """``math_score`` with ``mode='flexible'`` (``reward.math_mode: flexible``): the last number counts too."""
    return math_score(data_source, solution_str, ground_truth, extra_info, mode="flexible")


def normalize(text) -> str:
    """Lower case, ``$`` and surrounding whitespace stripped, inner whitespace runs as one space, no trailing period."""
    text = re.sub(r"\s+", " ", str(text).strip().strip("$").strip()).lower()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None) -> float:
    """1.0 when the normalised response equals the normalised ``ground_truth`` (or one of a list), else 0.0."""
    truths = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    return 1.0 if normalize(solution_str) in {normalize(t) for t in truths} else 0.0
