"""Ablation report: read each cell's ``metrics.jsonl``, write ``summary.csv``, ``report.md`` and PNG curves.

Owns metric parsing (last record wins for a repeated step, e.g. after a resume), the final/mean
summary and the plots. A cell may have several runs (one per seed): its numbers are then the
mean ± sample std over the seeds and its curve is the per-step mean with a ± std band. It knows
nothing about grids or training; ``ablate.py`` calls it.
"""

from __future__ import annotations

import contextlib
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

from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on savefig
from matplotlib.ticker import MaxNLocator

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
# Clip and mask fractions (``loss/clip_frac``, ``icepop/masked_frac``, a method's own): tabulated as well whenever a
# cell logged them, so an objectives grid shows how much of each batch every objective clipped or masked.
FRACTION_KEY = re.compile(r"(clip|mask)\w*_frac$")

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
            raise ValueError(f"{path}:{lineno}: expected an integer 'step', got {step!r}")  # noqa: TRY004 -- bad file content
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


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """``(mean, sample std)`` of ``values``; std is None for fewer than two values, both None for none."""
    if not values:
        return None, None
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def band(runs: Sequence[Series]) -> list[tuple[int, float, float, int]]:
    """Per step logged by any run: ``(step, mean, std (0 for one value), number of runs with it)``."""
    by_step: dict[int, list[float]] = {}
    for series in runs:
        for step, value in series:
            by_step.setdefault(step, []).append(value)
    rows = []
    for step, values in sorted(by_step.items()):
        mean, std = mean_std(values)
        rows.append((step, mean, std or 0.0, len(values)))
    return rows


def _fmt(value: float | None, std: float | None = None) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}" if std is None else f"{value:.4g} ± {std:.2g}"


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


def _write_atomic(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def _plot(key: str, label: str, curves: Mapping[str, list[Series]], path: Path) -> None:
    """One PNG: ``label`` against step, one line per cell (mean over its runs, ± std band for several)."""

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for cell, runs in curves.items():
        rows = band(runs)
        steps, means = [r[0] for r in rows], [r[1] for r in rows]
        label_n = cell if len(runs) == 1 else f"{cell} (n={len(runs)})"
        (line,) = ax.plot(
            steps, means, marker="o" if len(rows) < 30 else None, markersize=3, linewidth=1.4, label=label_n
        )
        if len(runs) > 1:
            ax.fill_between(
                steps,
                [m - r[2] for m, r in zip(means, rows)],
                [m + r[2] for m, r in zip(means, rows)],
                color=line.get_color(),
                alpha=0.18,
                linewidth=0,
            )
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


def _pivot(
    grid_keys: list[str], settings: Mapping[str, Mapping[str, Any]], finals: Mapping[str, str], label: str
) -> list[str]:
    """Final ``label`` (formatted) as grid key 1 (rows) x grid key 2 (columns), e.g. routing x N (seed 001)."""
    rk, ck = grid_keys
    cells = [c for c in finals if c in settings]
    rows = list(dict.fromkeys(str(settings[c][rk]) for c in cells))  # grid order
    cols = list(dict.fromkeys(str(settings[c][ck]) for c in cells))
    table = {(str(settings[c][rk]), str(settings[c][ck])): finals[c] for c in cells}
    body = [[r, *(table.get((r, col), "—") for col in cols)] for r in rows]
    return [f"## Final {label}: {rk} x {ck}", "", *_md_table([f"{rk} \\ {ck}", *cols], body), ""]


def logged_fractions(paths: Sequence[Path]) -> list[tuple[str, str]]:
    """``(key, key)`` of every clip/mask fraction (``FRACTION_KEY``) logged in ``paths`` and not in REPORT_METRICS."""
    keys: set[str] = set()
    for path in paths:
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a torn last line: read_metrics says so
                record = json.loads(line)
                if isinstance(record, dict):
                    keys.update(k for k in record if FRACTION_KEY.search(k))
    known = {k for k, _ in REPORT_METRICS}
    return [(k, k) for k in sorted(keys - known)]


def write_report(
    cell_run_dirs: Mapping[str, str | Path | Sequence[str | Path]],
    out_dir: str | Path,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    notes: Sequence[str] = (),
    metrics: Sequence[tuple[str, str]] | None = None,
) -> Path:
    """Write ``summary.csv``, ``plots/<metric>.png`` and ``report.md`` into ``out_dir``; return report.md.

    ``cell_run_dirs``: cell name -> run directory holding ``metrics.jsonl``, or a list of them (one
    per seed). ``settings``: cell name -> its grid values (dotted key -> value), shown as columns.
    ``summary.csv`` is long-format, one row per (cell, metric): ``cell, <grid keys>, metric, final,
    mean, steps, final_std, mean_std, seeds`` -- final / mean over steps are averaged over the
    cell's seeds (std: sample std over seeds, empty for one seed); ``steps`` is the most any seed logged.
    ``metrics`` (None): REPORT_METRICS and the clip/mask fractions any cell logged (``logged_fractions``).
    """
    out_dir = Path(out_dir)
    settings = settings or {}
    if metrics is None:
        runs = [[d] if isinstance(d, (str, Path)) else list(d) for d in cell_run_dirs.values()]
        files = [Path(r) / METRICS_FILE for dirs in runs for r in dirs if (Path(r) / METRICS_FILE).exists()]
        metrics = (*REPORT_METRICS, *logged_fractions(files))
    keys = [k for k, _ in metrics]
    grid_keys = list(dict.fromkeys(k for s in settings.values() for k in s))
    notes = list(notes)
    data: dict[str, list[dict[str, Series]]] = {}  # cell -> one {key: series} per run
    for cell, dirs in cell_run_dirs.items():
        data[cell] = []
        for run_dir in [dirs] if isinstance(dirs, (str, Path)) else list(dirs):
            path = Path(run_dir) / METRICS_FILE
            if path.exists():
                data[cell].append(read_metrics(path, keys))
            else:
                notes.append(f"{cell}: no {METRICS_FILE} in {run_dir}")
        if not data[cell]:
            data[cell] = [{k: [] for k in keys}]

    # summary[cell][key] = (final mean, mean-over-steps mean, final std, mean std, seeds with data, max steps)
    summary: dict[str, dict[str, tuple]] = {}
    for cell, runs in data.items():
        summary[cell] = {}
        for k in keys:
            per_run = [summarize(run[k]) for run in runs if run[k]]
            final, final_std = mean_std([f for f, _ in per_run])
            mean, mean_sd = mean_std([m for _, m in per_run])
            summary[cell][k] = (final, mean, final_std, mean_sd, len(per_run), max(len(run[k]) for run in runs))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["cell", *grid_keys, "metric", "final", "mean", "steps", "final_std", "mean_std", "seeds"])
    for cell in data:
        grid_vals = [json.dumps(settings.get(cell, {}).get(k)) for k in grid_keys]
        for k in keys:
            row = summary[cell][k]
            writer.writerow(
                [
                    cell,
                    *grid_vals,
                    k,
                    *("" if v is None else repr(v) for v in row[:2]),
                    row[5],
                    *("" if v is None else repr(v) for v in row[2:4]),
                    row[4],
                ]
            )
    _write_atomic(out_dir / "summary.csv", buf.getvalue())

    plots = []
    for key, label in metrics:
        curves = {cell: [run[key] for run in runs if run[key]] for cell, runs in data.items()}
        curves = {cell: runs for cell, runs in curves.items() if runs}
        if curves:
            rel = f"plots/{_slug(key)}.png"
            _plot(key, label, curves, out_dir / rel)
            plots.append((key, label, rel))
        else:
            notes.append(f"metric {key!r} was logged by no cell; no plot")

    seeds = max(len(runs) for runs in data.values()) if data else 0
    over = f", mean ± std over {seeds} seeds" if seeds > 1 else ""
    md = ["# Ablation report", "", f"{len(data)} cell(s); metrics from each run's `{METRICS_FILE}`{over}.", ""]
    if grid_keys:
        md += ["## Cells", ""]
        rows = [[c, *(str(settings.get(c, {}).get(k, "")) for k in grid_keys)] for c in data]
        md += _md_table(["cell", *grid_keys], rows)
        md.append("")
    if len(grid_keys) == 2 and keys:
        finals = {c: _fmt(summary[c][keys[0]][0], summary[c][keys[0]][2]) for c in data}
        md += _pivot(grid_keys, settings, finals, metrics[0][1])
    labels = [label for _, label in metrics]
    for title, idx in (("Final value (last step)", 0), ("Mean over steps", 1)):
        md += [f"## {title}{over}", ""]
        md += _md_table(
            ["cell", *labels], [[c, *(_fmt(summary[c][k][idx], summary[c][k][idx + 2]) for k in keys)] for c in data]
        )
        md.append("")
    if plots:
        md += ["## Curves", ""] + [f"![{label}]({rel})" for _, label, rel in plots] + [""]
    if notes:
        md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    md += ["Machine-readable: `summary.csv`.", ""]
    report = out_dir / "report.md"
    _write_atomic(report, "\n".join(md))
    return report
