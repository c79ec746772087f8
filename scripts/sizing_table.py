"""Print docs/launch.md's "Sizing a job" table: `moe-rl plan` of each cluster config, one column per config.

Runs the CLI (``moe_rl.cli.main(["plan", CONFIG])``), reads the size off each printed line (the first
``N GB`` / ``N MB`` of it; for host and disk lines the per-rank and per-node figures) and writes a
Markdown table; a line the plan marks ``[GPU check pending]`` is labelled "needs the GPU check (not run: no GPU
lent)" (until ``make gpu-check`` has run on a GPU and docs/gpu.md has its figures). Usage: ``python scripts/sizing_table.py`` (from the repository root).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from moe_rl.cli import main

CONFIGS = ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3_style")
SIZE = re.compile(r"(\d+\.\d+) (GB|MB)")
PENDING: set[str] = set()  # rows some config's plan marks [GPU check pending]
NEEDS_GPU = " (needs the GPU check; not run: no GPU lent)"


def plan_rows(config: str) -> dict[str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["plan", str(Path("configs") / f"{config}.yaml")])
    rows, section = {}, "GPU"
    for line in out.getvalue().splitlines()[1:]:
        if line.strip().startswith("derived defaults"):  # the derived values follow: docs/launch.md lists them apart
            break
        if not line.startswith("    "):
            section = line.split()[0].strip().capitalize()
            continue
        label = re.split(r"\s{2,}|~", line.strip())[0]
        sizes = [f"{float(n) / (1000 if unit == 'MB' else 1):.1f}" for n, unit in SIZE.findall(line)]
        seconds = re.search(r"; (\d+) s at", line)
        value = " / ".join(sizes) + (f" ({seconds.group(1)} s)" if seconds else "")
        rows[f"{section}: {label}"] = value
        if "[GPU check pending]" in line:
            PENDING.add(f"{section}: {label}")
    return rows


def table() -> str:
    cols = [plan_rows(c) for c in CONFIGS]
    lines = ["| line (GB; host and disk: per rank / per node) | " + " | ".join(CONFIGS) + " |"]
    lines.append("|---" * (len(CONFIGS) + 1) + "|")
    for key in cols[0]:
        label = key + (NEEDS_GPU if key in PENDING else "")
        lines.append(f"| {label} | " + " | ".join(c.get(key, "") for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
