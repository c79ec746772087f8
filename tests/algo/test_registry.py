"""The loss and estimator registries agree with the config's allowed values, which the config keeps itself.

``moe_rl.config`` does not import ``moe_rl.algo``: its ``loss.type`` / ``advantage.estimator`` Literals and the
preflight's table of the keys each loss reads (``config/loss_keys.py``) are its own copies. These tests are what
keep the copies equal to the registries, in both directions.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from moe_rl.algo import (
    ADVANTAGE_ESTIMATORS,
    LOSS_TYPES,
    LossInputs,
    PPOClipParams,
    adv_estimator_names,
    compute_advantages,
    get_adv_estimator,
    get_adv_estimator_fn,
    get_loss,
    get_policy_loss_fn,
    policy_loss_names,
    ppo_clip_loss,
    register_adv_est,
    register_policy_loss,
)
from moe_rl.config import AdvantageConfig, LossConfig
from moe_rl.config.loss_keys import READS


def _literal(model, field: str) -> tuple[str, ...]:
    return typing.get_args(model.model_fields[field].annotation)


def _differences(registered, allowed) -> str:
    return (
        f"registered but not allowed by the config: {sorted(set(registered) - set(allowed))}; "
        f"allowed by the config but not registered: {sorted(set(allowed) - set(registered))}"
    )


def test_registered_losses_are_exactly_the_config_loss_types():
    config_types = _literal(LossConfig, "type")
    assert set(policy_loss_names()) == set(config_types), _differences(policy_loss_names(), config_types)
    assert len(policy_loss_names()) == len(config_types) and set(LOSS_TYPES) == set(config_types)
    assert set(READS) == set(config_types)


def test_registered_estimators_are_exactly_the_config_estimators():
    config_estimators = _literal(AdvantageConfig, "estimator")
    assert set(adv_estimator_names()) == set(config_estimators), _differences(adv_estimator_names(), config_estimators)
    assert len(adv_estimator_names()) == len(config_estimators)
    assert set(ADVANTAGE_ESTIMATORS) == set(config_estimators)


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_each_hyper_parameter_model_reads_the_keys_the_preflight_lists(name):
    """A loss's hyper-parameter fields are the ``loss.*`` keys it reads: preflight's READS table names the same."""
    fields = {f.name for f in dataclasses.fields(get_policy_loss_fn(name).params)}
    assert fields == set(READS[name])
    assert set(LossConfig.model_fields) >= fields  # every field is a config key


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_params_from_a_config_take_its_values(name):
    cfg = LossConfig(type=name)
    params = get_policy_loss_fn(name).params.from_config(cfg)
    assert all(getattr(params, f.name) == getattr(cfg, f.name) for f in dataclasses.fields(params))


def test_unknown_names_and_duplicates_are_refused():
    with pytest.raises(ValueError, match=r"loss.type: expected one of \('ppo_clip', .*got 'ppo'"):
        get_policy_loss_fn("ppo")
    with pytest.raises(ValueError, match=r"advantage.estimator: expected one of \('grpo', .*got 'gae'"):
        compute_advantages(AdvantageConfig.model_construct(estimator="gae", eps=1e-6), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="loss.type 'ppo_clip': already registered by ppo_clip_loss"):
        register_policy_loss("ppo_clip", PPOClipParams)(lambda x, p: (x.logp, {}))
    with pytest.raises(ValueError, match="advantage.estimator 'grpo': already registered"):
        register_adv_est("grpo")(lambda x, cfg: x.rewards)


def test_aliases_and_the_registered_callable():
    assert get_loss is get_policy_loss_fn and get_adv_estimator is get_adv_estimator_fn
    assert get_loss("ppo_clip") is ppo_clip_loss and ppo_clip_loss.__name__ == "ppo_clip_loss"
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="old_logp: loss 'ppo_clip' is a ratio to the anchor"):
        ppo_clip_loss(LossInputs(torch.zeros(1, 2), None, torch.ones(1), mask))
