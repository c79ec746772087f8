"""Launch test helpers: the cluster configs and a parser for the rendered bash commands."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "configs" / "qwen3_30b_a3b.yaml"
DSV3 = REPO / "configs" / "deepseek_v3_style.yaml"


def rendered_commands(script: str) -> list[list[str]]:
    """argv of every `srun`/`env ... srun` command in a rendered script, as bash would split them."""
    joined = script.replace("\\\n", " ")  # bash line continuation
    commands = []
    for line in joined.splitlines():
        if line.startswith(("srun ", "env ")):
            argv = shlex.split(line)
            commands.append(argv[:-1] if argv[-1] == "&" else argv)
    return commands


def flag_value(argv: list[str], flag: str) -> str:
    """Value of `--flag value` or `--flag=value` in argv (exactly one occurrence)."""
    values = [argv[i + 1] for i, a in enumerate(argv) if a == flag]
    values += [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    assert len(values) == 1, f"expected one {flag} in {argv}, found {values}"
    return values[0]
