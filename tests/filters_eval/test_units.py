"""Dynamic sampling, overlong shaping, pass@k and the task stream's rounds, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_rl.data.stream import TaskStream
from moe_rl.reward.shaping import overlong_penalties
from moe_rl.source.evaluate import pass_at_k
from moe_rl.source.filters import FilterError, GroupRound, collect_groups, informative_groups
from moe_rl.tasks.synthetic import DigitTask


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 1, 2, 1 - math.comb(3, 2) / math.comb(4, 2)),  # 0.5
        (5, 2, 3, 1 - math.comb(3, 3) / math.comb(5, 3)),  # 0.9
        (4, 0, 1, 0.0),
        (4, 4, 4, 1.0),
        (4, 1, 1, 0.25),
        (8, 3, 4, 1 - math.comb(5, 4) / math.comb(8, 4)),
        (4, 2, 3, 1.0),  # n - c < k: every draw of 3 holds a correct one
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 1)


def test_overlong_penalty_is_dapo_soft_punishment():
    # verl reward_manager/dapo.py: expected = 16 - 4 = 12; min(-(L - 12) / 4 * 0.5, 0)
    got = overlong_penalties([3, 12, 13, 14, 16], max_new_tokens=16, buffer=4, penalty=0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="reward.overlong_buffer.length=20"):
        overlong_penalties([1], max_new_tokens=16, buffer=20, penalty=1.0)


def test_informative_groups_are_those_with_unequal_rewards():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5, 0, 0], 2).tolist() == [False, True, False, False]


def _rounds(reward_rounds, n=2):
    """generate(r): prompts 'r.g', samples 's.r.g.j', the given rewards."""

    def generate(r):
        rewards = reward_rounds[r]
        groups = len(rewards) // n
        return GroupRound(
            [f"{r}.{g}" for g in range(groups)],
            [f"s.{r}.{g}.{j}" for g in range(groups) for j in range(n)],
            list(rewards),
        )

    return generate


ROUNDS = [[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0.2, 0.4, 0, 0, 1, 1]]


def test_dynamic_sampling_keeps_informative_groups_in_order_and_counts_rounds():
    got = collect_groups(_rounds(ROUNDS), want=3, group_size=2, max_rounds=5)
    assert got.prompts == ["0.1", "1.0", "1.2"] and got.samples[:2] == ["s.0.1.0", "s.0.1.1"]
    assert got.rewards == [0, 1, 0, 1, 1, 0]
    assert got.rounds == 2 and got.groups_seen == 6 and got.groups_informative == 3 and got.groups_filled == 0
    assert got.metrics()["filter/informative_frac"] == pytest.approx(0.5)


def test_dynamic_sampling_fails_naming_rounds_and_fraction_or_falls_back():
    with pytest.raises(
        FilterError,
        match=r"1 informative groups of 3 \(33%\) after train.max_generation_rounds=1 rounds; "
        r"3 are needed",
    ):
        collect_groups(_rounds(ROUNDS), want=3, group_size=2, max_rounds=1)
    got = collect_groups(_rounds(ROUNDS), want=3, group_size=2, max_rounds=1, fallback=True)
    assert got.prompts == ["0.1", "0.0", "0.2"] and got.groups_filled == 2  # dropped groups in generation order
    assert len(got.samples) == 6 and got.metrics()["filter/fallback_groups"] == 2


def test_task_stream_round_zero_is_todays_draw_and_later_rounds_differ():
    task = DigitTask("copy", 64)
    stream = TaskStream(task, seed=1234)
    today = task.sample_prompts(4, np.random.default_rng([1234, 7]))
    assert [p.ids for p in stream.next_prompts(7, 4)] == [p.ids for p in today]
    assert [p.ids for p in stream.next_prompts(7, 4, round=1)] != [p.ids for p in today]
    assert [p.ids for p in stream.next_prompts(7, 4, round=1)] == [p.ids for p in stream.next_prompts(7, 4, round=1)]
