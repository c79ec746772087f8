"""Ablation report: read each cell's ``metrics.jsonl``, write ``summary.csv``, ``report.md`` and PNG curves.

Owns metric parsing (last record wins for a repeated step, e.g. after a resume), the final/mean
summary and the plots. It knows nothing about grids or training; ``ablate.py`` calls it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# (metrics.jsonl key, label) of every metric the report tabulates and plots, in column order.
REPORT_METRICS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("offpolicy/kl_k3", "KL k3 rollout vs learner"),
    ("replay/rollout_vs_natural/response/flip_rate", "router flip rate rollout vs learner"),
    ("replay/rollout_vs_dispatched/response/flip_rate", "router flip rate rollout vs dispatched"),
    ("icepop/masked_frac", "IcePop masked fraction"),
    ("offpolicy/ess", "ESS"),
    ("time/step_s", "step time (s)"),
)
METRICS_FILE = "metrics.jsonl"

Series = list[tuple[int, float]]  # (step, value), ascending steps


def read_metrics(path: str | Path, keys: Sequence[str]) -> dict[str, Series]:
    """Per key, the ``(step, value)`` series of a metrics.jsonl file (non-finite and missing values skipped).

    A record's ``step`` must be an int. A repeated step keeps its last record. An unparseable last
    line without a trailing newline (a writer killed mid-line) is ignored; any other bad line raises
    ``ValueError`` naming ``path:line``.
    """
    path = Path(path)
    text = path.read_text()
    lines = text.split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                continue  # torn final line
            raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}:{lineno}: expected an integer 'step', got {step!r}")
        by_step[step] = record
    out: dict[str, Series] = {key: [] for key in keys}
    for step in sorted(by_step):
        for key in keys:
            value = by_step[step].get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[key].append((step, float(value)))
    return out


def summarize(series: Series) -> tuple[float | None, float | None]:
    """``(value at the last step, mean over steps)``; ``(None, None)`` for an empty series."""
    if not series:
        return None, None
    return series[-1][1], math.fsum(v for _, v in series) / len(series)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


def _write_atomic(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def _plot(key: str, label: str, curves: Mapping[str, Series], path: Path) -> None:
    """One PNG: ``label`` against step, one line per cell."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on savefig
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for cell, series in curves.items():
        ax.plot([s for s, _ in series], [v for _, v in series], marker="o" if len(series) < 30 else None,
                markersize=3, linewidth=1.4, label=cell)  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(f"{label} ({key})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _write_atomic(path, buf.getvalue())


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _pivot(grid_keys: list[str], settings: Mapping[str, Mapping[str, Any]], finals: Mapping[str, float | None],
           label: str) -> list[str]:  # fmt: skip
    """Final ``label`` laid out as grid key 1 (rows) x grid key 2 (columns), e.g. routing x N (seed 001)."""
    rk, ck = grid_keys
    cells = [c for c in finals if c in settings]
    rows = list(dict.fromkeys(str(settings[c][rk]) for c in cells))  # grid order
    cols = list(dict.fromkeys(str(settings[c][ck]) for c in cells))
    table = {(str(settings[c][rk]), str(settings[c][ck])): finals[c] for c in cells}
    body = [[r, *(_fmt(table.get((r, col))) for col in cols)] for r in rows]
    return [f"## Final {label}: {rk} x {ck}", "", *_md_table([f"{rk} \\ {ck}", *cols], body), ""]


def write_report(
    cell_run_dirs: Mapping[str, str | Path],
    out_dir: str | Path,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    notes: Sequence[str] = (),
    metrics: Sequence[tuple[str, str]] = REPORT_METRICS,
) -> Path:
    """Write ``summary.csv``, ``plots/<metric>.png`` and ``report.md`` into ``out_dir``; return report.md.

    ``cell_run_dirs``: cell name -> run directory holding ``metrics.jsonl``. ``settings``: cell name ->
    its grid values (dotted key -> value), shown as columns. ``summary.csv`` is long-format, one row
    per (cell, metric): ``cell, <grid keys>, metric, final, mean, steps``.
    """
    out_dir = Path(out_dir)
    settings = settings or {}
    keys = [k for k, _ in metrics]
    grid_keys = list(dict.fromkeys(k for s in settings.values() for k in s))
    notes = list(notes)
    data: dict[str, dict[str, Series]] = {}
    for cell, run_dir in cell_run_dirs.items():
        path = Path(run_dir) / METRICS_FILE
        if path.exists():
            data[cell] = read_metrics(path, keys)
        else:
            notes.append(f"{cell}: no {METRICS_FILE} in {run_dir}")
            data[cell] = {k: [] for k in keys}

    summary = {cell: {k: summarize(series[k]) for k in keys} for cell, series in data.items()}
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["cell", *grid_keys, "metric", "final", "mean", "steps"])
    for cell in data:
        grid_vals = [json.dumps(settings.get(cell, {}).get(k)) for k in grid_keys]
        for k in keys:
            final, mean = summary[cell][k]
            writer.writerow([cell, *grid_vals, k, "" if final is None else repr(final),
                             "" if mean is None else repr(mean), len(data[cell][k])])  # fmt: skip
    _write_atomic(out_dir / "summary.csv", buf.getvalue())

    plots = []
    for key, label in metrics:
        curves = {cell: series[key] for cell, series in data.items() if series[key]}
        if curves:
            rel = f"plots/{_slug(key)}.png"
            _plot(key, label, curves, out_dir / rel)
            plots.append((key, label, rel))
        else:
            notes.append(f"metric {key!r} was logged by no cell; no plot")

    md = ["# Ablation report", "", f"{len(data)} cell(s); metrics from each cell's `{METRICS_FILE}`.", ""]
    if grid_keys:
        md += ["## Cells", ""]
        rows = [[c, *(str(settings.get(c, {}).get(k, "")) for k in grid_keys)] for c in data]
        md += _md_table(["cell", *grid_keys], rows)
        md.append("")
    if len(grid_keys) == 2 and keys:
        md += _pivot(grid_keys, settings, {c: summary[c][keys[0]][0] for c in data}, metrics[0][1])
    labels = [label for _, label in metrics]
    for title, idx in (("Final value (last step)", 0), ("Mean over steps", 1)):
        md += [f"## {title}", ""]
        md += _md_table(["cell", *labels], [[c, *(_fmt(summary[c][k][idx]) for k in keys)] for c in data])
        md.append("")
    if plots:
        md += ["## Curves", ""] + [f"![{label}]({rel})" for _, label, rel in plots] + [""]
    if notes:
        md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    md += ["Machine-readable: `summary.csv`.", ""]
    report = out_dir / "report.md"
    _write_atomic(report, "\n".join(md))
    return report
