"""Synthetic tasks: prompts tokenize as the tokenizer says, answers are right, rewards are graded."""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.config import TrainConfig
from moe_rl.tasks.synthetic import DigitTask, build_task, load_reward_fn
from moe_rl.tasks.tokenizer import EOS_ID, build_task_tokenizer


@pytest.mark.parametrize(
    ("task", "digits", "answer"),
    [
        ("copy", [3, 1, 4], "3 1 4"),
        ("reverse", [3, 1, 4], "4 1 3"),
        ("sort", [3, 1, 4, 1], "1 1 3 4"),
        ("max", [3, 1, 4, 1], "4"),
        ("add", [3, 7, 4, 5], "8 2"),
    ],
)
def test_answers_are_correct_and_prompt_ids_match_the_tokenizer(task, digits, answer):
    tok = build_task_tokenizer(64)
    prompt = DigitTask(task, 64).make_prompt(digits)
    assert prompt.answer_text == answer
    assert prompt.ids == [tok.bos_token_id] + tok(prompt.text, add_special_tokens=False).input_ids
    assert tok.decode(prompt.answer) == answer


def test_reward_grades_format_and_accuracy():
    task = DigitTask("reverse", 64, format_weight=0.3)
    prompt = task.make_prompt([1, 2, 3])
    right, digit = prompt.answer, task.digit_ids
    assert task.score(prompt, right + [EOS_ID]) == pytest.approx(1.0)
    assert task.score(prompt, [digit[9], digit[9], digit[9], EOS_ID]) == pytest.approx(0.3)  # digits, all wrong
    assert task.score(prompt, [right[0], digit[9], digit[9]]) == pytest.approx(0.3 + 0.7 / 3)
    assert task.score(prompt, [EOS_ID]) == 0.0
    assert task.score(prompt, [40, 41, 42, 43, 44, 45]) == 0.0  # non-digits


def test_sampling_is_seeded():
    task = DigitTask("copy", 64)
    a = task.sample_prompts(5, np.random.default_rng(7))
    b = task.sample_prompts(5, np.random.default_rng(7))
    assert a == b and len({p.text for p in a}) > 1


def test_user_reward_function_is_loaded_from_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompt, response_ids):\n    return float(len(response_ids))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    _, fn = build_task(TrainConfig(task="copy", reward_fn="my_rewards:length_reward"), 64)
    assert fn(None, [1, 2, 3]) == 3.0
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        load_reward_fn("my_rewards.length_reward")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_reward_fn("my_rewards:nope")


def test_unknown_task_names_the_field():
    with pytest.raises(ValueError, match="train.task='divide' is not a known task"):
        DigitTask("divide", 64)


def test_long_tasks_vary_the_digit_count_and_need_eos_right_after_the_answer():
    task = DigitTask("copy_long", 64)
    prompts = task.sample_prompts(200, np.random.default_rng(0))
    assert {len(p.answer) for p in prompts} == set(range(7, 12))  # 8-12 tokens with the eos
    assert all(p.text.startswith("copy : ") for p in prompts)
    prompt = task.make_prompt([3, 1, 4, 1, 5, 9, 2])
    right, digit = prompt.answer, task.digit_ids
    assert task.score(prompt, right + [EOS_ID]) == pytest.approx(1.0)
    assert task.score(prompt, right) == pytest.approx(0.15 + 0.7)  # no eos: half the format credit
    assert task.score(prompt, right + [digit[0], EOS_ID]) == pytest.approx(0.15 + 0.7)  # one digit too many
    assert task.score(prompt, right[:-1] + [EOS_ID]) == pytest.approx(0.15 * 6 / 7 + 0.7 * 6 / 7)  # one short
    assert DigitTask("reverse_long", 64).make_prompt([1, 2, 3, 4, 5, 6, 7]).answer_text == "7 6 5 4 3 2 1"


def test_fixed_length_tasks_keep_their_prompt_stream():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    got = [p.text for p in DigitTask("copy", 64).sample_prompts(4, rng_a)]
    expected = ["copy : " + " ".join(map(str, rng_b.integers(0, 10, 3).tolist())) + " >" for _ in range(4)]
    assert got == expected


def test_unknown_task_names_the_field_and_the_long_variants():
    with pytest.raises(ValueError, match=r"train.task='copy_short'.*'copy_long'"):
        DigitTask("copy_short", 64)
