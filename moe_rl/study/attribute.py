"""Where the rollout-vs-learner mismatch comes from: ``moe-rl diagnose --attribute``.

Owns ``run_attribute``: the zero-staleness test of ``moe_rl.study.diagnose`` (generate with SGLang, the
learner recomputes the same tokens with no update in between, natural routing) run once per
configuration -- the stock kernels; each item of the true-on-policy kernel contract
(``moe_rl.config.kernels.KERNELS``) turned on alone on both sides; the whole contract but that item;
the whole contract -- and the table of how much of the KL (k3), of |Δlogp| and of the router flips
each row removes. "Alone" says what an item fixes by itself; "all but" says what mismatch is left when
only that item is not shared. A new server and learner are built per row (the contract's items are
chosen at server start), from the same weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from moe_rl.config import ConfigError, ExperimentConfig
from moe_rl.config.kernels import KERNELS
from moe_rl.exact.preflight import true_on_policy_settings
from moe_rl.study.diagnose import generate, learner_logprobs, measure
from moe_rl.train.loop import RLTrainer

__all__ = ["COLUMNS", "attribution_rows", "render_table", "row_config", "row_numbers", "run_attribute"]

COLUMNS = {  # key -> header
    "kl_k3": "KL k3",
    "dlogp_max": "max \\|Δlogp\\|",
    "dlogp_mean": "mean \\|Δlogp\\|",
    "flip_prompt": "router flips (prompt)",
    "flip_response": "router flips (response)",
}


def attribution_rows(kernels: list[str] | None = None) -> list[tuple[str, frozenset[str] | None]]:
    """``(row name, items on)``: ``stock`` (mode off); each item alone (``+item``: what it removes on its
    own); the whole contract but that item (``-item``: the mismatch it alone leaves); ``all``."""
    items = list(KERNELS) if kernels is None else kernels
    full = frozenset(KERNELS)
    return [
        ("stock", None),
        *((f"+{k}", frozenset({k})) for k in items),
        *((f"-{k}", full - {k}) for k in items),
        ("all", full),
    ]


def row_config(
    cfg: ExperimentConfig, items: frozenset[str] | None, scratch: Path, num_prompts: int
) -> ExperimentConfig:
    """``cfg`` for one zero-staleness row: ``items`` on both sides (None: the mode off), one sync batch of
    ``num_prompts`` prompts (the batch source reads it when the trainer is built), scratch output."""
    rollout = cfg.rollout.model_copy(
        update={
            "true_on_policy": items is not None,
            "true_on_policy_kernels": None if items is None else sorted(items),
        }
    )
    return cfg.model_copy(
        update={
            "rollout": rollout,
            # one batch, generated here and now: the sync source (async would start a rollout process)
            "train": cfg.train.model_copy(
                update={"output_dir": str(scratch), "rollout_mode": "sync", "prompts_per_step": num_prompts}
            ),
            "replay": cfg.replay.model_copy(update={"routing": "r3"}),  # binds the routers: flips are measured
            "logging": cfg.logging.model_copy(update={"progress": False, "tensorboard": False}),
        }
    )


def _measure_row(cfg: ExperimentConfig, num_prompts: int) -> dict:
    trainer = RLTrainer(cfg)
    try:
        batch = generate(trainer, num_prompts)
        raw = learner_logprobs(trainer, batch, replay_routes=False, keep_mask=False)
    finally:
        trainer.close()
    return row_numbers(raw)


def row_numbers(raw: dict) -> dict:
    """One row's ``COLUMNS`` (+ ``tokens``) from ``learner_logprobs``'s output (natural routing)."""
    m = measure(raw)  # moe_rl.algo's off-policy metrics, as in the diagnose report and the training log
    flips = raw["flips"]
    return {
        "tokens": int(raw["mask"].sum()),
        "kl_k3": m["kl_k3"],
        "dlogp_max": m["log_ratio_abs_max"],
        "dlogp_mean": float(np.abs(raw["logp"] - raw["mu"])[raw["mask"]].mean()),
        "flip_prompt": float(flips.get("replay/rollout_vs_natural/prompt/flip_rate", float("nan"))),
        "flip_response": float(flips.get("replay/rollout_vs_natural/response/flip_rate", float("nan"))),
    }


def _check_exact_settings(cfg: ExperimentConfig, kernels: list[str] | None = None) -> None:
    """ConfigError (one message, the CLI prints it) for unknown ``kernels`` or a config that cannot be exact."""

    if cfg.rollout.addresses:
        raise ConfigError(
            "diagnose --attribute starts one server per row (each row's kernels are chosen at server start); "
            f"rollout.addresses={list(cfg.rollout.addresses)} would serve every row from one server: leave it unset"
        )
    unknown = sorted(set(kernels or ()) - KERNELS.keys())
    if unknown:
        raise ConfigError(f"diagnose --kernels: unknown item(s) {unknown}; expected some of {sorted(KERNELS)}")
    full = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"true_on_policy": True})})
    problems = list(true_on_policy_settings(full))
    if problems:
        raise ConfigError(
            "diagnose --attribute turns the true-on-policy kernels on, and this config cannot be exact:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def run_attribute(
    cfg: ExperimentConfig, num_prompts: int, out_dir: str | Path, kernels: list[str] | None = None
) -> dict:
    """Measure every row of ``attribution_rows(kernels)`` (2 x items + 2 server starts); writes
    ``attribution.json`` and ``attribution.md`` in ``out_dir`` and returns ``{"rows": {name: numbers}, ...}``."""
    _check_exact_settings(cfg, kernels)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, items in attribution_rows(kernels):
        scratch = Path(tempfile.mkdtemp(prefix=f"moe_rl_attribute_{name}_"))
        rows[name] = _measure_row(row_config(cfg, items, scratch, num_prompts), num_prompts)
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"attribute: {name}: " + ", ".join(f"{k}={rows[name][k]:.3g}" for k in COLUMNS), flush=True)
    numbers = {
        "config": {
            "rollout.dtype": cfg.rollout.dtype,
            "precision.params_dtype": cfg.precision.params_dtype,
            "prompts": num_prompts,
            "samples_per_prompt": cfg.rollout.samples_per_prompt,
        },
        "rows": rows,
    }
    (out_dir / "attribution.json").write_text(json.dumps(numbers, indent=1))
    (out_dir / "attribution.md").write_text(render_table(numbers))
    return numbers


def _removed(value: float, stock: float) -> str:
    return f"{100 * (1 - value / stock):.0f}%" if stock and np.isfinite(stock) else "–"


def render_table(numbers: dict, labels: dict[str, str] | None = None) -> str:
    """Markdown: per row, each metric and (in parentheses) the share of the stock value it removes (when a
    ``stock`` row was measured). ``labels``: row name -> label, for rows other than attribution_rows' own."""
    rows = numbers["rows"]
    stock = rows.get("stock")
    head = "| kernels on | " + " | ".join(COLUMNS.values()) + " | tokens |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, r in rows.items():
        plain = name == "stock" or stock is None
        cells = [f"{r[k]:.3g}" if plain else f"{r[k]:.3g} ({_removed(r[k], stock[k])})" for k in COLUMNS]
        label = {"stock": "none (stock)", "all": "all (true-on-policy)", **(labels or {})}.get(name) or (
            f"`{name[1:]}` alone" if name[0] == "+" else f"all but `{name[1:]}`"
        )
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['tokens']} |")
    c = numbers["config"]
    return (
        f"rollout.dtype={c['rollout.dtype']}, precision.params_dtype={c['precision.params_dtype']}, "
        f"{c['prompts']} prompts x {c['samples_per_prompt']} samples."
        + (" In parentheses: the share of the stock value the row removes (negative: it grew)." if stock else "")
        + "\n\n"
        + "\n".join(lines)
        + "\n"
    )
