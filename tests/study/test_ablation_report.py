"""Report from real metrics.jsonl files: summary.csv numbers, report.md tables, valid PNG curves."""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from moe_rl.study.report import REPORT_METRICS, read_metrics, write_report

KEYS = [k for k, _ in REPORT_METRICS]


def _write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _random_records(rng, steps: int, keys=KEYS) -> list[dict]:
    return [
        {"step": s, **{k: float(rng.normal(s * 0.1, 1.0)) for k in keys}, "loss/pg_loss": 0.0}
        for s in range(1, steps + 1)
    ]


@pytest.fixture
def three_cells(tmp_path):
    rng = np.random.default_rng(7)
    a = _random_records(rng, 6)
    b = _random_records(rng, 5)
    b_resumed = _random_records(rng, 5)[2:]  # steps 3..5 logged again after a resume: these win
    c = _random_records(rng, 4, keys=[k for k in KEYS if "flip_rate" not in k])
    c[1]["reward/mean"] = math.nan  # a NaN step is skipped, not averaged
    dirs = {
        "routing-none": _write_run(tmp_path / "runs" / "none", a),
        "routing-r2": _write_run(tmp_path / "runs" / "r2", b + b_resumed),
        "routing-r3": _write_run(tmp_path / "runs" / "r3", c),
    }
    return dirs, {"routing-none": a, "routing-r2": b[:2] + b_resumed, "routing-r3": c}


def _expected(records: list[dict], key: str) -> tuple[float | None, float | None]:
    values = [r[key] for r in sorted(records, key=lambda r: r["step"]) if key in r and not math.isnan(r[key])]
    return (values[-1], statistics.fmean(values)) if values else (None, None)


def test_summary_csv_has_final_and_mean_per_cell_and_metric(tmp_path, three_cells):
    dirs, effective = three_cells
    settings = {name: {"replay.routing": name.split("-")[1]} for name in dirs}
    write_report(dirs, tmp_path / "report", settings)
    with open(tmp_path / "report" / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 * len(KEYS)
    for row in rows:
        final, mean = _expected(effective[row["cell"]], row["metric"])
        assert json.loads(row["replay.routing"]) == row["cell"].split("-")[1]
        if final is None:
            assert (row["final"], row["mean"], row["steps"]) == ("", "", "0")
        else:
            assert float(row["final"]) == pytest.approx(final, rel=1e-12)
            assert float(row["mean"]) == pytest.approx(mean, rel=1e-12)
    r3_reward = next(r for r in rows if r["cell"] == "routing-r3" and r["metric"] == "reward/mean")
    assert r3_reward["steps"] == "3"  # 4 steps, one NaN


def test_report_md_tables_one_row_per_cell_and_links_existing_plots(tmp_path, three_cells):
    dirs, effective = three_cells
    report = write_report(dirs, tmp_path / "report")
    text = report.read_text()
    final_section = text.split("## Final value")[1].split("## Mean over steps")[0]
    rows = [line for line in final_section.splitlines() if line.startswith("| routing-")]
    assert [r.split("|")[1].strip() for r in rows] == list(dirs)
    reward_col = 1 + KEYS.index("reward/mean")
    for row in rows:
        cell = row.split("|")[1].strip()
        assert row.split("|")[1 + reward_col].strip() == f"{_expected(effective[cell], 'reward/mean')[0]:.4g}"
    links = re.findall(r"^!\[[^\]]*\]\(([^)]*)\)$", text, re.MULTILINE)
    assert len(links) == len(KEYS)
    assert all((report.parent / link).exists() for link in links)


def test_every_metric_gets_a_valid_non_trivial_png(tmp_path, three_cells):
    dirs, _ = three_cells
    write_report(dirs, tmp_path / "report")
    pngs = sorted((tmp_path / "report" / "plots").glob("*.png"))
    assert len(pngs) == len(KEYS)
    for png in pngs:
        raw = png.read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n", png
        assert len(raw) > 10_000, f"{png} is only {len(raw)} bytes"
        pixels = imread(png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300
        rgba = (pixels.reshape(-1, pixels.shape[-1])[:, :3] * 255).astype(np.uint32)
        colours = np.unique(rgba[:, 0] << 16 | rgba[:, 1] << 8 | rgba[:, 2])
        assert colours.size > 20, f"{png} looks blank ({colours.size} colours)"


def test_missing_metrics_file_and_unlogged_metric_are_noted_not_fatal(tmp_path):
    rng = np.random.default_rng(0)
    dirs = {
        "ok": _write_run(tmp_path / "ok", _random_records(rng, 3, keys=["reward/mean"])),
        "empty": tmp_path / "nope",
    }
    text = write_report(dirs, tmp_path / "report").read_text()
    assert "empty: no metrics.jsonl" in text
    assert "metric 'offpolicy/ess' was logged by no cell" in text
    assert [p.name for p in (tmp_path / "report" / "plots").glob("*.png")] == ["reward_mean.png"]


def test_torn_last_line_is_ignored_but_a_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.25}\n{"step": 3, "rew')
    assert read_metrics(path, ["reward/mean"]) == {"reward/mean": [(1, 0.5), (2, 0.25)]}
    path.write_text('{"step": 1, "reward/mean": 0.5}\nnot json\n{"step": 3, "reward/mean": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path, ["reward/mean"])
    path.write_text('{"reward/mean": 0.5}\n')
    with pytest.raises(ValueError, match="expected an integer 'step'"):
        read_metrics(path, ["reward/mean"])


def test_two_key_grid_gets_a_final_reward_pivot_with_gaps_for_missing_cells(tmp_path):
    rng = np.random.default_rng(3)
    dirs, settings, finals = {}, {}, {}
    for routing, n in [("none", 1), ("none", 4), ("r3", 1)]:  # (r3, 4) skipped: no row data
        name = f"routing-{routing}__minibatches_per_step-{n}"
        records = _random_records(rng, 3, keys=["reward/mean"])
        dirs[name] = _write_run(tmp_path / name, records)
        settings[name] = {"replay.routing": routing, "train.minibatches_per_step": n}
        finals[(routing, n)] = records[-1]["reward/mean"] + 0.0
    text = write_report(dirs, tmp_path / "report", settings).read_text()
    pivot = text.split("## Final reward: replay.routing x train.minibatches_per_step")[1].split("##")[0]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in pivot.splitlines()
        if line.startswith("| ") and "\\" not in line
    }
    assert rows == {
        "none": [f"{finals[('none', 1)]:.4g}", f"{finals[('none', 4)]:.4g}"],
        "r3": [f"{finals[('r3', 1)]:.4g}", "—"],
    }
