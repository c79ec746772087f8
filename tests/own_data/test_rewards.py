"""Rewards: math answer extraction and equivalence, exact match, verl-signature loading, the worker pool's
errors, NaN and timeouts (one error naming file, row and function, or zeroed and counted)."""

from __future__ import annotations

import time

import pytest

from moe_rl.config import load_config
from moe_rl.data.prompt import PromptItem
from moe_rl.reward import RewardError, build_rewarder
from moe_rl.reward.builtins import exact_match_score, extract_answer, last_boxed, math_flexible_score, math_score
from moe_rl.reward.custom import load_function
from moe_rl.reward.scorer import function_spec
from tests.own_data.tiny_hf import build_tokenizer


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("so the answer is \\boxed{42}.", "42", "42"),
        (
            "\\boxed{1} then \\boxed{\\frac{1}{2}} at last",
            "\\frac{1}{2}",
            "\\frac{1}{2}",
        ),  # the last box, nested braces
        ("\\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}", "\\sqrt{\\frac{a}{b}}"),
        ("We get 3, then 7/8 as the final answer, done.", None, "7/8"),  # fractions, trailing text
        ("total: 1,234.5 apples", None, "1234.5"),
        ("it is -12", None, "-12"),
        ("no number here", None, None),
        ("\\boxed{5} and then \\boxed{unclosed 7", None, "7"),  # the last box is never closed: no boxed answer
        ("It could be 3, 5 or 7", None, "7"),  # the case: a list of guesses is no answer
        ("3 + 4 = 7.\nAnswer: 7.", "7", "7"),  # math_dapo's Minerva line
        ("\\boxed{7}" + " filler" * 60, None, None),  # the box is outside the 300-character tail
        ("7 + 5 = 12. \\boxed{12", None, "12"),  # truncated inside the box
    ],
)
def test_extract_answer_strict_and_flexible(text, strict, flexible):
    assert extract_answer(text) == strict
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so it is 0.5.", "\\frac{1}{2}", 0.0),  # strict: an unmarked number is not an answer
        ("so\nAnswer: 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("I don't know", "42", 0.0),
        ("x = \\boxed{3}", "\\boxed{3}", 1.0),
        ("It could be 3, 5 or 7", "7", 0.0),
    ],
)
def test_math_score_is_strict_by_default(response, truth, score):
    assert math_score("gsm8k", response, truth, None) == score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so it is 0.5.", "\\frac{1}{2}", 1.0),
        ("there are 1,000 of them", "1000", 1.0),
        ("It could be 3, 5 or 7", "7", 1.0),
        ("\\boxed{7} or maybe 8", "7", 1.0),  # a box still wins over a later number
    ],
)
def test_math_flexible_takes_the_last_number(response, truth, score):
    assert math_flexible_score("gsm8k", response, truth, None) == score


def test_reward_math_mode_picks_the_function():
    strict = load_config(None, ["data.train_files=[x.jsonl]", "reward.type=math"])
    flexible = load_config(None, ["data.train_files=[x.jsonl]", "reward.type=math", "reward.math_mode=flexible"])
    assert load_function(function_spec(strict.reward)) is math_score
    assert load_function(function_spec(flexible.reward)) is math_flexible_score
    with pytest.raises(Exception, match="math_mode"):
        load_config(None, ["data.train_files=[x.jsonl]", "reward.type=math", "reward.math_mode=lenient"])


def test_last_boxed_is_linear():
    """A 28 KB run of unclosed boxes took 12 s with the old per-box rescans; one pass takes milliseconds."""
    t0 = time.perf_counter()
    assert last_boxed("\\boxed{" * 4000) is None
    assert last_boxed("\\boxed{" * 4000 + "}" * 4000) == ""
    assert time.perf_counter() - t0 < 0.5


def test_exact_match_normalises_case_space_and_period():
    assert exact_match_score("x", "  Paris. ", "paris", None) == 1.0
    assert exact_match_score("x", "Lyon", ["Paris", "lyon"], None) == 1.0
    assert exact_match_score("x", "Paris France", "paris", None) == 0.0


def test_custom_function_from_a_file_and_signature_checks(tmp_path):
    (tmp_path / "r.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
        "def old(prompt, ids):\n    return 0.0\n"
    )
    assert (
        load_function(f"{tmp_path}/r.py:score")(data_source="a", solution_str="b", ground_truth="c", extra_info=None)
        == 1.0
    )
    with pytest.raises(
        ValueError, match=r"does not take \['data_source', 'solution_str', 'ground_truth', 'extra_info'\]"
    ):
        load_function(f"{tmp_path}/r.py:old")
    with pytest.raises(ValueError, match=r"has no callable 'nope'"):
        load_function(f"{tmp_path}/r.py:nope")
    with pytest.raises(ValueError, match=r"does not exist"):
        load_function(f"{tmp_path}/missing.py:score")
    assert load_function("moe_rl.reward.builtins:math_score") is math_score


REWARDS = """
import math, time
def score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise KeyError("no such field")
    if ground_truth == "nan":
        return math.nan
    if ground_truth == "hang":
        time.sleep(60)
    return {"score": float(solution_str == ground_truth), "chars": len(solution_str)}
"""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def rewarder(reward_file, tok, **reward):
    cfg = load_config(
        None,
        [
            "data.train_files=[x.jsonl]",
            "reward.type=custom",
            f"reward.function={reward_file}:score",
            "reward.num_workers=2",
            *(f"reward.{k}={v}" for k, v in reward.items()),
        ],
    )
    logged = []
    return build_rewarder(cfg, tok, log=logged.append), logged


def score(r, tok, labels, text="5"):
    prompts = [
        PromptItem(ids=[1], label=label, data_source="d", file="train.jsonl", row=k) for k, label in enumerate(labels)
    ]
    return r.score(prompts, [tok.encode(text)] * len(labels))


def test_pool_scores_in_order_with_extra_metrics(reward_file, tok):
    r, _ = rewarder(reward_file, tok)
    try:
        out = score(r, tok, ["5", "6", "5"])
        assert out.rewards == [1.0, 0.0, 1.0]
        assert out.metrics == {"reward/errors": 0.0, "reward/chars": 1.0}
    finally:
        r.close()


@pytest.mark.parametrize(
    "label, why", [("raise", "raised KeyError: 'no such field'"), ("nan", "returned a non-finite score \\(nan\\)")]
)
def test_an_error_names_file_row_and_function(reward_file, tok, label, why):
    r, _ = rewarder(reward_file, tok)
    try:
        with pytest.raises(RewardError, match=rf"reward function '.*my_rewards.py:score' {why} on train.jsonl row 1"):
            score(r, tok, ["5", label])
    finally:
        r.close()


def test_a_hung_reward_is_killed_at_the_timeout_and_zeroed_when_asked(reward_file, tok):
    r, logged = rewarder(reward_file, tok, timeout_s=2, on_error="zero")
    try:
        out = score(r, tok, ["hang", "5", "raise"])
        assert out.rewards == [0.0, 1.0, 0.0] and out.metrics["reward/errors"] == 2.0
        assert "timed out after reward.timeout_s=2 s on train.jsonl row 0" in logged[0]
        assert score(r, tok, ["5"]).rewards == [1.0]  # the killed worker was replaced
    finally:
        r.close()
