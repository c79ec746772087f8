"""The step plan: minibatches independent of dp size, ranks own disjoint shares, clear errors."""

from __future__ import annotations

import pytest

from moe_rl.train.plan import PlanError, plan_step


def test_minibatches_do_not_depend_on_the_data_parallel_size():
    one = plan_step(16, minibatches=2, micro_batch_size=3, seed=7, step=4)
    two = [plan_step(16, minibatches=2, micro_batch_size=3, dp_rank=r, dp_size=2, seed=7, step=4) for r in range(2)]
    for m in range(2):
        assert one.minibatches[m].sample_ids == two[0].minibatches[m].sample_ids == two[1].minibatches[m].sample_ids
        # the ranks' shares partition the minibatch, contiguously and in order
        assert two[0].minibatches[m].local_ids + two[1].minibatches[m].local_ids == one.minibatches[m].sample_ids
    assert sorted(i for mb in one.minibatches for i in mb.sample_ids) == list(range(16))


def test_a_rank_scores_exactly_the_samples_it_updates_on_in_every_epoch():
    plan = plan_step(12, minibatches=2, micro_batch_size=2, epochs=2, dp_rank=1, dp_size=2, seed=0, step=0)
    updated = {i for _, mb in plan.updates() for i in mb.local_ids}
    assert updated == set(plan.owned_ids)
    assert [i for m in plan.owned_microbatches for i in m] == list(plan.owned_ids)
    assert [len(m) for m in plan.minibatches[0].microbatches] == [2, 1]  # share of 3, micro_batch_size 2
    assert [e for e, _ in plan.updates()] == [0, 0, 1, 1]


def test_steps_and_seeds_shuffle_differently_and_reproducibly():
    a = plan_step(8, minibatches=2, micro_batch_size=8, seed=1, step=0)
    assert a == plan_step(8, minibatches=2, micro_batch_size=8, seed=1, step=0)
    assert a.minibatches != plan_step(8, minibatches=2, micro_batch_size=8, seed=1, step=1).minibatches


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"minibatches": 3}, "train.minibatches_per_step=3 must divide the step's 8 samples"),
        ({"minibatches": 2, "dp_size": 3, "dp_rank": 0}, "4 samples .* 3 data-parallel ranks cannot share"),
        ({"minibatches": 1, "micro_batch_size": 0}, "train.micro_batch_size must be >= 1"),
    ],
)
def test_impossible_splits_name_the_keys(kwargs, message):
    kwargs = {"micro_batch_size": 2, **kwargs}
    with pytest.raises(PlanError, match=message):
        plan_step(8, **kwargs)
