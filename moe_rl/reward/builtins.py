"""Built-in rewards with verl's signature: ``math`` (final answer, symbolic equivalence) and ``exact_match``.

Owns final-answer extraction -- the last ``\\boxed{...}`` (nested braces allowed), else the last
number in the text (signs, thousands separators, decimals and ``a/b`` fractions) -- and the
comparison: ``math`` through ``math-verify`` (``parse`` + ``verify``: ``\\frac{1}{2}`` equals ``0.5``),
``exact_match`` as normalised strings (case, surrounding whitespace and ``$``, inner runs of spaces,
a trailing period). math-verify's own timeouts use SIGALRM, so these run in a process's main
thread: the reward pool's workers (``moe_rl.reward.pool``).
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "last_boxed", "math_score", "exact_match_score", "normalize"]

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: ``\\boxed{}`` first, then the last number; None if neither."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "").replace(" ", "") if numbers else None


def _parse(text: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def math_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` symbolically (math-verify), else 0.0."""
    from math_verify import verify

    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    if normalize(answer) == normalize(truth):
        return 1.0
    gold, pred = _parse(truth), _parse(answer)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


def normalize(text) -> str:
    """Lower case, ``$`` and surrounding whitespace stripped, inner whitespace runs as one space, no trailing period."""
    text = re.sub(r"\s+", " ", str(text).strip().strip("$").strip()).lower()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None) -> float:
    """1.0 when the normalised response equals the normalised ``ground_truth`` (or one of a list), else 0.0."""
    truths = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    return 1.0 if normalize(solution_str) in {normalize(t) for t in truths} else 0.0
