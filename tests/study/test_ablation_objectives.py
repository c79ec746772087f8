"""The objectives preset (``configs/ablation_objectives.yaml``), CI variant: its grid's first two objectives on
tiny_cpu for 2 steps through a real ``moe-rl ablate`` (one shared server), the report tabulating each objective's
clip fraction next to reward, KL k3 and flip rates."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe_rl.algo.registry import policy_loss_names
from moe_rl.config import load_config
from moe_rl.preflight import config_problems

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]
PRESET = ROOT / "configs/ablation_objectives.yaml"


BYPASS_ONLY = {"oapl"}  # the preset's comment gives its own command (correction.mode=bypass)


def test_the_preset_grid_covers_every_registered_loss_and_each_cell_passes_the_preflight():
    grid = yaml.safe_load(PRESET.read_text())["grid"]
    types = grid["loss"]["type"]
    assert sorted(types) == sorted(set(policy_loss_names()) - BYPASS_ONLY), "a registered loss.type is missing"
    assert len(grid["seeds"]) >= 3, "a learning figure is a band over >= 3 seeds"
    for loss_type in types:  # a cell the preflight refuses would fail the whole grid at its turn
        assert not config_problems(load_config(PRESET, [f"loss.type={loss_type}"])).problems, loss_type
    assert not config_problems(load_config(PRESET, ["loss.type=oapl", "correction.mode=bypass"])).problems


def test_two_objectives_on_tiny_cpu_train_and_report_their_clip_fractions(tmp_path, device):
    preset = yaml.safe_load(PRESET.read_text())
    two = preset["grid"]["loss"]["type"][:2]
    config = dict(preset, extends=str(ROOT / "configs/tiny_cpu.yaml"), grid={"loss": {"type": two}})
    (tmp_path / "objectives.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "moe_rl.cli", "ablate", str(tmp_path / "objectives.yaml"), "train.steps=2"]
    cmd += ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.minibatches_per_step=2"]
    cmd += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = list(csv.DictReader((tmp_path / "out" / "summary.csv").open()))
    cells = {f"type-{t}" for t in two}
    assert {r["cell"] for r in rows} == cells
    by_metric = {(r["cell"], r["metric"]): r for r in rows}
    for cell in cells:
        for metric in ("reward/mean", "offpolicy/kl_k3", "loss/clip_frac"):
            assert by_metric[(cell, metric)]["final"] != "", (cell, metric)
        assert by_metric[(cell, "replay/rollout_vs_dispatched/response/flip_rate")]["final"] == "0.0", "R3 is on"
    assert "loss/clip_frac" in (tmp_path / "out" / "report.md").read_text()
