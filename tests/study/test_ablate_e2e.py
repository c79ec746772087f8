"""A real 2-cell ablation: one shared SGLang server, real Megatron-Core training per cell, report files."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]


def test_two_cell_grid_trains_both_cells_on_one_server_and_reports(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "ablate",
        str(ROOT / "configs/ablation_replay.yaml"),
        "grid={replay.routing: [none, r3]}",
        "train.steps=2",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "train.minibatches_per_step=2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list((tmp_path / "logs").glob("sglang_*.log"))) == 1  # one server for the whole grid
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    cells = {r["cell"] for r in rows}
    assert cells == {"routing-none", "routing-r3"}
    flips = {
        r["cell"]: float(r["final"]) for r in rows if r["metric"] == "replay/rollout_vs_natural/response/flip_rate"
    }
    assert set(flips) == cells  # the routing=none baseline logs its flip rate too
    # same seeds, same initial weights synced into the same server: both cells see the same first rollout
    first = {c: json.loads((tmp_path / c / "metrics.jsonl").read_text().splitlines()[0]) for c in cells}
    assert first["routing-none"]["reward/mean"] == first["routing-r3"]["reward/mean"]
    assert first["routing-r3"]["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0
    assert (tmp_path / "report.md").read_text().count("routing-") >= 2
    assert len(list((tmp_path / "plots").glob("*.png"))) >= 3
