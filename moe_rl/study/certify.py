"""``moe-rl certify``: a pass/fail gate on the zero-staleness check, for a user's own CI.

Owns ``run_certify`` and its verdict. It wraps the zero-staleness test of ``moe_rl.study.diagnose``
(generate with SGLang -- a server started from the config, or ``rollout.addresses`` -- then, with no
weight update in between, the learner recomputes the same tokens with natural routing) and measures
max |Δlogp|, KL (k3) and the router flips exactly as ``moe_rl.study.attribute`` does for one row.

* ``rollout.true_on_policy`` on: one row for the config's kernel contract (and a second, the kept-set
  log-prob, under Keep Sampling Mask), plus the contract item by item as each side reports it (the
  server's kernel identity and the learner's). It passes only when every number is exactly 0.0.
* Off (normal mode): a difference is expected, so it always fails; it prints the attribution table
  (``moe-rl diagnose --attribute``: one server per row) where the config can run one, else the stock
  row alone and why the rest was not measured.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from moe_rl.config import ConfigError, ExperimentConfig
from moe_rl.config.kernels import KERNELS
from moe_rl.exact.contract import kernels_of
from moe_rl.exact.identity import EXTRA_KEY, learner_identity
from moe_rl.study.attribute import (
    COLUMNS,
    _check_exact_settings,
    render_table,
    row_config,
    row_numbers,
    run_attribute,
)
from moe_rl.study.diagnose import generate, learner_logprobs
from moe_rl.study.report import _write_atomic
from moe_rl.train.loop import RLTrainer

__all__ = ["GATED", "certify_verdict", "run_certify"]

GATED = ("dlogp_max", "kl_k3", "flip_prompt", "flip_response")  # each must be exactly 0.0 (NaN fails)
LABELS = {
    "all_kept": "all, kept-set log-prob (Keep Sampling Mask)",
    "config": "the config's items",
    "config_kept": "the config's items, kept-set log-prob (Keep Sampling Mask)",
    "stock_kept": "none (stock), kept-set log-prob (Keep Sampling Mask)",
}


def _measure(cfg: ExperimentConfig, num_prompts: int, items: frozenset[str] | None) -> tuple[dict, dict]:
    """One zero-staleness measurement with ``items`` on (None: the mode off): ``({row: numbers}, served
    identities)``; the row is named as attribution_rows names it, ``_kept`` for the Keep Sampling Mask one."""

    name = "stock" if items is None else "all" if items == frozenset(KERNELS) else "config"
    scratch = Path(tempfile.mkdtemp(prefix="moe_rl_certify_"))
    trainer = RLTrainer(row_config(cfg, items, scratch, num_prompts))
    try:
        batch = generate(trainer, num_prompts)
        rows = {name: row_numbers(learner_logprobs(trainer, batch, replay_routes=False, keep_mask=False))}
        if cfg.replay.keep_sampling_mask:
            rows[f"{name}_kept"] = row_numbers(learner_logprobs(trainer, batch, replay_routes=False, keep_mask=True))
    except BaseException:
        print(f"certify failed; its run directory (server logs, HF export) is kept: {scratch}", file=sys.stderr)
        raise
    finally:
        trainer.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return rows, batch.extra.get(EXTRA_KEY, {})


def _contract(cfg: ExperimentConfig, served: dict) -> dict:
    """Per item of the contract: shared by the learner (its config) and by each server (its reported identity)."""
    mine = kernels_of(cfg.rollout)
    theirs = {a: set(filter(None, i.get("kernels", "").split(","))) for a, i in served.items()}
    return {
        k: {"learner": k in mine, "servers": all(k in s for s in theirs.values()) and bool(theirs)} for k in KERNELS
    }


def certify_verdict(numbers: dict) -> tuple[bool, str]:
    """``(passed, one line)``: passes only in the mode, with every gated number of every row exactly 0.0. In
    normal mode the line gives the config's own rows (``stock``), not the attribution rows."""
    rows = {n: r for n, r in numbers["rows"].items() if numbers["mode"] == "true_on_policy" or n.startswith("stock")}
    worst = {k: max((r[k] for r in rows.values()), key=lambda v: math.inf if math.isnan(v) else v) for k in GATED}
    tokens = max(r["tokens"] for r in rows.values())
    exact = numbers["mode"] == "true_on_policy"
    shared = all(c["learner"] and c["servers"] for c in numbers.get("contract", {}).values())
    passed = exact and shared and tokens > 0 and all(v == 0.0 for v in worst.values())
    what = ", ".join(f"{COLUMNS[k].replace(chr(92), '')}={worst[k]:.3g}" for k in GATED)
    if passed:
        return True, f"certify: PASS: rollout and learner agree bit for bit ({what} on {tokens} tokens)"
    why = (
        "normal mode (rollout.true_on_policy=false) is never certified, a difference is expected there; "
        if not exact
        else "rollout.true_on_policy, but "
        + ("not every contract item is shared on both sides; " if not shared else "")
        + ("no response tokens were measured; " if tokens == 0 else "")
    )
    return False, f"certify: FAIL: {why}{what} on {tokens} tokens"


def run_certify(
    cfg: ExperimentConfig, num_prompts: int, kernels: list[str] | None = None, json_path: str | None = None
) -> dict:
    """Measure, print the table and the verdict line, write ``json_path`` (atomic); numbers with ``passed``."""

    unknown = sorted(set(kernels or ()) - KERNELS.keys())
    if unknown:
        raise ConfigError(f"certify --kernels: unknown item(s) {unknown}; expected some of {sorted(KERNELS)}")
    exact = cfg.rollout.true_on_policy
    numbers = {
        "mode": "true_on_policy" if exact else "normal",
        "config": {
            "rollout.dtype": cfg.rollout.dtype,
            "precision.params_dtype": cfg.precision.params_dtype,
            "prompts": num_prompts,
            "samples_per_prompt": cfg.rollout.samples_per_prompt,
        },
        "notes": [],
    }
    if exact:
        numbers["rows"], served = _measure(cfg, num_prompts, kernels_of(cfg.rollout))
        numbers["contract"] = _contract(cfg, served)
        numbers["identity"] = {"learner": learner_identity(cfg), "servers": served}
    else:
        try:
            _check_exact_settings(cfg, kernels)
            blocker = None
        except ConfigError as exc:
            blocker = str(exc).replace("diagnose --attribute", "the attribution table")
        if blocker is None:
            scratch = tempfile.mkdtemp(prefix="moe_rl_certify_attribute_")
            numbers["rows"] = run_attribute(cfg, num_prompts, scratch, kernels=kernels)["rows"]
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            numbers["rows"], _ = _measure(cfg, num_prompts, None)
            numbers["notes"].append(f"only the stock row was measured: {blocker}")
    numbers["passed"], numbers["verdict"] = certify_verdict(numbers)
    print(render(numbers))
    if json_path:
        _write_atomic(Path(json_path), json.dumps(numbers, indent=1))
    return numbers


def render(numbers: dict) -> str:
    """The printed report: the contract item by item (the mode), the table, notes and the verdict line."""
    out = []
    if "contract" in numbers:
        out += ["| contract item | learner | server(s) |", "|---|---|---|"]
        yes = {True: "shared", False: "NOT shared"}
        out += [f"| `{k}` | {yes[c['learner']]} | {yes[c['servers']]} |" for k, c in numbers["contract"].items()]
        out.append("")
    else:
        out.append("normal mode (rollout.true_on_policy=false): the attribution table (moe-rl diagnose --attribute)")
    out.append(render_table(numbers, labels=LABELS))
    out += [f"note: {n}" for n in numbers["notes"]]
    out.append(numbers["verdict"])
    return "\n".join(out)
