"""The ``moe-rl diagnose`` report: decision-tree verdict, markdown table, PNG plots.

Owns turning measured numbers into advice. The thresholds are the operational defaults of
seed 000, "Diagnosing and fixing off-policy drift: a decision tree" (Step 1 / Step 2). A
zero-staleness test can only show causes A, C and D (B, E and F need training dynamics).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

TABLE_COLUMNS = (
    ("kl_k1", "KL k1"),
    ("kl_k3", "KL k3"),
    ("chi2_token", "χ² token"),
    ("chi2_seq", "χ² seq"),
    ("ess", "ESS"),
    ("ppl_ratio", "PPL ratio"),
    ("prob_pearson", "Pearson p"),
    ("prob_abs_diff_mean", "mean |Δp|"),
    ("prob_abs_diff_max", "max |Δp|"),
    ("flip_rate", "router flip rate"),
    ("tokens_with_flip", "tokens w/ flip"),
    ("dispatched_flip_rate", "flip rate rollout vs dispatched experts"),
)


def verdict(numbers: dict) -> dict:
    """Cause (A / C / D / none) and the config changes the decision tree recommends."""
    s = numbers["settings"]
    nat, best = s["natural"], s["r3_ksm"]
    advice, causes = [], []
    engine_gap = nat["prob_pearson"] < 0.95 or nat["kl_k1"] > 0.05 or abs(nat["ppl_ratio"] - 1) > 0.05
    if engine_gap:
        causes.append("A")
        advice.append(
            "Cause A (precision / kernel / engine mismatch): align precisions first "
            f"(rollout.dtype={numbers['rollout']['dtype']}, learner {numbers['learner']['params_dtype']}, "
            f"rollout.weight_quantization={numbers['rollout']['weight_quantization']}); "
            "algorithmic correction would hide, not remove, this gap."
        )
    if nat["tokens_with_flip"] > 0.01:
        gain = _relative_drop(nat["kl_k3"], s["r3"]["kl_k3"])
        advice.append(
            f"MoE routing: {nat['tokens_with_flip']:.1%} of tokens route differently in the learner; "
            f"R3 cuts KL k3 by {gain:.0%} -> set replay.routing: r3."
        )
        if gain < 0.1:
            advice.append(
                "R3 removes the flips but not the probability gap, so most of the gap is not routing: "
                f"look at precision (rollout.dtype={numbers['rollout']['dtype']}, "
                f"rollout.weight_quantization={numbers['rollout']['weight_quantization']})."
            )
    if numbers["ksm_outside_mask_tokens"] or _relative_drop(s["r3"]["kl_k3"], best["kl_k3"]) > 0.1:
        advice.append(
            "Truncated sampling: the learner's support differs from the kept set -> "
            "set replay.keep_sampling_mask: true."
        )
    residual = best
    if residual["chi2_token"] > 1.0 or residual["ess"] < 0.5:
        causes.append("D")
        advice.append(
            "Cause D (IS variance blow-up) after replay: band-mask outliers -> correction.icepop: true "
            "(icepop_low 0.5, icepop_high 5.0); if IcePop masks > 10-25% fix the systems gap instead."
        )
    elif residual["chi2_token"] > 0.3:
        causes.append("C")
        advice.append(
            "Cause C (moderate token drift) after replay: geometric-mean rejection -> "
            "correction.rs_mode: seq_mean_k1, rs_lower: 0.99, rs_upper: 1.01."
        )
    healthy = nat["prob_pearson"] >= 0.99 and abs(nat["ppl_ratio"] - 1) < 0.02 and nat["kl_k1"] < 0.02
    if not causes and healthy and not advice:
        summary = "No meaningful drift (Pearson >= 0.99, PPL ratio ~ 1, KL < 0.02): continue training."
    elif not causes and healthy:
        summary = "Probabilities agree (Pearson >= 0.99, PPL ratio ~ 1, KL < 0.02), but the replay gaps below remain."
    elif not causes:
        summary = "Mild drift: watch KL and ESS; the replay advice below removes what routing causes."
    else:
        summary = "Cause " + " and ".join(causes) + " applies."
    return {"causes": causes, "summary": summary, "advice": advice}


def _relative_drop(before: float, after: float) -> float:
    return 0.0 if before <= 0 else max(0.0, (before - after) / before)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) and np.isfinite(v) else str(v)


def _plots(numbers: dict, arrays: dict, out_dir: Path) -> list[str]:
    matplotlib.use("Agg")

    names = list(numbers["settings"])
    files = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    nat = numbers["settings"]["natural"]["flip_rate_per_layer"]
    ax.bar(list(nat), list(nat.values()), color="tab:red")
    ax.set(title="Router flip rate per MoE layer (rollout vs learner, natural routing)", ylabel="flip rate")
    files.append(_save(fig, out_dir / "flip_rate_per_layer.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in names:
        prof = numbers["settings"][name]["by_position"]
        ax.plot(range(len(prof)), [p["max_abs_dp"] for p in prof], marker="o", label=name)
        ax.set_xticks(range(len(prof)), [p["positions"] for p in prof], rotation=45)
    ax.set(title="max |Δp| by response position", xlabel="response positions", ylabel="max |p_learner - p_rollout|")
    ax.legend()
    files.append(_save(fig, out_dir / "abs_dp_by_position.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in names:
        m = arrays[f"{name}/mask"]
        ratio = (arrays[f"{name}/logp"] - arrays[f"{name}/mu"])[m]
        ax.hist(ratio, bins=40, histtype="step", label=name)
    ax.set(title="log(π_learner / μ_rollout) per token", xlabel="log ratio", ylabel="tokens", yscale="log")
    ax.legend()
    files.append(_save(fig, out_dir / "log_ratio_hist.png"))
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)

    plt.close(fig)
    return path.name


def write_report(numbers: dict, arrays: dict, out_dir: str | Path) -> Path:
    """Write ``report.md`` (+ PNGs); ``numbers['verdict']`` is filled in as well."""
    out_dir = Path(out_dir)
    numbers["verdict"] = verdict(numbers)
    plots = _plots(numbers, arrays, out_dir)
    rows = [
        "| setting | " + " | ".join(label for _, label in TABLE_COLUMNS) + " |",
        "| --- |" + " --- |" * len(TABLE_COLUMNS),
    ]
    for name, s in numbers["settings"].items():
        rows.append(f"| {name} | " + " | ".join(_fmt(s.get(k)) for k, _ in TABLE_COLUMNS) + " |")
    v = numbers["verdict"]
    lines = [
        "# Training–inference mismatch diagnosis (zero staleness)",
        "",
        (
            f"{numbers['samples']} samples, {numbers['response_tokens']} response tokens; rollout "
            f"{numbers['rollout']['dtype']} (weights: {numbers['rollout']['weight_quantization']}), learner "
            f"{numbers['learner']['params_dtype']}; same weights, same tokens, no update in between."
        ),
        "",
        (
            "μ is the engine's log-prob over the full vocabulary (natural, r3) or renormalised over its kept set "
            "(ksm, r3_ksm); π is the learner's under the same rule."
        ),
        "",
        *rows,
        "",
        f"Sampled tokens outside the engine's own kept set: {numbers['ksm_outside_mask_tokens']}.",
        "",
        "## Verdict",
        "",
        v["summary"],
        "",
        *[f"- {a}" for a in v["advice"]],
        "",
        "## |Δp| by response position (max / mean)",
        "",
        "| positions | " + " | ".join(numbers["settings"]) + " |",
        "| --- |" + " --- |" * len(numbers["settings"]),
    ]
    profiles = {n: {p["positions"]: p for p in s["by_position"]} for n, s in numbers["settings"].items()}
    for pos in profiles["natural"]:
        cells = [f"{_fmt(profiles[n][pos]['max_abs_dp'])} / {_fmt(profiles[n][pos]['mean_abs_dp'])}" for n in profiles]
        lines.append(f"| {pos} | " + " | ".join(cells) + " |")
    lines += ["", "## Plots", "", *[f"![{p}]({p})" for p in plots], ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
