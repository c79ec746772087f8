"""``moe-rl diagnose --attribute``'s plumbing: which kernels each row turns on, on each side, and its table.

The rows themselves need a server per row (minutes); docs/findings.md holds the cpu_midsize table they gave.
Here: the contract's items reach the learner's modules and the server's environment one by one, and the
table's "removed" shares are the ones worked out by hand.
"""

from __future__ import annotations

import pytest
from megatron.core.transformer.moe.router import TopKRouter

from moe_rl.config import ConfigError
from moe_rl.config.kernels import KERNELS
from moe_rl.exact.contract import SERVER_ENV, kernels_from_env, kernels_of, server_env_value
from moe_rl.learner.exact_spec import (
    ExactColumnParallelLinear,
    ExactCoreAttention,
    ExactRMSNorm,
    ExactRowParallelLinear,
)
from moe_rl.learner.logprobs import uses_exact
from moe_rl.learner.model import build_model
from moe_rl.rollout.server_spec import ServerSpec, server_env
from moe_rl.study.attribute import _check_exact_settings, attribution_rows, render_table
from tests.learner.conftest import make_cfg

ALL = frozenset(KERNELS)


def _cfg(kernels=None, on=True):
    cfg = make_cfg(init_method_std=0.1)
    return cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"true_on_policy": on, "true_on_policy_kernels": kernels})}
    )


def test_rows_are_stock_each_item_alone_each_item_left_out_and_all():
    rows = dict(attribution_rows(["lm_head", "router"]))
    assert list(rows) == ["stock", "+lm_head", "+router", "-lm_head", "-router", "all"]
    assert rows["stock"] is None and rows["all"] == ALL
    assert rows["+router"] == {"router"} and rows["-router"] == ALL - {"router"}
    assert len(attribution_rows()) == 2 * len(KERNELS) + 2


def test_the_config_names_the_items_and_the_server_gets_only_a_subset():
    assert kernels_of(_cfg(on=False).rollout) == frozenset() and kernels_of(_cfg().rollout) == ALL
    assert kernels_of(_cfg(["router", "lm_head"]).rollout) == {"router", "lm_head"}
    env = server_env(ServerSpec.from_rollout_config(_cfg(["router", "lm_head"]).rollout, "/m"), base={})
    assert env["MOE_RL_TRUE_ON_POLICY"] == "1" and env[SERVER_ENV] == "lm_head,router"
    assert kernels_from_env(env[SERVER_ENV]) == {"lm_head", "router"}
    whole = server_env(ServerSpec.from_rollout_config(_cfg().rollout, "/m"), base={SERVER_ENV: "linear"})
    assert SERVER_ENV not in whole and kernels_from_env(whole.get(SERVER_ENV)) == ALL  # unset = all
    assert server_env_value(ALL) is None
    with pytest.raises(ValueError, match=f"{SERVER_ENV}: unknown kernel"):
        kernels_from_env("lm_head,lmhead")


@pytest.mark.parametrize("kernels", [["lm_head"], ["attention", "rmsnorm"], ["linear", "router", "log_softmax"]])
def test_the_learner_shares_exactly_the_named_items(megatron_world, kernels):
    model = build_model(_cfg(kernels))
    types = {type(m) for m in model.modules()}
    on = set(kernels)
    assert ({ExactColumnParallelLinear, ExactRowParallelLinear} <= types) == ("linear" in on)
    assert (ExactCoreAttention in types) == ("attention" in on)
    assert (ExactRMSNorm in types) == ("rmsnorm" in on)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(("gating" in vars(r)) == ("router" in on) for r in routers)
    assert ("forward" in vars(model.output_layer)) == ("lm_head" in on)
    assert uses_exact(model) == ("log_softmax" in on)
    assert (model.config.activation_func.__module__ == "moe_rl.exact.kernels") == ("activation" in on)


def test_attribute_refuses_a_config_that_cannot_be_exact():
    cfg = _cfg(on=False)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dtype": "bfloat16"})})
    with pytest.raises(ConfigError, match="rollout.dtype='bfloat16' with precision.params_dtype='float32'"):
        _check_exact_settings(cfg)
    with pytest.raises(ConfigError, match=r"diagnose --kernels: unknown item\(s\) \['lmhead'\]"):
        _check_exact_settings(_cfg(on=False), ["lm_head", "lmhead"])
    given = _cfg(on=False)
    given = given.model_copy(update={"rollout": given.rollout.model_copy(update={"addresses": ["http://h:1"]})})
    with pytest.raises(ConfigError, match=r"one server per row .* rollout.addresses=\['http://h:1'\]"):
        _check_exact_settings(given)


def test_the_table_gives_each_rows_share_of_the_stock_mismatch():
    def row(kl, dmax, dmean, fp, fr):
        return {
            "kl_k3": kl,
            "dlogp_max": dmax,
            "dlogp_mean": dmean,
            "flip_prompt": fp,
            "flip_response": fr,
            "tokens": 100,
        }

    numbers = {
        "config": {
            "rollout.dtype": "bfloat16",
            "precision.params_dtype": "bfloat16",
            "prompts": 4,
            "samples_per_prompt": 8,
        },
        "rows": {
            "stock": row(4e-6, 0.02, 1e-3, 0.04, 0.05),
            "+router": row(1e-6, 0.02, 5e-4, 0.01, 0.0625),
            "-router": row(3e-6, 0.01, 2.5e-4, 0.0, 0.05),
            "all": row(0.0, 0.0, 0.0, 0.0, 0.0),
        },
    }
    lines = render_table(numbers).splitlines()
    assert "| `router` alone | 1e-06 (75%) | 0.02 (0%) | 0.0005 (50%) | 0.01 (75%) | 0.0625 (-25%) | 100 |" in lines
    assert "| all but `router` | 3e-06 (25%) | 0.01 (50%) | 0.00025 (75%) | 0 (100%) | 0.05 (0%) | 100 |" in lines
    assert "| all (true-on-policy) | 0 (100%) | 0 (100%) | 0 (100%) | 0 (100%) | 0 (100%) | 100 |" in lines
    assert lines[2].startswith("| kernels on | KL k3 | max \\|Δlogp\\| |")
