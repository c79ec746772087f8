"""Preflight refuses estimators whose inputs the step does not produce yet, and ``advantage.*`` keys the
chosen estimator never reads (verl's names: ``norm_adv_by_std_in_grpo``, ``gdpo_reward_keys`` /
``gdpo_reward_weights``, ``handle_zero_tail``)."""

from __future__ import annotations

import pytest

from moe_rl.algo import adv_estimator_names
from moe_rl.config import AdvantageConfig, ConfigError, dump_config, load_config
from moe_rl.config.advantage_keys import ADVANTAGE_READS, NOT_WIRED
from moe_rl.preflight import config_problems

ELSEWHERE = "expected another estimator (its function is moe_rl.algo's, callable on its own: docs/algo.md)"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["advantage.estimator=gdpo", "advantage.gdpo_reward_keys=[fmt,acc]"],
            (
                "advantage.gdpo_reward_keys=['fmt', 'acc']: per-sample reward components are not carried to the trainer "
                "yet (the reward's extra keys are only averaged into reward/<key>); expected no gdpo_reward_keys (GDPO on "
                "the one reward: whitened GRPO)"
            ),
        ),
        (
            ["advantage.estimator=grpo", "advantage.norm_adv_by_std_in_grpo=false"],
            (
                "advantage.norm_adv_by_std_in_grpo=False is ignored by advantage.estimator='grpo'; expected no "
                "advantage.norm_adv_by_std_in_grpo (only grpo_passk, gdpo read it)"
            ),
        ),
        (
            ["advantage.estimator=gpg", "advantage.handle_zero_tail=false"],
            (
                "advantage.handle_zero_tail=False is ignored by advantage.estimator='gpg'; expected no "
                "advantage.handle_zero_tail (only optimal_token_baseline, tir_optimal_token_baseline read it)"
            ),
        ),
    ],
)
def test_advantage_setting_is_refused_naming_it(overrides, message):
    assert config_problems(load_config(overrides=overrides)).problems == [message]


def test_runnable_verl_estimators_remax_and_gpg_pass(tmp_path):
    for overrides in (
        ["advantage.estimator=gpg", "loss.type=gpg"],
        ["advantage.estimator=grpo_passk", "advantage.norm_adv_by_std_in_grpo=false"],
        ["advantage.estimator=gdpo"],
        ["advantage.estimator=remax"],  # the rollout generates its greedy response per prompt
        ["advantage.estimator=optimal_token_baseline", "advantage.handle_zero_tail=false"],  # Σπ²: the learner's
        ["advantage.estimator=tir_optimal_token_baseline", "correction.mode=bypass"],  # the pass runs for it there too
    ):
        cfg = load_config(overrides=overrides)
        assert config_problems(cfg).problems == [], overrides
        dumped = tmp_path / "resolved.yaml"  # a resolved dump sets every key, the unused ones at their defaults
        dumped.write_text(dump_config(cfg))
        assert config_problems(load_config(dumped)).problems == [], overrides


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["advantage.gdpo_reward_weights=[0.5]"], "advantage.gdpo_reward_weights needs advantage.gdpo_reward_keys"),
        (
            ["advantage.gdpo_reward_keys=[a,b]", "advantage.gdpo_reward_weights=[0.5]"],
            r"advantage.gdpo_reward_weights has 1 weights, expected one per advantage.gdpo_reward_keys \(2\)",
        ),
        (["advantage.gdpo_reward_keys=[a,a]"], "advantage.gdpo_reward_keys: expected distinct keys"),
    ],
)
def test_gdpo_weights_must_match_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_the_tables_name_registered_estimators_and_config_keys():
    """ADVANTAGE_READS / NOT_WIRED name registered estimators; every estimator-specific key is listed."""
    estimators = set(adv_estimator_names())
    assert set(ADVANTAGE_READS) <= estimators and set(NOT_WIRED) <= estimators
    specific = set(AdvantageConfig.model_fields) - {"estimator", "eps"}
    assert {k for keys in ADVANTAGE_READS.values() for k in keys} == specific
