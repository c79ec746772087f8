"""Grid-level ``seeds``: one run per (cell, seed) with both seeds set, and mean ± std with bands in the report."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from moe_rl.config import ConfigError
from moe_rl.study.ablate import expand_grid
from moe_rl.study.report import write_report

REPO = Path(__file__).resolve().parents[2]
ABLATION = REPO / "configs" / "ablation_replay.yaml"


def test_seeds_give_one_run_per_cell_and_seed_with_train_and_rollout_seed_set(tmp_path):
    cells, _ = expand_grid(ABLATION, ["grid={replay.routing: [none, r3], seeds: [5, 9]}"], out_dir=tmp_path)
    got = [(c.name, c.seed, c.config.train.seed, c.config.rollout.seed) for c in cells]
    assert got == [
        ("routing-none", 5, 5, 5),
        ("routing-none", 9, 9, 9),
        ("routing-r3", 5, 5, 5),
        ("routing-r3", 9, 9, 9),
    ]
    assert [Path(c.config.train.output_dir) for c in cells] == [
        tmp_path / "routing-none" / "seed-5",
        tmp_path / "routing-none" / "seed-9",
        tmp_path / "routing-r3" / "seed-5",
        tmp_path / "routing-r3" / "seed-9",
    ]


def test_seeds_leave_the_warm_start_seed_alone_so_every_run_starts_from_the_same_policy(tmp_path):
    cells, _ = expand_grid(
        ABLATION,
        ["grid={replay.routing: [none, r3], seeds: [1, 2]}", "train.warm_start={steps: 5, seed: 3}"],
        out_dir=tmp_path,
    )
    assert {c.config.train.warm_start.model_dump_json() for c in cells} == {
        cells[0].config.train.warm_start.model_dump_json()
    }
    assert {c.config.train.warm_start.seed for c in cells} == {3}


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ("{replay.routing: [r3], seeds: []}", "grid.seeds must be a non-empty list of integers"),
        ("{replay.routing: [r3], seeds: 3}", "grid.seeds must be a non-empty list of integers"),
        ("{replay.routing: [r3], seeds: [1, one]}", "grid.seeds must be a non-empty list of integers"),
        ("{replay.routing: [r3], seeds: [1, 1]}", "distinct integers >= 0"),
        ("{replay.routing: [r3], seeds: [-1]}", "distinct integers >= 0"),
        ("{train.seed: [1, 2], seeds: [1]}", "grid.seeds sets train.seed and rollout.seed"),
    ],
)
def test_malformed_seeds_are_one_clear_error(tmp_path, grid, needle):
    with pytest.raises(ConfigError, match=needle):
        expand_grid(ABLATION, [f"grid={grid}"], out_dir=tmp_path)


def _write_run(run_dir: Path, rewards: list[float]) -> Path:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": s, "reward/mean": r, "offpolicy/kl_k3": 1e-3 * s}) for s, r in enumerate(rewards, 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_report_gives_mean_and_sample_std_over_seeds_and_bands(tmp_path):
    rng = np.random.default_rng(11)
    curves = {cell: [list(rng.uniform(0, 1, 6)) for _ in range(3)] for cell in ("routing-none", "routing-r3")}
    dirs = {
        cell: [_write_run(tmp_path / cell / f"seed-{i}", r) for i, r in enumerate(runs)]
        for cell, runs in curves.items()
    }
    dirs["single"] = _write_run(tmp_path / "single", [0.1, 0.2, 0.3])
    report = write_report(dirs, tmp_path / "report", {c: {"replay.routing": c} for c in dirs})
    rows = {(r["cell"], r["metric"]): r for r in csv.DictReader((tmp_path / "report" / "summary.csv").open())}
    for cell, runs in curves.items():
        row = rows[(cell, "reward/mean")]
        finals, means = [r[-1] for r in runs], [statistics.fmean(r) for r in runs]
        assert float(row["final"]) == pytest.approx(statistics.fmean(finals), rel=1e-12)
        assert float(row["final_std"]) == pytest.approx(statistics.stdev(finals), rel=1e-12)
        assert float(row["mean"]) == pytest.approx(statistics.fmean(means), rel=1e-12)
        assert float(row["mean_std"]) == pytest.approx(statistics.stdev(means), rel=1e-12)
        assert (row["seeds"], row["steps"]) == ("3", "6")
    single = rows[("single", "reward/mean")]
    assert (single["final"], single["final_std"], single["seeds"]) == ("0.3", "", "1")
    text = report.read_text()
    assert "mean ± std over 3 seeds" in text
    none_row = next(line for line in text.split("## Final value")[1].splitlines() if line.startswith("| routing-none"))
    finals = [r[-1] for r in curves["routing-none"]]
    assert f"{statistics.fmean(finals):.4g} ± {statistics.stdev(finals):.2g}" in none_row


def _band_pixels(png: Path) -> int:
    """Pixels that are neither white, grey nor a saturated line colour: the translucent ± std band."""
    rgb = imread(png)[..., :3]
    spread = rgb.max(axis=-1) - rgb.min(axis=-1)
    return int(((spread > 0.04) & (spread < 0.35) & (rgb.min(axis=-1) > 0.6)).sum())


def test_several_seeds_draw_a_band_one_seed_does_not(tmp_path):
    rng = np.random.default_rng(2)
    many = {"cell": [_write_run(tmp_path / "m" / f"s{i}", list(rng.uniform(0, 1, 8))) for i in range(3)]}
    one = {"cell": [_write_run(tmp_path / "o", list(rng.uniform(0, 1, 8)))]}
    write_report(many, tmp_path / "rm")
    write_report(one, tmp_path / "ro")
    assert (
        _band_pixels(tmp_path / "rm" / "plots" / "reward_mean.png")
        > 5 * _band_pixels(tmp_path / "ro" / "plots" / "reward_mean.png") + 1000
    )
