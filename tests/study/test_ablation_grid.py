"""Grid expansion: default grid, YAML/override grid forms, invalid cells skipped, per-cell dirs, same seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moe_rl.config import ConfigError, load_config
from moe_rl.study.ablate import expand_grid, parse_grid

REPO = Path(__file__).resolve().parents[2]
ABLATION = REPO / "configs" / "ablation_replay.yaml"
TINY = REPO / "configs" / "tiny_cpu.yaml"


def _config_with(tmp_path: Path, extra: dict) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"extends": str(TINY), **extra}, sort_keys=False))
    return path


def test_default_grid_is_routing_times_minibatches_with_one_dir_per_cell(tmp_path):
    cells, out = expand_grid(ABLATION, out_dir=tmp_path / "abl")
    assert out == tmp_path / "abl"
    got = [(c.config.replay.routing, c.config.train.minibatches_per_step) for c in cells]
    assert got == [(r, n) for r in ("none", "r2", "r3") for n in (1, 2, 4)]
    assert len({c.config.train.output_dir for c in cells}) == 9
    for c in cells:
        assert Path(c.config.train.output_dir) == tmp_path / "abl" / c.name
    assert cells[5].name == "routing-r2__minibatches_per_step-4"


def test_every_cell_keeps_the_base_seeds_and_non_grid_settings(tmp_path):
    base = load_config(ABLATION)
    cells, _ = expand_grid(ABLATION, out_dir=tmp_path)
    for c in cells:
        assert (c.config.train.seed, c.config.rollout.seed) == (base.train.seed, base.rollout.seed)
        assert c.config.loss.type == base.loss.type and c.config.train.steps == base.train.steps


def test_default_out_dir_is_under_the_base_output_dir():
    _, out = expand_grid(ABLATION)
    assert out == Path(load_config(ABLATION).train.output_dir) / "ablation"


def test_r2_with_bypass_cells_are_skipped_with_the_schema_reason(tmp_path):
    cells, _ = expand_grid(ABLATION, ["correction.mode=bypass"], out_dir=tmp_path)
    skipped = [c for c in cells if c.skip_reason]
    assert [c.settings["replay.routing"] for c in skipped] == ["r2"] * 3
    assert all("bypass" in c.skip_reason and c.config is None for c in skipped)
    assert sum(c.config is not None for c in cells) == 6


def test_nested_and_dotted_grid_forms_expand_identically(tmp_path):
    dotted = _config_with(tmp_path, {"grid": {"loss.type": ["ppo_clip", "gspo"], "correction.icepop": [True, False]}})
    cells_a, _ = expand_grid(dotted, out_dir=tmp_path / "a")
    nested = _config_with(
        tmp_path, {"grid": {"loss": {"type": ["ppo_clip", "gspo"]}, "correction": {"icepop": [True, False]}}}
    )
    cells_b, _ = expand_grid(nested, out_dir=tmp_path / "a")
    assert (
        [c.name for c in cells_a]
        == [c.name for c in cells_b]
        == [
            "type-ppo_clip__icepop-on",
            "type-ppo_clip__icepop-off",
            "type-gspo__icepop-on",
            "type-gspo__icepop-off",
        ]
    )
    assert [(c.config.loss.type, c.config.correction.icepop) for c in cells_a] == [
        ("ppo_clip", True),
        ("ppo_clip", False),
        ("gspo", True),
        ("gspo", False),
    ]


def test_grid_given_whole_on_the_command_line_replaces_the_yaml_grid(tmp_path):
    cells, _ = expand_grid(ABLATION, ["grid={replay.routing: [none, r3]}"], out_dir=tmp_path)
    assert [c.name for c in cells] == ["routing-none", "routing-r3"]


def test_clashing_leaf_names_fall_back_to_full_keys(tmp_path):
    cells, _ = expand_grid(ABLATION, ["grid={train.seed: [1], rollout.seed: [2, 3]}"], out_dir=tmp_path)
    assert [c.name for c in cells] == ["train_seed-1__rollout_seed-2", "train_seed-1__rollout_seed-3"]
    assert [c.config.rollout.seed for c in cells] == [2, 3]


def test_checkpoint_dir_is_moved_into_each_cell(tmp_path):
    cells, _ = expand_grid(
        ABLATION, ["checkpoint.dir=/shared/ckpt", "grid={replay.routing: [none, r3]}"], out_dir=tmp_path
    )
    assert [c.config.checkpoint.dir for c in cells] == [
        str(tmp_path / n / "checkpoints") for n in ("routing-none", "routing-r3")
    ]


def test_optional_section_fields_are_valid_grid_keys():
    assert parse_grid({"precision.fp8.recipe": ["blockwise", "tensorwise"]}) == {
        "precision.fp8.recipe": ["blockwise", "tensorwise"]
    }


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ({"replay.routnig": ["r3"]}, "'replay.routnig' is not a config field"),
        ({"replay": ["r3"]}, "whole section"),
        ({"name.x": ["a"]}, "'name' is not a section"),
        ({"replay.routing": "r3"}, "grid.replay.routing must be a non-empty list"),
        ({"replay.routing": []}, "non-empty list"),
        ({"replay.routing": ["r3", "r3"]}, "value twice"),
        ({"replay.routing": ["r3"], "replay": {"routing": ["r2"]}}, "given twice"),
        ([1, 2], "non-empty mapping"),
    ],
)
def test_malformed_grid_is_one_clear_error(grid, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_grid(grid)
