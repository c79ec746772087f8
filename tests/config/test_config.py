"""Experiment config: YAML round trip, extends, overrides and every rejection with its message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moe_rl.config import ConfigError, dump_config, load_config, save_config, validate_tree


def write(path, text):
    path.write_text(text)
    return path


def test_default_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(overrides=["replay.routing=r3", "precision.fp8={format: hybrid, recipe: delayed}"])
    path = save_config(cfg, tmp_path / "c.yaml")
    again = load_config(path)
    assert again == cfg
    assert dump_config(again) == path.read_text()


def test_extends_chain_merges_sections_and_child_wins(tmp_path):
    write(tmp_path / "base.yaml", "model:\n  num_layers: 4\n  hidden_size: 32\ntrain:\n  steps: 7\n")
    write(tmp_path / "mid.yaml", "extends: base.yaml\nmodel:\n  hidden_size: 48\n")
    child = write(tmp_path / "child.yaml", "extends: [mid.yaml]\ntrain:\n  seed: 3\n")
    cfg = load_config(child, ["train.steps=9"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps, cfg.train.seed) == (4, 48, 9, 3)


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(
        overrides=[
            "model.moe_layer_freq=[0,1]",
            "rollout.addresses=[http://a:1, http://b:2]",
            "correction.opsm_delta=null",
            "rollout.top_p=0.9",
        ]
    )
    assert cfg.model.moe_layer_freq == [0, 1]
    assert cfg.rollout.addresses == ["http://a:1", "http://b:2"]
    assert cfg.correction.opsm_delta is None and cfg.rollout.top_p == 0.9


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.hidden_sise=64"], "unknown key 'model.hidden_sise'"),
        (["bogus.x=1"], "unknown key 'bogus'"),
        (["replay.routing=r4"], "replay.routing='r4' is not allowed; expected one of 'none', 'r2' or 'r3'"),
        (["model.num_layers=two"], "model.num_layers: Input should be a valid integer"),
        (["replay.routing=r2", "correction.mode=bypass"], "replay.routing='r2'"),
        (["model.moe_router_topk=9"], "model.moe_router_topk=9 must be <= model.num_moe_experts=8"),
        (["parallel.ep=3"], "parallel.ep=3 must divide model.num_moe_experts=8"),
        (["parallel.tp=3"], "parallel.tp=3 must divide"),
        (["model.num_query_groups=3"], "model.num_query_groups=3 must divide"),
        (["replay.routing=r3", "model.moe_router_fusion=true"], "moe_router_fusion=true bypasses router replay"),
        (["replay.routing=r3", "model.moe_router_load_balancing_type=sinkhorn"], "sinkhorn"),
        (["replay.routing=r3", "model.moe_expert_capacity_factor=1.0"], "moe_expert_capacity_factor"),
        (["model.moe_layer_freq=[1,0,1]"], "model.moe_layer_freq has 3 entries"),
        (["model.first_k_dense_layers=2"], "model has no MoE layer"),
        (["model.moe_router_num_groups=4"], "must be set together"),
        (["model.moe_router_enable_expert_bias=true"], "requires model.moe_router_score_function='sigmoid'"),
        (["correction.icepop_low=3", "correction.icepop_high=2"], "correction.icepop_low=3.0 must be <"),
        (["correction.rs_mode=seq_mean_k1"], "correction.rs_upper is required"),
        (["correction.rs_mode=token_k1", "correction.rs_upper=2"], "correction.rs_lower is required"),
        (["correction.rs_mode=token_k9", "correction.rs_upper=2"], "correction.rs_mode='token_k9' is not allowed"),
        (["train.minibatches_per_step=3"], "train.minibatches_per_step=3 must divide the rollout batch"),
        (["rollout.top_p=1.5"], "rollout.top_p: Input should be less than or equal to 1"),
        (["loss.type=ppo"], "loss.type='ppo' is not allowed"),
        (["precision.fp8={format: e5m2}"], "precision.fp8.format='e5m2' is not allowed"),
        (["loss.type=gmpo", "loss.aggregation=token_mean"], "loss.aggregation='token_mean' with loss.type='gmpo'"),
    ],
)
def test_bad_config_is_rejected_with_dotted_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value)


def test_malformed_yaml_names_the_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "model: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML in .*bad.yaml"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path / "list.yaml", "- a\n- b\n"))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(overrides=["model.num_layers"])


def test_moe_layer_pattern_combines_freq_and_first_dense():
    cfg = load_config(overrides=["model.num_layers=6", "model.moe_layer_freq=2", "model.first_k_dense_layers=1"])
    assert cfg.model.moe_layer_pattern() == [0, 0, 1, 0, 1, 0]
    assert cfg.model.num_moe_layers == 2


def test_shipped_configs_validate():
    configs = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
    assert {"tiny_cpu.yaml", "ablation_replay.yaml"} <= {p.name for p in configs}
    for path in configs:
        cfg = load_config(path)
        assert load_config(overrides=[f"{k}={v}" for k, v in _flat(yaml.safe_load(dump_config(cfg)))]) == cfg


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "grid":  # grid keys are dotted names themselves
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_gspo_gets_sequence_level_defaults_unless_set():
    cfg = load_config(overrides=["loss.type=gspo_token"])
    assert (cfg.loss.aggregation, cfg.loss.clip_low, cfg.loss.clip_high) == ("seq_mean_token_mean", 3e-4, 4e-4)
    assert load_config(overrides=["loss.type=gspo", "loss.clip_low=0.001"]).loss.clip_low == 0.001
    ppo = load_config(overrides=["loss.type=ppo_clip"]).loss
    assert (ppo.aggregation, ppo.clip_low, ppo.clip_high) == ("token_mean", 0.2, 0.28)
    gspo = load_config(overrides=["loss.type=gspo"])
    assert validate_tree(yaml.safe_load(dump_config(gspo))) == gspo  # the filled-in defaults round-trip
