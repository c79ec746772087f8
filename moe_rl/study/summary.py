"""The closing summary ``moe-rl train`` prints: what the run did and where its outputs are.

Owns reading a finished run directory (``metrics.jsonl``, ``checkpoints/``, ``rollouts/``,
``hf/current``, ``tensorboard/``), drawing its curves into ``<run>/report/plots/`` (through
``moe_rl.study.report.write_report``, so one run reads like a one-cell ablation) and formatting a
short text: reward first -> last, rollout-vs-learner KL and router flip rate, paths, and the
TensorBoard command. It only reads what the trainer wrote; it computes no training quantity.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_rl.study.report import METRICS_FILE, read_metrics, write_report

__all__ = ["SUMMARY_METRICS", "closing_summary", "print_closing_summary"]

# (metrics.jsonl key, label, format) in print order; the loop's response-token flip metrics come
# first, then the keys runs from before the moe_rl.train loop logged (a run has one or the other).
SUMMARY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "mean reward", ".3f"),
    ("response/len_mean", "mean response length (tokens)", ".1f"),
    ("offpolicy/kl_k3", "KL k3 rollout vs learner", ".2e"),
    ("alarm/kl_k3", "KL k3 of steps NOT trained on (kl alarm)", ".2e"),
    ("replay/rollout_vs_natural/response/flip_rate", "router flip rate rollout vs learner", ".2%"),
    ("replay/rollout_vs_dispatched/response/flip_rate", "router flip rate rollout vs dispatched", ".2%"),
    ("replay/rollout_vs_natural/response/tokens_with_flip", "tokens with >= 1 flipped layer", ".2%"),
    ("replay/rollout_vs_natural/flip_rate", "router flip rate rollout vs learner", ".2%"),
    ("replay/rollout_vs_applied/flip_rate", "router flip rate rollout vs applied (replay)", ".2%"),
)


def _first_last(series: list[tuple[int, float]], fmt: str) -> str:
    (s0, v0), (s1, v1) = series[0], series[-1]
    best = max(v for _, v in series)
    text = f"{v0:{fmt}} (step {s0}) -> {v1:{fmt}} (step {s1})"
    return text + (f", max {best:{fmt}}" if len(series) > 2 else "")


def _eval_metrics(metrics_path: Path) -> list[tuple[str, str, str]]:
    """The eval section's pass@k and reward keys present in ``metrics.jsonl`` (names depend on the eval sets)."""

    keys = set()
    for line in metrics_path.read_text().splitlines():
        if '"eval/' in line:
            keys |= {
                k for k in json.loads(line) if k.startswith("eval/") and ("/pass@" in k or k.endswith("/reward_mean"))
            }
    return [(k, f"eval {k[len('eval/') :]}", ".3f") for k in sorted(keys)]


def closing_summary(run_dir: str | Path, plots: bool = True) -> str:
    """Text summary of the run in ``run_dir``; draws ``<run_dir>/report/plots/*.png`` first when ``plots``."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        return f"run {run_dir}: no {METRICS_FILE} (no step finished)"
    shown = list(SUMMARY_METRICS) + _eval_metrics(metrics_path)
    data = read_metrics(metrics_path, [k for k, _, _ in shown])
    steps = max((s for series in data.values() for s, _ in series), default=0)
    lines = [f"== moe-rl train: {steps} step(s) in {run_dir}"]
    width = max(len(label) for _, label, _ in shown)
    for key, label, fmt in shown:
        if data[key]:
            lines.append(f"  {label:<{width}}  {_first_last(data[key], fmt)}")
    lines.append(f"  metrics          {metrics_path}")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if ckpts:
        lines.append(f"  checkpoints      {run_dir / 'checkpoints'} ({', '.join(ckpts)})")
    records = sorted((run_dir / "rollouts").glob("step_*.safetensors"))
    if records:
        lines.append(
            f"  rollout records  {run_dir / 'rollouts'} ({len(records)} files; `moe-rl records inspect {records[-1]}`)"
        )
    if (run_dir / "hf" / "current").exists():
        lines.append(f"  HF weights       {run_dir / 'hf' / 'current'}")
    if plots:
        report = write_report({run_dir.name: run_dir}, run_dir / "report")
        lines.append(f"  plots            {report.parent / 'plots'} (and {report})")
    if (run_dir / "tensorboard").exists():
        lines.append(f"  TensorBoard      tensorboard --logdir {run_dir / 'tensorboard'}")
    return "\n".join(lines)


def print_closing_summary(run_dir: str | Path) -> None:
    """Print ``closing_summary`` once per job (rank 0 of a torchrun launch)."""
    if os.environ.get("RANK", "0") == "0":
        print(closing_summary(run_dir), flush=True)
